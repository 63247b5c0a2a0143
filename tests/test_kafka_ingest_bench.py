"""bench/kafka_ingest.py runs end to end on a small topic and counts what it
produced (its figures are measurements, never asserted)."""

from __future__ import annotations

import pytest

from bench import kafka_ingest

pytestmark = pytest.mark.kafka


@pytest.mark.parametrize("extra", [[], ["--kafka-only", "--compression", "zstd"]])
async def test_the_consumer_catches_up_on_the_fleet(kafka_bootstrap: str, extra: list[str]) -> None:
    args = kafka_ingest.parser().parse_args(
        ["--bootstrap", kafka_bootstrap, "--records", "600", "--mode", "consumer", *extra]
    )
    out = await kafka_ingest.main_async(args)
    # 64 instances, each replaying hyb-d0 or hyb-d1 from its start.
    streams = kafka_ingest.templates(kafka_ingest.FIXTURE)
    per_instance = [streams[i % 2][: 600 // 64 + (i < 600 % 64)] for i in range(64)]
    assert out["records"] == 600
    assert out["events"] == sum(t.events for s in per_instance for t in s)
    assert out["seconds"] > 0 and out["cpu_s"] >= 0
