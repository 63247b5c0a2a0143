"""Which bridge relays which registration.

Registrations (`kvconductor.registry.bodies`, made at any bridge or daemon)
live on the compacted `registrations_topic` (`kvconductor.registry.log`);
every bridge reads the whole topic (the catalog) and follows it. Which
bridge relays which registration is decided by a Kafka consumer group
(`bridge.group_id`) on the same topic: a bridge relays the registrations in
the partitions the group assigns to it. One bridge relays them all; a
second one takes half of them; when a bridge stops or dies, the group hands
its partitions, and with them its registrations, to the others. A restarted
bridge reads them back from the topic.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, Collection

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from kvconductor.bridge.config import BridgeConfig
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.registry.bodies import RegisterBody, RegistrationConflict, to_publisher
from kvconductor.registry.log import CALL_TIMEOUT_S, RegistrationLog, cancelled
from kvconductor.registry.publishers import PublisherConfig, StreamKey

log = structlog.get_logger("kvconductor.bridge.registry")


class Registry:
    def __init__(
        self,
        cfg: BridgeConfig,
        metrics: BridgeMetrics,
        on_change: Callable[[], Awaitable[None]],
        reserved: Collection[StreamKey] = (),
    ) -> None:
        """`reserved`: the ranks the config file defines (not registrable)."""
        self.cfg = cfg
        self.reserved = reserved
        self.topic = cfg.bridge.registrations_topic
        self.metrics = metrics
        self.on_change = on_change
        self.log = RegistrationLog(cfg.kafka, self.topic, cfg.bridge.client_id, self._changed)
        self.owned: set[int] = set()
        self.group_consumer: AIOKafkaConsumer | None = None
        self.task: asyncio.Task[None] | None = None

    # --------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Read the catalog to its end and join the group (retried by the caller)."""
        await self.log.start()
        self.metrics.registrations.set(len(self.log.catalog))
        self.task = asyncio.get_running_loop().create_task(
            self._own(), name="bridge-registry-group"
        )

    async def stop(self) -> None:
        task, self.task = self.task, None
        await cancelled(task)
        consumer, self.group_consumer = self.group_consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), CALL_TIMEOUT_S)
        await self.log.stop()

    async def _changed(self) -> None:
        self.metrics.registrations.set(len(self.log.catalog))
        await self.on_change()

    # ---------------------------------------------------------- ownership

    async def _own(self) -> None:
        b = self.cfg.bridge
        registry = self

        class Listener(ConsumerRebalanceListener):  # type: ignore[misc]
            async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
                lost = {tp.partition for tp in revoked if tp.topic == registry.topic}
                if lost & registry.owned:
                    registry.owned -= lost
                    log.info("registration partitions revoked", partitions=sorted(lost))
                    await registry.on_change()

            async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
                got = {tp.partition for tp in assigned if tp.topic == registry.topic}
                registry.owned = got
                log.info("registration partitions assigned", partitions=sorted(got))
                await registry.on_change()

        delay = 0.5
        while True:
            consumer = AIOKafkaConsumer(
                client_id=f"{b.client_id}-group",
                group_id=b.group_id,
                enable_auto_commit=False,
                auto_offset_reset="latest",
                # Rebalances (a bridge joining or leaving) within about a second.
                heartbeat_interval_ms=1000,
                **self.log.options(),
            )
            try:
                await asyncio.wait_for(consumer.start(), CALL_TIMEOUT_S)
                self.group_consumer = consumer
                consumer.subscribe([self.topic], listener=Listener())
                delay = 0.5
                while True:
                    # Membership only: the records are read by the catalog.
                    await consumer.getmany(timeout_ms=1000)
            except (KafkaError, OSError, TimeoutError) as exc:
                log.warning("registration group failed; rejoining", error=str(exc))
                self.group_consumer = None
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(consumer.stop(), CALL_TIMEOUT_S)
                if self.owned:
                    self.owned = set()
                    await self.on_change()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)

    # ------------------------------------------------- the registrar's part

    async def register(self, body: RegisterBody) -> StreamKey:
        pub = to_publisher(body)
        key = StreamKey(pub.id, pub.dp_rank)
        if key in self.reserved:
            raise RegistrationConflict(
                f"{key.id!r} rank {key.rank} is defined in this bridge's config file"
            )
        return await self.log.register(body)

    def find(self, instance_id: str, tenant_id: str | None, dp_rank: int) -> StreamKey | None:
        return self.log.find(instance_id, tenant_id, dp_rank)

    async def unregister(self, key: StreamKey) -> None:
        await self.log.unregister(key)

    def bodies(self) -> list[RegisterBody]:
        return self.log.bodies()

    def desired(self) -> dict[StreamKey, PublisherConfig]:
        """The registrations this bridge relays (those of its partitions)."""
        return {k: e.publisher for k, e in self.log.catalog.items() if e.partition in self.owned}

    def describe(self) -> list[dict[str, object]]:
        return [
            {
                "instance_id": key.id,
                "dp_rank": key.rank,
                "partition": e.partition,
                "relayed_here": e.partition in self.owned,
                "registration": msgspec.to_builtins(e.body),
            }
            for key, e in sorted(self.log.catalog.items())
        ]
