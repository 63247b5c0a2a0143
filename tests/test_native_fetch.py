"""The native fetch path (kvconductor/consumers/fetcher.py, kernel/core/src/kafka/record_batch.rs)
reads exactly what aiokafka reads: the same records (keys, values,
headers, offsets, timestamps) of the same partitions, for every codec the
bridge can produce with, with transactions committed and aborted."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.errors import KafkaConnectionError
from aiokafka.protocol.fetch import FetchRequest
from aiokafka.record.default_records import DefaultRecordBatch, DefaultRecordBatchBuilder

from kvconductor.consumers.fetcher import NativeFetcher, record_reader
from kvconductor.index.conductor import Conductor, Incoming
from kvconductor.kafka.frames import FrameConnection, _Frames
from kvconductor.kernel import KERNEL
from kvconductor.snapshots.units import state_fingerprint
from tests.harness import daemon_config, engine_headers, produce, read_all, running, wait_for
from tests.test_daemon_kafka import random_stream

if KERNEL is not None:
    from kvconductor import _kernel

pytestmark = pytest.mark.skipif(KERNEL is None, reason="needs the compiled kernel")

CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
_CODEC_BITS = {"none": 0, "gzip": 1, "snappy": 2, "lz4": 3, "zstd": 4}
PARTITIONS = 3

Row = tuple[Any, ...]  # partition, offset, timestamp, key, value, headers


def _records(n: int, tag: str) -> list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]]:
    """Keys, values and headers of every shape: none, empty, long, binary."""
    out: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes]]]] = []
    for i in range(n):
        key = None if i % 11 == 0 else f"{tag}-inst-{i % 7}".encode()
        value = (
            None
            if i % 13 == 5 and key is not None
            else bytes((i * 31 + j) % 256 for j in range(i % 50)) * (1 + (i % 3) * 40)
        )
        headers = [("kv-model", b"m"), ("kv-seq", str(i).encode())]
        if i % 4 == 0:
            headers.append(("kv-empty", b""))
        if i % 9 == 0:
            headers.append(("h\u00e9", bytes(range(256))))
        out.append((key, value, headers))
    return out


def _incoming_rows(fetched: Any, partition: int) -> list[Row]:
    rows = []
    for rec, offset, ts in zip(fetched.records, fetched.offsets, fetched.timestamps, strict=True):
        assert isinstance(rec, Incoming)
        assert rec.now == ts / 1000.0
        rows.append((partition, offset, ts, rec.key, rec.value, tuple(rec.headers)))
    return rows


@pytest.mark.parametrize("codec", CODECS)
def test_reader_reads_aiokafkas_batches(codec: str) -> None:
    """Batches built by aiokafka's own builder, read back by both."""
    data = bytearray()
    base = 0
    for batch_no in range(4):
        builder = DefaultRecordBatchBuilder(
            magic=2,
            compression_type=_CODEC_BITS[codec],
            is_transactional=False,
            producer_id=-1,
            producer_epoch=-1,
            base_sequence=-1,
            batch_size=1 << 20,
        )
        for i, (key, value, headers) in enumerate(_records(20 + batch_no, f"b{batch_no}")):
            builder.append(
                i, timestamp=1_700_000_000_000 + i * 3, key=key, value=value, headers=headers
            )
        built = bytearray(builder.build())
        built[0:8] = base.to_bytes(8, "big", signed=True)
        base += 20 + batch_no
        data += built
    want: list[Row] = []
    pos = 0
    while pos < len(data):
        size = 12 + int.from_bytes(data[pos + 8 : pos + 12], "big")
        batch = DefaultRecordBatch(bytes(data[pos : pos + size]))
        assert batch.validate_crc()
        for r in batch:
            want.append((0, r.offset, r.timestamp, r.key, r.value, tuple(r.headers)))
        pos += size
    reader = record_reader()
    got = reader.read(bytes(data), 0, False)
    assert got.error is None
    assert _incoming_rows(got, 0) == want
    assert got.next_offset == base
    # From the middle of a batch, and with the last batch cut short.
    part = reader.read(bytes(data[:-7]), 5, True)
    assert _incoming_rows(part, 0) == [w for w in want if 5 <= w[1] < base - 23]
    assert all(rec.pool for rec in part.records)


