"""A broker stopped and started again while messages flow: the bridge buffers
within its bound, pushes back on ZMQ, and resumes without loss or duplicates.

Runs its own broker (never the session's), on free ports."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import zmq
import zmq.asyncio

from kvconductor.tools.kafka_local import broker as kafka_local
from tests.bridge_fakes import FakePublisher, bridge_config, publisher, running_bridge
from tests.harness import wait_for
from tests.test_bridge_kafka import (
    ATTACHED,
    check_stream,
    metric,
    records_until,
    relayed,
)

pytestmark = pytest.mark.kafka


def big(i: int) -> bytes:
    """A 64 KiB payload, distinct per message."""
    return i.to_bytes(8, "big") * (8 * 1024)


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


async def test_broker_outage_while_messages_flow(
    tmp_path: Path, ctx: zmq.asyncio.Context, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Faster broker starts, at some throughput cost (kafka_local's documented trade-off).
    monkeypatch.setenv(kafka_local.ENV_JAVA_OPTS, "-XX:TieredStopAtLevel=1")
    data_dir = tmp_path / "kafka"
    port, controller_port = kafka_local.free_ports(2)
    bootstrap = await asyncio.to_thread(
        kafka_local.start, data_dir, port=port, controller_port=controller_port
    )
    # Tiny ZMQ queues and 64 KiB messages: beyond the bridge's bound the
    # publisher drops messages, and the replay has to fill the gaps.
    pub = FakePublisher(ctx, sndhwm=1)
    # A small bound, so that the outage fills it and the bridge pushes back.
    cfg = bridge_config(
        bootstrap,
        (publisher(pub),),
        registrations=False,
        buffer_max_messages=40,
        zmq_rcvhwm=1,
        idle_probe_s=0.5,
    )
    total = 300
    try:
        async with running_bridge(cfg) as bridge:
            await pub.wait_subscribed()
            for i in range(50):
                await pub.publish(big(i))
            m = bridge.metrics
            await wait_for(lambda: relayed(bridge) == 50, 30, "first records acked")

            await asyncio.to_thread(kafka_local.stop, data_dir)
            for i in range(50, 250):  # while the broker is down
                await pub.publish(big(i))
                await asyncio.sleep(0.01)
            assert bridge.budget.messages <= 40
            await wait_for(lambda: not bridge.health()[0], 15, "health: kafka unavailable")
            assert bridge.budget.messages <= 40

            await asyncio.to_thread(
                kafka_local.start, data_dir, port=port, controller_port=controller_port
            )
            for i in range(250, total):
                await pub.publish(big(i))
                await asyncio.sleep(0.005)
            await wait_for(lambda: relayed(bridge) == total, 90, "all relayed")
            text = m.render().decode()
            assert metric(text, "kvconductor_bridge_buffer_full_total") >= 1
            assert bridge.health()[0]
            records = await records_until(bootstrap, cfg.kafka.engine_topic, total + 1, 30)
            check_stream(records, [ATTACHED, *(("data", i) for i in range(total))], payload_of=big)
            # Beyond the bound the publisher dropped messages; the replay filled them.
            assert metric(text, "kvconductor_bridge_gaps_total") >= 1
            assert metric(text, "kvconductor_bridge_replays_total", outcome="filled") >= 1
            assert metric(text, "kvconductor_bridge_unfillable_gaps_total") == 0
    finally:
        await pub.close()
        await asyncio.to_thread(kafka_local.stop, data_dir)
