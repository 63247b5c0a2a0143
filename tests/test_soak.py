"""`kvconductor soak`: its parts without a broker, then a short soak (what CI runs).

- every hostile record the soak sends is rejected by the core and changes
  nothing, so the dead-letter topic must hold exactly them;
- the end-of-soak checks see a lost or altered acknowledged record, and read
  the dead-letter headers back to their source records;
- the replay keeps each partition's order whatever the timestamps say, and
  rejects what the daemon would dead-letter;
- pending halves may differ between daemon and replay only at the age cutoff;
- the soak's pool backend evicts nothing younger than its keep time;
- a short soak (one fault of each kind) passes, loses nothing and
  dead-letters exactly the hostile records.
"""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import IndexLimits
from kvconductor.snapshots.units import state_fingerprint
from kvconductor.tools.demo.engines import (
    DEMO_BLOCK_SIZE,
    DEMO_MODEL,
    KafkaSink,
    Traffic,
    block_stored,
    default_fleet,
    engine_headers,
)
from kvconductor.tools.soak.check import dead_letters, lost, pending_differences, replay
from kvconductor.tools.soak.run import FAULT_KINDS
from kvconductor.tools.soak.traffic import HOSTILE_KINDS, SlowEvictingLru, hostile, record_digest
from kvconductor.wire.encode import vllm_payload, vllm_removed
from kvconductor.wire.errors import BadRecord
from kvconductor.wire.query import TokenQuery
from tests.test_cli import REPO, kvconductor

SOAK_TIMEOUT_S = 900.0


