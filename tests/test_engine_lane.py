"""The engine lane (kernel/py/src/lane.rs, kvconductor/index/engine_lane.py) applies
exactly what the Python path applies.

Every stream goes through `Conductor.ingest` twice, with the lane and with
`lane=False` (the Python path alone, the reference), and everything the
index keeps must come out equal: the snapshot fingerprint, counters,
blocks applied, notices, clocks, kv-seq positions, what is dirty, idle
instances. The streams mix what the lane applies with everything it must
leave to the Python path, record by record and inside one record.
"""

from __future__ import annotations

import contextlib
import random
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvconductor.index.conductor import Conductor, Incoming, Notice
from kvconductor.index.fleet import IndexLimits
from kvconductor.index.namespace import namespace_key
from kvconductor.kernel import KERNEL
from kvconductor.snapshots.units import state_fingerprint
from kvconductor.wire.engine import ARRAY_FIELDS
from kvconductor.wire.errors import BadRecord
from kvconductor.wire.media import DEVICE, HOST
from kvconductor.wire.packing import unpack_u64
from tests.harness import fixture_records
from tests.streams import mixed_stream

pytestmark = pytest.mark.skipif(KERNEL is None, reason="the lane is the compiled kernel's")

FIXTURES = Path(__file__).parent / "fixtures"
BS = 4
MASK64 = (1 << 64) - 1


def _state(c: Conductor, notices: list[Notice]) -> dict[str, Any]:
    index = c.snapshot_state()
    return {
        "fingerprint": state_fingerprint(index),
        "counters": +index.counters,
        "applied": +index.applied,
        "notices": [
            (n.at, n.applied, type(n.error).__name__, str(n.error) if n.error else None)
            for n in notices
        ],
        "now": index.now,
        "ns_now": {k: ns.now for k, ns in index.namespaces.items()},
        "instances": {
            name: (s.last_event_ts, dict(s.last_seq), set(s.namespaces), dict(s.groups))
            for name, s in index.instances.items()
        },
        "dirty": (index.dirty.owners, index.dirty.pools, index.dirty.instances),
        "idle": list(index.idle),
        "pending": c.pending(),
    }


# Bounds the generated streams reach: retired content evicted by count and
# age, owners at capacity, pending halves dropped.
TIGHT = IndexLimits(
    max_pending=20, max_pending_age_s=8.0, max_blocks_per_owner=24, max_retired_content=16
)


def _both(
    batches: list[list[Incoming]], limits: IndexLimits | None = None
) -> tuple[dict[str, Any], dict[str, Any], Conductor]:
    lane, ref = Conductor(limits), Conductor(limits, lane=False)
    got: list[Notice] = []
    want: list[Notice] = []
    for batch in batches:
        got += lane.ingest(batch)
        want += ref.ingest(batch)
    return _state(lane, got), _state(ref, want), lane


def _assert_same(batches: list[list[Incoming]], limits: IndexLimits | None = None) -> Conductor:
    got, want, lane = _both(batches, limits)
    for field in want:
        assert got[field] == want[field], field
    return lane


def test_vllm_kv_cache_manager_output() -> None:
    records = fixture_records("vllm-hybrid")
    lane = _assert_same([records[i : i + 50] for i in range(0, len(records), 50)])
    assert lane.lane is not None and len(lane.lane.contexts) > 0


# ------------------------------------------------------------ generated


def _seq_hash(model: str, tokens: list[int]) -> int:
    salt = sum(ord(c) * 131**i for i, c in enumerate(model))
    return hash((salt, *tokens)) & MASK64