async def _topic(bootstrap: str) -> str:
    name = f"native-fetch-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, PARTITIONS, 1)])
    finally:
        await admin.close()
    return name


async def _produce(bootstrap: str, topic: str, codec: str) -> None:
    """Plain records, then a committed and an aborted transaction, then more."""
    compression = None if codec == "none" else codec
    plain = AIOKafkaProducer(bootstrap_servers=bootstrap, compression_type=compression, linger_ms=5)
    txn = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        compression_type=compression,
        transactional_id=f"{topic}-txn",
        enable_idempotence=True,
    )
    await plain.start()
    await txn.start()
    try:
        recs = _records(300, codec)
        futures = [
            await plain.send(topic, v, key=k, headers=h, partition=i % PARTITIONS)
            for i, (k, v, h) in enumerate(recs[:150])
        ]
        await asyncio.gather(*futures)
        async with txn.transaction():
            for i, (k, v, h) in enumerate(recs[150:200]):
                await txn.send(topic, v, key=k, headers=h, partition=i % PARTITIONS)
        await txn.begin_transaction()
        for i, (k, v, h) in enumerate(recs[200:250]):
            await txn.send(
                topic, b"aborted:" + (v or b""), key=k, headers=h, partition=i % PARTITIONS
            )
        await txn.abort_transaction()
        futures = [
            await plain.send(topic, v, key=k, headers=h, partition=i % PARTITIONS)
            for i, (k, v, h) in enumerate(recs[250:])
        ]
        await asyncio.gather(*futures)
    finally:
        await txn.stop()
        await plain.stop()


async def _aiokafka_rows(bootstrap: str, topic: str, isolation: str) -> list[Row]:
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap, isolation_level=isolation, enable_auto_commit=False
    )
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        rows: list[Row] = []
        deadline = time.monotonic() + 30
        while any([await consumer.position(tp) < ends[tp] for tp in tps]):
            assert time.monotonic() < deadline, "aiokafka did not reach the end"
            for tp, recs in (await consumer.getmany(timeout_ms=200)).items():
                rows += [
                    (tp.partition, r.offset, r.timestamp, r.key, r.value, tuple(r.headers))
                    for r in recs
                ]
        return sorted(rows)
    finally:
        await consumer.stop()


