"""Figure 7 at a tiny size: in process, and the real path through the broker.

No timing is asserted: the numbers belong to `kvconductor bench`.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.dynamo_indexer import available
from bench.ingest import ingest_figure, real_path_figure
from bench.vllm_engine import EngineConfig, FleetConfig, fleet_workload
from bench.workload import Workload


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
    standalone = fig["dynamo_indexer"]
    if dynamo is not None:
        assert standalone == {"measured": False, "reason": dynamo}
        return
    (got,) = standalone["runs"]
    assert got["events_applied"] == sum(r.events for r in w.streams.records)
    same, compared = standalone["same_answers"]
    assert same == compared > 0
