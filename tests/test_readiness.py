"""Readiness per partition: `/ready` 503 naming the partitions the index is
stale on past `kafka.stale_after_s`, ready again once they are applied; the
per-partition metrics say the same."""

from __future__ import annotations

from collections.abc import Awaitable

import aiohttp
import pytest

from kvconductor.tools.api_client import parse_metrics
from tests.harness import daemon_config, http_json, produce, running, wait_for
from tests.streams import mixed_stream

pytestmark = pytest.mark.kafka

BOUND_S = 2.0


async def _metrics(port: int) -> dict[tuple[str, str, str], float]:
    """kvconductor_partition_* samples by (name, topic, partition)."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{port}/metrics") as resp,
    ):
        text = await resp.text()
    return {
        (name, labels["topic"], labels["partition"]): value
        for name, samples in parse_metrics(text).items()
        if name.startswith("kvconductor_partition_")
        for labels, value in samples
    }


async def test_ready_names_the_stale_partitions_and_recovers(kafka_bootstrap: str) -> None:
    cfg = daemon_config(
        kafka_bootstrap,
        KVCONDUCTOR_KAFKA_STALE_AFTER_S=str(BOUND_S),
        KVCONDUCTOR_KAFKA_PARTITIONS="1",
    )
    engine, _ = mixed_stream(3, 40)
    async with running(cfg) as daemon:
        port = daemon.http_port
        assert port is not None

        async def status() -> tuple[int, str]:
            code, body = await http_json(port, "GET", "/ready")
            return code, body["reason"]

        await wait_for(lambda: _is(status(), 200), 60, "ready")
        assert daemon.events is not None
        topic = cfg.kafka.engine_topic
        # The apply loop stuck (it waits for the lock), records arriving:
        # the index falls behind them.
        async with daemon.events.lock:
            await produce(kafka_bootstrap, topic, engine)
            reason = ""

            async def stale() -> bool:
                nonlocal reason
                code, reason = await status()
                return code == 503

            await wait_for(stale, 30, "not ready while the records wait")
            assert reason.startswith("index stale on 1 partition(s): "), reason
            assert f"{topic}/0 (" in reason and "records waiting for" in reason
            metrics = await _metrics(port)
            assert metrics[("kvconductor_partition_stale", topic, "0")] == 1.0
            assert metrics[("kvconductor_partition_behind_seconds", topic, "0")] > BOUND_S
            assert metrics[("kvconductor_partition_fetch_age_seconds", topic, "0")] < BOUND_S
            pool = cfg.kafka.pool_topic
            assert metrics[("kvconductor_partition_stale", pool, "0")] == 0.0
        await wait_for(lambda: _is(status(), 200), 30, "ready again once applied")
        metrics = await _metrics(port)
        assert metrics[("kvconductor_partition_stale", topic, "0")] == 0.0
        assert metrics[("kvconductor_partition_behind_seconds", topic, "0")] == 0.0


async def _is(status: Awaitable[tuple[int, str]], code: int) -> bool:
    return (await status)[0] == code
