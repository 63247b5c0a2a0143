"""Records deleted under the consumer's read position (retention, or
DeleteRecords) are counted and logged, not skipped in silence.

aiokafka's `auto_offset_reset` would move the position to the oldest record
and the event consumer would step its applied offsets past the hole; the
daemon's consumer runs with "none", and the event consumer resumes as at
an assignment: from the oldest record left, counting what was lost.
"""

from __future__ import annotations

import time
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete

from consumers.dead_letters import DeadLetterWriter
from consumers.event_consumer import EventConsumer
from consumers.positions import resume_positions
from kvconductor.core import Conductor
from kvconductor.metrics import Metrics
from tests.harness import engine_headers, stored, vllm_payload

pytestmark = pytest.mark.kafka


async def test_records_deleted_under_the_position_are_counted(kafka_bootstrap: str) -> None:
    tag = uuid.uuid4().hex[:8]
    engine, pool, dlq = f"e-{tag}", f"p-{tag}", f"d-{tag}"
    tp = TopicPartition(engine, 0)
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, acks="all", enable_idempotence=True
    )
    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        group_id=f"g-{tag}",
        enable_auto_commit=False,
        auto_offset_reset="none",  # as the daemon's
        isolation_level="read_committed",
    )
    try:
        await admin.create_topics([NewTopic(t, 1, 1) for t in (engine, pool, dlq)])
        await producer.start()
        conductor = Conductor()
        metrics = Metrics(conductor)
        dead_letters = DeadLetterWriter(producer, dlq, metrics)
        events = EventConsumer(consumer, conductor, metrics, dead_letters, engine, pool, 2000)

        async def on_assign(assigned: set[TopicPartition]) -> dict[TopicPartition, int]:
            return await resume_positions(consumer, assigned, {}, conductor.counters)

        events.on_assign = on_assign
        await consumer.start()
        events.subscribe()
        deadline = time.monotonic() + 60
        while not events.caught_up and time.monotonic() < deadline:
            await events.poll(200)
        assert events.caught_up

        consumer.pause(tp)
        for n in range(10):
            await producer.send(
                engine,
                key=b"vllm-0",
                value=vllm_payload([stored([1000 + n], [n, 0, 0, 0])]),
                headers=engine_headers(**{"kv-seq": str(n + 1)}),
            )
        await producer.flush()
        await admin.delete_records({tp: RecordsToDelete(5)}, timeout_ms=30_000)
        # Forget anything fetched before the pause, as a daemon that lags
        # behind retention never had it.
        consumer.seek(tp, events.applied_offsets[tp])
        consumer.resume(tp)
        handled = 0
        deadline = time.monotonic() + 60
        while events.applied_offsets.get(tp, 0) < 10 and time.monotonic() < deadline:
            handled += await events.poll(200)
        assert events.applied_offsets[tp] == 10
        assert handled == 5
        assert conductor.counters["offsets_lost_to_retention"] == 5
    finally:
        await consumer.stop()
        await producer.stop()
        await admin.close()
