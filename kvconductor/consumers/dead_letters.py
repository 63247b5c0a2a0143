"""The dead-letter topic: where records the index cannot take go, with why.

A dead-lettered record keeps its key, value and headers untouched and gains
`dlq-*` headers: the reason kind (a stable label), the reason text, where it
came from (topic, partition, offset, record timestamp) and when it was
dead-lettered, so `kvconductor dead-letters` can list and re-drive it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any, NamedTuple

import structlog
from aiokafka import AIOKafkaProducer

from kvconductor.obs.metrics import Metrics
from kvconductor.wire.records import (
    KV_ORIGIN_KEY,
    KV_ORIGIN_OFFSET,
    KV_ORIGIN_PARTITION,
    KV_ORIGIN_TOPIC,
    REPARTITION_HEADERS,
)

DLQ_KIND = "dlq-kind"
DLQ_REASON = "dlq-reason"
DLQ_TOPIC = "dlq-source-topic"
DLQ_PARTITION = "dlq-source-partition"
DLQ_OFFSET = "dlq-source-offset"
DLQ_TIMESTAMP = "dlq-source-timestamp"
DLQ_TIME = "dlq-time"

_MAX_REASON = 1000

log = structlog.get_logger("kvconductor.dead_letters")


def dead_letter_headers(
    original: Sequence[tuple[str, bytes]],
    kind: str,
    reason: str,
    topic: str,
    partition: int,
    offset: int,
    timestamp_ms: int,
    now_ms: int | None = None,
) -> list[tuple[str, bytes]]:
    headers = [(k, v) for k, v in original if not k.startswith("dlq-")]
    headers += [
        (DLQ_KIND, kind.encode()),
        (DLQ_REASON, reason[:_MAX_REASON].encode("utf-8", "replace")),
        (DLQ_TOPIC, topic.encode()),
        (DLQ_PARTITION, str(partition).encode()),
        (DLQ_OFFSET, str(offset).encode()),
        (DLQ_TIMESTAMP, str(timestamp_ms).encode()),
        (DLQ_TIME, str(now_ms if now_ms is not None else int(time.time() * 1000)).encode()),
    ]
    return headers


class DeadLetterWriter:
    """Sends dead letters and waits for all of them before offsets move on.

    A dead letter the broker does not acknowledge is sent again (with
    backoff, each failure counted) until it is: the record's offset is
    committed only after its copy is safe."""

    def __init__(self, producer: AIOKafkaProducer, topic: str, metrics: Metrics) -> None:
        self._producer = producer
        self._metrics = metrics
        self._topic = topic
        self._inflight: list[tuple[asyncio.Future[Any], _Letter]] = []

    async def send(self, record: Any, kind: str, reason: str) -> None:
        original = list(record.headers or ())
        # A repartitioned record (scale-out mode) is reported, and re-driven,
        # as the input record it came from.
        origin = {k: v for k, v in original if k in REPARTITION_HEADERS}
        topic = record.topic
        partition = record.partition
        offset = record.offset
        key = record.key
        if KV_ORIGIN_TOPIC in origin:
            topic = origin[KV_ORIGIN_TOPIC].decode()
            partition = int(origin[KV_ORIGIN_PARTITION])
            offset = int(origin[KV_ORIGIN_OFFSET])
            key = origin.get(KV_ORIGIN_KEY)
            original = [(k, v) for k, v in original if k not in origin]
        headers = dead_letter_headers(
            original, kind, reason, topic, partition, offset, record.timestamp
        )
        letter = _Letter(key, record.value, headers)
        self._inflight.append((await self._send(letter), letter))
        self._metrics.dead_letters.labels(kind=kind).inc()

    async def _send(self, letter: _Letter) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = await self._producer.send(
            self._topic, value=letter.value, key=letter.key, headers=letter.headers
        )
        return fut

    async def flush(self) -> None:
        """Wait until every dead letter sent so far is acknowledged."""
        delay = 0.5
        while self._inflight:
            inflight, self._inflight = self._inflight, []
            results = await asyncio.gather(*(f for f, _ in inflight), return_exceptions=True)
            failed = [
                letter
                for (_, letter), result in zip(inflight, results, strict=True)
                if isinstance(result, BaseException)
            ]
            if not failed:
                return
            self._metrics.dead_letter_failures.inc(len(failed))
            log.warning(
                "dead letters not acknowledged; sending them again",
                count=len(failed),
                error=str(next(r for r in results if isinstance(r, BaseException))),
                retry_in_s=delay,
            )
            await asyncio.sleep(delay)
            delay = min(delay * 2, 10.0)
            for letter in failed:
                self._inflight.append((await self._send(letter), letter))


class _Letter(NamedTuple):
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
