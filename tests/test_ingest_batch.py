"""`Conductor.ingest`: a batch of records applies as the same records one
at a time, and says which records were skipped or had something to say."""

from __future__ import annotations

from pathlib import Path

from kvconductor.index.conductor import Conductor, Incoming
from kvconductor.snapshots.units import state_fingerprint
from kvconductor.wire.errors import BadRecord, DecodeError
from tests.harness import fixture_records

FIXTURE = Path(__file__).parent / "fixtures" / "vllm-hybrid" / "records.jsonl"


def _records() -> list[Incoming]:
    return fixture_records("vllm-hybrid")


def test_batch_equals_one_at_a_time() -> None:
    records = _records()
    one = Conductor()
    for rec in records:
        assert rec.value is not None
        one.ingest_engine_record(rec.key, rec.headers, rec.value, rec.now)
    batch = Conductor()
    assert batch.ingest(records) == []
    assert state_fingerprint(batch.snapshot_state()) == state_fingerprint(one.snapshot_state())
    assert batch.counters == one.counters


def test_bad_records_are_noticed_and_skipped() -> None:
    records = _records()[:20]
    good = records[3]
    bad = [
        good._replace(value=None),
        good._replace(value=b"\xc1 not msgpack"),
        good._replace(headers=[("kv-model", b"m")]),
        good._replace(key=None),
    ]
    batch = Conductor()
    notices = batch.ingest(records[:5] + bad + records[5:])
    assert [n.at for n in notices] == [5, 6, 7, 8]
    assert all(isinstance(n.error, BadRecord) and n.applied is None for n in notices)
    assert isinstance(notices[0].error, DecodeError)
    clean = Conductor()
    clean.ingest(records)
    assert state_fingerprint(batch.snapshot_state()) == state_fingerprint(clean.snapshot_state())


def test_seq_gaps_are_noticed() -> None:
    records = _records()
    first = [r for r in records if r.key == b"hyb-d0"][:4]
    notices = Conductor().ingest([first[0], first[3]])
    assert len(notices) == 1 and notices[0].at == 1
    assert notices[0].applied is not None and notices[0].applied.seq_missing == 2
