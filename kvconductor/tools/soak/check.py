"""The end of a soak: what is in the topics, and whether the daemon agrees.

- `read_topics` reads every record of some topics up to their end offsets.
- `replay` applies the event records to a fresh index, the way an
  undisturbed daemon with the same `[index]` limits would have: partitions
  merged by record timestamp (the order they were produced in; each
  partition's own order kept), and pending halves aged out as event time
  passes each second, as the daemon's loop does.
- `lost` compares what the log holds with what the broker acknowledged.
- `daemon_answers` asks the running daemon and the replay the same queries
  and `/workers`; `daemon_final_state` restores the daemon's last snapshot
  (after it stopped), whose units must equal the replay's
  (`differing_units`), and its pending halves too, but for those a catch-up
  may keep or drop at the age cutoff (`pending_differences`).
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Iterable
from typing import Any, NamedTuple

import aiohttp
import msgspec
from aiokafka import AIOKafkaConsumer, TopicPartition

from kvconductor.config import Config, KafkaConfig, kafka_client_options
from kvconductor.consumers.dead_letters import DLQ_KIND, DLQ_OFFSET, DLQ_PARTITION, DLQ_TOPIC
from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import IndexLimits
from kvconductor.kafka.clients import refresh_metadata
from kvconductor.service.daemon import EXPIRE_EVERY_S
from kvconductor.service.replica import Replica
from kvconductor.snapshots.units import (
    UnitKey,
    export_pending,
    namespace_keys,
    retired_entries,
    state_fingerprint,
)
from kvconductor.tools.soak.traffic import Where, record_digest
from kvconductor.wire.errors import BadRecord
from kvconductor.wire.query import TokenQuery

HTTP_TIMEOUT_S = 30.0
PENDING_UNIT = "q"  # the kind of a pending unit's key (snapshots.pending_key)

Partitions = dict[TopicPartition, list[Any]]


async def read_topics(k: KafkaConfig, topics: list[str]) -> Partitions:
    """Every record of `topics`, per partition in offset order, up to the end
    offsets of when the read began."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=k.bootstrap_servers,
        client_id=f"{k.client_id}-soak-check",
        group_id=None,
        enable_auto_commit=False,
        max_partition_fetch_bytes=4 * 1024 * 1024,
        **kafka_client_options(k),
    )
    await consumer.start()
    try:
        await refresh_metadata(consumer)
        tps = [
            TopicPartition(topic, p)
            for topic in topics
            for p in sorted(consumer.partitions_for_topic(topic) or ())
        ]
        ends = await consumer.end_offsets(tps)
        out: Partitions = {tp: [] for tp in tps}
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        left = {tp for tp in tps if ends[tp] > 0}
        while left:
            batch = await consumer.getmany(*left, timeout_ms=500, max_records=10_000)
            for tp, records in batch.items():
                out[tp].extend(r for r in records if r.offset < ends[tp])
            for tp in list(left):
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
        return out
    finally:
        await consumer.stop()


def where(record: Any) -> Where:
    return (record.topic, record.partition, record.offset)


class Replay(NamedTuple):
    conductor: Conductor
    records: int
    rejected: dict[Where, str]  # record -> the kind it was rejected as


def replay(limits: IndexLimits, partitions: Partitions, pool_topic: str) -> Replay:
    conductor = Conductor(limits)
    rejected: dict[Where, str] = {}
    records = 0
    expired_at = float("-inf")  # the daemon expires every EXPIRE_EVERY_S; here in event time
    # heapq.merge takes from each partition in its own order, whatever the
    # timestamps say, so per-key order is what Kafka keeps.
    for r in heapq.merge(*partitions.values(), key=lambda r: r.timestamp):
        records += 1
        ingest = (
            conductor.ingest_pool_record
            if r.topic == pool_topic
            else conductor.ingest_engine_record
        )
        try:
            if r.value is None:
                rejected[where(r)] = "undecodable"
            else:
                ingest(r.key, r.headers, r.value, r.timestamp / 1000.0)
        except BadRecord as exc:
            rejected[where(r)] = exc.kind
        except Exception:  # the daemon dead-letters a bug's victim the same way
            rejected[where(r)] = "internal_error"
        now = conductor.now
        if now - expired_at >= EXPIRE_EVERY_S:
            conductor.expire(now)
            expired_at = now
    conductor.expire(conductor.now)
    return Replay(conductor, records, rejected)


class Loss(NamedTuple):
    lost: list[Where]  # acknowledged, and not in the log as sent
    unacknowledged: int  # in the log, never acknowledged (a retry's first copy)


def lost(acked: dict[Where, bytes], partitions: Partitions) -> Loss:
    in_log = {
        where(r): record_digest(r.key, r.value, list(r.headers or ()))
        for records in partitions.values()
        for r in records
    }
    missing = sorted(w for w, digest in acked.items() if in_log.get(w) != digest)
    return Loss(missing, len(in_log.keys() - acked.keys()))


class DeadLetters(NamedTuple):
    sources: dict[Where, str]  # source record -> dlq-kind
    copies: int  # dead-letter records (a source dead-lettered twice counts twice)


