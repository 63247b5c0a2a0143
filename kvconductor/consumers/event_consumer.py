"""The consumer of the engine and pool event topics.

One `AIOKafkaConsumer` in the daemon's group reads both topics in batches
(`getmany`). Each partition's records are applied through the core in order;
a record the core rejects is dead-lettered and the offset moves on. The
offsets of what has been applied are kept in `applied_offsets`: the daemon
commits them (with or without a snapshot) only after the batch's dead letters
are acknowledged, so a crash can repeat a batch but never skip one.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import repeat
from typing import Any, NamedTuple, Protocol

import structlog
from aiokafka import AIOKafkaConsumer, ConsumerRebalanceListener, TopicPartition
from aiokafka.errors import KafkaError, NoOffsetForPartitionError, OffsetOutOfRangeError
from aiokafka.structs import ConsumerRecord, OffsetAndMetadata

from kvconductor.consumers.dead_letters import DeadLetterWriter
from kvconductor.consumers.fetcher import NativeFetcher
from kvconductor.consumers.positions import resume_positions
from kvconductor.index.conductor import Conductor, Incoming, Notice
from kvconductor.obs.logs import RateLimitedLog
from kvconductor.obs.metrics import Metrics, PartitionRow
from kvconductor.records_first import RecordsFirst
from kvconductor.wire.errors import BadRecord
from kvconductor.wire.records import KV_CONTROL_KIND, KV_CONTROL_REASON, KV_KIND, KV_ORIGIN_KEY

log = structlog.get_logger("kvconductor.consumer")

# Applying time between two chances for queries to run.
YIELD_AFTER_S = 0.002
# Records of a batch go to the core in chunks sized to take about a
# quarter of YIELD_AFTER_S each of the event loop's time, by the last
# chunk's a record: a record costs from microseconds (the compiled path,
# short records) to milliseconds (a long prompt in Python), so no fixed
# count bounds the wait for queries. The apply thread's time is not the
# loop's: queries run meanwhile.
CHUNK_S = YIELD_AFTER_S / 4
MAX_CHUNK = 1024


class PartitionHealth(NamedTuple):
    """How stale one assigned partition leaves the index."""

    topic: str
    partition: int
    lag: int  # records between what the index applied and the partition's end, as last heard
    fetch_age_s: float  # since the partition's leader last answered a fetch
    behind_s: float  # since records known to be waiting have waited (0: caught up)

    @property
    def name(self) -> str:
        return f"{self.topic}/{self.partition}"

    def stale(self, bound_s: float) -> bool:
        return self.fetch_age_s > bound_s or self.behind_s > bound_s


def _stale_reason(stale: Iterable[PartitionHealth]) -> str:
    """/ready's reason for partitions the index is stale on."""
    parts = []
    for p in stale:
        if p.fetch_age_s >= p.behind_s:
            parts.append(f"{p.name} (no fetch answer for {p.fetch_age_s:.0f} s)")
        else:
            parts.append(f"{p.name} ({p.lag} records waiting for {p.behind_s:.0f} s)")
    return f"index stale on {len(parts)} partition(s): {', '.join(parts)}"


RevokeHook = Callable[[set[TopicPartition]], Awaitable[None]]
# Positions every assigned partition and returns the offset it seeked each to.
AssignHook = Callable[[set[TopicPartition]], Awaitable[dict[TopicPartition, int]]]


def in_produce_order(
    batch: Mapping[TopicPartition, list[ConsumerRecord]],
) -> Iterator[tuple[TopicPartition, ConsumerRecord]]:
    """A fetched batch's records across its partitions by timestamp, each
    partition's in offset order (merged, never sorted: producers' clocks
    may disagree within a partition).

    Applied partition after partition, a record waited for the batch's
    records of the partitions before it, produced after it or not. While
    the daemon keeps up batches are small and it makes no measurable
    difference (docs/benchmarks.md); once it falls behind a batch spans
    seconds, and this bounds a record's wait by what was produced before
    it."""
    if len(batch) == 1:
        ((tp, records),) = batch.items()
        return ((tp, r) for r in records)
    by_partition = [zip(repeat(tp), records) for tp, records in batch.items()]
    return heapq.merge(*by_partition, key=_timestamp)


