"""Restore time from the snapshot topic, on a real local broker.

The daemon's own pieces do the work: `SnapshotPublisher` writes one
generation of the index (one Kafka transaction, chunked units) to a
compacted topic created with the daemon's topic settings, and a fresh
process times `read_snapshot` (read_committed, from the beginning) plus
`snapshots.restore` into an empty index, then checks that the restored
index answers like the original.
"""

from __future__ import annotations

import asyncio
import contextlib
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient

from kvconductor.config import load_config
from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import Index
from kvconductor.kafka.topics import ensure_topics, topic_specs
from kvconductor.snapshots.store import SnapshotPublisher, read_snapshot
from kvconductor.snapshots.units import restore
from kvconductor.tools.kafka_local import broker as kafka_local

# The brokers `local_broker` runs, by bootstrap: their pids.
_local_pids: dict[str, int] = {}


@contextlib.contextmanager
def local_broker() -> Iterator[str]:
    """A fresh broker on free ports in a temporary folder, stopped at exit."""
    with tempfile.TemporaryDirectory(prefix="kvc-bench-kafka-") as tmp:
        data_dir = Path(tmp)
        port, controller = kafka_local.free_ports(2)
        bootstrap = kafka_local.start(data_dir, port=port, controller_port=controller)
        pid = kafka_local.running_pid(data_dir)
        if pid is not None:
            _local_pids[bootstrap] = pid
        try:
            yield bootstrap
        finally:
            _local_pids.pop(bootstrap, None)
            kafka_local.stop(data_dir)


def broker_pid(bootstrap: str) -> int | None:
    """The pid of the broker `local_broker` runs at `bootstrap` (None: a
    broker of someone else's, as --bootstrap gives)."""
    return _local_pids.get(bootstrap)


def new_topic() -> str:
    return f"kv-index-snapshots-bench-{uuid.uuid4().hex[:8]}"


async def _create_topic(bootstrap: str, topic: str) -> None:
    cfg = load_config(
        None,
        {
            "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "KVCONDUCTOR_KAFKA_SNAPSHOT_TOPIC": topic,
        },
    )
    specs = [s for s in topic_specs(cfg) if s.name == topic]
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await ensure_topics(admin, specs)
    finally:
        await admin.close()


async def _publish(conductor: Conductor, bootstrap: str, topic: str) -> dict[str, Any]:
    await _create_topic(bootstrap, topic)
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id="kvc-bench-snapshot",
        transactional_id=f"kvc-bench-{uuid.uuid4().hex[:8]}",
        enable_idempotence=True,
        max_request_size=2 * 1024 * 1024,
    )
    await producer.start()
    try:
        publisher = SnapshotPublisher(producer, topic, "kvc-bench")
        publisher.mark_all_dirty(conductor)
        stats = await publisher.publish(conductor, {})
    finally:
        await producer.stop()
    return {
        "publish_s": stats.seconds,
        "units": stats.units,
        "bytes": stats.bytes,
    }


def publish_snapshot(conductor: Conductor, bootstrap: str, topic: str) -> dict[str, Any]:
    """Publish the whole index as one generation; returns its size and time."""
    return asyncio.run(_publish(conductor, bootstrap, topic))


async def _read(bootstrap: str, topic: str) -> tuple[Any, float]:
    started = time.perf_counter()
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        enable_auto_commit=False,
        isolation_level="read_committed",
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=8 * 1024 * 1024,
    )
    await consumer.start()
    try:
        read = await read_snapshot(consumer, topic)
    finally:
        await consumer.stop()
    return read, time.perf_counter() - started


def restore_from_topic(bootstrap: str, topic: str) -> tuple[Index, dict[str, Any]]:
    """Read the topic and rebuild an index; returns it and the timings."""
    read, read_s = asyncio.run(_read(bootstrap, topic))
    started = time.perf_counter()
    index = Index()
    restore(index, read.units)
    restore_s = time.perf_counter() - started
    return index, {
        "read_s": read_s,
        "restore_s": restore_s,
        "total_s": read_s + restore_s,
        "records": read.records,
        "bytes": read.bytes,
        "skipped": read.skipped,
    }
