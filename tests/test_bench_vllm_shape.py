"""The benchmark's vLLM engine model emits records in vLLM's own shapes.

The reference is vLLM's real `KVCacheManager` output for two dense
instances (tests/fixtures/vllm-hybrid, `hyb-d0` and `hyb-d1`; the second
re-announces reused blocks for half its requests). The model runs the same
workload (`FIXTURE_FLEET`) once per fixture instance and seed, and the
pooled shape must match the pooled fixture's: events per record and
hashes per store within `TOLERANCE` of the fixture's means, the share of
single-hash stores within `SINGLE_STORE_SLACK`, and every removal one hash.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections import Counter
from pathlib import Path

import msgspec

from kvconductor.index.conductor import Conductor, Incoming
from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.vllm_engine import (
    FIXTURE_FLEET,
    EngineConfig,
    FleetConfig,
    VllmFleet,
    record_shape,
    run_fleet,
)
from kvconductor.wire.engine import decode_engine_payload

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-hybrid" / "records.jsonl"
DENSE = {"hyb-d0": 0.0, "hyb-d1": 0.5}  # instance: share of report-mode "full" requests
TOLERANCE = 0.25
SINGLE_STORE_SLACK = 0.15
SEEDS = (1, 2, 3)
STEPS = 300  # about the fixture's run (307 scheduler ticks)


def _fixture_records() -> list[Record]:
    out = []
    for line in FIXTURE.read_text().splitlines():
        r = json.loads(line)
        if r["key"] in DENSE:
            out.append(Record(False, r["key"].encode(), [], base64.b64decode(r["value_b64"]), 0, 0))
    return out


def _model_records() -> list[Record]:
    out: list[Record] = []
    for seed in SEEDS:
        for share in DENSE.values():
            engine = dataclasses.replace(FIXTURE_FLEET.engine, report_full_share=share)
            cfg = dataclasses.replace(FIXTURE_FLEET, seed=seed, instances=1, engine=engine)
            out += run_fleet(cfg, STEPS).streams.records
    return out


def _store_sizes(records: list[Record]) -> Counter[int]:
    sizes: Counter[int] = Counter()
    for r in records:
        for e in msgspec.msgpack.decode(r.payload)[1]:
            if e["type"] == "BlockStored":
                sizes[len(e["block_hashes"])] += 1
    return sizes


def test_the_model_has_the_dense_fixtures_shape() -> None:
    want = record_shape(_fixture_records())
    model = _model_records()
    got = record_shape(model)
    for key in ("events_per_record", "hashes_per_store"):
        assert abs(got[key] / want[key] - 1) <= TOLERANCE, (key, got[key], want[key])
    assert got["hashes_per_removal"] == want["hashes_per_removal"] == 1.0
    sizes = _store_sizes(model)
    want_sizes = _store_sizes(_fixture_records())
    single = sizes[1] / sum(sizes.values())
    want_single = want_sizes[1] / sum(want_sizes.values())
    assert abs(single - want_single) <= SINGLE_STORE_SLACK, (single, want_single)
    # Prefill chunks and re-announcements store many hashes at once.
    assert max(sizes) > 16


def test_every_removal_is_of_a_stored_copy_and_the_stream_replays_to_the_pool() -> None:
    """Replaying the events as a multiset of held copies ends where each
    engine's pool is; a tiny pool forces preemptions on the way."""
    engine = EngineConfig(gpu_blocks=48, max_num_seqs=4, max_batched_tokens=256)
    cfg = dataclasses.replace(FIXTURE_FLEET, seed=5, instances=3, engine=engine)
    fleet = VllmFleet(cfg)
    for _ in range(400):
        fleet.step()
    assert sum(e.preemptions for e in fleet.engines) > 0
    held: dict[bytes, Counter[int]] = {}
    seqs: dict[bytes, int] = {}
    for r in fleet.streams.records:
        copies = held.setdefault(r.key, Counter())
        seq = int(dict(r.headers)["kv-seq"])
        assert seq == seqs.get(r.key, 0) + 1  # one record a step with events, in order
        seqs[r.key] = seq
        batch = decode_engine_payload(r.payload)
        assert batch.events
        for ev in msgspec.msgpack.decode(r.payload)[1]:
            if ev["type"] == "BlockRemoved":
                (h,) = ev["block_hashes"]
                assert copies[h] > 0
                copies[h] -= 1
            else:
                assert len(ev["token_ids"]) == 16 * len(ev["block_hashes"])
                for h in ev["block_hashes"]:
                    copies[h] += 1
    for i, e in enumerate(fleet.engines):
        key = f"vllm-{i}".encode()
        want = Counter({h: len(ids) for h, ids in e.pool.cached.items()})
        assert +held.get(key, Counter()) == want


def test_kvconductor_takes_every_record() -> None:
    cfg = dataclasses.replace(FIXTURE_FLEET, instances=2)
    records = run_fleet(cfg, 200).streams.records
    conductor = Conductor()
    batch = [Incoming(False, r.key, r.headers, r.payload, r.ts) for r in records]
    assert conductor.ingest(batch) == []


def test_the_same_seed_gives_the_same_records() -> None:
    cfg = FleetConfig(seed=3, instances=2, engine=EngineConfig(gpu_blocks=256))
    a = run_fleet(cfg, 120).streams.records
    b = run_fleet(cfg, 120).streams.records
    assert [r.payload for r in a] == [r.payload for r in b] and a
