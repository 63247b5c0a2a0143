"""Kafka-side consumers of kvconductor: wire decoders and record consumers.

Wire decoders (pure functions, no I/O):

* `consumers.engine_wire.decode_engine_payload(payload, source)`: one engine
  ZMQ payload (vLLM 0.9 .. 0.33+, SGLang, TensorRT-LLM) -> `EngineBatch`;
* `consumers.pool_wire.decode_pool_payload(payload)`: one Mooncake RFC #1527
  pool payload -> `PoolBatch`;
* `consumers.hash_norm`: the one block-hash normalisation both share.

Wire formats per release: `docs/wire-formats.md`.
"""
