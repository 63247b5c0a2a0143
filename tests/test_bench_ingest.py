"""Figures 7 and 8 at a tiny size: in process, the real paths through the broker
and Dynamo's standalone indexer, and a Mooncake trace slice routed and replayed.

No timing is asserted: the numbers belong to `kvconductor bench`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvconductor.index.conductor import Conductor, Incoming
from kvconductor.tools.bench.dynamo_indexer import available
from kvconductor.tools.bench.ingest import ingest_figure, real_path_figure
from kvconductor.tools.bench.replay import replay_figure
from kvconductor.tools.bench.trace import Router, read_trace, vllm_trace_workload
from kvconductor.tools.bench.vllm_engine import (
    CLOCK_START,
    EngineConfig,
    FleetConfig,
    fleet_workload,
)
from kvconductor.tools.bench.workload import Workload


def _tiny() -> Workload:
    engine = EngineConfig(max_num_seqs=8, max_batched_tokens=512)
    cfg = FleetConfig.for_entries(
        4_000,
        seed=3,
        instances=3,
        engine=engine,
        system_prompts=3,
        documents=4,
        document_tokens=(256, 512),
        max_context_tokens=2048,
    )
    return fleet_workload(cfg, 4_000, churn=0.5, queries=20, query_tokens=1024)


def test_ingest_figure_counts_records_events_and_blocks() -> None:
    w = _tiny()
    fig = ingest_figure(w, ("kvconductor", "naive"), repeats=2, log=lambda _: None)
    shape = fig["shape"]
    assert shape["records"] + fig["build_records"] == len(w.streams.records)
    assert shape["records"] < shape["events"] < shape["blocks"]
    for peer in ("kvconductor", "naive"):
        u = fig["peers"][peer]
        assert len(u["events_per_s"]["runs"]) == 2
        assert u["us_per_record"]["median"] > 0
    assert fig["peers"]["kvconductor"]["notices"] == 0
    same, compared = fig["agreement"]["naive"]
    assert same == compared > 0
    assert len(fig["ratio"]["kvconductor/naive"]["runs"]) == 2


@pytest.mark.kafka
def test_the_real_paths_take_a_prequeued_backlog(kafka_bootstrap: str, tmp_path: Path) -> None:
    """The daemon on records prequeued on the broker and, when installed,
    Dynamo's standalone indexer on the same records over ZMQ, one run each."""
    w = _tiny()
    dynamo = available(None)
    fig = real_path_figure(w, kafka_bootstrap, dynamo, 1, tmp_path / "logs", log=lambda _: None)
    pre = fig["prequeued"]
    assert pre["identical"] is True
    assert pre["bad_records"] == 0 and pre["exit_codes"] == [0]
    (run,) = pre["runs"]
    assert 0 < run["shape"]["records"] <= len(w.streams.records)
    assert 0 < pre["query"]["p50_us"]["median"] <= pre["query"]["p99_us"]["median"]
    assert pre["query"]["queries_per_s"]["median"] > 0
    standalone = fig["dynamo_indexer"]
    if dynamo is not None:
        assert standalone == {"measured": False, "reason": dynamo}
        return
    (got,) = standalone["runs"]
    assert got["events_applied"] == sum(r.events for r in w.streams.records)
    same, compared = standalone["same_answers"]
    assert same == compared > 0
    assert standalone["query"]["p99_us"]["median"] > 0
    assert standalone["query"]["queries_per_s"]["median"] > 0
    assert len(fig["ratio_real"]["query p99, dynamo.indexer/kvconductor run"]["runs"]) == 1
    ratio = fig["ratio_real"]["queries/s with 8 clients, kvconductor run/dynamo.indexer"]
    assert ratio["median"] > 0


TRACE = Path(__file__).parent / "fixtures" / "traces" / "conversation_trace-head200.jsonl"


def test_the_trace_is_routed_by_conversation_or_in_turn() -> None:
    reqs = list(read_trace(TRACE))[:40]
    assert all(r.hash_ids[0] == 0 for r in reqs)  # why first-block routing cannot work
    by_session = Router(7, "session")
    placed: dict[int, int] = {}
    for r in reqs:
        inst = by_session(r)
        if len(r.hash_ids) > 1:
            assert placed.setdefault(r.hash_ids[1], inst) == inst
    assert len(set(placed.values())) == 7
    in_turn = Router(7, "round-robin")
    assert [in_turn(r) for r in reqs[:9]] == [0, 1, 2, 3, 4, 5, 6, 0, 1]


def test_the_trace_runs_through_the_engine_model_at_its_own_times() -> None:
    engine = EngineConfig(gpu_blocks=2048, max_num_seqs=16, max_batched_tokens=2048)
    cfg = FleetConfig(instances=7, engine=engine)
    w = vllm_trace_workload(TRACE, cfg, limit=30, queries=10, query_tokens=1024)
    assert w.stats["requests"] == 30
    keys = {r.key for r in w.streams.records}
    assert 1 < len(keys) <= 7
    ts = [r.ts for r in w.streams.records]
    assert ts == sorted(ts)
    # The slice's arrivals span its timestamps (ms), one engine step a 25 ms.
    first = next(iter(read_trace(TRACE))).timestamp / 1000
    assert ts[0] >= CLOCK_START + first
    assert (
        Conductor().ingest(
            [Incoming(False, r.key, r.headers, r.payload, r.ts) for r in w.streams.records]
        )
        == []
    )


@pytest.mark.kafka
def test_a_trace_replays_into_the_daemon(kafka_bootstrap: str, tmp_path: Path) -> None:
    engine = EngineConfig(gpu_blocks=1024, max_num_seqs=16, max_batched_tokens=2048)
    cfg = FleetConfig(instances=5, engine=engine)
    w = vllm_trace_workload(TRACE, cfg, limit=20, queries=10, query_tokens=1024)
    # Sped up, so the test takes a few seconds of the trace's minute.
    fig = replay_figure(w, kafka_bootstrap, 20.0, tmp_path / "logs", log=lambda _: None)
    assert fig["records"] == len(w.streams.records)
    assert fig["bad_records"] == 0 and fig["exit_code"] == 0
    assert fig["queries"] > 0 and fig["query_p50_ms"] <= fig["query_p99_ms"]
    assert fig["max_lag_records"] >= 0 and fig["catch_up_s"] >= 0
