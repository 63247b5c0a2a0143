"""The event consumer's warnings stay readable under a flood: a resync is
logged once a minute per instance at most, with the count held back."""

from __future__ import annotations

from typing import Any

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from structlog.testing import capture_logs

from kvconductor.consumers.event_consumer import EventConsumer
from kvconductor.index.conductor import Conductor
from kvconductor.obs.metrics import Metrics

RESYNC = "instance resynchronised: its stream lost messages, stale blocks cleared"
ATTACHED = "instance resynchronised: the bridge attached to its stream, earlier state unknown"


async def _apply(events: EventConsumer, *records: ConsumerRecord[bytes, bytes]) -> None:
    """The records, fetched as one batch of partition engine/0."""
    assert await events._apply_batch({TopicPartition("engine", 0): list(records)}, events.epoch)


def _resync(instance: str, offset: int) -> ConsumerRecord[bytes, bytes]:
    headers = [("kv-control", b"resync"), ("kv-control-reason", b"bridge restarted")]
    return ConsumerRecord(
        "engine", 0, offset, 1_000, 0, instance.encode(), b"", None, 1, 0, headers
    )


async def test_resyncs_are_logged_once_a_minute_per_instance() -> None:
    conductor = Conductor()
    unused: Any = None  # no fetch and no dead letter in this test
    events = EventConsumer(unused, conductor, Metrics(conductor), unused, "engine", "pool", 10)
    with capture_logs() as logs:
        await _apply(events, *(_resync(i, offset) for offset, i in enumerate(["a", "a", "a", "b"])))
    warned = [(e["instance"], e["suppressed_since_last"]) for e in logs if e["event"] == RESYNC]
    assert warned == [("a", 0), ("b", 0)]
    events.problems.interval_s = 0.0
    with capture_logs() as logs:
        await _apply(events, _resync("a", 4))
    warned = [(e["instance"], e["suppressed_since_last"]) for e in logs if e["event"] == RESYNC]
    assert warned == [("a", 2)]


async def test_a_bridge_attaching_is_logged_as_routine() -> None:
    conductor = Conductor()
    unused: Any = None
    events = EventConsumer(unused, conductor, Metrics(conductor), unused, "engine", "pool", 10)
    record = _resync("a", 0)
    record.headers = [
        ("kv-control", b"resync"),
        ("kv-control-reason", b"bridge attached to the stream: earlier state unknown"),
        ("kv-control-kind", b"attached"),
    ]
    with capture_logs() as logs:
        await _apply(events, record)
    (entry,) = [e for e in logs if e["event"] in (ATTACHED, RESYNC)]
    assert (entry["event"], entry["log_level"]) == (ATTACHED, "info")
    assert entry["reason"] == "bridge attached to the stream: earlier state unknown"
