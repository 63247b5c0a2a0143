"""The event consumer applies a fetched batch through `Conductor.ingest`:
in produce order, never a record twice, offsets past every record handled
(dead-lettered ones too), and a core bug dead-lettered as internal_error."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from structlog.testing import capture_logs

import kvconductor.consumers.event_consumer as event_consumer
from kvconductor.consumers.event_consumer import EventConsumer
from kvconductor.index.conductor import Conductor
from kvconductor.obs.metrics import Metrics
from kvconductor.snapshots.units import state_fingerprint

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-hybrid" / "records.jsonl"
TP = TopicPartition("engine", 0)


class Letters:
    """Stands in for the dead-letter writer: what was sent, and flushes."""

    def __init__(self) -> None:
        self.sent: list[tuple[int, str, str]] = []
        self.flushes = 0

    async def send(self, record: Any, kind: str, reason: str) -> None:
        self.sent.append((record.offset, kind, reason))

    async def flush(self) -> None:
        self.flushes += 1


def _records() -> list[ConsumerRecord[bytes, bytes]]:
    out = []
    for offset, line in enumerate(FIXTURE.read_text().splitlines()):
        row = json.loads(line)
        headers = [(k, v.encode()) for k, v in row["headers"].items()]
        value = base64.b64decode(row["value_b64"])
        key = row["key"].encode()
        out.append(
            ConsumerRecord(
                "engine", 0, offset, 1000 + offset, 0, key, value, None, 1, len(value), headers
            )
        )
    return out


def _one_at_a_time(records: list[ConsumerRecord[bytes, bytes]]) -> Conductor:
    one = Conductor()
    for r in records:
        one.ingest_engine_record(r.key, r.headers, r.value, r.timestamp / 1000.0)
    return one


def _consumer(conductor: Conductor, letters: Letters) -> EventConsumer:
    unused: Any = None  # no fetch in these tests
    return EventConsumer(unused, conductor, Metrics(conductor), letters, "engine", "pool", 10)


async def test_a_batch_applies_as_its_records_one_at_a_time() -> None:
    records = _records()
    one = _one_at_a_time(records)
    conductor = Conductor()
    events = _consumer(conductor, Letters())
    assert await events._apply_batch({TP: records}, events.epoch) == len(records)
    assert state_fingerprint(conductor.snapshot_state()) == state_fingerprint(one.snapshot_state())
    assert events.applied_offsets[TP] == len(records)
    # Fetched again (a seek back, a rebalance): nothing applies twice.
    assert await events._apply_batch({TP: records}, events.epoch) == 0
    assert state_fingerprint(conductor.snapshot_state()) == state_fingerprint(one.snapshot_state())


async def test_records_go_to_the_core_in_chunks(monkeypatch: Any) -> None:
    # A chunk's time budget no record meets: one record a call.
    monkeypatch.setattr(event_consumer, "CHUNK_S", 0.0)
    records = _records()[:40]
    conductor = Conductor()
    calls: list[int] = []
    ingest_steps = conductor.ingest_steps

    def counted(batch: Any) -> Any:
        calls.append(len(batch))
        return ingest_steps(batch)

    monkeypatch.setattr(conductor, "ingest_steps", counted)
    events = _consumer(conductor, Letters())
    assert await events._apply_batch({TP: records}, events.epoch) == 40
    assert calls == [1] * 40
    assert state_fingerprint(conductor.snapshot_state()) == state_fingerprint(
        _one_at_a_time(records).snapshot_state()
    )


async def test_bad_records_and_core_bugs_are_dead_lettered_and_passed(monkeypatch: Any) -> None:
    records = _records()[:6]
    records[1].value = b"\xc1 not msgpack"
    records[3].key = b"boom"
    conductor = Conductor()
    real = conductor._engine_record

    def buggy(key: Any, *rest: Any) -> Any:
        if key == b"boom":
            raise KeyError("a core bug")
        return real(key, *rest)

    monkeypatch.setattr(conductor, "_engine_record", buggy)
    letters = Letters()
    events = _consumer(conductor, letters)
    with capture_logs() as logs:
        assert await events._apply_batch({TP: records}, events.epoch) == 6
    assert [(o, k) for o, k, _ in letters.sent] == [(1, "undecodable"), (3, "internal_error")]
    assert letters.sent[1][2] == "KeyError: 'a core bug'"
    assert letters.flushes == 1
    assert events.applied_offsets[TP] == 6
    (bug,) = [e for e in logs if e["event"] == "internal error applying a record"]
    assert bug["log_level"] == "error" and isinstance(bug["exc_info"], KeyError)
    assert bug["offset"] == 3