class Rec(NamedTuple):
    """The fields of an aiokafka ConsumerRecord the checks read."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]
    timestamp: int


class ApplyingProducer:
    """Stands in for the producer of a `KafkaSink`: applies each record to a
    conductor at once, in order, and keeps it."""

    def __init__(self) -> None:
        self.conductor = Conductor()
        self.records: list[Rec] = []

    async def send(self, topic: str, *, key: bytes, value: bytes, headers: Any) -> None:
        ingest = (
            self.conductor.ingest_pool_record
            if topic == "pool"
            else self.conductor.ingest_engine_record
        )
        ingest(key, headers, value, time.time())
        offset = len(self.records)
        self.records.append(Rec(topic, 0, offset, key, value, headers, int(time.time() * 1000)))

    async def flush(self) -> None:
        pass


async def demo_state(steps: int = 400) -> ApplyingProducer:
    producer = ApplyingProducer()
    traffic = Traffic(KafkaSink(producer, "engine", "pool"), seed=3, poison=False)
    await traffic.start()
    for _ in range(steps):
        await traffic.step()
    return producer


async def test_every_hostile_record_is_rejected_and_changes_nothing() -> None:
    producer = await demo_state()
    conductor = producer.conductor
    before = state_fingerprint(conductor.snapshot_state())
    assert before, "the demo traffic built no state"
    rng = random.Random(5)
    kinds: dict[str, str] = {}
    for kind in HOSTILE_KINDS:
        h = hostile(kind, b"vllm-0", rng)
        if h.value is None:  # the consumer dead-letters a record without a value
            kinds[kind] = "no value"
            continue
        ingest = conductor.ingest_pool_record if h.pool else conductor.ingest_engine_record
        with pytest.raises(BadRecord) as raised:
            ingest(h.key, h.headers, h.value, time.time())
        kinds[kind] = raised.value.kind
    assert state_fingerprint(conductor.snapshot_state()) == before
    # Every way in is tried: bad payloads, bad headers, bad values.
    assert {"undecodable", "missing_header", "invalid_header", "rejected"} <= set(kinds.values())


def _hits(conductor: Conductor, tokens: list[int]) -> int:
    answer = conductor.query(TokenQuery(DEMO_MODEL, DEMO_BLOCK_SIZE, tokens))
    return max((int(h["longest_matched"]) for t in answer.values() for h in t.values()), default=0)


def test_replay_keeps_each_partition_in_order_whatever_the_timestamps() -> None:
    spec = default_fleet()[0]
    tokens = list(range(2 * DEMO_BLOCK_SIZE))
    store = vllm_payload([block_stored([11, 12], None, tokens, "GPU", DEMO_BLOCK_SIZE)], 0, 1.0)
    remove = vllm_payload([vllm_removed([11, 12], "GPU")], 0, 2.0)
    bad = hostile("garbage", spec.instance.encode(), random.Random(1))
    key = spec.instance.encode()
    partition = [  # stored, then removed: but the removal carries the older timestamp
        Rec("engine", 0, 0, key, store, engine_headers(spec, 0), 2000),
        Rec("engine", 0, 1, key, remove, engine_headers(spec, 1), 1000),
        Rec("engine", 0, 2, bad.key, bad.value, bad.headers, 1500),
    ]
    got = replay(IndexLimits(), {"p": partition}, "pool")
    assert got.records == 3
    assert got.rejected == {("engine", 0, 2): "undecodable"}
    assert _hits(got.conductor, tokens) == 0
    # By timestamp alone the removal would come first and miss.
    by_time = Conductor()
    for r in sorted(partition[:2], key=lambda r: r.timestamp):
        by_time.ingest_engine_record(r.key, r.headers, r.value, r.timestamp / 1000)
    assert _hits(by_time, tokens) == len(tokens)


def test_lost_sees_missing_and_altered_records_and_counts_extra_copies() -> None:
    kept = Rec("t", 0, 0, b"k", b"v", [("h", b"1")], 0)
    altered = Rec("t", 0, 1, b"k", b"changed", [], 0)
    extra = Rec("t", 1, 0, b"k", b"retry's first copy", [], 0)
    acked = {
        ("t", 0, 0): record_digest(b"k", b"v", [("h", b"1")]),
        ("t", 0, 1): record_digest(b"k", b"v2", []),
        ("t", 0, 2): record_digest(b"k", b"v3", []),
    }
    loss = lost(acked, {"a": [kept, altered], "b": [extra]})
    assert loss.lost == [("t", 0, 1), ("t", 0, 2)]
    assert loss.unacknowledged == 1


def test_dead_letters_name_their_source_records() -> None:
    def letter(offset: int, source: int, kind: str) -> Rec:
        headers = [
            ("kv-model", b"m"),
            ("dlq-kind", kind.encode()),
            ("dlq-source-topic", b"kv-events"),
            ("dlq-source-partition", b"2"),
            ("dlq-source-offset", str(source).encode()),
        ]
        return Rec("dlq", 0, offset, b"k", b"v", headers, 0)

    # The same source twice: a daemon killed before it committed re-sends it.
    letters = [letter(0, 7, "undecodable"), letter(1, 7, "undecodable")]
    got = dead_letters({"d": [*letters, letter(2, 9, "missing_header")]})
    assert got.copies == 3
    assert got.sources == {
        ("kv-events", 2, 7): "undecodable",
        ("kv-events", 2, 9): "missing_header",
    }


def _with_intent(intent_at: float | None) -> Conductor:
    """vllm-2 (offloading into the pool) stores two blocks at t=1000, then,
    if `intent_at`, offloads them (an intent no pool confirms); an unrelated
    store brings the clock to t=1100."""
    conductor = Conductor(IndexLimits(max_pending_age_s=100.0))
    pooled, other = default_fleet()[4], default_fleet()[0]
    tokens = list(range(2 * DEMO_BLOCK_SIZE))
    stored = vllm_payload([block_stored([11, 12], None, tokens, "GPU", DEMO_BLOCK_SIZE)], 0, 1)
    key = pooled.instance.encode()
    conductor.ingest_engine_record(key, engine_headers(pooled, 0), stored, 1000.0)
    if intent_at is not None:
        intent = vllm_payload([block_stored([11, 12], None, [], "CPU", DEMO_BLOCK_SIZE)], 0, 1)
        conductor.ingest_engine_record(key, engine_headers(pooled, 1), intent, intent_at)
    later = vllm_payload([block_stored([21], None, tokens[:16], "GPU", DEMO_BLOCK_SIZE)], 0, 1)
    conductor.ingest_engine_record(b"vllm-0", engine_headers(other, 0), later, 1100.0)
    conductor.expire(conductor.now)
    return conductor


def test_pending_halves_may_differ_only_at_the_age_cutoff() -> None:
    plain = _with_intent(None)
    at_cutoff = pending_differences(_with_intent(1000.0), plain, 100.0, band_s=10.0)
    assert at_cutoff.problems == []
    assert at_cutoff.at_cutoff == 2  # the two blocks' intents, stamped at the cutoff
    inside = pending_differences(plain, _with_intent(1050.0), 100.0, band_s=10.0)
    assert inside.at_cutoff == 0
    assert len(inside.problems) == 2
    assert all("only in the replay" in p and "+50.0 s" in p for p in inside.problems)
    same = pending_differences(_with_intent(1050.0), _with_intent(1050.0), 100.0, 10.0)
    assert same == (([], 0, 2, 0.0))


def test_pool_keeps_recent_blocks_beyond_its_capacity() -> None:
    lru = SlowEvictingLru(2, keep_s=60.0)
    for h in (1, 2, 3):
        lru.touch(h)
    assert lru.overflow() == []
    assert len(lru) == 3
    lru.keep_s = 0.0
    assert lru.overflow() == [1]
    assert list(lru.blocks) == [2, 3]


@pytest.mark.kafka
async def test_short_soak_survives_every_fault_and_matches_the_replay(tmp_path: Path) -> None:
    """One fault of each kind (`--minutes 0`), then the checks. Its own broker:
    the soak stops, kills and freezes it. The daemon it starts reads only its
    configuration file, so the environment is passed on as it is (with the
    kafka-local settings: jar cache, JVM options)."""
    report = tmp_path / "soak.json"
    proc = await asyncio.create_subprocess_exec(
        *kvconductor(),
        "soak", "--minutes", "0", "--fault-every", "2", "--seed", "7", "--json", str(report),
        cwd=REPO,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )  # fmt: skip
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), SOAK_TIMEOUT_S)
    except TimeoutError:
        proc.send_signal(signal.SIGINT)  # it stops its daemon and broker, then reports
        try:
            await asyncio.wait_for(proc.wait(), 120)
        except TimeoutError:
            proc.kill()
            await proc.wait()
        raise AssertionError(f"the soak did not end within {SOAK_TIMEOUT_S:.0f} s") from None
    text = out.decode(errors="replace")
    print(text)
    result = json.loads(report.read_text())
    assert proc.returncode == 0, (result["problems"], text[-3000:])
    assert result["verdict"] == "PASS"
    f = result["figures"]
    assert f["faults"] == {kind: {"injected": 1, "survived": 1} for kind in FAULT_KINDS}
    assert f["acknowledged_lost"] == 0
    assert f["hostile_kinds"] == len(HOSTILE_KINDS)
    assert f["dead_lettered_records"] == f["hostile_records"]
    assert f["events_acked"] > 0 and f["daemon_lives"] >= 2
    assert "soak: PASS" in text
