"""Snapshots on Kafka: publishing generations and reading them back.

Record layout on the compacted snapshot topic:

- key: msgpack array `[*unit_key, chunk]` (see `snapshots` for unit keys);
- value: msgpack `UnitValue {v, generation, chunk, chunks, data}`, or null
  (a tombstone) for a chunk or unit that is gone.

A generation is one Kafka transaction holding every unit changed since the
previous generation, tombstones for units that disappeared, one generation
record per source partition (`["g", topic, partition]`) with the offset the
units reflect, and the consumer group's offsets committed through
`send_offsets_to_transaction`. Readers use `read_committed`, so they see
whole generations or nothing; compaction keeps the newest value per key,
which is exactly the newest state of every unit.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeVar

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from kvconductor.index.block_store import BlockStore
from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import Index
from kvconductor.index.namespace import Dirty, NamespaceKey
from kvconductor.kafka.clients import refresh_metadata
from kvconductor.records_first import RecordsFirst
from kvconductor.snapshots.units import (
    SCHEMA_VERSION,
    CutUnit,
    GenerationUnit,
    Unit,
    UnitKey,
    UnitValue,
    begin_cut,
    completing,
    decode_unit,
    encode_unit,
    export_unit,
    export_unit_at_cut,
    generation_key,
    mark_all_changed,
    namespace_keys,
    pending_key,
    pending_version,
    unit_namespace,
)

log = structlog.get_logger("kvconductor.snapshot")

# Under the broker's default max.message.bytes (1 MiB) with room for headers.
CHUNK_BYTES = 512 * 1024

_key_encoder = msgspec.msgpack.Encoder()
_key_decoder = msgspec.msgpack.Decoder(list[Any])
_value_decoder = msgspec.msgpack.Decoder(UnitValue)


def chunk_key(unit_key: UnitKey, chunk: int) -> bytes:
    return _key_encoder.encode([*unit_key, chunk])


class PublishStats(NamedTuple):
    generation: int
    units: int
    tombstones: int
    bytes: int
    seconds: float
    # The cut: per source partition, the offset the generation reflects.
    offsets: dict[TopicPartition, int]
    # Longest single hold of the lock the publish was given (without one,
    # the caller held its lock throughout: the whole publish).
    hold_s: float
    rounds: int  # pre-copy rounds before the final one
    final_units: int  # units exported or frozen in the final round, under the lock


# Pre-copy: the longest it exports units under the lock at a time. A single
# unit takes what it takes (its export is one step).
SLICE_S = 0.002
# The final round starts once the instance and pending units marked again
# look this cheap to export, or once a round no longer shrinks them (units
# that change all the time), or after this many pre-copy rounds.
FINAL_S = 0.005
MAX_ROUNDS = 4
# The final round lets queries in this often (records wait for the lock);
# each time costs the hold whatever runs meanwhile.
QUERIES_EVERY_S = 0.005

UnitId = tuple[str, Any]  # (kind, id), as `export_unit` takes them
Exported = list[tuple[UnitKey, Unit | None]]
AtCut = list[tuple[UnitKey, Unit | CutUnit | None]]
U = TypeVar("U", Unit | None, Unit | CutUnit | None)
CutObserver = Callable[[Conductor, int, dict[TopicPartition, int]], None]


class SnapshotPublisher:
    """Writes generations with a transactional producer (one per daemon).

    A generation is captured in rounds (see `publish`), then sent in one
    transaction. Never two publishes at once: the daemon serialises them."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, group_id: str) -> None:
        self.producer = producer
        self.topic = topic
        self.group_id = group_id
        self.generation = 0
        # Chunks currently on the topic per unit, to tombstone leftovers.
        self.published: dict[UnitKey, int] = {}
        self.pending_versions: dict[NamespaceKey, int] = {}
        # From the cut (offsets taken) until the transaction ended: the
        # generation can no longer be abandoned, only waited for.
        self.sending = False
        # Called at every cut with the conductor exactly in the state the
        # generation holds, its number and offsets (tests check it against
        # what the topic then restores).
        self.observe_cut: CutObserver | None = None

    def adopt(self, restored: SnapshotRead, keep: Callable[[UnitKey], bool] | None = None) -> None:
        """Continue after a restore: same generation numbering, and the units
        this daemon now owns (`keep`; all by default) as already published."""
        self.generation = max(self.generation, restored.generation)
        for key, chunks in restored.chunks.items():
            if keep is None or keep(key):
                self.published[key] = chunks

    def forget(self, drop: Callable[[NamespaceKey], bool]) -> None:
        """Stop tracking units of namespaces handed over to another daemon."""
        for key in [k for k in self.published if (ns := unit_namespace(k)) and drop(ns)]:
            del self.published[key]
        for ns_key in [k for k in self.pending_versions if drop(k)]:
            del self.pending_versions[ns_key]

    async def publish(
        self,
        conductor: Conductor,
        offsets: Mapping[TopicPartition, int],
        *,
        lock: asyncio.Lock | None = None,
        records_first: RecordsFirst | None = None,
    ) -> PublishStats:
        """Publish one generation: the units changed since the last one and
        the offsets they reflect, atomically.

        `offsets` is read at the cut, so pass the live mapping the appliers
        move on. Without `lock`, the caller holds whatever keeps records
        from being applied, for the whole publish. With it, records keep
        being applied: pre-copy rounds export the marked instance and
        pending units a slice at a time under `lock` and encode them
        outside it, each round taking the units marked again meanwhile;
        the final round, under `lock` throughout, freezes every owner and
        pool unit taken, exports what else is marked by then and reads the
        offsets (the cut), and the transaction is sent outside it. A unit
        that changes after its export is marked again, so every unit is
        published as it was at the cut. If the transaction fails, the
        units' marks are given back: the next generation rewrites them.

        `records_first` (with `lock`): outside the final round, the work
        goes on in steps that give way to records being applied (see
        `RecordsFirst`)."""
        started = time.monotonic()
        copy = _Copy(self, conductor, lock, records_first)
        try:
            final = await copy.capture(offsets)
            for key, unit in final:
                # Records apply between steps again: the blocks are the cut's
                # whatever they change (`BlockStore.begin_cut`, `freeze_owner`).
                await copy.encode(key, await copy.complete(unit))
            copy.end_cut()
            stats = await self._send(copy, started)
        except BaseException:
            copy.give_back()
            raise
        finally:
            copy.end_cut()
            self.sending = False
        return stats

    async def _send(self, copy: _Copy, started: float) -> PublishStats:
        generation = copy.generation
        units = tombstones = size = 0
        send = self.producer.send
        async with self.producer.transaction():
            for key, records in copy.records.items():
                had = self.published.get(key, 0)
                for c, value in enumerate(records):
                    await send(self.topic, key=chunk_key(key, c), value=value)
                    size += len(value)
                for c in range(len(records), had):
                    await send(self.topic, key=chunk_key(key, c), value=None)
                    tombstones += 1
                units += bool(records)
                # Sends rarely wait: let records and queries in between units.
                await copy.turn()
            now = time.time()
            for tp, offset in copy.offsets.items():
                cut = [(tp.topic, tp.partition, offset)]
                gen = GenerationUnit(generation, cut, copy.clock, now)
                value = msgspec.msgpack.encode(
                    UnitValue(SCHEMA_VERSION, generation, 0, 1, encode_unit(gen))
                )
                await send(self.topic, key=chunk_key(generation_key_for(tp), 0), value=value)
            if copy.offsets:
                await self.producer.send_offsets_to_transaction(dict(copy.offsets), self.group_id)
        # Only a committed generation moves the bookkeeping on.
        self.generation = generation
        for key, records in copy.records.items():
            if records:
                self.published[key] = len(records)
            else:
                self.published.pop(key, None)
        for tp in copy.offsets:
            self.published[generation_key_for(tp)] = 1
        for ns_key, version in copy.versions.items():
            if version < 0:
                self.pending_versions.pop(ns_key, None)
            else:
                self.pending_versions[ns_key] = version
        return PublishStats(
            generation,
            units,
            tombstones,
            size,
            time.monotonic() - started,
            copy.offsets,
            copy.hold_s if copy.lock is not None else time.monotonic() - started,
            copy.rounds,
            copy.final_units,
        )

    def mark_all_dirty(self, conductor: Conductor) -> None:
        """Make the next generation rewrite every unit (after a restore or a
        change of partition ownership)."""
        for ns_key in mark_all_changed(conductor.snapshot_state()):
            self.pending_versions.pop(ns_key, None)
        for key in self.published:
            if key[0] == "q":
                ns_key = NamespaceKey(key[1], key[2], key[3], key[4], key[5])
                self.pending_versions.setdefault(ns_key, -2)


