"""The demo's simulated engines and pool backend, without Kafka: their records go
straight into the index core, which must take every one of them and then find
the cached prefixes in every tier."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec

from kvconductor.index.conductor import Conductor
from kvconductor.tools.demo.engines import (
    DEMO_BLOCK_SIZE,
    DEMO_MODEL,
    EngineSpec,
    SimEngine,
    Traffic,
    engine_headers,
    pool_headers,
    text_tokens,
)
from kvconductor.wire.query import TokenQuery


class CoreSink:
    """A sink that applies what it gets to a Conductor, as the daemon would."""

    poison = True

    def __init__(self) -> None:
        self.conductor = Conductor()
        self.raw_records: list[tuple[bytes, list[tuple[str, bytes]]]] = []

    async def engine(self, spec: EngineSpec, payload: bytes, seq: int) -> None:
        self.conductor.ingest_engine_record(
            spec.instance, engine_headers(spec, seq), payload, time.time()
        )

    async def pool(self, payload: bytes, seq: int) -> None:
        self.conductor.ingest_pool_record("mooncake-0", pool_headers(seq), payload, time.time())

    async def raw(self, key: bytes, payload: bytes, headers: list[tuple[str, bytes]]) -> None:
        self.raw_records.append((key, headers))

    async def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def run_traffic(steps: int, seed: int = 0) -> tuple[Traffic, CoreSink]:
    sink = CoreSink()
    traffic = Traffic(sink, seed=seed)  # type: ignore[arg-type]

    async def go() -> None:
        await traffic.start()
        for i in range(steps):
            if i % 50 == 0:  # let the pool's confirmation delay pass now and then
                traffic.pool._inbox = [(0.0, h) for _, h in traffic.pool._inbox]
            await traffic.step()

    asyncio.run(go())
    return traffic, sink


def test_every_record_is_accepted_and_fills_every_tier() -> None:
    traffic, sink = run_traffic(1500)  # BadRecord would raise
    workers = sink.conductor.workers()
    assert len(workers) == 1 and workers[0]["model"] == DEMO_MODEL
    instances: dict[str, Any] = workers[0]["instances"]  # type: ignore[assignment]
    assert set(instances) == {"vllm-0", "vllm-1", "vllm-2"}
    assert set(instances["vllm-0"]) == {"0", "1"}
    totals = {tier: 0 for tier in ("GPU", "CPU", "DISK")}
    for ranks in instances.values():
        for tiers in ranks.values():
            for tier in totals:
                totals[tier] += tiers[tier]
    assert all(n > 0 for n in totals.values()), totals
    pools: dict[str, Any] = workers[0]["pools"]  # type: ignore[assignment]
    assert pools["mooncake-0"]["cpu"] > 0  # two-phase offloads confirmed
    assert sink.conductor.counters["unknown_medium"] == 0
    assert sink.conductor.counters["block_size_mismatch"] == 0
    assert traffic.stats.poison == 1 and len(sink.raw_records) == 1
    assert "kv-block-size" not in dict(sink.raw_records[0][1])


def test_sample_queries_hit_with_tiers_in_order() -> None:
    traffic, sink = run_traffic(600, seed=3)
    hits = 0
    for _ in range(50):
        _, text = traffic.workload.sample_query()
        answer = sink.conductor.query(
            TokenQuery(model=DEMO_MODEL, block_size=DEMO_BLOCK_SIZE, token_ids=text_tokens(text))
        )
        for hit in answer.get("default", {}).values():
            assert hit["GPU"] <= hit["CPU"] <= hit["DISK"] == hit["longest_matched"]  # type: ignore[operator]
            hits += hit["longest_matched"] > 0  # type: ignore[operator]
    assert hits > 0


def test_engine_evicts_leaves_first_and_offloads() -> None:
    engine = SimEngine(EngineSpec("e", 0, "local", gpu_blocks=4, cpu_blocks=2), 4)
    tokens = list(range(4 * 6))  # six blocks: two more than the GPU holds
    served, offloaded = engine.serve(tokens)
    events = msgspec.to_builtins(served, builtin_types=(bytes,))  # as the engine sends them
    hashes = engine.hashes(tokens)
    kinds = [(e["type"], e["medium"]) for e in events]
    assert kinds == [
        ("BlockStored", "GPU"),
        ("BlockStored", "CPU"),
        ("BlockRemoved", "GPU"),
    ]
    assert events[0]["block_hashes"] == hashes and events[0]["parent_block_hash"] is None
    # The last blocks (leaves) go first; the prefix stays on the GPU.
    assert events[2]["block_hashes"] == [hashes[5], hashes[4]]
    assert events[1]["token_ids"] == [] and events[1]["block_size"] == 0  # hash-only offload
    assert offloaded == []
    assert list(engine.gpu.blocks) == hashes[:4][::-1]