def _next_chunk(n: int, seconds: float) -> int:
    """The next chunk's length, after `n` records took `seconds`."""
    if seconds <= 0:
        return MAX_CHUNK
    return max(1, min(MAX_CHUNK, int(n * CHUNK_S / seconds)))


class Batch(Protocol):
    """A fetched batch in produce order, as `_apply_records` applies it:
    `_Records` (aiokafka's fetch path) or `fetcher.NativeBatch`."""

    incoming: Sequence[Incoming]

    def applied(self, start: int, end: int) -> Iterable[tuple[TopicPartition, int, int]]:
        """Per partition with records in `incoming[start:end]`: the offset
        after its last there, and how many."""
        ...

    def record(self, i: int) -> Any:
        """Record `i` as the dead-letter writer reads it (a ConsumerRecord's fields)."""
        ...


class _Records:
    """A `getmany` batch in produce order."""

    def __init__(
        self, ordered: Sequence[tuple[TopicPartition, ConsumerRecord]], incoming: list[Incoming]
    ) -> None:
        self.ordered = ordered
        self.incoming: Sequence[Incoming] = incoming

    def applied(self, start: int, end: int) -> Iterable[tuple[TopicPartition, int, int]]:
        last: dict[TopicPartition, tuple[int, int]] = {}
        for tp, r in self.ordered[start:end]:
            seen = last.get(tp)
            last[tp] = (r.offset + 1, 1 if seen is None else seen[1] + 1)
        return [(tp, after, n) for tp, (after, n) in last.items()]

    def record(self, i: int) -> ConsumerRecord:
        return self.ordered[i][1]


def _timestamp(item: tuple[TopicPartition, ConsumerRecord]) -> int:
    ts: int = item[1].timestamp
    return ts


class _Listener(ConsumerRebalanceListener):  # type: ignore[misc]
    def __init__(self, owner: EventConsumer) -> None:
        self._owner = owner

    async def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
        await self._owner._revoked(set(revoked))

    async def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
        await self._owner._assigned(set(assigned))


