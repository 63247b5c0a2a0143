"""The Kafka side: every stream buffer drained in order by one idempotent producer.

One `AIOKafkaProducer` (`acks="all"`, `enable_idempotence=True`) serves all
streams. A pump task per stream sends its records one after the other to the
partition of the stream's key (Kafka's default partitioner, computed here so
the bridge knows where each record goes); a record leaves the buffer only
when Kafka acknowledges it. The idempotent producer keeps a partition's
records in order and retries transient errors (a broker that is down, a
leader that moves) without duplicating them, so a broker outage only makes
the buffer grow: when it is full, the streams stop reading (see `buffer`).

If the producer fails for good (a batch expired, a fatal sequence error),
nothing it held can be trusted to be written or not. The sink then stops
it, starts a new one (retrying until the broker answers), reads each
affected partition back from the last offset it knows was written by this
bridge (`marks`: the last acknowledged offset, or the partition's end before
the first send), drops the buffered records that are already there (same
key, value and headers, in order) and sends the rest. So even a failed
producer causes neither loss nor duplicates.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError, KafkaTimeoutError, MessageSizeTooLargeError

from kvconductor.bridge.buffer import Budget, StreamBuffer
from kvconductor.bridge.config import BridgeConfig
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.bridge.records import Entry
from kvconductor.config import kafka_service_options
from kvconductor.kafka.clients import retire
from kvconductor.kafka.partitioner import default_partition
from kvconductor.registry.publishers import StreamKey

log = structlog.get_logger("kvconductor.bridge.sink")

CALL_TIMEOUT_S = 15.0
STOP_TIMEOUT_S = 5.0
# Kafka counts as unavailable when a record waits this long for its ack.
STALL_S = 5.0


async def abandon_producer(producer: Any) -> None:
    """Stop a producer without waiting for records it can no longer deliver.

    `AIOKafkaProducer.stop()` first flushes, which never ends while the
    broker is away, so its undelivered batches are failed first (aiokafka
    has no public call for that: this uses its accumulator's `fail_all`)."""
    if producer is None:
        return
    accumulator = getattr(producer, "_message_accumulator", None)
    if accumulator is not None:
        with contextlib.suppress(Exception):
            accumulator.fail_all(KafkaError("producer abandoned by the bridge"))
    await retire(producer, STOP_TIMEOUT_S * 6)


class Sink:
    def __init__(self, cfg: BridgeConfig, metrics: BridgeMetrics, budget: Budget) -> None:
        self.cfg = cfg
        self.metrics = metrics
        self.budget = budget
        self.buffers: dict[StreamKey, StreamBuffer] = {}
        self.pumps: dict[StreamKey, asyncio.Task[None]] = {}
        self.producer: Any = None
        self.reader: Any = None
        self.generation = 0
        self.ready = asyncio.Event()
        self.marks: dict[TopicPartition, int] = {}
        self.partitions: dict[StreamKey, TopicPartition] = {}
        self.recovering: asyncio.Task[None] | None = None
        self.on_too_large: Callable[[StreamBuffer, Entry], Entry] | None = None
        self._stopped = False

    # ------------------------------------------------------------ clients

    def _new_producer(self) -> Any:
        k, b = self.cfg.kafka, self.cfg.bridge
        return AIOKafkaProducer(
            bootstrap_servers=k.bootstrap_servers,
            client_id=b.client_id,
            acks="all",
            enable_idempotence=True,
            linger_ms=b.linger_ms,
            max_request_size=b.max_request_size,
            max_batch_size=b.batch_size,
            compression_type=None if b.compression_type == "none" else b.compression_type,
            **kafka_service_options(k),
        )

    def _new_reader(self) -> Any:
        k, b = self.cfg.kafka, self.cfg.bridge
        return AIOKafkaConsumer(
            bootstrap_servers=k.bootstrap_servers,
            client_id=f"{b.client_id}-reader",
            group_id=None,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            fetch_max_wait_ms=100,
            max_partition_fetch_bytes=max(4 * 1024 * 1024, b.max_request_size),
            **kafka_service_options(k),
        )

    async def _start_clients(self) -> tuple[Any, Any]:
        producer = self._new_producer()
        reader = self._new_reader()
        try:
            await asyncio.wait_for(producer.start(), CALL_TIMEOUT_S)
            await asyncio.wait_for(reader.start(), CALL_TIMEOUT_S)
        except BaseException:
            await abandon_producer(producer)
            with contextlib.suppress(Exception):
                await reader.stop()
            raise
        return producer, reader

    async def start(self) -> None:
        """Start the producer; raises KafkaError/OSError/TimeoutError when Kafka is away."""
        self.producer, self.reader = await self._start_clients()
        self.ready.set()
        self.metrics.kafka_up.set(1)

    async def stop(self) -> None:
        self._stopped = True
        self.ready.clear()
        tasks = [*self.pumps.values()]
        if self.recovering is not None:
            tasks.append(self.recovering)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self.pumps.clear()
        producer, self.producer = self.producer, None
        if producer is not None:
            with contextlib.suppress(TimeoutError, KafkaError):
                await asyncio.wait_for(producer.flush(), STOP_TIMEOUT_S)
            await abandon_producer(producer)
        if self.reader is not None:
            with contextlib.suppress(Exception):
                await self.reader.stop()
            self.reader = None

    # ------------------------------------------------------------ streams

    def add(self, buffer: StreamBuffer) -> None:
        self.buffers[buffer.key] = buffer
        self.pumps[buffer.key] = asyncio.get_running_loop().create_task(
            self._pump(buffer), name=f"bridge-pump-{buffer.key}"
        )

    async def remove(self, key: StreamKey) -> None:
        task = self.pumps.pop(key, None)
        buffer = self.buffers.pop(key, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if buffer is not None:
            buffer.drop_all()
            self._gauges()

    def waiting_s(self) -> float:
        """Age of the oldest record handed to the producer and not yet acknowledged."""
        now = time.monotonic()
        ages = [now - b.entries[0].enqueued for b in self.buffers.values() if b.sent > 0]
        return max(ages, default=0.0)

    @property
    def delivering(self) -> bool:
        """The producer is up and its oldest record is not stuck."""
        return self.ready.is_set() and self.waiting_s() < STALL_S

    def update_gauges(self) -> None:
        self._gauges()
        self.metrics.kafka_up.set(1 if self.delivering else 0)

    def _gauges(self) -> None:
        self.metrics.buffer_messages.set(self.budget.messages)
        self.metrics.buffer_bytes.set(self.budget.bytes)
        self.metrics.backpressure_seconds.set(self.budget.waited_s)

    # --------------------------------------------------------------- pump

    async def _partition(self, producer: Any, buffer: StreamBuffer) -> TopicPartition:
        tp = self.partitions.get(buffer.key)
        if tp is None:
            parts = await asyncio.wait_for(producer.partitions_for(buffer.topic), CALL_TIMEOUT_S)
            key = buffer.entries[0].key
            tp = TopicPartition(buffer.topic, default_partition(key, len(parts)))
            self.partitions[buffer.key] = tp
        if tp not in self.marks:
            # Nothing of this bridge run was written to tp before its end now.
            ends = await asyncio.wait_for(self.reader.end_offsets([tp]), CALL_TIMEOUT_S)
            self.marks.setdefault(tp, ends[tp])
        return tp

    async def _pump(self, buffer: StreamBuffer) -> None:
        while True:
            await self.ready.wait()
            producer = self.producer
            if buffer.sent >= len(buffer.entries) or producer is None:
                buffer.changed.clear()
                if buffer.sent >= len(buffer.entries):
                    await buffer.changed.wait()
                continue
            gen = self.generation
            try:
                tp = await self._partition(producer, buffer)
            except (KafkaError, OSError, TimeoutError) as exc:
                self._fail(gen, exc)
                continue
            if gen != self.generation:
                continue
            index = buffer.sent
            entry = buffer.entries[index]
            buffer.sent += 1
            try:
                fut = await producer.send(
                    tp.topic,
                    value=entry.value,
                    key=entry.key,
                    headers=entry.headers,
                    partition=tp.partition,
                )
            except MessageSizeTooLargeError:
                if gen == self.generation:
                    buffer.sent -= 1
                    self._too_large(buffer, index)
                continue
            except KafkaTimeoutError:
                # Not appended (the batch ahead could not drain): try again.
                if gen == self.generation:
                    buffer.sent -= 1
                continue
            except (KafkaError, OSError) as exc:
                self._fail(gen, exc)
                continue
            if gen != self.generation:
                continue
            fut.add_done_callback(functools.partial(self._delivered, buffer, entry, gen, tp))

    def _too_large(self, buffer: StreamBuffer, index: int) -> None:
        entry = buffer.entries[index]
        log.error(
            "record too large for Kafka: replaced by a resync record",
            stream=str(buffer.key),
            seq=entry.seq,
            bytes=len(entry.value),
            max_request_size=self.cfg.bridge.max_request_size,
        )
        if self.on_too_large is not None:
            buffer.replace_unsent(index, self.on_too_large(buffer, entry))

    def _delivered(
        self, buffer: StreamBuffer, entry: Entry, gen: int, tp: TopicPartition, fut: Any
    ) -> None:
        if gen != self.generation:
            return  # a recovery decides about this record
        if fut.cancelled():
            self._fail(gen, KafkaError("delivery cancelled"))
            return
        exc = fut.exception()
        if exc is not None:
            if isinstance(exc, MessageSizeTooLargeError):
                entry.too_large = True
            self._fail(gen, exc)
            return
        meta = fut.result()
        if not buffer.pop_acked(entry):
            return
        offset = getattr(meta, "offset", None)
        if isinstance(offset, int) and offset >= 0:
            self.marks[tp] = max(self.marks.get(tp, 0), offset + 1)
        self._count_relayed(buffer, entry)

    def _count_relayed(self, buffer: StreamBuffer, entry: Entry) -> None:
        labels = (buffer.key.id, str(buffer.key.rank))
        if not entry.control:
            self.metrics.messages.labels(*labels).inc()
            self.metrics.bytes.labels(*labels).inc(len(entry.value))
        self.metrics.produce_latency.observe(time.monotonic() - entry.enqueued)
        self._gauges()

    # ----------------------------------------------------------- recovery

    def _fail(self, gen: int, exc: BaseException) -> None:
        if gen != self.generation or self._stopped:
            return
        self.generation += 1
        self.ready.clear()
        self.metrics.kafka_up.set(0)
        log.warning("producer failed; recovering", error=repr(exc))
        self.recovering = asyncio.get_running_loop().create_task(self._recover())

    async def _recover(self) -> None:
        self.metrics.recoveries.inc()
        old, self.producer = self.producer, None
        old_reader, self.reader = self.reader, None
        await abandon_producer(old)
        if old_reader is not None:
            with contextlib.suppress(Exception):
                await old_reader.stop()
        delay = 0.5
        while True:
            try:
                producer, reader = await self._start_clients()
            except (KafkaError, OSError, TimeoutError) as exc:
                log.warning("kafka unavailable; retrying", error=repr(exc), retry_in_s=delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            self.reader = reader
            try:
                confirmed = await self._read_back()
            except (KafkaError, OSError, TimeoutError) as exc:
                log.warning("read-back failed; retrying", error=repr(exc), retry_in_s=delay)
                self.reader = None
                await abandon_producer(producer)
                with contextlib.suppress(Exception):
                    await reader.stop()
                await asyncio.sleep(delay)
                delay = min(delay * 2, 10.0)
                continue
            break
        total = 0
        for buffer in self.buffers.values():
            n = confirmed.get(buffer.key, 0)
            for _ in range(n):
                entry = buffer.entries[0]
                buffer.pop_acked(entry)
                self._count_relayed(buffer, entry)
            total += n
            buffer.sent = 0
            for i, entry in enumerate(buffer.entries):
                if entry.too_large:
                    self._too_large(buffer, i)
        self.metrics.recovered_confirmed.inc(total)
        log.info("producer recovered", confirmed_on_kafka=total)
        self.producer = producer
        self.recovering = None
        self.metrics.kafka_up.set(1)
        self.ready.set()

    async def _read_back(self) -> dict[StreamKey, int]:
        """How many of each stream's sent-but-unacknowledged records are on Kafka."""
        pending: dict[StreamKey, list[Entry]] = {}
        for key, buffer in self.buffers.items():
            if buffer.sent > 0 and key in self.partitions:
                pending[key] = list(buffer.entries)[: buffer.sent]
        if not pending:
            return {}
        by_tp: dict[TopicPartition, list[StreamKey]] = {}
        for key in pending:
            by_tp.setdefault(self.partitions[key], []).append(key)
        tps = list(by_tp)
        reader = self.reader
        ends = await asyncio.wait_for(reader.end_offsets(tps), CALL_TIMEOUT_S)
        todo = [tp for tp in tps if self.marks.get(tp, 0) < ends[tp]]
        matched: dict[StreamKey, int] = dict.fromkeys(pending, 0)
        if todo:
            reader.assign(todo)
            for tp in todo:
                reader.seek(tp, self.marks.get(tp, 0))
            deadline = time.monotonic() + CALL_TIMEOUT_S * 4
            while True:
                positions = {tp: await reader.position(tp) for tp in todo}
                if all(positions[tp] >= ends[tp] for tp in todo):
                    break
                if time.monotonic() > deadline:
                    raise KafkaTimeoutError("read-back did not reach the partitions' end")
                batch = await reader.getmany(*todo, timeout_ms=500)
                for tp, records in batch.items():
                    for record in records:
                        if record.offset >= ends[tp]:
                            continue
                        self._match(record, by_tp[tp], pending, matched)
            reader.assign([])
        for tp in tps:
            self.marks[tp] = max(self.marks.get(tp, 0), ends[tp])
        return {k: n for k, n in matched.items() if n}

    @staticmethod
    def _match(
        record: Any,
        keys: list[StreamKey],
        pending: dict[StreamKey, list[Entry]],
        matched: dict[StreamKey, int],
    ) -> None:
        headers = [(name, bytes(value)) for name, value in record.headers or ()]
        for key in keys:
            entries = pending[key]
            i = matched[key]
            if i >= len(entries):
                continue
            entry = entries[i]
            if record.key == entry.key and record.value == entry.value and headers == entry.headers:
                matched[key] = i + 1
                return