class _Copy:
    """One generation being captured: its units exported and encoded so far,
    and every dirty mark taken off the index for it."""

    def __init__(
        self,
        publisher: SnapshotPublisher,
        conductor: Conductor,
        lock: asyncio.Lock | None,
        records_first: RecordsFirst | None,
    ) -> None:
        self.publisher = publisher
        self.conductor = conductor
        self.lock = lock
        # Between two steps of work outside the final round. Without `lock`
        # the caller keeps records out throughout: nothing to give way to.
        self.turn = (
            records_first.turn if records_first is not None and lock is not None else _next_tasks
        )
        self.generation = publisher.generation + 1
        # Per unit key, its chunks' record values; empty: the unit is gone.
        self.records: dict[UnitKey, list[bytes]] = {}
        self.taken = Dirty()
        # Pending version of each namespace's pending unit as exported (-1:
        # gone), and as last taken.
        self.versions: dict[NamespaceKey, int] = {}
        self.seen: dict[NamespaceKey, int] = {}
        # Seconds each unit's last export took: what a final round would cost.
        self.cost: dict[UnitId, float] = {}
        self.offsets: dict[TopicPartition, int] = {}
        self.clock = 0.0
        # Stores whose cut this generation opened (`_final`).
        self.cut_stores: list[BlockStore] = []
        self.hold_s = 0.0
        self.rounds = 0
        self.final_units = 0

    async def capture(self, offsets: Mapping[TopicPartition, int]) -> AtCut:
        """Run the rounds up to the cut; returns the final round's units,
        exported but not encoded yet."""
        lock = self.lock
        if lock is None:
            return await self._final(self._take(), offsets)
        spent = float("inf")  # export seconds of the last pre-copy round
        while True:
            await self.turn()
            async with lock:
                held = time.perf_counter()
                ids = self._take()
                estimate = self._estimate(ids)
                # A round that would not halve what is left gains nothing:
                # those units change faster than rounds go.
                final = (
                    await self._final(ids, offsets)
                    if self.rounds >= MAX_ROUNDS or estimate <= FINAL_S or estimate > spent / 2
                    else None
                )
                self._held(held)
            if final is not None:
                return final
            spent = await self._precopy(ids, lock)
            self.rounds += 1

    def _take(self) -> list[UnitId]:
        """The instance and pending units changed since they were last
        taken; call between batches. Owner and pool units changed join
        `taken`, all of which the final round freezes: pre-copying them is
        wasted under churn (at 4.3M entries the final round found 237-257
        of 259 changed again), and a freeze costs a mark whatever the
        unit's size, so they wait for the cut."""
        dirty = self.conductor.changes
        ids: list[UnitId] = [("i", u) for u in dirty.instances]
        self.taken.owners |= dirty.owners
        self.taken.pools |= dirty.pools
        self.taken.instances |= dirty.instances
        dirty.clear()
        # Pending units have versions instead of marks.
        namespaces = namespace_keys(self.conductor.snapshot_state())
        published = self.publisher.pending_versions
        for ns_key in namespaces | published.keys() | self.versions.keys():
            version = self._pending_version(ns_key)
            if self.versions.get(ns_key, published.get(ns_key)) != version:
                ids.append(("q", ns_key))
                self.seen[ns_key] = version
        return ids

    def _stale(self, uid: UnitId) -> bool:
        """Changed again since it was taken: the next round takes it again,
        so exporting it now would be wasted."""
        kind, unit_id = uid
        if kind == "i":
            return unit_id in self.conductor.changes.instances
        return self._pending_version(unit_id) != self.seen[unit_id]

    def _pending_version(self, ns_key: NamespaceKey) -> int:
        return pending_version(self.conductor.snapshot_state(), ns_key)

    def _estimate(self, ids: list[UnitId]) -> float:
        """What exporting `ids` would take, from their last exports; before
        any, more than a final round may take (the first round pre-copies)."""
        cost = self.cost
        if not cost:
            return float("inf") if ids else 0.0
        mean = sum(cost.values()) / len(cost)
        return sum(cost.get(uid, mean) for uid in ids)

    def _export(
        self, uid: UnitId, export: Callable[[Index, str, Any], tuple[UnitKey, U]]
    ) -> tuple[UnitKey, U]:
        kind, unit_id = uid
        t = time.perf_counter()
        key, unit = export(self.conductor.snapshot_state(), kind, unit_id)
        self.cost[uid] = time.perf_counter() - t
        if kind == "q":
            self.versions[unit_id] = self._pending_version(unit_id)
        return key, unit

    async def _precopy(self, ids: list[UnitId], lock: asyncio.Lock) -> float:
        """Export `ids` a slice at a time under `lock`, encode them outside
        it; returns the export seconds."""
        n = 0
        spent = 0.0
        while n < len(ids):
            await self.turn()
            async with lock:
                held = time.perf_counter()
                exported: Exported = []
                while n < len(ids):
                    uid = ids[n]
                    n += 1
                    if not self._stale(uid):
                        exported.append(self._export(uid, export_unit))
                    if time.perf_counter() - held >= SLICE_S:
                        break
                spent += time.perf_counter() - held
                self._held(held)
            for key, unit in exported:
                await self.encode(key, unit)
                await self.turn()
        return spent

    async def _final(self, ids: list[UnitId], offsets: Mapping[TopicPartition, int]) -> AtCut:
        """Freeze the owner and pool units taken, export what is left of
        `ids` and read the offsets: the cut. Records are not applied
        meanwhile (the lock); queries are, now and then. A frozen unit's
        blocks and identities are read after the lock (`CutUnit`): reading
        them here was most of the final round, which records wait out
        (docs/benchmarks.md)."""
        self.cut_stores += begin_cut(self.conductor.snapshot_state())
        taken = self.taken
        ids = [("o", u) for u in taken.owners] + [("p", u) for u in taken.pools] + ids
        exported: AtCut = []
        last = time.perf_counter()
        for uid in ids:
            exported.append(self._export(uid, export_unit_at_cut))
            if time.perf_counter() - last >= QUERIES_EVERY_S:
                await asyncio.sleep(0)
                last = time.perf_counter()
        self.final_units = len(ids)
        self.offsets = dict(offsets)
        self.clock = self.conductor.now
        publisher = self.publisher
        publisher.sending = True
        if publisher.observe_cut is not None:
            publisher.observe_cut(self.conductor, self.generation, self.offsets)
        return exported

    async def complete(self, unit: Unit | CutUnit | None) -> Unit | None:
        """`snapshots.completing`, with a turn after each step."""
        steps = completing(unit)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                completed: Unit | None = done.value
                return completed
            await self.turn()

    def _held(self, since: float) -> None:
        self.hold_s = max(self.hold_s, time.perf_counter() - since)

    async def encode(self, key: UnitKey, unit: Unit | None) -> None:
        """The unit's records, ready to send (a later export replaces them),
        with a turn after each chunk: the largest units encoded in one step
        made records wait it out."""
        if unit is None:
            self.records[key] = []
            return
        data = memoryview(encode_unit(unit))  # chunks are views: one copy less
        chunks = max(1, -(-len(data) // CHUNK_BYTES))
        records = []
        for c in range(chunks):
            part = data[c * CHUNK_BYTES : (c + 1) * CHUNK_BYTES]
            # msgspec writes any buffer as bin: the view encodes as bytes would.
            value = UnitValue(SCHEMA_VERSION, self.generation, c, chunks, part)  # type: ignore[arg-type]
            records.append(msgspec.msgpack.encode(value))
            if c + 1 < chunks:
                await self.turn()
        self.records[key] = records

    def end_cut(self) -> None:
        """Close the cuts `_final` opened (once)."""
        for store in self.cut_stores:
            store.end_cut()
        self.cut_stores.clear()

    def give_back(self) -> None:
        """The generation is not published: its units stay marked changed."""
        dirty = self.conductor.changes
        dirty.owners |= self.taken.owners
        dirty.pools |= self.taken.pools
        dirty.instances |= self.taken.instances


async def _next_tasks() -> None:
    """Let the tasks that are ready run (a query, the next batch)."""
    await asyncio.sleep(0)


def generation_key_for(tp: TopicPartition) -> UnitKey:
    return (*generation_key(tp.topic), tp.partition)


class SnapshotRead(NamedTuple):
    units: dict[UnitKey, Unit]
    chunks: dict[UnitKey, int]
    offsets: dict[TopicPartition, int]
    generation: int
    records: int
    bytes: int
    seconds: float
    skipped: int


async def read_snapshot(
    consumer: AIOKafkaConsumer,
    topic: str,
    progress: Callable[[int, int], None] | None = None,
) -> SnapshotRead:
    """Read the snapshot topic from the beginning to its end.

    The consumer must be started, with no group, `read_committed`. "The end"
    is each partition's end offset taken up front, compared with the
    consumer's position (never the last record's offset: compaction leaves
    holes and the last offset may be a transaction marker). Records past it
    (a generation committed during the read) are left out, so the result is
    whole generations; the consumer is left at those ends, to follow on."""
    started = time.monotonic()
    partitions = consumer.partitions_for_topic(topic)
    if partitions is None:
        await refresh_metadata(consumer)
        partitions = consumer.partitions_for_topic(topic) or set()
    tps = [TopicPartition(topic, p) for p in sorted(partitions)]
    consumer.assign(tps)
    await consumer.seek_to_beginning(*tps)
    ends = await consumer.end_offsets(tps)
    total = sum(ends.values())
    latest: dict[bytes, UnitValue | None] = {}
    records = size = 0
    remaining = {tp for tp in tps if ends[tp] > 0}
    while remaining:
        batch = await consumer.getmany(*remaining, timeout_ms=500, max_records=10_000)
        for tp, recs in batch.items():
            end = ends[tp]
            for r in recs:
                if r.offset >= end:
                    # Past the end taken up front: a generation being
                    # committed now; taking part of it would mix generations.
                    continue
                records += 1
                if r.value is None:
                    latest[r.key] = None
                    continue
                size += len(r.value)
                try:
                    latest[r.key] = _value_decoder.decode(r.value)
                except msgspec.DecodeError:
                    log.error("undecodable snapshot record skipped", offset=r.offset)
        for tp in list(remaining):
            if await consumer.position(tp) >= ends[tp]:
                remaining.discard(tp)
        if progress is not None:
            progress(records, total)
    # A follower continues from exactly what was read.
    for tp in tps:
        consumer.seek(tp, ends[tp])
    units, chunks, skipped = _assemble(latest)
    offsets: dict[TopicPartition, int] = {}
    generation = 0
    for unit in units.values():
        if isinstance(unit, GenerationUnit):
            generation = max(generation, unit.generation)
            for t, p, o in unit.offsets:
                offsets[TopicPartition(t, p)] = o
    return SnapshotRead(
        units, chunks, offsets, generation, records, size, time.monotonic() - started, skipped
    )


def _assemble(
    latest: dict[bytes, UnitValue | None],
) -> tuple[dict[UnitKey, Unit], dict[UnitKey, int], int]:
    parts: dict[UnitKey, dict[int, UnitValue]] = {}
    for raw_key, value in latest.items():
        if value is None:
            continue
        try:
            key = _key_decoder.decode(raw_key)
        except msgspec.DecodeError:
            continue
        parts.setdefault(tuple(key[:-1]), {})[key[-1]] = value
    units: dict[UnitKey, Unit] = {}
    chunks: dict[UnitKey, int] = {}
    skipped = 0
    for unit_key, by_chunk in parts.items():
        newest = max(v.generation for v in by_chunk.values())
        head = by_chunk.get(0)
        if head is None or head.generation != newest or head.v > SCHEMA_VERSION:
            skipped += 1
            continue
        pieces = [by_chunk.get(c) for c in range(head.chunks)]
        if any(p is None or p.generation != newest for p in pieces):
            skipped += 1
            continue
        data = b"".join(p.data for p in pieces if p is not None)
        try:
            units[unit_key] = decode_unit(data)
        except msgspec.DecodeError:
            skipped += 1
            continue
        chunks[unit_key] = max(by_chunk) + 1
    if skipped:
        log.error("incomplete or unreadable snapshot units skipped", units=skipped)
    return units, chunks, skipped


__all__ = [
    "CHUNK_BYTES",
    "PublishStats",
    "SnapshotPublisher",
    "SnapshotRead",
    "chunk_key",
    "pending_key",
    "read_snapshot",
]
