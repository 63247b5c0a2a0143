"""Scale-out stage one: re-key engine and pool records by namespace group.

Consume-transform-produce in one Kafka transaction per batch: the records
go to the internal topic keyed by `routing.group_key`, and the input offsets
are committed in the same transaction, so each input record lands on the
internal topic exactly once. Per input partition the order is kept, and an
instance's records always share one group key, so per-instance order holds
on the internal topic too.

Each forwarded record keeps its value (or its events' bytes, when a pool
record is split) and headers, plus where it came from: `kv-kind` (engine or
pool), `kv-origin-key` (the instance or backend id), `kv-origin-topic`,
`kv-origin-partition`, `kv-origin-offset`.
"""

from __future__ import annotations

from typing import Any

import structlog
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from kvconductor.consumers.routing import engine_route, pool_routes
from kvconductor.wire.records import (
    KV_KIND,
    KV_ORIGIN_KEY,
    KV_ORIGIN_OFFSET,
    KV_ORIGIN_PARTITION,
    KV_ORIGIN_TOPIC,
    REPARTITION_HEADERS,
)

log = structlog.get_logger("kvconductor.repartitioner")


class Repartitioner:
    def __init__(
        self,
        consumer: AIOKafkaConsumer,
        producer: AIOKafkaProducer,
        group_id: str,
        engine_topic: str,
        pool_topic: str,
        internal_topic: str,
        max_records: int,
    ) -> None:
        self.consumer = consumer
        self.producer = producer
        self.group_id = group_id
        self.engine_topic = engine_topic
        self.pool_topic = pool_topic
        self.internal_topic = internal_topic
        self.max_records = max_records
        self.forwarded = 0

    def subscribe(self) -> None:
        self.consumer.subscribe([self.engine_topic, self.pool_topic])

    async def poll(self, timeout_ms: int) -> int:
        batch = await self.consumer.getmany(timeout_ms=timeout_ms, max_records=self.max_records)
        batch = {tp: recs for tp, recs in batch.items() if recs}
        if not batch:
            return 0
        try:
            async with self.producer.transaction():
                for recs in batch.values():
                    for r in recs:
                        await self._forward(r)
                await self.producer.send_offsets_to_transaction(
                    {tp: recs[-1].offset + 1 for tp, recs in batch.items()}, self.group_id
                )
        except BaseException:
            # The transaction was aborted: read the batch again next time.
            for tp, recs in batch.items():
                if tp in self.consumer.assignment():
                    self.consumer.seek(tp, recs[0].offset)
            raise
        n = sum(len(recs) for recs in batch.values())
        self.forwarded += n
        return n

    async def _forward(self, r: Any) -> None:
        topic: str = r.topic
        key: bytes | None = r.key
        value: bytes | None = r.value
        original = [(k, v) for k, v in (r.headers or ()) if k not in REPARTITION_HEADERS]
        kind = "pool" if topic == self.pool_topic else "engine"
        headers = [
            *original,
            (KV_KIND, kind.encode()),
            (KV_ORIGIN_TOPIC, topic.encode()),
            (KV_ORIGIN_PARTITION, str(r.partition).encode()),
            (KV_ORIGIN_OFFSET, str(r.offset).encode()),
        ]
        if key is not None:
            headers.append((KV_ORIGIN_KEY, key))
        routes = (
            pool_routes(original, value) if kind == "pool" else [(engine_route(original), value)]
        )
        for group, payload in routes:
            await self.producer.send(
                self.internal_topic,
                key=group,
                value=payload,
                headers=headers,
                timestamp_ms=r.timestamp,
            )
