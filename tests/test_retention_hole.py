"""Records deleted under the consumer's read position (retention, or
DeleteRecords) are counted and logged, not skipped in silence.

aiokafka's `auto_offset_reset` would move the position to the oldest record
and the event consumer would step its applied offsets past the hole; the
daemon's consumer runs with "none", and the event consumer resumes as at
an assignment: from the oldest record left, counting what was lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete

from kvconductor.consumers.dead_letters import DeadLetterWriter
from kvconductor.consumers.event_consumer import EventConsumer
from kvconductor.consumers.positions import resume_positions
from kvconductor.index.conductor import Conductor
from kvconductor.obs.metrics import Metrics
from tests.harness import engine_headers, stored, vllm_payload

pytestmark = pytest.mark.kafka


@contextlib.asynccontextmanager
async def _consuming(
    kafka_bootstrap: str, assign_delay: float = 0.0
) -> AsyncIterator[tuple[EventConsumer, AIOKafkaProducer, AIOKafkaAdminClient, str]]:
    """An event consumer positioned as the daemon's, on fresh topics; its
    assign hook waits `assign_delay` seconds before it seeks."""
    tag = uuid.uuid4().hex[:8]
    engine, pool, dlq = f"e-{tag}", f"p-{tag}", f"d-{tag}"
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
            await asyncio.sleep(assign_delay)
            return await resume_positions(consumer, assigned, {}, conductor.counters)

        events.on_assign = on_assign
        await consumer.start()
        events.subscribe()
        yield events, producer, admin, engine
    finally:
        await consumer.stop()
        await producer.stop()
        await admin.close()


async def _catch_up(events: EventConsumer) -> None:
    deadline = time.monotonic() + 60
    while not events.caught_up and time.monotonic() < deadline:
        await events.poll(200)
    assert events.caught_up


async def test_records_deleted_under_the_position_are_counted(kafka_bootstrap: str) -> None:
    async with _consuming(kafka_bootstrap) as (events, producer, admin, engine):
        consumer, conductor = events.consumer, events.conductor
        tp = TopicPartition(engine, 0)
        await _catch_up(events)

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


async def test_a_fetch_ahead_of_the_assign_hook_is_not_an_error(kafka_bootstrap: str) -> None:
    # aiokafka's fetcher looks up the group's committed offset (there is none)
    # while the hook is still working out where to seek; under "none" it
    # reports NoOffsetForPartitionError, which must not escape a poll.
    async with _consuming(kafka_bootstrap, assign_delay=1.0) as (events, producer, _, engine):
        await producer.send_and_wait(
            engine,
            key=b"vllm-0",
            value=vllm_payload([stored([1000], [1, 0, 0, 0])]),
            headers=engine_headers(**{"kv-seq": "1"}),
        )
        await _catch_up(events)
        tp = TopicPartition(engine, 0)
        deadline = time.monotonic() + 30
        while events.applied_offsets.get(tp, 0) < 1 and time.monotonic() < deadline:
            await events.poll(200)
        assert events.applied_offsets[tp] == 1
