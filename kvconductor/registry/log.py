"""The registrations topic: every registration, read and written.

The topic (compacted) holds one record per registered instance rank, key
`["<instance_id>", <dp_rank>]`, value `registrations.record_value`, and a
tombstone once it is unregistered, so it always holds the current list.
Every bridge, daemon and replica reads it whole (the catalog) and follows
it, so they agree on one list whichever of them took a registration.

    log = RegistrationLog(kafka_cfg, "kv-bridge-registrations", "kvconductor", on_change)
    await log.start()          # the catalog read to the end of the topic
    key = await log.register(body)
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, NamedTuple

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.errors import KafkaError

from kvconductor.config import KafkaConfig, kafka_client_options
from kvconductor.registry.bodies import (
    Context,
    InvalidRegistration,
    ReadOnlyRegistrations,
    RegisterBody,
    body_key,
    decode_record_key,
    decode_record_value,
    merge_registrations,
    record_key,
    record_value,
    registered_profiles,
    registered_ranks,
    to_publisher,
)
from kvconductor.registry.publishers import PublisherConfig, StreamKey
from kvconductor.wire.engine_hashes import VllmProfile

log = structlog.get_logger("kvconductor.registrations")

CALL_TIMEOUT_S = 15.0


async def cancelled(task: asyncio.Task[None] | None) -> None:
    """Cancel a follower task and wait until it has ended."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await task


class Entry(NamedTuple):
    partition: int
    publisher: PublisherConfig
    body: RegisterBody


