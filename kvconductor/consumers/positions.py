"""Where a partition resumes: the offset the restored state reflects."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

import structlog
from aiokafka import AIOKafkaConsumer, TopicPartition

log = structlog.get_logger("kvconductor.consumer")


async def resume_positions(
    consumer: AIOKafkaConsumer,
    partitions: Iterable[TopicPartition],
    recorded: Mapping[TopicPartition, int],
    counters: Counter[str],
) -> dict[TopicPartition, int]:
    """Seek each partition to its recorded offset, or to its oldest record when
    none is recorded; returns where each was put.

    A recorded offset that retention already deleted means records the state
    never saw are gone: said loudly, counted, and the partition resumes from
    the oldest record that exists rather than silently skipping ahead."""
    tps = list(partitions)
    beginnings = await consumer.beginning_offsets(tps)
    positions: dict[TopicPartition, int] = {}
    for tp in tps:
        first = beginnings[tp]
        start = recorded.get(tp)
        if start is None:
            start = first
        elif start < first:
            log.error(
                "the snapshot's offset was deleted by retention: records between were "
                "never applied; continuing from the oldest record that exists",
                topic=tp.topic,
                partition=tp.partition,
                snapshot_offset=start,
                oldest_offset=first,
                lost=first - start,
            )
            counters["offsets_lost_to_retention"] += first - start
            start = first
        consumer.seek(tp, start)
        positions[tp] = start
    return positions
