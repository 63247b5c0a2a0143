"""The field fleet's kinds (kvconductor.tools.bench.field_fleet) against real output.

Each generated kind must decode with the project's decoders and ingest
without a skipped record, carry the fields the real payloads of its kind
carry (tests/fixtures/vllm), and, on the fixture's scheduler settings
(`FIXTURE_FLEET`), have as many device events a record as vLLM's real
`KVCacheManager` wrote for dense instances (tests/fixtures/vllm-hybrid).
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest

from kvconductor.index.conductor import Conductor
from kvconductor.tools.bench import kinds as kinds_bench
from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.field_fleet import (
    FIXTURES,
    KINDS,
    FieldConfig,
    field_fleet,
    hybrid_records,
)
from kvconductor.tools.bench.vllm_engine import FIXTURE_FLEET
from kvconductor.wire.engine import decode_engine_payload
from kvconductor.wire.pool import decode_pool_payload
from kvconductor.wire.records import Incoming

GENERATED = KINDS[:9]


@pytest.fixture(scope="module")
def fleet() -> dict[str, list[Record]]:
    return field_fleet(FieldConfig(records=400, engine=FIXTURE_FLEET.engine, fleet=FIXTURE_FLEET))


def _real(path: str) -> Any:
    return msgspec.msgpack.decode((FIXTURES / "vllm" / path).read_bytes())


def _raw(r: Record) -> list[Any]:
    return list(msgspec.msgpack.decode(r.payload))


def _headers(r: Record) -> dict[str, str]:
    return {k: v.decode() for k, v in r.headers}


def _stores(records: list[Record]) -> Iterator[dict[str, Any]]:
    for r in records:
        if not r.pool:
            yield from (e for e in _raw(r)[1] if e["type"] == "BlockStored")


def test_every_kind_decodes_and_ingests_whole(fleet: dict[str, list[Record]]) -> None:
    assert list(fleet) == list(KINDS)
    for kind, records in fleet.items():
        assert records, kind
        for r in records:
            if r.pool:
                batch: Any = decode_pool_payload(r.payload)
            else:
                batch = decode_engine_payload(r.payload, _headers(r).get("kv-source", "vllm"))
            assert len(batch.events) == r.events, kind
        seen = []
        for lane in (True, False):
            conductor = Conductor(lane=lane)
            items = [Incoming(r.pool, r.key, r.headers, r.payload, r.ts) for r in records]
            notices = conductor.ingest(items)
            assert [n for n in notices if n.error is not None] == [], (kind, lane)
            assert [n for n in notices if n.applied and n.applied.seq_missing] == [], kind
            seen.append((conductor.entries(), dict(conductor.applied), conductor.pending()))
        # The lane and the Python path hold the same (the timing compares like with like).
        assert seen[0] == seen[1], kind
        tiers = {tier for _, tier in seen[0][1]} - {"group"}  # hybrids' other groups
        want = {"cpu-offload": {"GPU", "CPU"}, "pool-offload": {"GPU", "intent", "CPU"}}
        assert tiers == want.get(kind, {"GPU"}), kind


def test_device_events_a_record_as_vllm_writes_them(fleet: dict[str, list[Record]]) -> None:
    real = [r.events for r in hybrid_records(FIXTURES, ("hyb-d0", "hyb-d1"))]
    lo, hi = min(real), max(real)
    for kind in GENERATED:
        device = [
            sum(1 for e in _raw(r)[1] if _medium(e) == "GPU") for r in fleet[kind] if not r.pool
        ]
        device = [n for n in device if n]  # a pool confirmation's step may store nothing new
        assert lo <= min(device) and max(device) <= 2 * hi, kind
        assert lo <= statistics.mean(device) <= 2 * statistics.mean(real), kind


def _medium(e: Any) -> str | None:
    if isinstance(e, dict):
        m: str | None = e.get("medium")
        return m
    return e[6] if e[0] == "BlockStored" else e[2] if e[0] == "BlockRemoved" else None


def test_map_form_kinds_carry_vllm_033_fields(fleet: dict[str, list[Record]]) -> None:
    real = _real("0.33.0/stored.msgpack")[1][0]
    removed = _real("0.33.0/removed.msgpack")[1][0]
    for kind in ("dense", "dp8", "cpu-offload", "pool-offload"):
        records = [r for r in fleet[kind] if not r.pool]
        for r in records:
            for e in _raw(r)[1]:
                if e["medium"] == "GPU":
                    assert set(e) == set(real if e["type"] == "BlockStored" else removed), kind
                    assert all(isinstance(h, int) and h >= 0 for h in e["block_hashes"])


def test_dp_ranks_in_the_payload_or_the_header(fleet: dict[str, list[Record]]) -> None:
    dp8 = [r for r in fleet["dp8"] if not r.pool]
    assert {_raw(r)[2] for r in dp8} == set(range(8))
    assert len({r.key for r in dp8}) == 1
    dp2 = fleet["dp2-lora"]
    assert {_raw(r)[2] for r in dp2} == {None}
    assert {_headers(r)["kv-dp-rank"] for r in dp2} == {"0", "1"}
    assert len({r.key for r in dp2}) == 1


def test_lora_stores_name_their_adapter_in_extra_keys(fleet: dict[str, list[Record]]) -> None:
    for kind in ("dp2-lora", "lora"):
        stores = list(_stores(fleet[kind]))
        named = [e for e in stores if e["lora_name"] is not None]
        for e in named:
            assert e["extra_keys"] == [[e["lora_name"]]] * len(e["block_hashes"])
            assert e["lora_id"] == int(e["lora_name"].rsplit("-", 1)[1]) + 1
        for e in stores:
            if e["lora_name"] is None:
                assert "extra_keys" not in e and e["lora_id"] is None
        share = len(named) / len(stores)
        assert (0.05 < share < 0.6) if kind == "dp2-lora" else share == 1.0, (kind, share)
    # The same system prompts under another adapter are other blocks.
    plain = {h for e in _stores(fleet["dense"]) for h in e["block_hashes"]}
    adapted = {h for e in _stores(fleet["lora"]) for h in e["block_hashes"]}
    assert not plain & adapted


def test_offload_kinds_as_the_connector_and_the_pool_write_them(
    fleet: dict[str, list[Record]],
) -> None:
    local = fleet["cpu-offload"]
    assert {_headers(r)["kv-offload"] for r in local} == {"local"}
    cpu = [e for r in local for e in _raw(r)[1] if e["medium"] == "CPU"]
    assert {e["type"] for e in cpu} == {"BlockStored", "BlockRemoved"}
    for e in cpu:
        if e["type"] == "BlockStored":  # hash only (docs/wire-formats.md 3.5)
            assert (e["token_ids"], e["block_size"], e["parent_block_hash"]) == ([], 0, None)
    gpu_stored = {h for e in _stores(local) if e["medium"] == "GPU" for h in e["block_hashes"]}
    cpu_stored = {h for e in cpu if e["type"] == "BlockStored" for h in e["block_hashes"]}
    assert cpu_stored <= gpu_stored
    pool = fleet["pool-offload"]
    engine = [r for r in pool if not r.pool]
    assert {_headers(r)["kv-offload"] for r in engine} == {"pool"}
    intents = {h for e in _stores(engine) if e["medium"] == "CPU" for h in e["block_hashes"]}
    confirmed = {
        h
        for r in pool
        if r.pool
        for e in _raw(r)[1]
        if e["event_type"] == "stored"
        for h in e["seq_hashes"]
    }
    # What the backend confirms, the engine said it offloads (but where the
    # cut falls between a confirmation that came first and its intent).
    assert intents and len(confirmed & intents) >= 0.9 * len(confirmed)


def test_other_wire_forms_as_the_real_payloads(fleet: dict[str, list[Record]]) -> None:
    digests = _real("0.33.0-bytes-hashes/stored.msgpack")[1][0]["block_hashes"]
    for e in _stores(fleet["bytes-hashes"]):
        assert all(isinstance(h, bytes) and len(h) == len(digests[0]) for h in e["block_hashes"])
    stored = _real("0.22.0/stored.msgpack")[1][0]
    removed = _real("0.22.0/removed.msgpack")[1][0]
    for r in fleet["vllm-array"]:
        for e in _raw(r)[1]:
            assert isinstance(e, list)
            assert len(e) == len(stored if e[0] == "BlockStored" else removed)
    sglang = fleet["sglang"]
    assert {_headers(r)["kv-source"] for r in sglang} == {"sglang"}
    keys = {"type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id"}
    hashes = []
    for r in sglang:
        for e in _raw(r)[1]:
            assert set(e) <= keys | {"medium"}, e
            hashes += e["block_hashes"]
    assert any(h < 0 for h in hashes) and any(h > 0 for h in hashes)  # signed int64


def test_fixture_kinds_are_copies_under_fresh_ids(fleet: dict[str, list[Record]]) -> None:
    swa = fleet["hybrid-swa"]
    source = hybrid_records(FIXTURES, ("hyb-a0",))
    assert len({r.key for r in swa}) == len(swa) // len(source) >= 2
    assert [r.payload for r in swa[:: len(swa) // len(source)]] == [r.payload for r in source]
    gemma = fleet["hybrid-gemma3"]
    assert {_headers(r)["kv-model"] for r in gemma} == {"tiny-gemma3"}
    every_key = [k for records in fleet.values() for k in {r.key for r in records}]
    assert len(every_key) == len(set(every_key))


def test_kinds_quick_prints_the_table(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "kinds.json"
    assert (
        kinds_bench.main(["--quick", "--kinds", "dense,lora,hybrid-mamba", "--out", str(out)]) == 0
    )
    table = capsys.readouterr().out
    for kind in ("dense", "lora", "hybrid-mamba", "mixed fleet"):
        assert f"| {kind} |" in table
    result = msgspec.json.decode(out.read_bytes())
    assert result["kinds"]["dense"]["vs_dense"] == 1.0
    assert all(row["errors"] == 0 for row in result["kinds"].values())