class RegistrationLog:
    def __init__(
        self,
        kafka: KafkaConfig,
        topic: str,
        client_id: str,
        on_change: Callable[[], Awaitable[None]] | None = None,
        writable: bool = True,
    ) -> None:
        """`writable` False: follow the topic only (a query replica, which
        never writes to Kafka); a new registration or an unregistration
        raises ReadOnlyRegistrations, an identical repeat still succeeds."""
        self.kafka = kafka
        self.writable = writable
        self.topic = topic
        self.client_id = client_id
        self.on_change = on_change
        self.catalog: dict[StreamKey, Entry] = {}
        self._ranks: dict[Context, dict[str, set[int]]] | None = None
        self._profiles: dict[Context, tuple[VllmProfile, ...]] | None = None
        self.loaded = asyncio.Event()
        self.producer: Any = None
        self.consumer: Any = None
        self.task: asyncio.Task[None] | None = None

    def options(self) -> dict[str, Any]:
        k = self.kafka
        return {"bootstrap_servers": k.bootstrap_servers, **kafka_client_options(k)}

    # --------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the clients and read the catalog to its end (retried by the caller)."""
        if self.writable:
            self.producer = AIOKafkaProducer(
                client_id=f"{self.client_id}-registry",
                acks="all",
                enable_idempotence=True,
                **self.options(),
            )
        self.consumer = AIOKafkaConsumer(
            self.topic,
            client_id=f"{self.client_id}-catalog",
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=200,
            **self.options(),
        )
        try:
            if self.producer is not None:
                await asyncio.wait_for(self.producer.start(), CALL_TIMEOUT_S)
            await asyncio.wait_for(self.consumer.start(), CALL_TIMEOUT_S)
            await asyncio.wait_for(self._load(), CALL_TIMEOUT_S * 2)
        except BaseException:
            await self.stop()
            raise
        self.task = asyncio.get_running_loop().create_task(
            self._follow(), name=f"{self.client_id}-registrations"
        )

    async def stop(self) -> None:
        task, self.task = self.task, None
        await cancelled(task)
        for name in ("consumer", "producer"):
            client = getattr(self, name)
            setattr(self, name, None)
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.stop(), CALL_TIMEOUT_S)

    # ------------------------------------------------------------ catalog

    def _apply(self, record: Any) -> bool:
        self._ranks = self._profiles = None
        key = decode_record_key(record.key)
        if key is None:
            log.warning("registration with an unreadable key skipped", offset=record.offset)
            return False
        if record.value is None:
            return self.catalog.pop(key, None) is not None
        try:
            body = decode_record_value(record.value)
            pub = to_publisher(body)
        except (msgspec.DecodeError, msgspec.ValidationError, InvalidRegistration) as exc:
            log.warning("registration skipped", key=str(key), error=str(exc))
            return False
        old = self.catalog.get(key)
        self.catalog[key] = Entry(record.partition, pub, body)
        return old is None or old.publisher != pub or old.partition != record.partition

    async def _load(self) -> None:
        consumer = self.consumer
        while not consumer.assignment():
            await consumer.getmany(timeout_ms=100)
        parts = list(consumer.assignment())
        ends = await consumer.end_offsets(parts)
        while True:
            batch = await consumer.getmany(timeout_ms=200)
            for records in batch.values():
                for record in records:
                    self._apply(record)
            if all([await consumer.position(tp) >= ends[tp] for tp in parts]):
                break
        self.loaded.set()
        log.info("registrations loaded", registrations=len(self.catalog))

    async def _follow(self) -> None:
        while True:
            try:
                batch = await self.consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:
                log.warning("reading registrations failed; retrying", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            changed = False
            for records in batch.values():
                for record in records:
                    changed |= self._apply(record)
            if changed and self.on_change is not None:
                await self.on_change()

    # ------------------------------------------------------------- writes

    def check(self, body: RegisterBody) -> tuple[StreamKey, RegisterBody | None]:
        """The body's key and what to write for it: the body, or its merge
        with the registered one (`merge_registrations`); None when the
        registered one already says it all. InvalidRegistration when it
        contradicts one."""
        pub = to_publisher(body)
        key = StreamKey(pub.id, pub.dp_rank)
        old = self.catalog.get(key)
        if old is not None:
            merged = merge_registrations(old.body, body)
            return key, (None if merged == old.body else merged)
        for other, entry in self.catalog.items():
            if entry.publisher.endpoint == pub.endpoint:
                raise InvalidRegistration(
                    f"conflicting active registration for endpoint: {pub.endpoint}"
                    f" (service key {body_key(entry.body)}, {other.id} rank {other.rank})",
                    field="endpoint",
                )
        return key, body

    async def register(self, body: RegisterBody) -> StreamKey:
        """Write a new or merged registration to the topic; one the
        registered one already says writes nothing."""
        key, write = self.check(body)
        if write is not None:
            partition = await self._write(key, record_value(write))
            # Taken at once, not when read back: a repeat or a conflict right
            # after it is seen as one.
            await self._changed(key, Entry(partition, to_publisher(write), write))
        return key

    def find(self, instance_id: str, tenant_id: str | None, dp_rank: int) -> StreamKey | None:
        """The key registered for Conductor's service key, if any."""
        key = StreamKey(instance_id, dp_rank)
        entry = self.catalog.get(key)
        if entry is None or entry.publisher.tenant != (tenant_id or "default"):
            return None
        return key

    def ranks(self, context: Context) -> dict[str, set[int]]:
        """The registered engine instances of a context and their ranks."""
        if self._ranks is None:
            self._ranks = registered_ranks(e.publisher for e in self.catalog.values())
        return self._ranks.get(context, {})

    def profiles(self, context: Context) -> tuple[VllmProfile, ...]:
        """The hash profiles the context's engine registrations bind."""
        return self._profile_map().get(context, ())

    def any_profile(self) -> bool:
        """Whether any registration binds a profile (else no query needs one)."""
        return bool(self._profile_map())

    def _profile_map(self) -> dict[Context, tuple[VllmProfile, ...]]:
        if self._profiles is None:
            self._profiles = registered_profiles(e.body for e in self.catalog.values())
        return self._profiles

    def bodies(self) -> list[RegisterBody]:
        return [e.body for _, e in sorted(self.catalog.items())]

    async def unregister(self, key: StreamKey) -> None:
        await self._write(key, None)
        await self._changed(key, None)

    async def _changed(self, key: StreamKey, entry: Entry | None) -> None:
        self._ranks = self._profiles = None
        if entry is None:
            self.catalog.pop(key, None)
        else:
            self.catalog[key] = entry
        if self.on_change is not None:
            await self.on_change()

    async def _write(self, key: StreamKey, value: bytes | None) -> int:
        """Write a record; the partition it went to."""
        if not self.writable:
            raise ReadOnlyRegistrations(
                "this is a query replica, which never writes to Kafka: register at the "
                "daemon or a bridge"
            )
        if self.producer is None or not self.loaded.is_set():
            raise KafkaError("registrations are not loaded yet")
        start = time.monotonic()
        fut = await asyncio.wait_for(
            self.producer.send(self.topic, key=record_key(key), value=value), CALL_TIMEOUT_S
        )
        meta = await asyncio.wait_for(fut, max(1.0, CALL_TIMEOUT_S - (time.monotonic() - start)))
        return int(meta.partition)
