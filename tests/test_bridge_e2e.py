"""End to end: a publisher speaking vLLM 0.33's frames -> bridge -> real Kafka
-> daemon -> HTTP /query."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests.bridge_fakes import FakePublisher, bridge_config, publisher, running_bridge
from tests.harness import (
    FIXTURES,
    daemon_config,
    http_json,
    running,
    stored,
    vllm_payload,
    wait_for,
)

pytestmark = pytest.mark.kafka

TOKENS = list(range(101, 109))  # the 0.33.0 fixtures' prompt: two blocks of four
OTHER = list(range(201, 209))


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def hit(tokens: int) -> dict[str, Any]:
    return {
        "default": {
            "vllm-e2e": {
                "longest_matched": tokens,
                "GPU": tokens,
                "CPU": tokens,
                "DISK": tokens,
                "DP": {"0": tokens},
            }
        }
    }


async def test_publisher_to_bridge_to_daemon_query(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    dcfg = daemon_config(kafka_bootstrap)
    pub = FakePublisher(ctx)
    bcfg = bridge_config(
        kafka_bootstrap,
        (publisher(pub, id="vllm-e2e"),),
        engine_topic=dcfg.kafka.engine_topic,
        pool_topic=dcfg.kafka.pool_topic,
        registrations=False,
    )
    fixture = FIXTURES / "0.33.0"
    try:
        async with running(dcfg) as daemon, running_bridge(bcfg):
            port = daemon.http_port
            assert port is not None

            async def answer(tokens: list[int]) -> Any:
                _, body = await http_json(
                    port, "POST", "/query", {"model": "m", "block_size": 4, "token_ids": tokens}
                )
                return body

            async def answers(tokens: list[int], want: Any) -> bool:
                return bool(await answer(tokens) == want)

            await pub.wait_subscribed()
            await pub.publish((fixture / "stored.msgpack").read_bytes())  # blocks 1, 2
            # Lost on the way: only the replay fills it. Without it block 2 would stay.
            await pub.publish((fixture / "removed.msgpack").read_bytes(), drop=True)
            await pub.publish(vllm_payload([stored([21, 22], OTHER)]))
            await wait_for(lambda: answers(OTHER, hit(8)), 30, "second prompt indexed")
            assert await answer(TOKENS) == hit(4)

            # The engine restarts (its sequence goes back to 0): the bridge's resync
            # record makes the daemon forget what the old process held.
            port_, replay_port = pub.port, pub.replay_port
            await pub.close()
            pub = FakePublisher(ctx, port=port_, replay_port=replay_port)
            await pub.wait_subscribed()
            await pub.publish(vllm_payload([stored([31], list(range(301, 305)))]))
            await wait_for(lambda: answers(list(range(301, 305)), hit(4)), 30, "after restart")
            assert await answer(TOKENS) == hit(0)
            assert await answer(OTHER) == hit(0)
    finally:
        await pub.close()
