"""The contract's byte layouts and what they decode to (sections 1-5). Pure: imports
nothing of kvconductor but the kernel loader, and no I/O.

Section 1 (hashes): `hashing`, `hash_norm`, `local_hashes`, `engine_hashes` (vLLM's own
block names). Section 2 (engine events): `records` (headers), `engine`, `media`.
Section 3 (pool events): `pool`. Section 4 (queries): `query`, `conductor` (Mooncake
Conductor's msgpack form), `dynamo` (Dynamo's remote-indexer form). Section 5
(snapshots): `packing`. Every decoder yields `events`; bad input raises `errors`.
"""
