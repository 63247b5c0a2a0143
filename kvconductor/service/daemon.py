"""The daemon: Kafka in, index in memory, HTTP out, snapshots for durability.

Start-up: serve HTTP (health now, ready later), create or check the topics,
restore the index from the snapshot topic, then consume the engine and pool
topics in one consumer group, starting each partition at the offset the
restored snapshot reflects (or its beginning when none does). Every
`snapshot.interval_s` the changed units and the applied offsets go out as
one transaction, which also commits the group's offsets; so a restart
resumes exactly where the state it restores left off. That generation is
captured and sent by a task of its own while the loop goes on applying
records; only its final round stops them (`SnapshotPublisher.publish`).
With snapshots disabled the daemon rebuilds from the beginning of the
topics each start and commits offsets only so that lag tools can see
progress.

Scale-out (`kafka.repartition`): each daemon also runs stage one, which
re-keys every record by namespace group onto the internal topic, and the
index loop reads that topic instead. A daemon then holds the namespaces of
its internal partitions: on assignment it restores just their units and
seeks to their offsets; on revocation it publishes a final generation and
forgets them, so the next owner starts exactly where it stopped.

Everything here moves bytes and time; the index logic is in the core.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import time
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from aiohttp import web
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, ProducerFenced

from kvconductor.config import (
    Config,
    kafka_fetch_options,
    kafka_group_options,
    kafka_service_options,
)
from kvconductor.consumers.dead_letters import DeadLetterWriter
from kvconductor.consumers.event_consumer import EventConsumer
from kvconductor.consumers.fetcher import native_fetcher
from kvconductor.consumers.positions import resume_positions
from kvconductor.consumers.repartitioner import Repartitioner
from kvconductor.consumers.routing import group_key
from kvconductor.http.serve import serve_api
from kvconductor.index.conductor import Conductor
from kvconductor.index.namespace import NamespaceKey
from kvconductor.kafka.clients import retire, started, until_kafka_answers
from kvconductor.kafka.partitioner import default_partition
from kvconductor.kafka.topics import (
    ensure_service_topics,
    topic_specs,
)
from kvconductor.kernel import STATUS as KERNEL_STATUS
from kvconductor.lifecycle import (
    FatalError,
    Lifecycle,
    Phase,
    serve_until_signalled,
)
from kvconductor.obs.metrics import Metrics
from kvconductor.obs.overflow_log import OverflowLog
from kvconductor.registry.log import RegistrationLog
from kvconductor.snapshots.store import SnapshotPublisher, SnapshotRead, read_snapshot
from kvconductor.snapshots.units import UnitKey, drop_namespaces, restore, unit_namespace

log = structlog.get_logger("kvconductor.daemon")

EXPIRE_EVERY_S = 1.0
POLL_TIMEOUT_MS = 200
# Once stopping, how long Kafka calls (the last snapshot, producers' flushes)
# may still take: against an unreachable broker they would wait forever.
STOP_GRACE_S = 15.0


def _progress_log(every_s: float = 2.0) -> Callable[[int, int], None]:
    """A restore's progress as a log line every few seconds (logs are JSON
    lines for machines; a bar would only garble them)."""
    started = last = time.monotonic()

    def progress(done: int, total: int) -> None:
        nonlocal last
        now = time.monotonic()
        if now - last >= every_s:
            last = now
            log.info(
                "restoring snapshot",
                records=done,
                of_about=total,
                seconds=round(now - started, 1),
            )

    return progress


class Daemon:
    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.conductor = Conductor(cfg.index)
        self.metrics = Metrics(self.conductor)
        self.overflow = OverflowLog()
        self.stopping = asyncio.Event()
        self._stop_by = float("inf")
        self.lifecycle = Lifecycle()
        self.http_port: int | None = None
        self.events: EventConsumer | None = None
        self.publisher: SnapshotPublisher | None = None
        self._runner: web.AppRunner | None = None
        self._kafka_ok = True
        self._renew_snapshot_producer = False
        # The periodic generation, captured and sent beside the event loop.
        self._publishing: asyncio.Task[bool] | None = None
        # Per partition, the next offset the in-memory state has not applied:
        # where a (re)assigned partition resumes.
        self._state_offsets: dict[TopicPartition, int] = {}
        self._last_published: dict[TopicPartition, int] = {}
        self.repartitioner: Repartitioner | None = None
        # Scale-out: internal partitions whose namespaces this daemon holds.
        self._owned: set[int] = set()
        self._internal_partitions = 0
        topic = cfg.http.registrations_topic
        self.registrations = (
            RegistrationLog(cfg.kafka, topic, cfg.kafka.client_id) if topic else None
        )

    # ---------------------------------------------------------- readiness

    @property
    def status(self) -> str:
        return self.lifecycle.status

    def ready(self) -> tuple[bool, str]:
        if not self.lifecycle.running:
            return False, self.status
        if not self._kafka_ok:
            return False, "kafka unavailable"
        events = self.events
        if events is None or not events.consumer.assignment():
            return False, "waiting for partition assignment"
        # A broker answers a fetch every kafka.fetch_max_wait_ms even when
        # idle: this long without an answer means it is gone, frozen or
        # unreachable.
        bound = self.cfg.kafka.stale_after_s
        silent = events.silent_for()
        if silent > bound:
            return False, f"kafka unavailable: no answer for {silent:.0f} s"
        if not events.caught_up:
            return False, "catching up"
        stale = events.staleness(bound)
        if stale is not None:
            return False, stale
        return True, "ready"

    # ------------------------------------------------------------- phases

    async def start_http(self) -> None:
        http = self.cfg.http
        self._runner, self.http_port = await serve_api(
            self.conductor, self.metrics, http, self.ready, self.registrations
        )
        # Which query path runs: a missing kernel is slower, not wrong.
        log.info("http listening", host=http.host, port=self.http_port, query_path=KERNEL_STATUS)

    async def _with_backoff(self, what: str, attempt: Any) -> Any:
        def kafka_down(exc: BaseException) -> None:
            self._kafka_ok = False

        return await until_kafka_answers(what, attempt, self.lifecycle, self.stopping, kafka_down)

    async def _start_client(self, what: str, make: Any) -> Any:
        """Start a fresh Kafka client, retrying with a new one until it starts."""

        return await self._with_backoff(what, lambda: started(make))

    async def prepare_topics(self) -> None:
        opts = kafka_service_options(self.cfg.kafka)

        async def attempt() -> None:
            k = self.cfg.kafka
            await ensure_service_topics(k, k.client_id, opts, topic_specs(self.cfg))

        self.lifecycle.move(Phase.STARTING, "creating topics")
        await self._with_backoff("creating topics", attempt)
        self._kafka_ok = True

    async def read_snapshot(self) -> SnapshotRead:
        k = self.cfg.kafka

        async def attempt() -> Any:
            consumer = await started(
                lambda: AIOKafkaConsumer(
                    bootstrap_servers=k.bootstrap_servers,
                    client_id=f"{k.client_id}-restore",
                    group_id=None,
                    enable_auto_commit=False,
                    isolation_level="read_committed",
                    fetch_max_wait_ms=50,
                    **kafka_service_options(k),
                )
            )
            try:
                return await read_snapshot(consumer, k.snapshot_topic, _progress_log())
            finally:
                await consumer.stop()

        read: SnapshotRead = await self._with_backoff("restoring snapshot", attempt)
        self._kafka_ok = True
        return read

    async def restore_snapshot(self) -> None:
        self.lifecycle.move(Phase.RESTORING)
        read = await self.read_snapshot()
        self._restore(read)
        self._state_offsets = dict(read.offsets)
        self._last_published = dict(read.offsets)
        if self.publisher is not None:
            self.publisher.adopt(read)
        log.info(
            "snapshot restored",
            generation=read.generation,
            units=len(read.units),
            records=read.records,
            bytes=read.bytes,
            seconds=round(read.seconds, 3),
            partitions=len(read.offsets),
        )

    def _owns(self, partitions: set[int]) -> Any:
        n = self._internal_partitions

        def owns(ns: NamespaceKey) -> bool:
            key = group_key(ns.tenant, ns.model, ns.block_size, ns.salt)
            return default_partition(key, n) in partitions

        return owns

    def _restore(
        self, read: SnapshotRead, keep: Callable[[NamespaceKey], bool] | None = None
    ) -> None:
        """Load a snapshot's units into the index; a unit the index cannot
        take (arrays of different lengths, more namespaces or owners than
        the limits) stops the daemon with the reason, not a traceback."""
        try:
            restore(self.conductor.snapshot_state(), read.units, keep)
        except ValueError as exc:
            raise FatalError(
                f"the snapshot topic {self.cfg.kafka.snapshot_topic} cannot be restored: {exc}"
            ) from exc

    async def _take_over(self, assigned: set[TopicPartition]) -> None:
        """Scale-out: load the units of newly assigned internal partitions."""
        events = self.events
        assert events is not None
        internal = self.cfg.kafka.repartition_topic
        parts = events.consumer.partitions_for_topic(internal) or set()
        self._internal_partitions = len(parts)
        gained = {tp.partition for tp in assigned if tp.topic == internal} - self._owned
        if not gained:
            return
        read = await self.read_snapshot()
        owns = self._owns(gained)
        self._restore(read, owns)

        def keep_unit(key: UnitKey) -> bool:
            ns = unit_namespace(key)
            if ns is not None:
                return bool(owns(ns))
            return key[0] == "i" and self.conductor.has_instance(key[1])

        if self.publisher is not None:
            self.publisher.adopt(read, keep_unit)
        for tp, offset in read.offsets.items():
            if tp.topic == internal and tp.partition in gained:
                self._state_offsets[tp] = offset
                self._last_published[tp] = offset
        self._owned |= gained
        log.info("took over partitions", partitions=sorted(gained), generation=read.generation)

    async def _on_assign(self, assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
        events = self.events
        assert events is not None
        consumer = events.consumer
        await self._settle_publish()  # a restore must not meet a generation half captured
        if self.cfg.kafka.repartition:
            await self._take_over(assigned)
        return await resume_positions(
            consumer, assigned, self._state_offsets, self.conductor.counters
        )

    async def _on_revoke(self, revoked: set[TopicPartition]) -> None:
        # Hand over what was applied before another daemon takes the partitions.
        await self.checkpoint(force=True)
        if self.cfg.kafka.repartition:
            lost = {tp.partition for tp in revoked if tp.topic == self.cfg.kafka.repartition_topic}
            drop = self._owns(lost)
            drop_namespaces(self.conductor.snapshot_state(), drop)
            if self.publisher is not None:
                self.publisher.forget(drop)
            for tp in revoked:
                self._state_offsets.pop(tp, None)
                self._last_published.pop(tp, None)
            self._owned -= lost

    async def checkpoint(self, force: bool = False) -> None:
        """Publish a generation (or commit offsets); call under `events.lock`,
        which is held throughout: the hand-over on revocation and at stop."""
        events = self.events
        if events is None:
            return
        await self._settle_publish()
        if self.publisher is None:
            offsets = dict(events.applied_offsets)
            self.conductor.changes.clear()
            if offsets != self._last_published:
                await events.commit(offsets)
                self._last_published = offsets
                self._state_offsets.update(offsets)
            return
        if force or self._changed():
            await self._publish(None)

    def _changed(self) -> bool:
        assert self.events is not None
        dirty = self.conductor.changes
        return bool(
            self.events.applied_offsets != self._last_published or dirty.owners or dirty.pools
        )

    async def _checkpoint_in_background(self) -> bool:
        """The periodic generation: records keep being applied while it is
        captured (between its slices) and sent (see `SnapshotPublisher.publish`).
        False if Kafka failed it."""
        assert self.events is not None
        try:
            if self._changed():
                await self._publish(self.events.lock)
        except KafkaError as exc:
            self._kafka_ok = False
            log.warning("snapshot failed; retrying", error=str(exc))
            return False
        return True

    async def _settle_publish(self) -> None:
        """Under `events.lock`, before anything else publishes, restores or
        hands over: a background generation not cut yet is abandoned (its
        units stay marked), one being sent is waited for (it needs no lock)."""
        task = self._publishing
        if task is None or task.done():
            return
        assert self.publisher is not None
        if not self.publisher.sending:
            task.cancel()
        await asyncio.wait([task])

    async def _publish(self, lock: asyncio.Lock | None) -> None:
        publisher, events = self.publisher, self.events
        assert publisher is not None and events is not None
        if self._renew_snapshot_producer:
            await self._renew_publisher()
        try:
            stats = await publisher.publish(
                self.conductor,
                events.applied_offsets,
                lock=lock,
                records_first=events.records_first,
            )
        except ProducerFenced as exc:
            raise FatalError(
                "another daemon took over this transactional id (kafka.client_id must be "
                "unique per daemon): stopping"
            ) from exc
        except KafkaError:
            # The generation is lost, and maybe the producer with it: aiokafka
            # gives a transactional producer up for good when the broker drops
            # the connection of a coordinator lookup (aio-libs/aiokafka#1151),
            # and every later transaction then fails.
            self._renew_snapshot_producer = True
            raise
        self._last_published = stats.offsets
        self._state_offsets.update(stats.offsets)
        log.info(
            "snapshot published",
            generation=stats.generation,
            units=stats.units,
            tombstones=stats.tombstones,
            bytes=stats.bytes,
            seconds=round(stats.seconds, 3),
            hold_s=round(stats.hold_s, 4),
            rounds=stats.rounds,
            final_units=stats.final_units,
        )

    def _transactional_producer(
        self, role: str, transactional_id: str, **options: Any
    ) -> AIOKafkaProducer:
        k = self.cfg.kafka
        return AIOKafkaProducer(
            bootstrap_servers=k.bootstrap_servers,
            client_id=f"{k.client_id}-{role}",
            transactional_id=transactional_id,
            enable_idempotence=True,
            **options,
            **kafka_service_options(k),
        )

    def _snapshot_producer(self) -> AIOKafkaProducer:
        k = self.cfg.kafka
        return self._transactional_producer(
            "snapshot", f"{k.group_id}-{k.client_id}", max_request_size=2 * 1024 * 1024
        )

    def _repartition_producer(self) -> AIOKafkaProducer:
        k = self.cfg.kafka
        # It forwards every engine record: aiokafka's 16 KiB batches (four
        # typical records) bounded it (see the bridge's batch_size).
        return self._transactional_producer(
            "repartition", f"{k.group_id}-{k.client_id}-repartition", max_batch_size=512 * 1024
        )

    async def _renew_publisher(self) -> None:
        """Replace the snapshot producer by one with the same transactional
        id, which fences the old one and aborts what it left open."""
        assert self.publisher is not None
        fresh = await started(self._snapshot_producer)
        old, self.publisher.producer = self.publisher.producer, fresh
        self._renew_snapshot_producer = False
        log.info("snapshot producer renewed")
        await retire(old, STOP_GRACE_S)

    async def run(self) -> None:
        """Run until `stop()`; raises FatalError for conditions that need a human."""
        k = self.cfg.kafka
        opts = kafka_service_options(k)
        await self.start_http()
        producer: AIOKafkaProducer | None = None
        snap_producer: AIOKafkaProducer | None = None
        consumer: AIOKafkaConsumer | None = None
        clients: list[Any] = []
        stage_one: asyncio.Task[None] | None = None
        try:
            await self.prepare_topics()
            if self.registrations is not None:
                await self._with_backoff("loading registrations", self.registrations.start)
            if self.cfg.snapshot.enabled:
                snap_producer = await self._start_client(
                    "starting snapshot producer", self._snapshot_producer
                )
                self.publisher = SnapshotPublisher(snap_producer, k.snapshot_topic, k.group_id)
                if not k.repartition:
                    await self.restore_snapshot()
            producer = await self._start_client(
                "starting dead-letter producer",
                lambda: AIOKafkaProducer(
                    bootstrap_servers=k.bootstrap_servers,
                    client_id=f"{k.client_id}-dlq",
                    acks="all",
                    enable_idempotence=True,
                    **opts,
                ),
            )
            consumer = AIOKafkaConsumer(
                bootstrap_servers=k.bootstrap_servers,
                client_id=k.client_id,
                group_id=k.group_id,
                enable_auto_commit=False,
                # Every assignment seeks explicitly; a position retention has
                # deleted is handled by the event consumer, counted and logged.
                auto_offset_reset="none",
                isolation_level="read_committed",
                **kafka_fetch_options(k),
                **opts,
                **kafka_group_options(k),
            )
            fetcher = native_fetcher(consumer, k) if k.native_fetch else None
            # `fetch_path = "auto"` leaves the choice to the build: say it.
            log.info("event fetch path", fetch_path="native" if fetcher else "aiokafka")
            # The broker answered the admin client moments ago: a consumer
            # that fails to start now is a real error, not an outage.
            self.events = EventConsumer(
                consumer,
                self.conductor,
                self.metrics,
                DeadLetterWriter(producer, k.dead_letter_topic, self.metrics),
                k.engine_topic,
                k.pool_topic,
                k.fetch_max_records,
                k.repartition_topic if k.repartition else None,
                fetcher,
            )
            self.events.on_assign = self._on_assign
            self.events.on_revoke = self._on_revoke
            events = self.events
            self.metrics.partitions.source = lambda: events.partition_rows(k.stale_after_s)
            await consumer.start()
            if fetcher is not None:
                clients.append(fetcher)
                await fetcher.start()
            self.events.subscribe()
            if k.repartition:
                rep_producer = await self._start_client(
                    "starting repartition producer", self._repartition_producer
                )
                rep_consumer = AIOKafkaConsumer(
                    bootstrap_servers=k.bootstrap_servers,
                    client_id=f"{k.client_id}-repartition",
                    group_id=f"{k.group_id}-repartition",
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    isolation_level="read_committed",
                    **kafka_fetch_options(k),
                    **opts,
                    **kafka_group_options(k),
                )
                clients.extend([rep_consumer, rep_producer])
                await rep_consumer.start()
                self.repartitioner = Repartitioner(
                    rep_consumer,
                    rep_producer,
                    f"{k.group_id}-repartition",
                    k.engine_topic,
                    k.pool_topic,
                    k.repartition_topic,
                    k.fetch_max_records,
                )
                self.repartitioner.subscribe()
                stage_one = asyncio.create_task(self._repartition_loop())
            self._kafka_ok = True
            self.lifecycle.move(Phase.RUNNING)
            ended = await self._within_grace(self._loop(), "consuming")
            if stage_one is not None:
                ended = await self._within_grace(stage_one, "repartitioning") and ended
            if ended:  # else the loop, left behind, may hold the lock
                try:
                    await self._within_grace(self._last_checkpoint(), "last snapshot")
                except KafkaError as exc:
                    # Nothing is lost: a restart resumes from the last published
                    # generation's offsets and reads the rest again.
                    log.warning(
                        "kafka unavailable: stopping without the last snapshot", error=str(exc)
                    )
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise
        finally:
            self.lifecycle.move(Phase.STOPPING)
            self.stop()
            if self._publishing is not None and not self._publishing.done():
                self._publishing.cancel()  # the last snapshot was given up on
            if self.publisher is not None:
                snap_producer = self.publisher.producer  # renewed, maybe
            if stage_one is not None and not stage_one.done():
                stage_one.cancel()
                with contextlib.suppress(Exception):
                    await self._within_grace(stage_one, "repartitioning")
            if self.repartitioner is not None and self.repartitioner.producer not in clients:
                clients.append(self.repartitioner.producer)  # its renewal
            for client in (*clients, consumer, producer, snap_producer):
                if client is not None:
                    with contextlib.suppress(Exception):
                        await self._within_grace(client.stop(), "closing kafka clients")
            if self.registrations is not None:
                await self._within_grace(self.registrations.stop(), "closing kafka clients")
            if self._runner is not None:
                await self._runner.cleanup()
            self.overflow.check(self.conductor.counters, time.monotonic(), force=True)
            self.lifecycle.move(Phase.STOPPED)
            log.info("stopped")

    async def _loop(self) -> None:
        events = self.events
        assert events is not None
        interval = self.cfg.snapshot.interval_s
        last_expire = last_checkpoint = time.monotonic()
        while not self.stopping.is_set():
            self._kafka_ok = await events.poll_or_back_off(POLL_TIMEOUT_MS, "consuming")
            if not self._kafka_ok:
                continue
            now = time.monotonic()
            if now - last_expire >= EXPIRE_EVERY_S:
                # Under the lock: a generation's final round must see no change.
                async with events.lock:
                    self.conductor.expire(self.conductor.now)
                self.overflow.check(self.conductor.counters, now)
                last_expire = now
            task = self._publishing
            if task is not None and task.done():
                self._publishing = None
                # FatalError stops the daemon; a failed generation is retried
                # at once (cancelled: a hand-over published in its place).
                if not task.cancelled() and not task.result():
                    last_checkpoint = -interval
            if now - last_checkpoint >= interval and self._publishing is None:
                if self.publisher is not None:
                    self._publishing = asyncio.create_task(self._checkpoint_in_background())
                    last_checkpoint = now
                    continue
                try:
                    async with events.lock:
                        await self.checkpoint()
                    last_checkpoint = now
                except KafkaError as exc:
                    self._kafka_ok = False
                    log.warning("offset commit failed; retrying", error=str(exc))

    async def _repartition_loop(self) -> None:
        stage = self.repartitioner
        assert stage is not None
        renew = False
        while not self.stopping.is_set():
            try:
                if renew:
                    # As for the snapshot producer (aio-libs/aiokafka#1151): a
                    # transactional producer aiokafka gave up on fails every
                    # later batch, and stage one would stall for good.
                    old, stage.producer = stage.producer, await started(self._repartition_producer)
                    renew = False
                    log.info("repartition producer renewed")
                    await retire(old, STOP_GRACE_S)
                await stage.poll(POLL_TIMEOUT_MS)
            except ProducerFenced as exc:
                log.error("repartition producer fenced: another daemon uses this client_id")
                self.stop()
                raise FatalError("kafka.client_id must be unique per daemon") from exc
            except KafkaError as exc:
                log.warning(
                    "repartitioning failed; retrying the batch with a new producer",
                    error=str(exc),
                )
                renew = True
                await asyncio.sleep(1.0)

    async def _last_checkpoint(self) -> None:
        assert self.events is not None
        async with self.events.lock:
            await self.checkpoint()

    async def _within_grace(self, step: Awaitable[Any], what: str) -> bool:
        """Await `step`; once stopping, only until the stop grace is over,
        then cancel it and go on without it (a Kafka call waiting on an
        unreachable broker may not end even when cancelled). True if it ended."""
        task = asyncio.ensure_future(step)
        stopping = asyncio.ensure_future(self.stopping.wait())
        try:
            await asyncio.wait([task, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                await asyncio.wait([task], timeout=max(1.0, self._stop_by - time.monotonic()))
        except BaseException:
            task.cancel()
            raise
        finally:
            stopping.cancel()
        if not task.done():
            task.cancel()
            log.warning("kafka unavailable: stopping without waiting for it", step=what)
            return False
        if not task.cancelled():
            task.result()
        return True

    def stop(self) -> None:
        if not self.stopping.is_set():
            self._stop_by = time.monotonic() + STOP_GRACE_S
        self.stopping.set()


async def run_daemon(cfg: Config) -> int:
    """The `kvconductor run` entry: signals, then the daemon until stopped."""
    # Modules and their objects live as long as the process: frozen out of
    # the collector's reach, the full collections that records keep
    # triggering no longer walk them (in the event loop, the imports alone
    # made each one a pause queries would wait out).
    gc.collect()
    gc.freeze()
    daemon = Daemon(cfg)
    return await serve_until_signalled(
        daemon.run, daemon.stop, "signal received: finishing the batch in hand, committing, closing"
    )
