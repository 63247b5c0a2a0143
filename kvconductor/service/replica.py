"""Query replicas: the daemon's index, rebuilt and kept fresh in any process.

    replica = Replica(cfg)                    # or Replica(bootstrap_servers=...)
    await replica.start()                     # snapshot topic -> index
    await replica.wait_caught_up(timeout=60)  # optional
    replica.query(TokenQuery(model="m", block_size=16, token_ids=[...]))
    await replica.stop()

`start()` reads the snapshot topic (contract section 5) to its end and
restores the index from it, exactly as the daemon does at start-up. Then the
replica keeps fresh in one of two ways (`follow=`):

- `"events"` (default): tail the engine and pool topics (or, in scale-out
  mode, the repartitioned topic the daemons read) from the offsets the
  snapshot records, with a group-less consumer, applying every record
  through a `Conductor` exactly like the daemon. Partitions with no recorded
  offset start at the beginning. The replica is then as fresh as the topics
  and answers exactly like a daemon at the same offsets; it costs the
  event-applying CPU of a daemon.
- `"snapshots"`: keep reading the snapshot topic and apply each newer
  generation's units (`snapshots.apply_units`). Cheaper (a generation
  carries only changed units), and as fresh as the daemon's snapshot
  interval; after each generation the index equals the daemon's at that
  generation's offsets. The union of several daemons' generations (scale
  out) arrives the same way.
- `"none"`: restore once and stay put (tools, tests).

A replica never writes to Kafka: no consumer group, no commits, no dead
letters (records the index rejects are counted in the metrics and logged,
as in the daemon; the daemon dead-letters them). `kvconductor replica
--config FILE` serves the same HTTP API as the daemon from a replica, ready
once caught up (`run_replica`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, Literal

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from kvconductor.config import Config, kafka_service_options
from kvconductor.consumers.dead_letters import DeadLetterWriter
from kvconductor.consumers.event_consumer import EventConsumer
from kvconductor.consumers.positions import resume_positions
from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.kafka.access import check_access
from kvconductor.kafka.clients import refresh_metadata
from kvconductor.lifecycle import Lifecycle, Phase
from kvconductor.obs.metrics import Metrics
from kvconductor.snapshots.store import SnapshotRead, read_snapshot
from kvconductor.snapshots.units import (
    SCHEMA_VERSION,
    GenerationUnit,
    Unit,
    UnitKey,
    UnitValue,
    apply_units,
    decode_unit,
    restore,
)
from kvconductor.wire.query import HashQuery, QueryResponse, TokenQuery

log = structlog.get_logger("kvconductor.replica")

Follow = Literal["events", "snapshots", "none"]
FOLLOW_MODES: tuple[Follow, ...] = ("events", "snapshots", "none")

POLL_TIMEOUT_MS = 200
EXPIRE_EVERY_S = 1.0  # as the daemon: age out pending halves by event time

_key_decoder = msgspec.msgpack.Decoder(list[Any])
_value_decoder = msgspec.msgpack.Decoder(UnitValue)


class ReplicaError(RuntimeError):
    """The replica cannot start (a topic is missing, it was started twice)."""


class SnapshotUnusable(ReplicaError):
    """The snapshot topic holds what this replica's index cannot take (more
    namespaces or owners than its limits, arrays of different lengths):
    retrying will not help, as for the daemon, which stops on it."""


class _NoDeadLetters(DeadLetterWriter):
    """Read-only: rejected records are counted and logged, never re-published."""

    def __init__(self, metrics: Metrics) -> None:
        super().__init__(None, "", metrics)

    async def send(self, record: Any, kind: str, reason: str) -> None:
        return None

    async def flush(self) -> None:
        return None


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> list[int]:
    parts = consumer.partitions_for_topic(topic)
    if not parts:
        await refresh_metadata(consumer)
        parts = consumer.partitions_for_topic(topic)
    if not parts:
        raise ReplicaError(f"topic {topic!r} has no partitions in the broker's metadata")
    return sorted(parts)


class Replica:
    """An in-process copy of the daemon's index, rebuilt from Kafka.

    Pass the daemon's `Config` (only `[kafka]` and `[index]` are used), or
    leave it out and name the broker and topics; keyword arguments override
    the config's values. Queries run on the caller's event loop thread, like
    the updates, so they always see a consistent index."""

    def __init__(
        self,
        cfg: Config | None = None,
        *,
        follow: Follow = "events",
        bootstrap_servers: str | None = None,
        snapshot_topic: str | None = None,
        engine_topic: str | None = None,
        pool_topic: str | None = None,
        client_id: str | None = None,
        limits: IndexLimits | None = None,
    ) -> None:
        if follow not in FOLLOW_MODES:
            raise ValueError(f"follow must be one of {FOLLOW_MODES}, got {follow!r}")
        cfg = cfg if cfg is not None else Config()
        overrides = {
            name: value
            for name, value in (
                ("bootstrap_servers", bootstrap_servers),
                ("snapshot_topic", snapshot_topic),
                ("engine_topic", engine_topic),
                ("pool_topic", pool_topic),
                ("client_id", client_id),
            )
            if value is not None
        }
        if overrides:
            cfg = msgspec.structs.replace(
                cfg, kafka=msgspec.structs.replace(cfg.kafka, **overrides)
            )
        self.cfg = cfg
        self.follow: Follow = follow
        self.limits = limits if limits is not None else cfg.index
        self.conductor = Conductor(self.limits)
        self.metrics = Metrics(self.conductor)
        # The generation restored, then the newest applied (follow="snapshots").
        self.generation = 0
        self.restored: SnapshotRead | None = None
        self.lifecycle = Lifecycle(Phase.NOT_STARTED)
        self.error: BaseException | None = None
        self._offsets: dict[TopicPartition, int] = {}
        self._consumer: AIOKafkaConsumer | None = None
        self._events: EventConsumer | None = None
        self._task: asyncio.Task[None] | None = None
        self._kafka_ok = True
        self._caught_up = False
        # follow="snapshots": records read but not applied yet, and units
        # still missing chunks.
        self._buffer: list[tuple[UnitKey, int, UnitValue | None]] = []
        self._cut = 0
        self._pieces: dict[UnitKey, dict[int, UnitValue | None]] = {}
        self._incomplete_logged = 0.0

    # ------------------------------------------------------------ queries

    def query(self, req: TokenQuery) -> QueryResponse:
        """The contract's answer for a prompt's tokens (section 4)."""
        return self.conductor.query(req)

    def query_by_hash(self, req: HashQuery) -> QueryResponse:
        """The contract's answer for a prompt named by engine block hashes."""
        return self.conductor.query_by_hash(req)

    def offsets(self) -> dict[TopicPartition, int]:
        """Per source partition, the next offset to read: the index reflects
        every record before it. follow="events": the engine and pool (or
        repartitioned) partitions this replica tails; "snapshots"/"none": the
        offsets recorded by the newest generation applied."""
        return dict(self._offsets)

    @property
    def caught_up(self) -> bool:
        """Has the replica once reached the end of what it follows?"""
        if self._events is not None:
            return self._events.caught_up
        return self._caught_up

    @property
    def status(self) -> str:
        return self.lifecycle.status

    def ready(self) -> tuple[bool, str]:
        """(ready, reason), for a readiness probe: started, Kafka reachable,
        caught up."""
        if self.error is not None:
            return False, f"failed: {type(self.error).__name__}: {self.error}"
        if not self.lifecycle.running:
            return False, self.status
        if not self._kafka_ok:
            return False, "kafka unavailable"
        if not self.caught_up:
            return False, "catching up"
        events = self._events
        stale = events.staleness(self.cfg.kafka.stale_after_s) if events is not None else None
        if stale is not None:
            return False, stale
        return True, "ready"

    async def wait_caught_up(self, timeout: float | None = None) -> None:
        """Wait until `caught_up`; raises TimeoutError after `timeout` seconds
        and the follower's error if it failed."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.caught_up:
            if self.error is not None:
                raise ReplicaError(f"replica failed: {self.error}") from self.error
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"replica not caught up after {timeout}s")
            await asyncio.sleep(0.05)

    # ---------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Replica:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _consumer_options(self, suffix: str) -> dict[str, Any]:
        k = self.cfg.kafka
        return {
            "bootstrap_servers": k.bootstrap_servers,
            "client_id": f"{k.client_id}-{suffix}",
            "group_id": None,
            "enable_auto_commit": False,
            "auto_offset_reset": "earliest",
            "isolation_level": "read_committed",
            **kafka_service_options(k),
        }

    async def start(self) -> None:
        """Restore from the snapshot topic, then follow in the background.

        All or nothing: on failure (the topic does not exist yet, Kafka is
        unreachable) the index stays empty and `start()` may be retried;
        `KafkaAccessError` (credentials or certificate refused) is for good."""
        if self._task is not None or self._consumer is not None:
            raise ReplicaError("replica already started")
        k = self.cfg.kafka
        await check_access(k)
        self.lifecycle.move(Phase.RESTORING)
        consumer = AIOKafkaConsumer(**self._consumer_options("replica"), fetch_max_wait_ms=100)
        try:
            await consumer.start()
            if k.snapshot_topic not in await consumer.topics():
                raise ReplicaError(f"snapshot topic {k.snapshot_topic!r} does not exist")
            read = await read_snapshot(consumer, k.snapshot_topic)
            index = Index(self.limits)
            try:
                restore(index, read.units)
            except ValueError as exc:
                raise SnapshotUnusable(
                    f"the snapshot topic {k.snapshot_topic} cannot be restored: {exc}"
                ) from exc
            self.conductor.replace_state(index)
            self.restored = read
            self.generation = read.generation
            self._offsets = dict(read.offsets)
            log.info(
                "snapshot restored",
                topic=k.snapshot_topic,
                generation=read.generation,
                units=len(read.units),
                records=read.records,
                bytes=read.bytes,
                seconds=round(read.seconds, 3),
                skipped=read.skipped,
                follow=self.follow,
            )
            if self.follow == "snapshots":
                self._consumer = consumer
                self._caught_up = True
                self._task = asyncio.create_task(self._follow_snapshots(consumer))
            else:
                await consumer.stop()
                if self.follow == "events":
                    await self._start_events(read)
                else:
                    self._caught_up = True
        except BaseException:
            self.lifecycle.move(Phase.NOT_STARTED)
            self.conductor.replace_state(Index(self.limits))
            self._offsets = {}
            task, self._task = self._task, None
            if task is not None:
                task.cancel()
            for client in {consumer, self._consumer} - {None}:
                with contextlib.suppress(Exception):
                    await client.stop()
            self._consumer = None
            self._events = None
            raise
        self.lifecycle.move(Phase.RUNNING)

    async def stop(self) -> None:
        """Stop following and close the Kafka client (the index stays queryable)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        consumer, self._consumer = self._consumer, None
        if consumer is not None:
            with contextlib.suppress(Exception):
                await consumer.stop()
        if self.lifecycle.running:
            self.lifecycle.move(Phase.STOPPED)

    # ------------------------------------------------------ follow events

    async def _start_events(self, read: SnapshotRead) -> None:
        k = self.cfg.kafka
        internal = k.repartition_topic if k.repartition else None
        topics = [internal] if internal is not None else [k.engine_topic, k.pool_topic]
        consumer = AIOKafkaConsumer(
            **self._consumer_options("replica-events"),
            max_partition_fetch_bytes=4 * 1024 * 1024,
        )
        self._consumer = consumer
        await consumer.start()
        existing = await consumer.topics()
        missing = [t for t in topics if t not in existing]
        if missing:
            raise ReplicaError(f"topics {missing} do not exist")
        tps = [TopicPartition(t, p) for t in topics for p in await _partitions(consumer, t)]
        consumer.assign(tps)
        offsets = await resume_positions(consumer, tps, read.offsets, self.conductor.counters)
        foreign = sorted(f"{tp.topic}/{tp.partition}" for tp in read.offsets if tp not in offsets)
        if foreign:
            log.warning(
                "the snapshot records offsets of partitions this replica does not tail "
                "(different topics or kafka.repartition than the daemon?)",
                partitions=foreign[:20],
            )
        self._offsets = offsets
        self._events = EventConsumer(
            consumer,
            self.conductor,
            self.metrics,
            _NoDeadLetters(self.metrics),
            k.engine_topic,
            k.pool_topic,
            k.fetch_max_records,
            internal,
        )
        # Where each partition's next record is expected (as the daemon's
        # assignment hook sets it): anything below is never applied.
        self._events.applied_offsets.update(offsets)
        events = self._events
        self.metrics.partitions.source = lambda: events.partition_rows(k.stale_after_s)
        self._task = asyncio.create_task(self._follow_events(self._events))

    async def _follow_events(self, events: EventConsumer) -> None:
        last_expire = time.monotonic()
        while True:
            try:
                self._kafka_ok = await events.poll_or_back_off(POLL_TIMEOUT_MS, "following events")
            except Exception as exc:
                self.error = exc
                log.exception("replica stopped following events")
                raise
            if not self._kafka_ok:
                continue
            self._offsets.update(events.applied_offsets)
            self.conductor.changes.clear()  # a replica publishes nothing
            now = time.monotonic()
            if now - last_expire >= EXPIRE_EVERY_S:
                self.conductor.expire(self.conductor.now)
                last_expire = now

    # --------------------------------------------------- follow snapshots

    async def _follow_snapshots(self, consumer: AIOKafkaConsumer) -> None:
        tps = sorted(consumer.assignment())
        while True:
            try:
                batch = await consumer.getmany(timeout_ms=POLL_TIMEOUT_MS, max_records=10_000)
                for records in batch.values():
                    for record in records:
                        self._take(record)
                at_end = True
                for tp in tps:
                    end = consumer.last_stable_offset(tp)
                    if end is None or end < 0:
                        end = consumer.highwater(tp)
                    if end is None or await consumer.position(tp) < end:
                        at_end = False
                self._kafka_ok = True
            except KafkaError as exc:
                self._kafka_ok = False
                log.warning("kafka error while following snapshots; retrying", error=str(exc))
                await asyncio.sleep(1.0)
                continue
            try:
                self._apply_buffered(at_end)
            except Exception as exc:
                self.error = exc
                log.exception("replica stopped following snapshots")
                raise

    def _take(self, record: Any) -> None:
        try:
            key = _key_decoder.decode(record.key)
            value = None if record.value is None else _value_decoder.decode(record.value)
        except (msgspec.DecodeError, TypeError):
            log.error("undecodable snapshot record skipped", offset=record.offset)
            return
        if len(key) < 2 or not isinstance(key[-1], int):
            log.error("snapshot record with a malformed key skipped", offset=record.offset)
            return
        unit_key: UnitKey = tuple(key[:-1])
        self._buffer.append((unit_key, key[-1], value))
        if unit_key[0] == "g":
            # Generation records close a generation's transaction: everything
            # read so far is whole generations (or whole units of others').
            self._cut = len(self._buffer)

    def _apply_buffered(self, at_end: bool) -> None:
        """Apply the units completed by whole generations read so far.

        The boundary is the last generation record read, or everything when
        the reader stands at the partition's last stable offset (no
        transaction is half read). A unit applies once all its chunks of one
        generation are in; tombstoned chunk 0 means the unit is gone."""
        cut = len(self._buffer) if at_end else self._cut
        if cut == 0:
            return
        window, self._buffer = self._buffer[:cut], self._buffer[cut:]
        self._cut = 0
        pieces = self._pieces
        for unit_key, chunk, value in window:
            pieces.setdefault(unit_key, {})[chunk] = value
        changes: dict[UnitKey, Unit | None] = {}
        for unit_key, by_chunk in list(pieces.items()):
            if 0 not in by_chunk:
                if all(v is None for v in by_chunk.values()):
                    del pieces[unit_key]  # leftover chunks of a shrunk unit
                continue
            head = by_chunk[0]
            if head is None:
                changes[unit_key] = None
                del pieces[unit_key]
                continue
            parts = [by_chunk.get(c) for c in range(head.chunks)]
            if any(p is None or p.generation != head.generation for p in parts):
                continue  # more chunks to come
            del pieces[unit_key]
            if head.v > SCHEMA_VERSION:
                log.error(
                    "snapshot unit of a newer schema skipped: upgrade this reader",
                    key=repr(unit_key),
                    schema=head.v,
                )
                continue
            try:
                changes[unit_key] = decode_unit(b"".join(p.data for p in parts if p is not None))
            except msgspec.DecodeError:
                log.error("undecodable snapshot unit skipped", key=repr(unit_key))
        if at_end and pieces:
            now = time.monotonic()
            if now - self._incomplete_logged > 60:
                self._incomplete_logged = now
                log.warning("snapshot units with missing chunks wait", units=len(pieces))
        if not changes:
            return
        try:
            apply_units(self.conductor.snapshot_state(), changes)
        except ValueError as exc:
            raise SnapshotUnusable(
                f"a generation of the snapshot topic cannot be applied: {exc}"
            ) from exc
        for unit in changes.values():
            if isinstance(unit, GenerationUnit):
                self.generation = max(self.generation, unit.generation)
                for topic, partition, offset in unit.offsets:
                    self._offsets[TopicPartition(topic, partition)] = offset


__all__ = [
    "FOLLOW_MODES",
    "Follow",
    "Replica",
    "ReplicaError",
    "SnapshotUnusable",
]
