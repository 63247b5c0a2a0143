"""The consumers of the engine and pool topics: the asyncio side of ingest.

`event_consumer` runs the batch loop (produce-order merge, rebalance hooks) into
`kvconductor.index.conductor.Conductor.ingest`; `dead_letters` is its failure path;
`positions` resume offsets; `repartitioner` and `routing` the scale-out stage. The
decoders they feed are in `kvconductor.wire` (formats per release: docs/wire-formats.md).
"""
