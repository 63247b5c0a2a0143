"""The native fetch path (`[kafka] fetch_path = "native"`).

The daemon sends its Fetch requests itself, to each partition's leader,
over a connection of its own to each (`kvconductor.kafka.frames`: every
answer read from the socket straight into one buffer, opened and
authenticated by aiokafka), and the compiled kernel
(kernel/core/src/kafka/record_batch.rs) reads each answer's partitions and their
record batches in place, straight into the `Incoming`s the core takes:
no Python per record, no copy of the fetched bytes. An `AIOKafkaClient`
of its own keeps the cluster's metadata (who leads what).
aiokafka's fetcher spends Python objects on every record for the same
work (its per-record generator, `ConsumerRecord`s, header tuples): the
cost per record that bounded ingest (docs/benchmarks.md).

aiokafka's consumer keeps everything else: group membership, the
assignment, commits and the offsets API. Its own fetcher stays idle, as
every assigned partition is paused; `fill` calls `getmany` (which returns
nothing) only so the consumer counts as polled (`max_poll_interval_ms`).

Positions: each assigned partition's is set by the event consumer from
its assignment hook (the snapshot's offsets, `kvconductor/consumers/positions.py`)
and by its seeks. A rebalance starts a new generation: answers to
requests sent before it are dropped, and whatever was fetched but not
handed out is fetched again from the new positions. `take` runs under the
event consumer's lock, after the rebalance hooks, so what it hands out
is always for partitions owned now and never below what was applied.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Collection, Mapping, Sequence
from typing import Any, NamedTuple

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka import errors as kafka_errors
from aiokafka.client import AIOKafkaClient
from aiokafka.codec import gzip_decode, lz4_decode, snappy_decode, zstd_decode
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    NoOffsetForPartitionError,
    OffsetOutOfRangeError,
    TopicAuthorizationFailedError,
)
from aiokafka.protocol.fetch import FetchRequest

from kvconductor.config import (
    KafkaConfig,
    kafka_client_options,
    kafka_fetch_options,
    kafka_service_options,
)
from kvconductor.index.conductor import Incoming
from kvconductor.kafka.frames import FrameConnection
from kvconductor.kernel import KERNEL
from kvconductor.obs.logs import RateLimitedLog
from kvconductor.wire.records import KV_KIND, KV_ORIGIN_KEY

if KERNEL is not None:
    from kvconductor import _kernel

log = structlog.get_logger("kvconductor.fetcher")

ISOLATION = {"read_uncommitted": 0, "read_committed": 1}

# Errors after which the partition's leader is looked up again.
_METADATA_ERRORS = (
    kafka_errors.NotLeaderForPartitionError,
    kafka_errors.UnknownTopicOrPartitionError,
    kafka_errors.LeaderNotAvailableError,
    kafka_errors.ReplicaNotAvailableError,
    kafka_errors.KafkaStorageError,
    kafka_errors.StaleLeaderEpochCodeError,
)

_CODECS = {1: gzip_decode, 2: snappy_decode, 3: lz4_decode, 4: zstd_decode}


def _inflate(codec: int, data: bytes) -> bytes:
    """A compressed batch's records, by aiokafka's codecs (the kernel
    checked the batch's CRC first)."""
    decode = _CODECS.get(codec)
    if decode is None:
        raise ValueError(f"unknown compression codec {codec}")
    return bytes(decode(data))


def _require_kernel() -> None:
    if KERNEL is None:
        raise RuntimeError("fetch_path = native needs the compiled kernel (kvconductor._kernel)")


def record_reader(check_crc: bool = True) -> _kernel.RecordReader:
    """The kernel's reader of fetched record batches into `Incoming`s."""
    _require_kernel()
    return _kernel.RecordReader(Incoming, _inflate, KV_KIND, KV_ORIGIN_KEY, check_crc)


class FetchedRecord(NamedTuple):
    """A record handed out, as the dead-letter writer and notices read it
    (the fields of aiokafka's `ConsumerRecord` they use)."""

    topic: str
    partition: int
    offset: int
    timestamp: int
    key: bytes | None
    value: bytes | None
    headers: Any


class NativeBatch:
    """Records of several partitions in produce order (`event_consumer.
    in_produce_order`'s order), as the event consumer applies them."""

    def __init__(self, merged: _kernel.Merged, tps: list[TopicPartition]) -> None:
        self.merged = merged
        self.tps = tps
        self.incoming: Sequence[Incoming] = merged.records

    def __len__(self) -> int:
        return len(self.incoming)

    def applied(self, start: int, end: int) -> list[tuple[TopicPartition, int, int]]:
        """Per partition with records in `incoming[start:end]`: the offset
        after its last there, and how many."""
        tps = self.tps
        return [(tps[p], after, n) for p, after, n in self.merged.through(start, end)]

    def record(self, i: int) -> FetchedRecord:
        part, offset, timestamp = self.merged.at(i)
        tp = self.tps[part]
        rec = self.incoming[i]
        return FetchedRecord(
            tp.topic, tp.partition, offset, timestamp, _key(rec.key), rec.value, rec.headers
        )


def _key(key: bytes | str | None) -> bytes | None:
    return key.encode() if isinstance(key, str) else key


class _Partition:
    """One assigned partition's fetch state."""

    __slots__ = ("answered_ms", "buffered", "fetch_at", "highwater", "lso", "position")

    # Reads held per partition: with one waiting to be taken the next fetch
    # still goes out, as aiokafka's does once a batch is handed out, so a
    # partition's leader is heard from while the apply loop is held up
    # (`/ready` tells a stuck index from a silent broker by it).
    AHEAD = 2

    def __init__(self, position: int) -> None:
        self.position = position  # past the last record handed out
        self.fetch_at = position  # the next fetch's offset
        self.buffered: deque[_kernel.Fetched] = deque()  # reads not all handed out, in order
        self.highwater: int | None = None
        self.lso: int | None = None
        self.answered_ms: int | None = None  # when its leader last answered a fetch


class NativeFetcher:
    """Fetches the consumer's assigned partitions itself (see the module doc).

    `modes`: per topic, its records' `Incoming.pool` (None: repartitioned
    records, whose kind and key are in their headers)."""

    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        client: AIOKafkaClient,
        modes: Mapping[str, bool | None],
        *,
        isolation_level: str = "read_committed",
        auto_offset_reset: str = "none",
        fetch_max_wait_ms: int = 500,
        fetch_min_bytes: int = 1,
        fetch_max_bytes: int = 50 * 1024 * 1024,
        max_partition_fetch_bytes: int = 1024 * 1024,
        retry_backoff_ms: int = 100,
        check_crc: bool = True,
        connection: Mapping[str, Any] | None = None,
    ) -> None:
        if isolation_level not in ISOLATION:
            raise ValueError(f"isolation_level must be one of {sorted(ISOLATION)}")
        if auto_offset_reset not in ("none", "earliest", "latest"):
            raise ValueError("auto_offset_reset must be none, earliest or latest")
        self.consumer = consumer
        self.client = client
        self.modes = dict(modes)
        self.reader = record_reader(check_crc)
        _require_kernel()
        self._merge = _kernel.merge_fetched
        self._answer = _kernel.fetch_response
        # `FrameConnection.open`'s options: client id, security.
        self._connection = {"client_id": "kvconductor-fetch", **(connection or {})}
        self._conns: dict[int, FrameConnection] = {}
        self._isolation = ISOLATION[isolation_level]
        self._reset = auto_offset_reset
        self._max_wait_ms = fetch_max_wait_ms
        self._min_bytes = fetch_min_bytes
        self._max_bytes = fetch_max_bytes
        self._partition_bytes = max_partition_fetch_bytes
        self._backoff_s = retry_backoff_ms / 1000
        self.parts: dict[TopicPartition, _Partition] = {}
        self.generation = 0
        self._inflight: dict[int, asyncio.Task[None]] = {}
        self._out_of_range: dict[TopicPartition, int] = {}
        self._failure: KafkaError | None = None
        self._rotation = 0
        self.problems = RateLimitedLog("kvconductor.fetcher")
        self.corrupt_reads = 0

    async def start(self) -> None:
        await self.client.bootstrap()
        await self.client.set_topics(list(self.modes))

    async def stop(self) -> None:
        for task in self._inflight.values():
            task.cancel()
        await asyncio.gather(*self._inflight.values(), return_exceptions=True)
        self._inflight.clear()
        for conn in self._conns.values():
            conn.close()
        self._conns.clear()
        await self.client.close()

    # ------------------------------------------------------------ positions

    def assign(self, positions: Mapping[TopicPartition, int]) -> None:
        """Partitions assigned, each at its position; aiokafka's fetcher is
        paused on them. A new generation (see the module doc)."""
        self._new_generation()
        assigned = self.consumer.assignment()
        for tp in list(self.parts):
            if tp not in assigned:
                del self.parts[tp]
        for tp, offset in positions.items():
            if tp in assigned:
                self.parts[tp] = _Partition(offset)
        if positions:
            self.consumer.pause(*[tp for tp in positions if tp in assigned])

    def revoke(self, tps: Collection[TopicPartition]) -> None:
        self._new_generation()
        for tp in tps:
            self.parts.pop(tp, None)
            self._out_of_range.pop(tp, None)

    def seek(self, tp: TopicPartition, offset: int) -> None:
        st = self.parts.get(tp)
        if st is None:
            return
        st.position = st.fetch_at = offset
        st.buffered.clear()
        self._out_of_range.pop(tp, None)

    def position(self, tp: TopicPartition) -> int | None:
        st = self.parts.get(tp)
        return None if st is None else st.position

    def highwater(self, tp: TopicPartition) -> int | None:
        st = self.parts.get(tp)
        return None if st is None else st.highwater

    def last_stable_offset(self, tp: TopicPartition) -> int | None:
        st = self.parts.get(tp)
        return None if st is None else st.lso

    def last_poll_timestamp(self, tp: TopicPartition) -> int | None:
        """When the partition's leader last answered, or now while records
        it returned wait to be taken: Kafka is not the one behind then (the
        fetches wait for the index, whose delay `behind_s` tells)."""
        st = self.parts.get(tp)
        if st is None:
            return None
        return int(time.time() * 1000) if st.buffered else st.answered_ms

    def _new_generation(self) -> None:
        self.generation += 1
        for st in self.parts.values():
            st.buffered.clear()
            st.fetch_at = st.position

    # --------------------------------------------------------------- fetching

    def ready(self) -> bool:
        """Whether records wait to be taken."""
        return any(st.buffered for st in self.parts.values())

    async def fill(self, timeout_ms: int) -> None:
        """Wait up to `timeout_ms` for records to take (fewer if some wait
        already). Raises OffsetOutOfRangeError ({partition: offset}) for
        positions retention deleted when the reset policy is none."""
        await self._keep_polled()
        self._raise_pending()
        await self._reset_positions()
        self._send()
        if not self.ready():
            tasks = list(self._inflight.values())
            if tasks:
                await asyncio.wait(tasks, timeout=timeout_ms / 1000)
            else:  # no leader known: wait for the metadata
                await asyncio.sleep(min(timeout_ms / 1000, self._backoff_s))
            self._send()
        self._raise_pending()

    def take(
        self,
        limit: int,
        floor: Mapping[TopicPartition, int],
        assigned: Collection[TopicPartition],
    ) -> NativeBatch | None:
        """Up to `limit` fetched records in produce order, each partition's
        from its position or `floor` (applied already) if higher, of
        partitions in `assigned` only; the next fetches go out at once, to
        run while these are applied."""
        tps: list[TopicPartition] = []
        parts: list[_kernel.Fetched] = []
        starts: list[int] = []
        for tp, st in self.parts.items():
            if not st.buffered or tp not in assigned:
                continue
            tps.append(tp)
            parts.append(st.buffered[0])  # a partition's next read only: its order holds
            starts.append(max(st.position, floor.get(tp, 0)))
        if not parts:
            return None
        merged = self._merge(parts, starts, limit)
        for p, after, _ in merged.through(0, len(merged)):
            self.parts[tps[p]].position = after
        for tp in tps:
            st = self.parts[tp]
            while st.buffered and st.buffered[0].remaining(st.position) == 0:
                st.position = max(st.position, st.buffered.popleft().next_offset)
        self._send()
        return NativeBatch(merged, tps) if len(merged) else None

    async def _keep_polled(self) -> None:
        # Paused everywhere, it has nothing to return; anything it fetched
        # before a pause landed is not ours to apply, nor its errors.
        with contextlib.suppress(NoOffsetForPartitionError, OffsetOutOfRangeError):
            await self.consumer.getmany(timeout_ms=0)

    def _raise_pending(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure
        if self._out_of_range and self._reset == "none":
            lost, self._out_of_range = self._out_of_range, {}
            raise OffsetOutOfRangeError(lost)

    async def _reset_positions(self) -> None:
        """The reset policy, for positions retention deleted."""
        if not self._out_of_range:
            return
        tps, self._out_of_range = list(self._out_of_range), {}
        generation = self.generation
        if self._reset == "earliest":
            ends = await self.consumer.beginning_offsets(tps)
        else:
            ends = await self.consumer.end_offsets(tps)
        if generation != self.generation:
            return  # a rebalance positioned them meanwhile
        for tp in tps:
            log.warning("fetch position out of range; reset", partition=str(tp), to=ends[tp])
            self.seek(tp, ends[tp])

    def _send(self) -> None:
        """A Fetch request to each leader with partitions to fetch and none
        in flight."""
        cluster = self.client.cluster
        by_node: dict[int, list[tuple[TopicPartition, int]]] = {}
        stale = False
        for tp, st in self.parts.items():
            if len(st.buffered) >= _Partition.AHEAD or tp in self._out_of_range:
                continue
            node = cluster.leader_for_partition(tp)
            if node is None or node < 0:
                stale = True
                continue
            if node not in self._inflight:
                by_node.setdefault(node, []).append((tp, st.fetch_at))
        if stale:
            self.client.force_metadata_update()
        for node, wanted in by_node.items():
            task = asyncio.create_task(self._fetch(node, wanted, self.generation))
            self._inflight[node] = task
            task.add_done_callback(self._landed)

    def _landed(self, task: asyncio.Task[None]) -> None:
        for node, t in list(self._inflight.items()):
            if t is task:
                del self._inflight[node]

    def _request(self, wanted: list[tuple[TopicPartition, int]]) -> FetchRequest:
        # Rotated: a broker fills a response's partitions in order, so the
        # first ones would take the whole fetch size every time.
        self._rotation += 1
        k = self._rotation % len(wanted)
        by_topic: dict[str, list[tuple[int, int, int]]] = {}
        for tp, offset in wanted[k:] + wanted[:k]:
            by_topic.setdefault(tp.topic, []).append((tp.partition, offset, self._partition_bytes))
        return FetchRequest(
            self._max_wait_ms,
            self._min_bytes,
            self._max_bytes,
            self._isolation,
            list(by_topic.items()),
        )

    async def _connect(self, node: int) -> FrameConnection:
        conn = self._conns.get(node)
        if conn is not None and conn.connected:
            return conn
        broker = self.client.cluster.broker_metadata(node)
        if broker is None:
            raise KafkaConnectionError(f"broker {node} not in the metadata")
        try:
            conn = await FrameConnection.open(broker.host, broker.port, **self._connection)
        except (OSError, TimeoutError) as exc:
            raise KafkaConnectionError(f"broker {node}: {exc}") from exc
        self._conns[node] = conn
        return conn

    async def _fetch(
        self, node: int, wanted: list[tuple[TopicPartition, int]], generation: int
    ) -> None:
        try:
            conn = await self._connect(node)
            # Read at once, its records copied out: its buffer can be the next's.
            version, frame = await conn.request(self._request(wanted), reuse=True)
            # The body, after the correlation id (a v0 response header).
            failed, answers = self._answer(frame, 4, version)
        except (KafkaError, ValueError) as exc:
            self.problems.warn(f"fetch:{node}", "fetch failed; retrying", node=node, error=str(exc))
            self.client.force_metadata_update()
            await asyncio.sleep(self._backoff_s)
            return
        if generation != self.generation:
            return  # sent before a rebalance
        if failed:  # a fetch session's error: the answer holds no partitions
            self.problems.warn(
                f"fetch-error:{failed}", "fetch refused; retrying", node=node, error_code=failed
            )
            await asyncio.sleep(self._backoff_s)
            return
        asked = dict(wanted)
        now_ms = int(time.time() * 1000)
        committed = self._isolation == 1
        retry = False
        for topic, partition, error_code, highwater, lso, aborted, start, end in answers:
            tp = TopicPartition(topic, partition)
            st = self.parts.get(tp)
            if st is None or st.fetch_at != asked.get(tp):
                continue  # sought elsewhere meanwhile
            error = kafka_errors.for_code(error_code)
            if error is kafka_errors.NoError:
                st.highwater = highwater
                st.answered_ms = now_ms
                st.lso = lso
                self._read(tp, st, frame[start:end], self.modes.get(topic), aborted, committed)
            elif issubclass(error, _METADATA_ERRORS):
                self.client.force_metadata_update()
                retry = True
            elif error is kafka_errors.OffsetOutOfRangeError:
                self._out_of_range[tp] = st.fetch_at
            elif error is TopicAuthorizationFailedError:
                self._failure = TopicAuthorizationFailedError(topic)
            else:
                self.problems.warn(
                    f"fetch-error:{error.__name__}",
                    "unexpected fetch error; retrying",
                    partition=str(tp),
                    error=error.__name__,
                )
                retry = True
        if retry:  # the node stays busy meanwhile: no request storm while metadata settles
            await asyncio.sleep(self._backoff_s)

    def _read(
        self,
        tp: TopicPartition,
        st: _Partition,
        data: memoryview,
        mode: bool | None,
        aborted: list[tuple[int, int]] | None,
        committed: bool,
    ) -> None:
        fetched = self.reader.read(data, st.fetch_at, mode, aborted, committed)
        if fetched.error is not None:
            # A batch that fails its CRC or does not parse is fetched again
            # (a network fault passes; the records before it are kept).
            self.corrupt_reads += 1
            self.problems.warn(
                f"corrupt:{tp}",
                "fetched record batch unreadable; fetching it again",
                partition=str(tp),
                offset=fetched.next_offset,
                error=fetched.error,
            )
        if len(fetched) or (st.buffered and fetched.next_offset > st.fetch_at):
            st.buffered.append(fetched)  # one past control or aborted batches only: in turn
        elif not st.buffered and fetched.next_offset > st.position:
            st.position = fetched.next_offset
        st.fetch_at = fetched.next_offset


def native_fetcher(consumer: AIOKafkaConsumer, kafka: KafkaConfig) -> NativeFetcher:
    """The daemon's fetcher for `consumer` (read_committed, no reset: the
    event consumer handles deleted positions), with a client of its own."""
    client_id = f"{kafka.client_id}-fetch"
    client = AIOKafkaClient(
        bootstrap_servers=kafka.bootstrap_servers,
        client_id=client_id,
        **kafka_service_options(kafka),
    )
    connection = {
        "client_id": client_id,
        "request_timeout_ms": kafka.request_timeout_ms,
        **kafka_client_options(kafka),
    }
    return NativeFetcher(
        consumer,
        client,
        {},
        isolation_level="read_committed",
        auto_offset_reset="none",
        connection=connection,
        **kafka_fetch_options(kafka),  # type: ignore[arg-type]
    )