async def _native_rows(
    bootstrap: str, topic: str, isolation: str, limit: int
) -> tuple[list[Row], list[int]]:
    """Every record through the native fetcher, and the merged order's
    timestamps (produce order: never decreasing across partitions here)."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    client = AIOKafkaClient(bootstrap_servers=bootstrap, client_id="native-test")
    fetcher = NativeFetcher(
        consumer,
        client,
        {topic: False},
        isolation_level=isolation,
        fetch_max_wait_ms=100,
        # Small: many fetches, batches cut short at the end of an answer.
        max_partition_fetch_bytes=8192,
    )
    await fetcher.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        ends = await consumer.end_offsets(tps)
        fetcher.assign({tp: 0 for tp in tps})
        rows: list[Row] = []
        stamps: list[int] = []
        deadline = time.monotonic() + 30
        while any((fetcher.position(tp) or 0) < ends[tp] for tp in tps):
            assert time.monotonic() < deadline, "the native fetcher did not reach the end"
            await fetcher.fill(200)
            batch = fetcher.take(limit, {}, set(tps))
            if batch is None:
                continue
            for i in range(len(batch)):
                rec = batch.record(i)
                rows.append(
                    (rec.partition, rec.offset, rec.timestamp, rec.key, rec.value, rec.headers)
                )
                stamps.append(rec.timestamp)
            for tp, after, _ in batch.applied(0, len(batch)):
                assert after == fetcher.position(tp) or fetcher.position(tp) is not None
        assert consumer.paused() == set(tps)
        return sorted(rows), stamps
    finally:
        await fetcher.stop()
        await consumer.stop()


@pytest.mark.kafka
@pytest.mark.parametrize("codec", CODECS)
def test_native_fetch_equals_aiokafka(kafka_bootstrap: str, codec: str) -> None:
    async def main() -> None:
        topic = await _topic(kafka_bootstrap)
        await _produce(kafka_bootstrap, topic, codec)
        for isolation in ("read_committed", "read_uncommitted"):
            want = await _aiokafka_rows(kafka_bootstrap, topic, isolation)
            got, _ = await _native_rows(kafka_bootstrap, topic, isolation, 10_000)
            assert got == want, isolation
            aborted = [r for r in want if (r[4] or b"").startswith(b"aborted:")]
            assert len(aborted) == (0 if isolation == "read_committed" else 50)
            assert len(want) == 250 + len(aborted)
        # Handed out a few at a time: nothing lost or repeated.
        got, _ = await _native_rows(kafka_bootstrap, topic, "read_committed", 7)
        assert got == await _aiokafka_rows(kafka_bootstrap, topic, "read_committed")

    asyncio.run(main())


@pytest.mark.kafka
async def test_the_daemon_on_the_native_path(kafka_bootstrap: str) -> None:
    """Compressed and transactional input, a poison record: the daemon on
    the native path ends where an in-process index does, the poison
    record dead-lettered; aiokafka's fetcher stays paused throughout."""
    cfg = daemon_config(kafka_bootstrap, KVCONDUCTOR_KAFKA_FETCH_PATH="native")
    engine, pool = random_stream(11, 200)
    oracle = Conductor()
    for key, value, headers in engine:
        oracle.ingest_engine_record(key, headers, value, 1.0)
    for key, value, headers in pool:
        oracle.ingest_pool_record(key, headers, value, 1.0)
    async with running(cfg) as daemon:
        await wait_for(lambda: daemon.status == "running", 30, "consuming")
        events = daemon.events
        assert events is not None and events.fetcher is not None
        producer = AIOKafkaProducer(
            bootstrap_servers=kafka_bootstrap,
            compression_type="lz4",
            transactional_id=f"native-{uuid.uuid4().hex[:8]}",
            enable_idempotence=True,
        )
        await producer.start()
        try:
            async with producer.transaction():
                for key, value, headers in engine[:100]:
                    await producer.send(
                        cfg.kafka.engine_topic, value, key=key.encode(), headers=headers
                    )
            await producer.begin_transaction()
            await producer.send(
                cfg.kafka.engine_topic, b"\xc1aborted", key=b"a", headers=engine_headers()
            )
            await producer.abort_transaction()
        finally:
            await producer.stop()
        await produce(
            kafka_bootstrap, cfg.kafka.engine_topic, [("a", b"\xc1garbage", engine_headers())]
        )
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine[100:])
        await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool)

        def converged() -> bool:
            return state_fingerprint(daemon.conductor.snapshot_state()) == state_fingerprint(
                oracle.snapshot_state()
            )

        await wait_for(converged, 60, "the in-process index's state")
        assert events.consumer.paused() == events.consumer.assignment()
        dead: list[Any] = []

        async def one_dead_letter() -> bool:
            dead[:] = await read_all(kafka_bootstrap, cfg.kafka.dead_letter_topic)
            return len(dead) >= 1

        await wait_for(one_dead_letter, 60, "the poison record dead-lettered")
        await wait_for(lambda: daemon.ready()[0], 60, "caught up")
    assert len(dead) == 1
    h = dict(dead[0].headers)
    assert h["dlq-kind"] == b"undecodable"
    assert h["dlq-source-topic"].decode() == cfg.kafka.engine_topic
    assert dead[0].key == b"a" and dead[0].value == b"\xc1garbage"


