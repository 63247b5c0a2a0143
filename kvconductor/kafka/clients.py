"""Starting and retiring aiokafka clients, for the daemon, the bridge and the tools."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import ConnectionGroup
from aiokafka.errors import KafkaConnectionError, KafkaError
from aiokafka.protocol.metadata import MetadataRequest

from kvconductor.lifecycle import Lifecycle, with_backoff

# How long an admin request waits for a broker to accept a connection
# before trying the next one.
CONNECT_TRY_S = 2.0


class Client(Protocol):
    async def start(self) -> None: ...
    async def stop(self) -> None: ...


C = TypeVar("C", bound=Client)
T = TypeVar("T")


async def started(make: Callable[[], C]) -> C:
    """A client from `make`, started; stopped again if it fails to start
    (aiokafka leaves tasks and connections of a failed start open)."""
    client = make()
    try:
        await client.start()
    except BaseException:
        with contextlib.suppress(Exception):
            await client.stop()
        raise
    return client


async def refresh_metadata(consumer: AIOKafkaConsumer) -> None:
    """Make the consumer's metadata current, so that `partitions_for_topic`
    knows a topic created or grown since it started.

    aiokafka (0.14) has no public call for it: `topics()` fetches into a copy
    it throws away. This asks the consumer's own client, a private attribute;
    check it when upgrading aiokafka."""
    await consumer._client.force_metadata_update()


async def until_kafka_answers(
    what: str,
    attempt: Callable[[], Awaitable[T]],
    lifecycle: Lifecycle,
    stopping: asyncio.Event,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """A start-up step of the daemon or the bridge, retried while Kafka does
    not answer; meanwhile probes say "<what>: kafka unavailable"."""
    return await with_backoff(
        what,
        attempt,
        retry_on=(KafkaError, OSError),
        lifecycle=lifecycle,
        waiting=lambda exc: f"{what}: kafka unavailable",
        stopping=stopping,
        on_retry=on_retry,
    )


async def retire(client: Client, grace_s: float) -> None:
    """Stop a client a successor replaced, within `grace_s`: one aiokafka
    gave up on may not stop cleanly."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(client.stop(), grace_s)


class LiveAdminClient(AIOKafkaAdminClient):  # type: ignore[misc]
    """An admin client whose requests go to a broker that answers.

    aiokafka bootstraps from the bootstrap servers in random order and sends
    each admin request to a random broker of the metadata, and on a broker
    that accepts connections but answers nothing (frozen, overloaded) waits
    out the whole request timeout. This one bootstraps giving each server
    `CONNECT_TRY_S` (then, if none answered that fast, the request timeout),
    and sends to the broker that answered it last while connected, else the
    first that answers a metadata request within `CONNECT_TRY_S`.

    It overrides aiokafka's private `_send_request` and uses its client's
    private `_request_timeout_ms` and `_conns`, as aiokafka 0.14 has them:
    check them when upgrading aiokafka."""

    # The broker that last answered.
    _live: int | None = None

    async def start(self) -> None:
        client = self._client
        full = client._request_timeout_ms
        client._request_timeout_ms = min(full, int(CONNECT_TRY_S * 1000))
        try:
            await super().start()
        except KafkaConnectionError:
            client._request_timeout_ms = full
            await super().start()
        finally:
            client._request_timeout_ms = full

    async def _send_request(self, request: Any, node_id: int | None = None) -> Any:
        if node_id is None:
            node_id = await self._live_node()
        return await self._client.send(node_id, request)

    async def _live_node(self) -> int:
        client = self._client
        live = self._live
        if live is not None:
            conn = client._conns.get((live, ConnectionGroup.DEFAULT))
            if conn is not None and conn.connected():
                return live
        nodes = [int(b.nodeId) for b in client.cluster.brokers()]
        random.shuffle(nodes)
        for node in nodes:
            # A frozen broker's kernel still accepts connections: only an
            # answer tells.
            with contextlib.suppress(KafkaError, OSError, TimeoutError):
                await asyncio.wait_for(client.send(node, MetadataRequest([])), CONNECT_TRY_S)
                self._live = node
                return node
        raise KafkaConnectionError("no broker of the cluster answers")