class _Fleet:
    """Engines of a few instances storing and evicting prompts' blocks as
    vLLM does, with every shape the lane must leave alone mixed in."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng
        self.prompts = [[rng.randrange(50) for _ in range(BS * 8)] for _ in range(12)]
        self.instances = [f"e{i}" for i in range(5)]
        self.seq = dict.fromkeys(self.instances, 0)
        self.clock = 100.0
        # What each owner's device tier holds, read from a run of the
        # records so far: the engine simulation stores what it lacks.
        self.truth = Conductor(lane=False)

    def hashes(self, model: str, p: int) -> list[int]:
        tokens = self.prompts[p]
        return [_seq_hash(model, tokens[: BS * (k + 1)]) for k in range(8)]

    def stored(self, owner: tuple[str, str, int], held: set[int]) -> dict[str, Any]:
        """vLLM's prefix caching: the blocks after the longest prefix the
        instance holds, hung from its last block; odd shapes on e4."""
        rng = self.rng
        inst, model, _ = owner
        p = rng.randrange(len(self.prompts))
        seqs = self.hashes(model, p)
        start = next((k for k, h in enumerate(seqs) if h not in held), 8)
        odd = inst == "e4"
        if start == 8:
            start = 0  # a re-announcement (vLLM's `kv_cache_report_mode: "full"`)
        if odd and rng.random() < 0.3:
            start = rng.randrange(8)  # copies
        end = rng.randrange(start + 1, 9)
        ev: dict[str, Any] = {
            "type": "BlockStored",
            "block_hashes": seqs[start:end],
            "parent_block_hash": seqs[start - 1] if start else None,
            "token_ids": self.prompts[p][start * BS : end * BS],
            "block_size": BS,
            "lora_id": None,
            "medium": "GPU",
        }
        roll = rng.random()
        if roll < 0.03:
            ev["token_ids"] = None
        elif roll < 0.06:
            ev["medium"] = rng.choice(["CPU", "cpu_tier2", "weird", None])
        elif roll < 0.08:
            ev["kv_cache_spec_kind"] = rng.choice(["full_attention", "mla_attention"])
        elif roll < 0.09:
            ev["block_size"] = rng.choice([None, 0, -1] + ([2 * BS, BS // 2] if odd else []))
        elif roll < 0.11:
            key = None if rng.random() < 0.7 else ["img", 3]
            ev["extra_keys"] = [key] * (end - start)
        elif roll < 0.12:
            ev["block_hashes"] = [*ev["block_hashes"], rng.getrandbits(64)]
        elif roll < 0.13:
            ev["token_ids"] = ev["token_ids"][:-1]
        elif odd and roll < 0.16:
            ev.update(group_idx=1, kv_cache_spec_kind="sliding_window")
            ev["kv_cache_spec_sliding_window"] = 8
        elif odd and roll < 0.17:
            ev["lora_name"] = "adapter"
        if ev["medium"] in ("GPU", None):
            held.update(ev["block_hashes"])
        return ev

    def removed(self, owner: tuple[str, str, int], held: set[int]) -> dict[str, Any]:
        """vLLM's evictions: a chain's last held block, now and then another
        block, a few, or unheld ones."""
        rng = self.rng
        model = owner[1]
        chains = [self.hashes(model, p) for p in range(len(self.prompts))]
        chains = [seqs for seqs in chains if seqs[0] in held]
        if chains and rng.random() < 0.9:
            # vLLM frees a request's blocks tail first: the chain's deepest block goes.
            seqs = rng.choice(chains)
            picked = [next(h for h in reversed(seqs) if h in held)]
        elif held and rng.random() < 0.5:
            picked = [rng.choice(sorted(held))]
        else:
            picked = [rng.choice(self.hashes(model, rng.randrange(len(self.prompts))))]
        if rng.random() < 0.1:
            picked += rng.sample(self.hashes(model, rng.randrange(len(self.prompts))), 2)
        if rng.random() < 0.03:
            picked.append(picked[0])
        held.difference_update(picked)
        ev: dict[str, Any] = {"type": "BlockRemoved", "block_hashes": picked, "medium": "GPU"}
        if rng.random() < 0.04:
            ev["medium"] = rng.choice(["CPU", "weird"])
        if rng.random() < 0.02:
            ev["group_idx"] = 1
        return ev

    def offloaded(self, owner: tuple[str, str, int], held: set[int]) -> dict[str, Any]:
        """vLLM's CPU offload: device blocks not on the host yet stored there
        by hash alone (block size 0), or a host block evicted."""
        rng = self.rng
        host = self.held(owner, HOST)
        if host and rng.random() < 0.3:
            return {
                "type": "BlockRemoved",
                "block_hashes": [rng.choice(sorted(host))],
                "medium": "CPU",
            }
        fresh = sorted(held - host) or sorted(held)
        picked = rng.sample(fresh, min(len(fresh), rng.randrange(1, 4)))
        if rng.random() < 0.1:
            picked.append(rng.getrandbits(64))  # content never seen: it waits
        return {
            "type": "BlockStored",
            "block_hashes": picked,
            "parent_block_hash": None,
            "token_ids": [],
            "block_size": 0,
            "medium": "CPU",
        }

    def held(self, owner: tuple[str, str, int], tier: int = DEVICE) -> set[int]:
        inst, model, rank = owner
        ns = self.truth.snapshot_state().namespaces.get(
            namespace_key("default", model, BS, None, "")
        )
        o = ns.owners.get(inst, {}).get(rank) if ns is not None else None
        if o is None:
            return set()
        return set(unpack_u64(ns.store.export_owner(o.slot, tier)[0]))

    def record(self) -> Incoming:
        rng = self.rng
        self.clock += rng.choice([0.0, 0.01, 0.5, -0.2])
        roll = rng.random()
        if roll < 0.05:
            return self.pool_record()
        inst = rng.choice(self.instances)
        # One instance serves two models (its removals then search both).
        model = "m2" if inst == "e4" and rng.random() < 0.5 else "m"
        self.seq[inst] += 1 if rng.random() < 0.95 else rng.choice([0, 2, 5])
        headers = [
            ("kv-model", model.encode()),
            ("kv-block-size", str(BS).encode()),
            ("kv-source", b"vllm"),
            ("kv-seq", str(self.seq[inst]).encode()),
        ]
        header_rank = 1 if rng.random() < 0.03 else 0
        if header_rank:
            headers.append(("kv-dp-rank", b"1"))
        rank = rng.choice([0, 0, 0, 0, 0, 0, None, 1])
        owner = (inst, model, header_rank if rank is None else rank)
        if inst == "e2":
            headers.append(("kv-offload", b"pool"))
        if rng.random() < 0.01:
            headers.append(("kv-control", b"resync"))
        events: list[dict[str, Any]] = []
        held = self.held(owner)
        for _ in range(rng.choice([1, 1, 2, 3, 5])):
            kind = rng.random()
            if kind < 0.5:
                events.append(self.stored(owner, held))
            elif kind < 0.58 and held:
                events.append(self.offloaded(owner, held))
            elif kind < 0.99:
                events.append(self.removed(owner, held))
            else:
                events.append({"type": "AllBlocksCleared"})
        value = self.encode(events, rank)
        if rng.random() < 0.02:
            # Dead-lettered: no kv-model, or a cut payload.
            if rng.random() < 0.5:
                headers = headers[1:]
            else:
                value = value[:-3]
        rec = Incoming(False, inst.encode(), headers, value, self.clock)
        self.truth.ingest([rec])
        return rec

    def encode(self, events: list[dict[str, Any]], rank: int | None) -> bytes:
        if self.rng.random() < 0.8:
            return msgspec.msgpack.encode([self.clock, events, rank])
        arrays = []
        for ev in events:
            names = ARRAY_FIELDS[ev["type"]][1:]
            row = [ev["type"], *(ev.get(n) for n in names)]
            while len(row) > 1 and row[-1] is None and len(row) > 2:
                row.pop()
            arrays.append(row)
        return msgspec.msgpack.encode([self.clock, arrays, rank])

    def pool_record(self) -> Incoming:
        rng = self.rng
        p = rng.randrange(len(self.prompts))
        seqs = self.hashes("m", p)
        n = rng.randrange(1, 9)
        if rng.random() < 0.7:
            ev: dict[str, Any] = {"event_type": "stored", "seq_hashes": seqs[:n], "medium": "cpu"}
            if rng.random() < 0.5:
                ev["token_ids"] = self.prompts[p][: n * BS]
        else:
            ev = {"event_type": "removed", "seq_hashes": seqs[:n], "medium": "cpu"}
        headers = [("kv-model", b"m"), ("kv-block-size", str(BS).encode())]
        value = msgspec.msgpack.encode([self.clock, [ev], 0])
        rec = Incoming(True, b"pool-0", headers, value, self.clock)
        self.truth.ingest([rec])
        return rec


@pytest.mark.parametrize("tight", [False, True], ids=["default-limits", "tight-limits"])
@pytest.mark.parametrize("seed", range(40))
def test_generated_streams(seed: int, tight: bool) -> None:
    fleet = _Fleet(seed)
    records = [fleet.record() for _ in range(400)]
    rng = random.Random(seed)
    batches, i = [], 0
    while i < len(records):
        n = rng.choice([1, 7, 50, 400])
        batches.append(records[i : i + n])
        i += n
    _assert_same(batches, TIGHT if tight else None)


def test_pending_halves_and_resyncs() -> None:
    """The snapshot durability tests' stream: two-phase joins, token-less
    stores, unresolved chains, clears and resyncs across two namespaces."""
    engine, pool = mixed_stream(3, 600)
    records = [Incoming(False, k, h, v, 1.0 + i / 10) for i, (k, v, h) in enumerate(engine)]
    records += [Incoming(True, k, h, v, 100.0) for k, v, h in pool]
    random.Random(3).shuffle(records)
    _assert_same([records[i : i + 64] for i in range(0, len(records), 64)])


def test_a_direct_record_in_between_is_seen() -> None:
    """`ingest_engine_record` (the Python path) between batches: the lane
    looks the instance up again."""
    fleet = _Fleet(1)
    records = [fleet.record() for _ in range(300)]
    lane, ref = Conductor(), Conductor(lane=False)
    for c in (lane, ref):
        c.ingest(records[:100])
        for rec in records[100:150]:
            if not rec.pool and rec.value is not None:
                with contextlib.suppress(BadRecord):
                    c.ingest_engine_record(rec.key, rec.headers, rec.value, rec.now)
        c.remove_instance("e1")
        c.ingest(records[150:])
    assert state_fingerprint(lane.snapshot_state()) == state_fingerprint(ref.snapshot_state())
    assert +lane.snapshot_state().counters == +ref.snapshot_state().counters