def dead_letters(partitions: Partitions) -> DeadLetters:
    sources: dict[Where, str] = {}
    copies = 0
    for records in partitions.values():
        for r in records:
            h = {k: v.decode("utf-8", "replace") for k, v in r.headers or ()}
            copies += 1
            source = (
                h.get(DLQ_TOPIC, ""),
                int(h.get(DLQ_PARTITION, -1)),
                int(h.get(DLQ_OFFSET, -1)),
            )
            sources[source] = h.get(DLQ_KIND, "")
    return DeadLetters(sources, copies)


def _builtins(value: Any) -> Any:
    """What the daemon's JSON of `value` decodes to."""
    return msgspec.json.decode(msgspec.json.encode(value))


async def daemon_answers(
    url: str, conductor: Conductor, queries: Iterable[TokenQuery]
) -> list[str]:
    """Differences between the daemon's HTTP answers and the replay's: blocks
    per tier per instance (`/workers`) and each query's answer. (Pending
    halves are compared on the final state, see `pending_differences`.)"""
    problems: list[str] = []
    timeout = aiohttp.ClientTimeout(total=HTTP_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        async with session.get(f"{url}/workers") as resp:
            got = (await resp.json())["workers"]
        want = _builtins(conductor.workers())
        if got != want:
            problems.append(f"/workers: daemon {got} != replay {want}")
        for q in queries:
            async with session.post(f"{url}/query", data=msgspec.json.encode(q)) as resp:
                got = await resp.json()
            want = _builtins(conductor.query(q))
            if got != want:
                problems.append(
                    f"/query of {len(q.token_ids)} tokens: daemon {got} != replay {want}"
                )
    return problems


class FinalState(NamedTuple):
    restored: Conductor
    offsets: dict[TopicPartition, int]  # source partition -> next offset, as recorded


async def daemon_final_state(cfg: Config) -> FinalState:
    """The state the stopped daemon's last snapshot holds, and the offsets it
    reflects: a restore from the snapshot topic alone."""
    replica = Replica(cfg, follow="none", client_id=f"{cfg.kafka.client_id}-soak-restore")
    await replica.start()
    try:
        return FinalState(replica.conductor, replica.offsets())
    finally:
        with contextlib.suppress(Exception):
            await replica.stop()


def _is_pending(key: UnitKey) -> bool:
    return bool(key[0] == PENDING_UNIT)


def differing_units(got: Conductor, want: Conductor) -> tuple[list[str], int]:
    """Snapshot units other than pending halves that differ, with which side
    has them; and how many units were compared."""
    a, b = state_fingerprint(got.snapshot_state()), state_fingerprint(want.snapshot_state())
    out = []
    keys = {k for k in a.keys() | b.keys() if not _is_pending(k)}
    for key in sorted(keys, key=repr):
        if a.get(key) == b.get(key):
            continue
        side = "both" if key in a and key in b else ("daemon" if key in a else "replay")
        out.append(f"{key!r} ({'differs' if side == 'both' else 'only in the ' + side})")
    return out, len(keys)


class PendingDiff(NamedTuple):
    problems: list[str]  # entries on one side only, away from the age cutoff
    at_cutoff: int  # entries on one side only, within the band around it
    compared: int  # entries compared
    max_skew_s: float  # the largest difference of one entry's time on the two sides


def _pending_entries(conductor: Conductor) -> dict[tuple[Any, ...], float]:
    """Every pending half and retired content, without its time -> its time."""
    out: dict[tuple[Any, ...], float] = {}
    index = conductor.snapshot_state()
    for ns_key in namespace_keys(index):
        unit = export_pending(index, ns_key)
        if unit is not None:
            for e in [*unit.entries, *retired_entries(unit)]:
                out[(ns_key, msgspec.structs.replace(e, ts=0.0))] = e.ts
    return out


def pending_differences(
    got: Conductor, want: Conductor, max_age_s: float, band_s: float
) -> PendingDiff:
    """Pending halves and retired content on one side only.

    Their time is the namespace's clock when they were added: the newest
    record timestamp applied so far, across partitions, so it depends on how
    the partitions were interleaved; a daemon catching up after a restart
    applies each partition's backlog in turn, and stamps entries up to that
    backlog's length later than an undisturbed run does. Both sides age them
    out at the same cutoff (the last record's time - `max_age_s`), so an entry
    within `band_s` of it may be kept on one side only; anywhere else, the two
    must hold the same entries."""
    a, b = _pending_entries(got), _pending_entries(want)
    cutoff = max(got.now, want.now) - max_age_s
    problems: list[str] = []
    at_cutoff = 0
    for side, mine, other in (("daemon", a, b), ("replay", b, a)):
        for entry, ts in mine.items():
            if entry in other:
                continue
            if abs(ts - cutoff) <= band_s:
                at_cutoff += 1
            else:
                problems.append(
                    f"only in the {side}: {entry[1]!r} of {entry[0]}, "
                    f"{ts - cutoff:+.1f} s from the age cutoff"
                )
    skews = [abs(a[e] - b[e]) for e in a.keys() & b.keys()]
    return PendingDiff(problems, at_cutoff, len(a.keys() | b.keys()), max(skews, default=0.0))
