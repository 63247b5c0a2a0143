"""Log compaction really keeps the snapshot topic at about one record per unit.

The snapshot topic is created with small segments and an eager cleaner
(`segment.ms` 1 s, `min.cleanable.dirty.ratio` 0.01, `segment.bytes` 1 MiB,
the minimum in Kafka 4.x, `delete.retention.ms` 100 ms so tombstones go too;
the test broker runs the cleaner every second, `log.cleaner.backoff.ms=1000`).
The daemon publishes many generations; afterwards the topic, read from the
beginning, holds one record per live unit (chunk) plus the few of the last
generation in the active segment, far fewer than were written, and both a
replica and a restarted daemon restore the exact state.
"""

from __future__ import annotations

import asyncio
import time

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvconductor.config import Config
from kvconductor.service.replica import Replica
from kvconductor.snapshots.units import state_fingerprint
from tests.harness import daemon_config, engine_headers, pool_payload, produce, running, wait_for
from tests.streams import end_offsets, fingerprint_diff, mixed_stream, oracle

pytestmark = pytest.mark.kafka

SNAPSHOT_TOPIC_CONFIGS = {
    "cleanup.policy": "compact",
    "segment.ms": "1000",
    "segment.bytes": str(1024 * 1024),
    "min.cleanable.dirty.ratio": "0.01",
    "delete.retention.ms": "100",
    "min.compaction.lag.ms": "0",
}


async def count_records(bootstrap: str, topic: str) -> tuple[int, int, int]:
    """(records, tombstones, end offset) of a one-partition topic, read from
    the beginning with read_committed (transaction markers are not records)."""
    tp = TopicPartition(topic, 0)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        isolation_level="read_committed",
        fetch_max_wait_ms=50,
    )
    await consumer.start()
    records = tombstones = 0
    try:
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        end = (await consumer.end_offsets([tp]))[tp]
        while await consumer.position(tp) < end:
            batch = await consumer.getmany(tp, timeout_ms=500)
            for r in batch.get(tp, []):
                if r.offset < end:
                    records += 1
                    tombstones += r.value is None
    finally:
        await consumer.stop()
    return records, tombstones, end


async def test_compaction_keeps_about_one_record_per_live_unit(kafka_bootstrap: str) -> None:
    cfg: Config = daemon_config(kafka_bootstrap, KVCONDUCTOR_SNAPSHOT_INTERVAL_S="0.2")
    k = cfg.kafka
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        topic = NewTopic(k.snapshot_topic, 1, 1, topic_configs=SNAPSHOT_TOPIC_CONFIGS)
        await admin.create_topics([topic])
    finally:
        await admin.close()
    engine, pool = mixed_stream(31, 4000)
    want = state_fingerprint(oracle(engine, pool).snapshot_state())
    # A pool removal of a backend that holds nothing: the offsets move (a tiny
    # generation follows, which rolls the previous segment so the cleaner can
    # take it) and the state does not.
    nudge = ("nobody", pool_payload([{"event_type": "removed", "seq_hashes": [1]}]))
    slices = 40
    async with running(cfg) as daemon:
        for s in range(slices):
            lo_e, hi_e = len(engine) * s // slices, len(engine) * (s + 1) // slices
            lo_p, hi_p = len(pool) * s // slices, len(pool) * (s + 1) // slices
            await produce(kafka_bootstrap, k.engine_topic, engine[lo_e:hi_e])
            await produce(kafka_bootstrap, k.pool_topic, pool[lo_p:hi_p])
            await asyncio.sleep(0.25)
        ends = await end_offsets(kafka_bootstrap, [k.engine_topic, k.pool_topic])
        await wait_for(
            lambda: (
                daemon.events is not None
                and all(daemon._last_published.get(tp) == o for tp, o in ends.items())
            ),
            60,
            "everything applied and published",
        )
        assert fingerprint_diff(state_fingerprint(daemon.conductor.snapshot_state()), want) == []
        assert daemon.publisher is not None
        generations = daemon.publisher.generation
        live = sum(daemon.publisher.published.values())
        # The cleaner is asynchronous; on a loaded machine it can lag minutes.
        deadline = time.monotonic() + 180
        while True:
            records, tombstones, written = await count_records(kafka_bootstrap, k.snapshot_topic)
            # The active segment is never cleaned: it keeps the last
            # generation's records (its generation records, one per source
            # partition: 6 here) besides their older copies.
            if records <= live + 10 or time.monotonic() > deadline:
                break
            await produce(kafka_bootstrap, k.pool_topic, [(nudge[0], nudge[1], engine_headers())])
            # Longer than segment.ms: each nudge's generation then rolls the
            # previous segment, so the active one holds one generation only
            # (two could exceed the slack above and never clean).
            await asyncio.sleep(2.5)
        print(
            f"\n{generations} generations, {written} offsets written, {live} live unit "
            f"records; after compaction {records} records ({tombstones} tombstones)"
        )
        assert generations >= 30
        assert written >= 5 * live, "too little was written for compaction to show"
        assert records <= live + 10, (records, live)
        # Restore from the compacted topic: a replica, then the daemon itself.
        async with Replica(cfg, follow="none") as replica:
            assert (
                fingerprint_diff(state_fingerprint(replica.conductor.snapshot_state()), want) == []
            )
    async with running(cfg) as daemon:
        await wait_for(lambda: daemon.ready()[0], 60, "restarted daemon ready")
        assert fingerprint_diff(state_fingerprint(daemon.conductor.snapshot_state()), want) == []
