"""Run-time registrations (Mooncake RFC #1403 bodies) on a compacted topic.

`POST /register` writes the registration to `registrations_topic`, key
`["<instance_id>", <dp_rank>]` (JSON), value `{"version": 1,
"registration": <the RFC body>}`; `POST /unregister` writes a tombstone
(null value) for that key. The topic is log-compacted, so it always holds
the current registrations, and nothing else is stored anywhere.

Every bridge reads the whole topic (the catalog) and follows it. Which
bridge relays which registration is decided by a Kafka consumer group
(`bridge.group_id`) on the same topic: a bridge relays the registrations in
the partitions the group assigns to it. One bridge relays them all; a
second one takes half of them; when a bridge stops or dies, the group hands
its partitions, and with them its registrations, to the others. A restarted
bridge reads them back from the topic.

Body (JSON): `endpoint`, `replay_endpoint` ("" or null: none), `type`
(`vLLM`, `SGLang`, `TRTLLM` or `TensorRT-LLM`: an engine; `Mooncake`: a pool
backend; any case), `modelname`, `lora_name`, `tenant_id` (default
"default"), `instance_id`, `block_size`, `dp_rank` (default 0),
`additionalsalt`; and, as a kvconductor extension, `kv_offload` (`local` or
`pool`, engines only). Unknown fields are ignored. A registration is one
socket: `endpoint` is the socket of rank `dp_rank`. Registering the same
`(instance_id, dp_rank)` again replaces it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.abc import ConsumerRebalanceListener
from aiokafka.errors import KafkaError

from kvconductor.bridge.config import BridgeConfig, PublisherConfig, publisher_from_mapping
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.bridge.records import StreamKey
from kvconductor.config import ConfigError, kafka_client_options

log = structlog.get_logger("kvconductor.bridge.registry")

VERSION = 1
CALL_TIMEOUT_S = 15.0

TYPES: dict[str, tuple[str, str]] = {
    "vllm": ("engine", "vllm"),
    "sglang": ("engine", "sglang"),
    "trtllm": ("engine", "trtllm"),
    "trt-llm": ("engine", "trtllm"),
    "tensorrt-llm": ("engine", "trtllm"),
    "tensorrt_llm": ("engine", "trtllm"),
    "mooncake": ("pool", "mooncake"),
}


class RegisterBody(msgspec.Struct, kw_only=True):
    endpoint: str
    type: str
    instance_id: str
    replay_endpoint: str | None = None
    modelname: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    block_size: int | None = None
    dp_rank: int = 0
    additionalsalt: str | None = None
    kv_offload: str | None = None


class UnregisterBody(msgspec.Struct, kw_only=True):
    instance_id: str
    dp_rank: int = 0
    type: str | None = None
    modelname: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    block_size: int | None = None


class _Stored(msgspec.Struct):
    version: int
    registration: RegisterBody


class InvalidRegistration(ValueError):
    """A registration body that cannot be relayed (answered with 400)."""


class RegistrationConflict(ValueError):
    """A registration for a publisher rank the config file defines (409)."""


def to_publisher(body: RegisterBody) -> PublisherConfig:
    """The publisher a registration describes; InvalidRegistration if it cannot be relayed."""
    kind_source = TYPES.get(body.type.strip().lower())
    if kind_source is None:
        raise InvalidRegistration(
            f"type: expected vLLM, SGLang, TRTLLM or Mooncake, got {body.type!r}"
        )
    raw: dict[str, object] = {
        "id": body.instance_id,
        "endpoint": body.endpoint,
        "kind": kind_source[0],
        "source": kind_source[1],
        "replay_endpoint": body.replay_endpoint or None,
        "dp_rank": body.dp_rank,
        "tenant": body.tenant_id or "default",
        "salt": body.additionalsalt or "",
    }
    if body.modelname:
        raw["model"] = body.modelname
    if body.block_size is not None:
        raw["block_size"] = body.block_size
    if body.lora_name:
        raw["lora_name"] = body.lora_name
    if body.kv_offload:
        raw["offload"] = body.kv_offload
    raw = {k: v for k, v in raw.items() if v is not None}
    names = {
        "id": "instance_id",
        "model": "modelname",
        "tenant": "tenant_id",
        "salt": "additionalsalt",
        "offload": "kv_offload",
    }
    try:
        return publisher_from_mapping(raw, "registration")
    except ConfigError as exc:
        text = str(exc).removeprefix("config error: registration ")
        key, _, why = text.partition(":")
        raise InvalidRegistration(f"{names.get(key, key)}:{why}") from None


def record_key(key: StreamKey) -> bytes:
    return msgspec.json.encode([key.id, key.rank])


def _decode_key(raw: bytes | None) -> StreamKey | None:
    try:
        instance, rank = msgspec.json.decode(raw or b"", type=tuple[str, int])
    except (msgspec.DecodeError, ValueError):
        return None
    return StreamKey(instance, rank)


class Registry:
    def __init__(
        self,
        cfg: BridgeConfig,
        metrics: BridgeMetrics,
        on_change: Callable[[], Awaitable[None]],
    ) -> None:
        self.cfg = cfg
        self.topic = cfg.bridge.registrations_topic
        self.metrics = metrics
        self.on_change = on_change
        self.catalog: dict[StreamKey, tuple[int, PublisherConfig, RegisterBody]] = {}
        self.owned: set[int] = set()
        self.loaded = asyncio.Event()
        self.producer: Any = None
        self.catalog_consumer: Any = None
        self.group_consumer: Any = None
        self.tasks: list[asyncio.Task[None]] = []

    # --------------------------------------------------------- lifecycle

    def _options(self) -> dict[str, Any]:
        k = self.cfg.kafka
        return {"bootstrap_servers": k.bootstrap_servers, **kafka_client_options(k)}

    async def start(self) -> None:
        """Start the clients and read the catalog to its end (retried by the caller)."""
        b = self.cfg.bridge
        self.producer = AIOKafkaProducer(
            client_id=f"{b.client_id}-registry",
            acks="all",
            enable_idempotence=True,
            **self._options(),
        )
        self.catalog_consumer = AIOKafkaConsumer(
            self.topic,
            client_id=f"{b.client_id}-catalog",
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=200,
            **self._options(),
        )
        try:
            await asyncio.wait_for(self.producer.start(), CALL_TIMEOUT_S)
            await asyncio.wait_for(self.catalog_consumer.start(), CALL_TIMEOUT_S)
            await asyncio.wait_for(self._load(), CALL_TIMEOUT_S * 2)
        except BaseException:
            await self._stop_clients()
            raise
        loop = asyncio.get_running_loop()
        self.tasks.append(loop.create_task(self._follow(), name="bridge-registry-catalog"))
        self.tasks.append(loop.create_task(self._own(), name="bridge-registry-group"))

    async def stop(self) -> None:
        for task in self.tasks:
            task.cancel()
        for task in self.tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.tasks.clear()
        await self._stop_clients()

    async def _stop_clients(self) -> None:
        for name in ("group_consumer", "catalog_consumer", "producer"):
            client = getattr(self, name)
            setattr(self, name, None)
            if client is not None:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(client.stop(), CALL_TIMEOUT_S)

    # ------------------------------------------------------------ catalog

    def _apply(self, record: Any) -> bool:
        key = _decode_key(record.key)
        if key is None:
            log.warning("registration with an unreadable key skipped", offset=record.offset)
            return False
        if record.value is None:
            return self.catalog.pop(key, None) is not None
        try:
            stored = msgspec.json.decode(record.value, type=_Stored)
            if stored.version != VERSION:
                raise InvalidRegistration(f"unknown version {stored.version}")
            pub = to_publisher(stored.registration)
        except (msgspec.DecodeError, msgspec.ValidationError, InvalidRegistration) as exc:
            log.warning("registration skipped", key=str(key), error=str(exc))
            return False
        old = self.catalog.get(key)
        self.catalog[key] = (record.partition, pub, stored.registration)
        return old is None or old[1] != pub or old[0] != record.partition

    async def _load(self) -> None:
        consumer = self.catalog_consumer
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
        self.metrics.registrations.set(len(self.catalog))
        self.loaded.set()
        log.info("registrations loaded", registrations=len(self.catalog))

    async def _follow(self) -> None:
        consumer = self.catalog_consumer
        while True:
            try:
                batch = await consumer.getmany(timeout_ms=1000)
            except KafkaError as exc:
                log.warning("reading registrations failed; retrying", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            changed = False
            for records in batch.values():
                for record in records:
                    changed |= self._apply(record)
            if changed:
                self.metrics.registrations.set(len(self.catalog))
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
                **self._options(),
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

    def desired(self) -> dict[StreamKey, PublisherConfig]:
        """The registrations this bridge relays (those of its partitions)."""
        return {k: pub for k, (part, pub, _) in self.catalog.items() if part in self.owned}

    # ------------------------------------------------------------- writes

    async def register(self, body: RegisterBody) -> StreamKey:
        pub = to_publisher(body)
        key = StreamKey(pub.id, pub.dp_rank)
        value = msgspec.json.encode({"version": VERSION, "registration": body})
        await self._write(key, value)
        return key

    async def unregister(self, key: StreamKey) -> bool:
        if key not in self.catalog:
            return False
        await self._write(key, None)
        return True

    async def _write(self, key: StreamKey, value: bytes | None) -> None:
        if self.producer is None:
            raise KafkaError("registrations are not loaded yet")
        start = time.monotonic()
        fut = await asyncio.wait_for(
            self.producer.send(self.topic, key=record_key(key), value=value), CALL_TIMEOUT_S
        )
        await asyncio.wait_for(fut, max(1.0, CALL_TIMEOUT_S - (time.monotonic() - start)))

    def describe(self) -> list[dict[str, object]]:
        return [
            {
                "instance_id": key.id,
                "dp_rank": key.rank,
                "partition": part,
                "relayed_here": part in self.owned,
                "registration": msgspec.to_builtins(body),
            }
            for key, (part, _, body) in sorted(self.catalog.items())
        ]
