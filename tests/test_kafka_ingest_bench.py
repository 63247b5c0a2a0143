"""kvconductor/tools/bench/kafka_ingest.py runs end to end on a small topic and counts what it
produced (its figures are measurements, never asserted)."""

from __future__ import annotations

import pytest

from kvconductor.tools.bench import kafka_ingest


@pytest.mark.kafka
@pytest.mark.parametrize("extra", [[], ["--kafka-only", "--compression", "zstd"]])
async def test_the_consumer_catches_up_on_the_fixture(
    kafka_bootstrap: str, extra: list[str]
) -> None:
    args = kafka_ingest.parser().parse_args(
        [
            *("--bootstrap", kafka_bootstrap, "--workload", "fixture", "--records", "600"),
            *("--mode", "consumer", *extra),
        ]
    )
    out = await kafka_ingest.main_async(args)
    # 64 instances, each replaying hyb-d0 or hyb-d1 from its start.
    streams = kafka_ingest.templates(kafka_ingest.FIXTURE)
    per_instance = [streams[i % 2][: 600 // 64 + (i < 600 % 64)] for i in range(64)]
    assert out["records"] == 600
    assert out["events"] == sum(t.events for s in per_instance for t in s)
    assert out["seconds"] > 0 and out["cpu_s"] >= 0


@pytest.mark.kafka
async def test_the_consumer_catches_up_on_the_fleet(kafka_bootstrap: str) -> None:
    args = kafka_ingest.parser().parse_args(
        [
            *("--bootstrap", kafka_bootstrap, "--entries", "5000", "--records", "400"),
            *("--mode", "consumer", "--set", "fetch_path=native"),
        ]
    )
    out = await kafka_ingest.main_async(args)
    assert out["workload"] == "fleet" and out["records"] == 400
    assert out["events"] > 400


def test_a_replayed_stream_is_a_fresh_instance() -> None:
    """No instance stores again what it holds: each replay has its own id."""
    streams = kafka_ingest.templates(kafka_ingest.FIXTURE)
    n = len(streams[0]) + 5
    made = list(kafka_ingest.fixture_records(streams, 2, 2 * n))
    assert len(made) == 2 * n
    keys = [r.key for r in made[0::2]]
    assert len(set(keys[: len(streams[0])])) == 1
    assert keys[len(streams[0])] != keys[0]
    seqs = [dict(r.headers)["kv-seq"] for r in made[0::2]]
    assert seqs[len(streams[0])] == b"0"
    assert [r.value for r in made[0::2]][: len(streams[0])] == [t.value for t in streams[0]]