class _Owner:
    """What a `_Frames` hands its frames to (a `FrameConnection`'s part)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.closed: list[Exception | None] = []

    def _buffer_for(self, size: int) -> memoryview:
        return memoryview(bytearray(size))

    def _on_frame(self, frame: memoryview) -> None:
        self.frames.append(bytes(frame))

    def close(self, why: Exception | None = None) -> None:
        self.closed.append(why)


@pytest.mark.parametrize("chunk", [1, 3, 4, 5, 7, 1 << 20])
def test_frames_split_across_reads_arrive_whole(chunk: int) -> None:
    """However the socket's bytes come (the transport reads at most what
    `get_buffer` offers), each frame is handed over once, whole, in order."""
    frames = [b"\x00\x00\x00\x01" + bytes(range(256)) * 40, b"", b"\x00\x00\x00\x02ab", b"x" * 9]
    wire = b"".join(len(f).to_bytes(4, "big") + f for f in frames)
    owner = _Owner()
    proto = _Frames(owner)  # type: ignore[arg-type]
    at = 0
    while at < len(wire):
        buf = proto.get_buffer(-1)
        n = min(chunk, len(buf), len(wire) - at)
        buf[:n] = wire[at : at + n]
        proto.buffer_updated(n)
        at += n
    assert owner.frames == frames
    proto.buffer_updated(0)  # a read of nothing changes nothing
    assert owner.frames == frames and not owner.closed
    buf = proto.get_buffer(-1)
    buf[:4] = (-5).to_bytes(4, "big", signed=True)
    proto.buffer_updated(4)
    assert len(owner.closed) == 1  # a negative size: the connection is out of step


async def _fill_to_end(fetcher: NativeFetcher, tps: list[TopicPartition], rows: list[Row]) -> None:
    ends = await fetcher.consumer.end_offsets(tps)
    deadline = time.monotonic() + 30
    while any((fetcher.position(tp) or 0) < ends[tp] for tp in tps):
        assert time.monotonic() < deadline, "the native fetcher did not reach the end"
        await fetcher.fill(200)
        batch = fetcher.take(10_000, {}, set(tps))
        for i in range(len(batch) if batch is not None else 0):
            assert batch is not None
            rec = batch.record(i)
            rows.append((rec.partition, rec.offset, rec.timestamp, rec.key, rec.value, rec.headers))


async def _started_fetcher(
    bootstrap: str, topic: str, **options: Any
) -> tuple[NativeFetcher, list[TopicPartition]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    client = AIOKafkaClient(bootstrap_servers=bootstrap, client_id="native-test")
    fetcher = NativeFetcher(consumer, client, {topic: False}, fetch_max_wait_ms=100, **options)
    await fetcher.start()
    tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
    consumer.assign(tps)
    fetcher.assign({tp: 0 for tp in tps})
    return fetcher, tps


@pytest.mark.kafka
async def test_batches_past_the_fetch_size_and_dropped_connections(kafka_bootstrap: str) -> None:
    """A batch larger than the partition fetch size comes whole (the broker
    sends a partition's first batch whatever its size), answers cut short
    mid-batch are fetched on from the cut, and a connection the broker
    drops is opened again: every record once, in order."""
    topic = await _topic(kafka_bootstrap)
    big = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, linger_ms=50, max_batch_size=512 * 1024
    )
    await big.start()
    try:
        sent = [
            await big.send(topic, bytes([i % 251]) * 20_000, key=b"k", partition=i % PARTITIONS)
            for i in range(60)
        ]
        await asyncio.gather(*sent)
    finally:
        await big.stop()
    want = await _aiokafka_rows(kafka_bootstrap, topic, "read_committed")
    fetcher, tps = await _started_fetcher(
        kafka_bootstrap, topic, max_partition_fetch_bytes=4096, fetch_max_bytes=64 * 1024
    )
    try:
        rows: list[Row] = []
        await fetcher.fill(2000)
        assert fetcher.ready()
        for conn in fetcher._conns.values():
            conn._transport.abort()  # as a broker going away does
        await _fill_to_end(fetcher, tps, rows)
        assert sorted(rows) == want
        assert fetcher.corrupt_reads == 0
    finally:
        await fetcher.stop()
        await fetcher.consumer.stop()


@pytest.mark.kafka
async def test_a_deleted_topic_is_a_leader_error_not_a_crash(kafka_bootstrap: str) -> None:
    """Partitions whose leader answers UNKNOWN_TOPIC_OR_PARTITION (a topic
    deleted under the daemon) are looked up again and fetched on at their
    positions, without an error out of `fill`."""
    topic = await _topic(kafka_bootstrap)
    await _produce(kafka_bootstrap, topic, "none")
    fetcher, tps = await _started_fetcher(kafka_bootstrap, topic)
    try:
        rows: list[Row] = []
        await _fill_to_end(fetcher, tps, rows)
        positions = {tp: fetcher.position(tp) for tp in tps}
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
        await admin.start()
        try:
            await admin.delete_topics([topic])
        finally:
            await admin.close()
        for _ in range(10):
            await fetcher.fill(200)
            assert fetcher.take(10_000, {}, set(tps)) is None
        assert {tp: fetcher.position(tp) for tp in tps} == positions
    finally:
        await fetcher.stop()
        await fetcher.consumer.stop()


@pytest.mark.kafka
async def test_a_frame_connection_answers_in_order(kafka_bootstrap: str) -> None:
    """Requests sent back to back on one connection are answered each by
    its own frame; closed, a connection fails what it still owes."""
    host, port = kafka_bootstrap.rsplit(":", 1)
    conn = await FrameConnection.open(host, int(port), client_id="frames-test")
    try:
        topics = [f"no-such-topic-{i}" for i in range(3)]
        answers = await asyncio.gather(
            *[conn.request(FetchRequest(10, 1, 1024, 1, [(t, [(0, 0, 1024)])])) for t in topics]
        )
        for topic, (version, frame) in zip(topics, answers, strict=True):
            failed, parts = _kernel.fetch_response(frame, 4, version)
            assert failed == 0
            assert [(p[0], p[1], p[2]) for p in parts] == [(topic, 0, 3)]  # unknown partition
        # One after the other, `reuse`: each answer read into the last one's buffer.
        kept = []
        for topic in topics:
            version, frame = await conn.request(
                FetchRequest(10, 1, 1024, 1, [(topic, [(0, 0, 1024)])]), reuse=True
            )
            assert _kernel.fetch_response(frame, 4, version)[1][0][0] == topic
            kept.append(frame.obj)
        assert kept[0] is kept[1] is kept[2]
        assert all(a[1].obj is not kept[0] for a in answers)
        # Past a partition's end: the broker holds the fetch for its max wait.
        quiet = await _topic(kafka_bootstrap)
        await produce(kafka_bootstrap, quiet, [("k", b"v", [])])
        consumer = AIOKafkaConsumer(bootstrap_servers=kafka_bootstrap)
        await consumer.start()
        try:
            tps = [TopicPartition(quiet, p) for p in range(PARTITIONS)]
            ends = [
                (tp.partition, end, 1024) for tp, end in (await consumer.end_offsets(tps)).items()
            ]
        finally:
            await consumer.stop()
        pending = asyncio.ensure_future(
            conn.request(FetchRequest(5000, 1 << 20, 1 << 21, 1, [(quiet, ends)]))
        )
        await asyncio.sleep(0.05)
        conn.close()
        with pytest.raises(KafkaConnectionError):
            await pending
        assert not conn.connected
    finally:
        conn.close()