class EventConsumer:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        conductor: Conductor,
        metrics: Metrics,
        dead_letters: DeadLetterWriter,
        engine_topic: str,
        pool_topic: str,
        max_records: int,
        internal_topic: str | None = None,
        fetcher: NativeFetcher | None = None,
    ) -> None:
        self.consumer = consumer
        self.conductor = conductor
        self.metrics = metrics
        self.dead_letters = dead_letters
        self.engine_topic = engine_topic
        self.pool_topic = pool_topic
        self.max_records = max_records
        # Scale-out mode: read only the repartitioned topic (see repartitioner).
        self.internal_topic = internal_topic
        # The native fetch path (kvconductor/consumers/fetcher.py); None: aiokafka's.
        self.fetcher = fetcher
        if fetcher is not None:
            fetcher.modes = (
                {internal_topic: None}
                if internal_topic is not None
                else {engine_topic: False, pool_topic: True}
            )
        # Per assigned partition, the next offset the index expects: where it
        # was positioned on assignment, then past every record applied.
        self.applied_offsets: dict[TopicPartition, int] = {}
        # Called under `lock`; on_assign must position every assigned partition.
        self.on_revoke: RevokeHook | None = None
        self.on_assign: AssignHook | None = None
        self.caught_up = False
        self.problems = RateLimitedLog("kvconductor.consumer")
        self._chunk = 1  # records per call into the core (see CHUNK_S)
        # The kernel's part of applying runs here, the GIL released, while
        # the event loop serves queries and reads the next fetches.
        self._applier = ThreadPoolExecutor(1, thread_name_prefix="kvconductor-apply")
        # aiokafka runs rebalance callbacks in its coordinator task, so they
        # can fire while a fetched batch is half applied. Applying a batch,
        # the rebalance hooks and checkpoints all hold this lock, and a batch
        # fetched before a rebalance is dropped (the hooks' seeks re-deliver it).
        self.lock = asyncio.Lock()
        # Snapshot work waits its turn while a batch is applied.
        self.records_first = RecordsFirst()
        self.epoch = 0
        # Wall-clock time Kafka was last heard from, besides fetch responses
        # (see `silent_for`), overall and per partition.
        self._heard = time.time()
        self._heard_from: dict[TopicPartition, float] = {}
        # Per partition behind its end: the end offset it has to reach, and
        # since when it is known to be there (a lower bound of the wait).
        self._behind: dict[TopicPartition, tuple[int, float]] = {}

    def subscribe(self) -> None:
        topics = (
            [self.internal_topic]
            if self.internal_topic is not None
            else [self.engine_topic, self.pool_topic]
        )
        self.consumer.subscribe(topics, listener=_Listener(self))

    async def _revoked(self, revoked: set[TopicPartition]) -> None:
        async with self.lock:
            self.epoch += 1
            self.caught_up = False
            if self.on_revoke is not None and revoked:
                await self.on_revoke(revoked)
            if self.fetcher is not None:
                self.fetcher.revoke(revoked)
            for tp in revoked:
                self.applied_offsets.pop(tp, None)
                self._heard_from.pop(tp, None)
                self._behind.pop(tp, None)
                self.metrics.forget_partition(tp.topic, tp.partition)

    async def _assigned(self, assigned: set[TopicPartition]) -> None:
        async with self.lock:
            self.epoch += 1
            self.caught_up = False
            if self.fetcher is not None and assigned:
                # At once: given a position during the hook's awaits,
                # aiokafka's fetcher would fetch (and decode, and drop) it.
                self.consumer.pause(*assigned)
            if self.on_assign is not None and assigned:
                # The seek targets, not position(): a getmany running in the
                # other task may already have handed out records past them.
                self.applied_offsets.update(await self.on_assign(assigned))
            if self.fetcher is not None:
                expected = self.applied_offsets
                for tp in assigned - expected.keys():  # no hook: the group's committed offset
                    expected[tp] = await self.consumer.position(tp)
                self.fetcher.assign({tp: expected[tp] for tp in assigned})
            self._heard = now = time.time()
            for tp in assigned:
                self._heard_from[tp] = now
                self._behind.pop(tp, None)
        log.info(
            "partitions assigned", partitions=sorted(f"{t.topic}/{t.partition}" for t in assigned)
        )

    async def poll(self, timeout_ms: int) -> int:
        """Fetch one batch and apply it; returns the records handled."""
        if self.fetcher is not None:
            return await self._poll_native(self.fetcher, timeout_ms)
        epoch = self.epoch
        try:
            batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=self.max_records)
        except OffsetOutOfRangeError as exc:
            await self._skip_deleted(exc.args[0])
            return 0
        except NoOffsetForPartitionError:
            # A race at assignment, not a fault: aiokafka's fetcher looked for
            # a committed offset (the group never commits one) before the
            # assign hook's seek landed. The hook positions every partition it
            # is given, so the next fetch reads from there.
            return 0
        if batch:
            self._heard = now = time.time()
            for tp in batch:
                self._heard_from[tp] = now
            self.records_first.applying()
        try:
            handled = await self._apply_batch(batch, epoch)
        finally:
            self.records_first.done()
        await self._after_batch()
        return handled

    async def _after_batch(self) -> None:
        self._measure_lag()
        if not self.caught_up:
            self.caught_up = await self._is_caught_up()

    async def _poll_native(self, fetcher: NativeFetcher, timeout_ms: int) -> int:
        """`poll` on the native fetch path: what the fetcher holds is taken
        under the lock, after any rebalance hook (see kvconductor/consumers/fetcher.py)."""
        try:
            await fetcher.fill(timeout_ms)
        except OffsetOutOfRangeError as exc:
            await self._skip_deleted(exc.args[0])
            return 0
        handled = 0
        if fetcher.ready():
            self.records_first.applying()
            try:
                async with self.lock:
                    batch = fetcher.take(
                        self.max_records, self.applied_offsets, self.consumer.assignment()
                    )
                    if batch is not None:
                        try:
                            await self._apply_records(batch)
                        except BaseException:
                            # What was handed out and not applied is read again.
                            for tp in batch.tps:
                                if tp in self.applied_offsets:
                                    fetcher.seek(tp, self.applied_offsets[tp])
                            raise
                        handled = len(batch)
            finally:
                self.records_first.done()
        await self._after_batch()
        return handled

    async def _apply_batch(
        self, batch: dict[TopicPartition, list[ConsumerRecord]], epoch: int
    ) -> int:
        """Apply a fetched batch under the lock; returns the records handled."""
        async with self.lock:
            expected = self.applied_offsets
            if epoch != self.epoch:
                # A rebalance ran during the fetch or while waiting for the
                # lock: the batch may predate the partitions' new positions.
                # Go back to where the index is, and read it again from there.
                assigned = self.consumer.assignment()
                for tp in batch:
                    if tp in assigned and tp in expected:
                        self.consumer.seek(tp, expected[tp])
                return 0
            fresh: dict[TopicPartition, list[ConsumerRecord]] = {}
            for tp, records in batch.items():
                # Never apply a record twice: what is below the applied
                # offset was applied already.
                start = expected.get(tp, 0)
                if records and records[0].offset < start:
                    records = [r for r in records if r.offset >= start]
                if records:
                    fresh[tp] = records
            if not fresh:
                return 0
            ordered = list(in_produce_order(fresh))
            await self._apply_records(_Records(ordered, self._incoming(ordered)))
        return len(ordered)

    def _incoming(self, ordered: Sequence[tuple[TopicPartition, ConsumerRecord]]) -> list[Incoming]:
        """The batch's records as the core takes them."""
        if self.internal_topic is None:
            pool_topic = self.pool_topic
            return [
                Incoming(r.topic == pool_topic, r.key, r.headers, r.value, r.timestamp / 1000.0)
                for _, r in ordered
            ]
        # A repartitioned record says in its headers where it came from.
        out = []
        for _, r in ordered:
            h = dict(r.headers or ())
            pool = h.get(KV_KIND) == b"pool"
            out.append(
                Incoming(pool, h.get(KV_ORIGIN_KEY), r.headers, r.value, r.timestamp / 1000.0)
            )
        return out

    async def _apply_records(self, batch: Batch) -> None:
        """Apply records in chunks, moving each partition's applied offset
        past every record handled (dead-lettered ones too), and letting
        queries in after `YIELD_AFTER_S` of applying."""
        expected = self.applied_offsets
        incoming = batch.incoming
        clock = time.perf_counter
        resume = clock() + YIELD_AFTER_S
        dead_lettered = False
        done = 0
        while done < len(incoming):
            chunk = incoming[done : done + self._chunk]
            n = len(chunk)
            began = clock()
            notices, cancelled, threaded = await self._ingest(chunk)
            self._chunk = _next_chunk(n, clock() - began - threaded)
            # The index holds the chunk now, its offsets go with it (what a
            # snapshot captures must match), dead letters sent or not.
            per_topic: dict[str, int] = {}
            for tp, after, count in batch.applied(done, done + n):
                expected[tp] = after
                per_topic[tp.topic] = per_topic.get(tp.topic, 0) + count
            for notice in notices:
                i = done + notice.at
                dead_lettered |= await self._notice(batch.record(i), incoming[i], notice)
            # Counted once applied: a reader of the metric that sees a record
            # consumed may query it (queries run between chunks).
            consumed = self.metrics.records_consumed
            for topic, count in per_topic.items():
                consumed.labels(topic=topic).inc(count)
            if cancelled:
                raise asyncio.CancelledError
            done += n
            if clock() >= resume:
                # Let queries in: a batch takes seconds when behind.
                await asyncio.sleep(0)
                resume = clock() + YIELD_AFTER_S
        if dead_lettered:
            await self.dead_letters.flush()

    async def _ingest(self, chunk: Sequence[Incoming]) -> tuple[list[Notice], bool, float]:
        """`conductor.ingest(chunk)` with the kernel's calls on the apply
        thread; also returns whether the task was cancelled and the seconds
        the calls took. A chunk begun is applied to its end, as its offsets
        must go with it: a cancellation meanwhile is raised once they have."""
        loop = asyncio.get_running_loop()
        steps = self.conductor.ingest_steps(chunk)
        cancelled = False
        clock = time.perf_counter
        threaded = 0.0
        try:
            call = next(steps)
            while True:
                began = clock()
                running = loop.run_in_executor(self._applier, call)
                while True:
                    try:
                        out = await asyncio.shield(running)
                        break
                    except asyncio.CancelledError:
                        if running.cancelled():
                            raise
                        cancelled = True
                threaded += clock() - began
                call = steps.send(out)
        except StopIteration as done:
            return done.value, cancelled, threaded

    async def poll_or_back_off(self, timeout_ms: int, doing: str) -> bool:
        """`poll`, for a loop that outlives outages: a Kafka error is logged
        and waited out for a second. Returns whether Kafka answered."""
        try:
            await self.poll(timeout_ms)
        except KafkaError as exc:
            log.warning(f"kafka error while {doing}; retrying", error=str(exc))
            await asyncio.sleep(1.0)
            return False
        return True

    async def _skip_deleted(self, partitions: Iterable[TopicPartition]) -> None:
        """Retention deleted records this consumer had not read yet: resume at
        the oldest record left, saying loudly and counting what was lost
        (otherwise aiokafka's reset would skip the hole in silence)."""
        async with self.lock:
            assigned = self.consumer.assignment()
            tps = [tp for tp in partitions if tp in assigned]
            positions = await resume_positions(
                self.consumer, tps, self.applied_offsets, self.conductor.counters
            )
            self.applied_offsets.update(positions)
            if self.fetcher is not None:
                for tp, offset in positions.items():
                    self.fetcher.seek(tp, offset)

    async def _notice(self, record: Any, incoming: Incoming, notice: Notice) -> bool:
        """Act on what the core said of a record; returns whether it was
        dead-lettered."""
        error = notice.error
        topic = record.topic
        if error is not None:
            if isinstance(error, BadRecord):
                await self._dead_letter(record, error.kind, error.reason)
            else:  # a bug in the core must not stop the daemon
                log.error(
                    "internal error applying a record",
                    topic=topic,
                    offset=record.offset,
                    exc_info=error,
                )
                await self._dead_letter(
                    record, "internal_error", f"{type(error).__name__}: {error}"
                )
            return True
        applied = notice.applied
        assert applied is not None
        key = incoming.key
        instance = key.decode("utf-8", "replace") if isinstance(key, bytes) else key or ""
        if applied.resync:
            headers = {k: v.decode("utf-8", "replace") for k, v in record.headers or ()}
            # A bridge attaching to a stream (how each one starts) is routine;
            # any other resync lost messages.
            attached = headers.get(KV_CONTROL_KIND) == "attached"
            # Once a minute per instance at most: a flapping bridge resyncs
            # on every restart (counted in index_events_total{kind="resyncs"}).
            self.problems.log(
                logging.INFO if attached else logging.WARNING,
                f"resync:{instance}",
                "instance resynchronised: the bridge attached to its stream, earlier state unknown"
                if attached
                else "instance resynchronised: its stream lost messages, stale blocks cleared",
                instance=instance,
                reason=headers.get(KV_CONTROL_REASON, ""),
                headers=headers,
                blocks_cleared=applied.blocks,
            )
        if applied.seq_missing:
            self.metrics.observe_seq(applied.seq_missing)
            self.problems.warn(
                f"gap:{instance}",
                "kv-seq gap: messages missing from the engine's stream",
                instance=instance,
                missing=applied.seq_missing,
                topic=topic,
                partition=record.partition,
                offset=record.offset,
            )
        return False

    async def _dead_letter(self, record: Any, kind: str, reason: str) -> None:
        self.metrics.bad_records.labels(topic=record.topic, kind=kind).inc()
        self.problems.warn(
            kind,
            "record dead-lettered",
            reason=reason,
            topic=record.topic,
            partition=record.partition,
            offset=record.offset,
        )
        await self.dead_letters.send(record, kind, reason)

    def silent_for(self) -> float:
        """Seconds since Kafka last answered this consumer, for any partition
        (see `_fetch_age`)."""
        now = time.time()
        ages = [self._fetch_age(tp, now) for tp in self.consumer.assignment()]
        return min(ages, default=max(0.0, now - self._heard))

    def _fetch_age(self, tp: TopicPartition, now: float) -> float:
        """Seconds since the partition's leader last answered.

        A healthy broker answers every fetch within `fetch_max_wait_ms`, with
        records or without, and each answer stamps its partitions. The
        fetcher skips partitions whose fetched records are still unread, so a
        batch handed out counts as an answer too, and so does an assignment
        (the first fetch has not come back yet)."""
        heard = self._heard_from.get(tp, self._heard)
        stamp = self._source.last_poll_timestamp(tp)
        if stamp is not None:
            heard = max(heard, stamp / 1000.0)
        return max(0.0, now - heard)

    def _measure_lag(self) -> None:
        now = time.time()
        for tp in self.consumer.assignment():
            lag = self._track(tp, now)
            if lag is not None:
                self.metrics.set_lag(tp.topic, tp.partition, lag)

    def _track(self, tp: TopicPartition, now: float) -> int | None:
        """The partition's lag (None: not known yet), noting since when
        records known to be waiting on it have waited."""
        high = self._source.highwater(tp)
        pos = self.applied_offsets.get(tp)
        if high is None or pos is None:
            return None
        target = self._behind.get(tp)
        if high <= pos:
            self._behind.pop(tp, None)
        elif target is None or pos >= target[0]:
            self._behind[tp] = (high, now)
        lag: int = high - pos
        return lag

    def partitions(self) -> list[PartitionHealth]:
        """Every assigned partition's lag, fetch age and wait, by name. Also
        while a batch is being applied, or stuck: the fetcher goes on
        learning the partitions' ends meanwhile."""
        now = time.time()
        out = []
        for tp in self.consumer.assignment():
            lag = self._track(tp, now)
            behind = self._behind.get(tp)
            out.append(
                PartitionHealth(
                    tp.topic,
                    tp.partition,
                    max(0, lag or 0),
                    self._fetch_age(tp, now),
                    0.0 if behind is None else max(0.0, now - behind[1]),
                )
            )
        return sorted(out)

    def staleness(self, bound_s: float) -> str | None:
        """/ready's reason when the index is stale on a partition past
        `bound_s`, else None."""
        stale = [p for p in self.partitions() if p.stale(bound_s)]
        return _stale_reason(stale) if stale else None

    def partition_rows(self, bound_s: float) -> list[PartitionRow]:
        """`partitions`, for the metrics, each marked stale past `bound_s`."""
        return [
            PartitionRow(p.topic, p.partition, p.fetch_age_s, p.behind_s, p.stale(bound_s))
            for p in self.partitions()
        ]

    async def _is_caught_up(self) -> bool:
        assigned = self.consumer.assignment()
        if not assigned:
            return False
        # Behind the end the last fetch answer saw, it is behind: said with
        # no request, which would wait behind the fetch in flight (up to
        # fetch_max_wait_ms) after every batch while catching up.
        source = self._source
        for tp in assigned:
            end = source.last_stable_offset(tp)
            if end is None or end < 0:
                end = source.highwater(tp)
            if end is not None and await self._position(tp) < end:
                return False
        ends = await self.consumer.end_offsets(list(assigned))
        for tp in assigned:
            if await self._position(tp) < ends[tp]:
                return False
        return True

    @property
    def _source(self) -> AIOKafkaConsumer | NativeFetcher:
        """What knows the partitions' ends and fetch answers."""
        return self.consumer if self.fetcher is None else self.fetcher

    async def _position(self, tp: TopicPartition) -> int:
        """The offset after the last record handed out for `tp`."""
        if self.fetcher is not None:
            pos = self.fetcher.position(tp)
            if pos is not None:
                return pos
        position: int = await self.consumer.position(tp)
        return position

    async def commit(self, offsets: Mapping[TopicPartition, int] | None = None) -> None:
        """Commit applied offsets to the group (the no-snapshot mode)."""
        offsets = self.applied_offsets if offsets is None else offsets
        assigned = self.consumer.assignment()
        mine = {tp: OffsetAndMetadata(o, "") for tp, o in offsets.items() if tp in assigned}
        if mine:
            await self.consumer.commit(mine)
