"""The index core: pure, synchronous, no I/O. `conductor.Conductor` is the one API the
shell uses (records in, answers out).

`fleet` holds the namespaces, instances and kv-seq checks; `namespace` one namespace's
owners, pool stores and two-phase joins; `pending` the queue of pending halves;
`block_store` the per-block state behind one interface with two builds (Python and the
compiled kernel); `engine_lane` the compiled path for whole batches of engine records;
`query`, `answer_shape` and `tokenless` answer queries (section 4); `cache_groups` the
KV-cache groups of hybrid models; `limits` the bounds, which the configuration reads
without loading the rest.
"""
