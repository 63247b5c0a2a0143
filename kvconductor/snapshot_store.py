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
from collections.abc import Callable
from typing import Any, NamedTuple

import msgspec
import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from kvconductor.index import Index
from kvconductor.namespace_index import NamespaceIndex, NamespaceKey
from kvconductor.snapshots import (
    SCHEMA_VERSION,
    GenerationUnit,
    Unit,
    UnitKey,
    UnitValue,
    decode_unit,
    encode_unit,
    export_unit,
    generation_key,
    pending_key,
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


class SnapshotPublisher:
    """Writes generations with a transactional producer (one per daemon)."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, group_id: str) -> None:
        self.producer = producer
        self.topic = topic
        self.group_id = group_id
        self.generation = 0
        # Chunks currently on the topic per unit, to tombstone leftovers.
        self.published: dict[UnitKey, int] = {}
        self.pending_versions: dict[NamespaceKey, int] = {}

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

    def _changed_units(self, index: Index) -> list[tuple[str, Any]]:
        dirty = index.dirty
        ids: list[tuple[str, Any]] = [("o", u) for u in dirty.owners]
        ids += [("p", u) for u in dirty.pools]
        ids += [("i", u) for u in dirty.instances]
        for ns_key, ns in index.namespaces.items():
            if self.pending_versions.get(ns_key) != pending_version(ns):
                ids.append(("q", ns_key))
        for ns_key in list(self.pending_versions):
            if ns_key not in index.namespaces:
                ids.append(("q", ns_key))
        return ids

    async def publish(
        self,
        index: Index,
        offsets: dict[TopicPartition, int],
        progress: Callable[[int, int], None] | None = None,
    ) -> PublishStats:
        """Publish one generation: changed units, then offsets, atomically."""
        started = time.monotonic()
        ids = self._changed_units(index)
        generation = self.generation + 1
        units = tombstones = size = 0
        new_published: dict[UnitKey, int] = {}
        pending_versions: dict[NamespaceKey, int] = {}
        send = self.producer.send
        async with self.producer.transaction():
            for n, (kind, uid) in enumerate(ids):
                key, unit = export_unit(index, kind, uid)
                had = self.published.get(key, 0)
                if unit is None:
                    for c in range(had):
                        await send(self.topic, key=chunk_key(key, c), value=None)
                        tombstones += 1
                    new_published[key] = 0
                else:
                    data = encode_unit(unit)
                    parts = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)]
                    parts = parts or [b""]
                    for c, part in enumerate(parts):
                        value = msgspec.msgpack.encode(
                            UnitValue(SCHEMA_VERSION, generation, c, len(parts), part)
                        )
                        await send(self.topic, key=chunk_key(key, c), value=value)
                        size += len(value)
                    for c in range(len(parts), had):
                        await send(self.topic, key=chunk_key(key, c), value=None)
                        tombstones += 1
                    new_published[key] = len(parts)
                    units += 1
                if kind == "q":
                    ns = index.namespaces.get(uid)
                    pending_versions[uid] = pending_version(ns) if ns is not None else -1
                if progress is not None and n % 1000 == 0:
                    progress(n, len(ids))
                if n % 16 == 15:
                    # Big units take a while to export and encode: let
                    # queries in (events wait for the lock the caller holds).
                    await asyncio.sleep(0)
            now = time.time()
            for tp, offset in offsets.items():
                gen = GenerationUnit(generation, [(tp.topic, tp.partition, offset)], index.now, now)
                gkey = generation_key_for(tp)
                value = msgspec.msgpack.encode(
                    UnitValue(SCHEMA_VERSION, generation, 0, 1, encode_unit(gen))
                )
                await send(self.topic, key=chunk_key(gkey, 0), value=value)
                new_published[gkey] = 1
            if offsets:
                await self.producer.send_offsets_to_transaction(
                    {tp: o for tp, o in offsets.items()}, self.group_id
                )
        # Only a committed generation moves the bookkeeping on.
        self.generation = generation
        for key, count in new_published.items():
            if count:
                self.published[key] = count
            else:
                self.published.pop(key, None)
        for ns_key, version in pending_versions.items():
            if version < 0:
                self.pending_versions.pop(ns_key, None)
            else:
                self.pending_versions[ns_key] = version
        index.dirty.clear()
        return PublishStats(generation, units, tombstones, size, time.monotonic() - started)

    def mark_all_dirty(self, index: Index) -> None:
        """Make the next generation rewrite every unit (after a restore or a
        change of partition ownership)."""
        for ns_key, ns in index.namespaces.items():
            for instance, ranks in ns.owners.items():
                for rank in ranks:
                    index.dirty.owners.add((ns_key, instance, rank))
            for backend, medium in ns.pools:
                index.dirty.pools.add((ns_key, backend, medium))
            self.pending_versions.pop(ns_key, None)
        index.dirty.instances.update(index.instances)
        for key in self.published:
            if key[0] == "q":
                ns_key = NamespaceKey(key[1], key[2], key[3], key[4], key[5])
                self.pending_versions.setdefault(ns_key, -2)


def pending_version(ns: NamespaceIndex) -> int:
    return ns.pending_version()


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
        await consumer._client.force_metadata_update()
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
