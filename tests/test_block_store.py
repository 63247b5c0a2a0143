"""The compiled `BlockStore` (kernel/py/src/store.rs) behaves exactly like the
reference `PyBlockStore`: the same random operations on both give the same
return values and the same state after every step.

The hash space is small, so duplicates, conflicting identities, retirement,
eviction at small retired limits, expiry, capacity, clears, snapshot round
trips, owners in several 64-slot words and pools of both tiers all happen.
The cases the random walk found wrong in the reference once are pinned
below, on both stores.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from operator import methodcaller
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from kvconductor.index.answer_shape import PyAnswerShape, new_shape
from kvconductor.index.block_store import BlockStore, PyBlockStore
from kvconductor.kernel import KERNEL
from kvconductor.wire.hashing import chain_identities, pack_tokens
from kvconductor.wire.media import DEVICE, DISK, HOST
from kvconductor.wire.packing import pack_f64, pack_u64, unpack_f64, unpack_u64

pytestmark = pytest.mark.skipif(KERNEL is None, reason="the compiled kernel is not built")

BLOCK = 2
SEED = 1337
# Prompts sharing prefixes; chain k's block i is stored under hash 100k + i.
PROMPTS = [
    list(range(1, 13)),
    [*range(1, 7), *range(40, 46)],
    list(range(60, 72)),
]
CHAINS = [chain_identities(pack_tokens(p), len(p) // BLOCK, BLOCK, SEED) for p in PROMPTS]
IDENTS = sorted({i for chain in CHAINS for i in chain} | {7, 2**64 - 1})
SEQS = [*range(12), 2**63, 2**64 - 1] + [100 * k + i for k in range(len(CHAINS)) for i in range(3)]
SLOTS = [0, 1, 63, 64, 65, 127, 128, 200, 4095]
PIDS = [0, 1, 2]
TIERS = [DEVICE, HOST, DISK]
ROOMS = [-1, 0, 1, 2, 5, 100, 2**70]
LIMITS = [0, 1, 2, 3, 8, sys.maxsize]

seq_lists = st.lists(st.sampled_from(SEQS), max_size=8)


def retired_items(store: BlockStore) -> list[tuple[int, int, float]]:
    seqs, idents, ts = store.export_retired()
    return list(zip(unpack_u64(seqs), unpack_u64(idents), unpack_f64(ts), strict=True))


def restore_retired(store: BlockStore, seq: int, ident: int, ts: float) -> None:
    store.load_retired(pack_u64([seq]), pack_u64([ident]), pack_f64([ts]))


def _compiled(max_retired: int, max_age_s: float) -> BlockStore:
    assert KERNEL is not None
    return KERNEL.BlockStore(max_retired, max_age_s)


def _pairs(packed: tuple[bytes, bytes]) -> list[tuple[int, int]]:
    """An export as (seq, identity) pairs; stores differ in export order."""
    return sorted(zip(unpack_u64(packed[0]), unpack_u64(packed[1]), strict=True))


class Stores(RuleBasedStateMachine):
    """The reference and the compiled store, driven together."""

    ref: PyBlockStore
    rust: BlockStore
    # Slots and pool ids added (and perhaps dropped since: KeyError then).
    owner_slots = Bundle("owner_slots")
    pool_ids = Bundle("pool_ids")

    @initialize(
        target=owner_slots,
        limit=st.sampled_from(LIMITS),
        age=st.sampled_from([0.5, 2.0, 1e9]),
        slots=st.sets(st.sampled_from(SLOTS), min_size=1, max_size=4),
    )
    def start(self, limit: int, age: float, slots: set[int]) -> object:
        self.ref = PyBlockStore(limit, age)
        self.rust = _compiled(limit, age)
        self.versions = (0, 0)
        self.now = 0.0
        self.age = age
        self.holds: list[int] = []  # hashes acquired by hand, to release
        self.owners: set[int] = set()
        self.pools: dict[int, int] = {}  # pid -> tier
        # While a cut is open: the frozen units not read yet, with their
        # hashes at the freeze.
        self.cut: dict[tuple[int, ...], list[int]] | None = None
        for slot in sorted(slots):
            self.add_owner(slot)
        return multiple(*slots)

    def both(self, call: Callable[[Any], Any]) -> Any:
        """`call` on each store: the same result, or the same exception type."""
        out: list[tuple[str, Any]] = []
        for store in (self.ref, self.rust):
            try:
                out.append(("ok", call(store)))
            except Exception as exc:
                out.append(("raised", type(exc)))
        assert out[0] == out[1]
        return out[0][1]

    # ----------------------------------------------------------- catalog

    @rule(step=st.sampled_from([0.0, 0.25, 1.0, 3.0]))
    def advance(self, step: float) -> None:
        self.now += step
        self.both(lambda s: s.set_now(self.now))

    @rule(data=st.data())
    def expire(self, data: st.DataObject) -> None:
        # Now, or just when a retired entry comes of age (kept at the bound).
        times = [self.now] + [ts + self.age for _, _, ts in retired_items(self.ref)]
        now = data.draw(st.sampled_from(times))
        self.both(lambda s: s.expire(now))

    @rule(seq=st.sampled_from(SEQS), ident=st.sampled_from(IDENTS))
    def acquire(self, seq: int, ident: int) -> None:
        self.both(lambda s: s.acquire(seq, ident))
        self.holds.append(seq)

    @precondition(lambda self: self.holds)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        seq = self.holds.pop(data.draw(st.integers(0, len(self.holds) - 1)))
        self.both(lambda s: s.release(seq))

    @rule(seq=st.sampled_from(SEQS), ident=st.sampled_from(IDENTS))
    def remember(self, seq: int, ident: int) -> None:
        self.both(lambda s: s.remember(seq, ident))

    # The reference raises KeyError at limit 0 (test_restore_at_limit_zero).
    @precondition(lambda self: self.ref.retired_limit() > 0)
    @rule(
        seq=st.sampled_from(SEQS),
        ident=st.sampled_from(IDENTS),
        back=st.sampled_from([0.0, 1.0, 5.0]),
    )
    def restore_retired(self, seq: int, ident: int, back: float) -> None:
        self.both(lambda s: restore_retired(s, seq, ident, self.now - back))

    @rule()
    def clear_retired(self) -> None:
        self.both(lambda s: s.clear_retired())

    @rule(limit=st.sampled_from(LIMITS))
    def set_retired_limit(self, limit: int) -> None:
        self.both(lambda s: s.set_retired_limit(limit))

    # ------------------------------------------------------------ owners

    @rule(target=owner_slots, slot=st.sampled_from(SLOTS))
    def add_owner(self, slot: int) -> int:
        if slot not in self.owners:
            self.both(lambda s: s.add_owner(slot))
            self.owners.add(slot)
        return slot

    @rule(slot=owner_slots)
    def drop_owner(self, slot: int) -> None:
        # Only empty owners are dropped (NamespaceIndex's rule).
        if slot not in self.owners or not self.ref.owner_size(slot):
            self.both(lambda s: s.drop_owner(slot))
            self.owners.discard(slot)

    @rule(
        slot=owner_slots,
        tier=st.sampled_from(TIERS),
        seqs=seq_lists,
        data=st.data(),
        room=st.sampled_from(ROOMS),
        as_tuple=st.booleans(),
    )
    def place_owner(
        self,
        slot: int,
        tier: int,
        seqs: list[int],
        data: st.DataObject,
        room: int,
        as_tuple: bool,
    ) -> None:
        idents = data.draw(
            st.none() | st.lists(st.sampled_from(IDENTS), min_size=len(seqs), max_size=len(seqs))
        )
        arg = tuple(seqs) if as_tuple else seqs
        self.both(lambda s: s.place_owner(slot, tier, arg, idents, room))

    @rule(
        slot=owner_slots,
        tier=st.sampled_from(TIERS),
        chain=st.integers(0, len(CHAINS) - 1),
        n=st.integers(1, 3),
    )
    def place_chain(self, slot: int, tier: int, chain: int, n: int) -> None:
        seqs = [100 * chain + i for i in range(n)]
        self.both(lambda s: s.place_owner(slot, tier, seqs, CHAINS[chain][:n], 100))

    @rule(slot=owner_slots, tier=st.sampled_from(TIERS), seqs=seq_lists)
    def count_new(self, slot: int, tier: int, seqs: list[int]) -> None:
        self.both(lambda s: s.count_new(slot, tier, seqs))

    @rule(slot=owner_slots, tier=st.sampled_from(TIERS), seqs=seq_lists)
    def remove_owner(self, slot: int, tier: int, seqs: list[int]) -> None:
        self.both(lambda s: s.remove_owner(slot, tier, seqs))

    @precondition(lambda self: self.owners)
    @rule(data=st.data())
    def clear_owner(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.owners)))
        assert self.rust.clear_owner(slot) == self.ref.clear_owner(slot)

    @rule(slot=owner_slots, tier=st.sampled_from(TIERS))
    def export_owner(self, slot: int, tier: int) -> None:
        self.both(lambda s: _pairs(s.export_owner(slot, tier)))

    # ------------------------------------------------------------- pools

    @rule(target=pool_ids, pid=st.sampled_from(PIDS), tier=st.sampled_from([HOST, DISK]))
    def add_pool(self, pid: int, tier: int) -> int:
        if pid not in self.pools:
            self.both(lambda s: s.add_pool(pid, tier))
            self.pools[pid] = tier
        return pid

    @rule(pid=pool_ids)
    def drop_pool(self, pid: int) -> None:
        if pid not in self.pools or not self.ref.pool_len(pid):
            self.both(lambda s: s.drop_pool(pid))
            self.pools.pop(pid, None)

    @rule(
        pid=pool_ids,
        seqs=seq_lists,
        data=st.data(),
        room=st.sampled_from(ROOMS),
        report=st.booleans(),
    )
    def place_pool(
        self, pid: int, seqs: list[int], data: st.DataObject, room: int, report: bool
    ) -> None:
        idents = data.draw(
            st.none() | st.lists(st.sampled_from(IDENTS), min_size=len(seqs), max_size=len(seqs))
        )

        def place(s: BlockStore) -> tuple[object, list[int] | None]:
            out: list[int] | None = [] if report else None
            return s.place_pool(pid, seqs, idents, room, out), out

        self.both(place)

    @rule(pid=pool_ids, chain=st.integers(0, len(CHAINS) - 1), n=st.integers(1, 3))
    def pool_chain(self, pid: int, chain: int, n: int) -> None:
        seqs = [100 * chain + i for i in range(n)]
        self.both(lambda s: s.place_pool(pid, seqs, CHAINS[chain][:n], 100, None))

    @rule(pid=pool_ids, seq=st.sampled_from(SEQS))
    def remove_pool(self, pid: int, seq: int) -> None:
        self.both(lambda s: s.remove_pool(pid, seq))

    @precondition(lambda self: self.pools)
    @rule(data=st.data())
    def clear_pool(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.pools)))
        assert self.rust.clear_pool(pid) == self.ref.clear_pool(pid)

    @rule(pid=pool_ids)
    def export_pool(self, pid: int) -> None:
        self.both(lambda s: _pairs(s.export_pool(pid)))

    # -------------------------------------------------------------- cuts

    @precondition(lambda self: self.cut is None)
    @rule()
    def freeze_all(self) -> None:
        """A generation's final round: every owner and pool frozen at a cut,
        to be read later whatever changes in between."""
        self.both(lambda s: s.begin_cut())
        self.cut = {}
        for slot in sorted(self.owners):
            for store in (self.ref, self.rust):
                store.freeze_owner(slot)
            for tier in TIERS:
                self.cut[(slot, tier)] = sorted(unpack_u64(self.ref.export_owner(slot, tier)[0]))
        for pid in sorted(self.pools):
            for store in (self.ref, self.rust):
                store.freeze_pool(pid)
            self.cut[(pid,)] = sorted(unpack_u64(self.ref.export_pool(pid)[0]))

    @precondition(lambda self: self.cut)
    @rule(data=st.data())
    def read_cut(self, data: st.DataObject) -> None:
        assert self.cut is not None
        key = data.draw(st.sampled_from(sorted(self.cut)))
        want = self.cut.pop(key)
        for store in (self.ref, self.rust):
            got = store.cut_owner_seqs(*key) if len(key) == 2 else store.cut_pool_seqs(*key)
            assert sorted(unpack_u64(got)) == want

    @precondition(lambda self: self.cut is not None)
    @rule()
    def end_cut(self) -> None:
        self.both(lambda s: s.end_cut())
        self.cut = None

    # ----------------------------------------------------------- restore

    @precondition(lambda self: self.cut is None)
    @rule()
    def round_trip(self) -> None:
        """Both stores rebuilt from the reference's exports, as a restore
        from snapshots does: tiers and pools loaded, then the hand-held
        references (like pinned intents), retired entries last."""
        owners = {
            slot: [self.ref.export_owner(slot, tier) for tier in TIERS]
            for slot in sorted(self.owners)
        }
        pools = {pid: self.ref.export_pool(pid) for pid in sorted(self.pools)}
        limit = self.ref.retired_limit()
        retired = self.ref.export_retired()
        before = self.ref.dump()
        before_content: dict[int, int] = before["content"]  # type: ignore[assignment]
        fresh: list[BlockStore] = [PyBlockStore(sys.maxsize, 1e9), _compiled(sys.maxsize, 1e9)]
        for store in fresh:
            store.set_now(self.now)
            for slot, tiers in owners.items():
                store.add_owner(slot)
                for tier, (seqs, idents) in zip(TIERS, tiers, strict=True):
                    if seqs:
                        store.load_owner(slot, tier, seqs, idents)
            for pid, (seqs, idents) in pools.items():
                store.add_pool(pid, self.pools[pid])
                store.load_pool(pid, seqs, idents)
            for seq in self.holds:
                store.acquire(seq, before_content[seq])
            store.load_retired(*retired)
            store.set_retired_limit(limit)
            assert store.dump() == before
        self.ref, self.rust = fresh  # type: ignore[assignment]
        self.versions = (self.ref.retired_version(), self.rust.retired_version())

    # ------------------------------------------------------------- query

    @rule(
        chain=st.integers(0, len(CHAINS) - 1),
        n=st.integers(0, len(PROMPTS[0]) // BLOCK),
        data=st.data(),
    )
    def match(self, chain: int, n: int, data: st.DataObject) -> None:
        listed_slots = data.draw(st.sets(st.sampled_from(sorted(self.owners) or SLOTS)))
        if data.draw(st.booleans()):
            listed_slots |= self.owners
        listed = sum(1 << slot for slot in listed_slots)
        tokens = pack_tokens(PROMPTS[chain][: n * BLOCK])
        idents = CHAINS[chain][:n]
        want = self.ref.match_tokens(tokens, BLOCK, SEED, listed)
        assert self.rust.match_tokens(tokens, BLOCK, SEED, listed) == want
        assert self.ref.match_identities(idents, listed) == want
        assert self.rust.match_identities(idents, listed) == want
        assert self.rust.match_identities(tuple(idents), listed) == want
        by_seq = self.both(lambda s: s.identities_of([100 * chain + i for i in range(n)]))
        self.both(lambda s: s.match_identities(by_seq, listed))
        # The answers written by the walk: owners in pairs, one instance each.
        layout = [(f"i{s // 2}", [(s % 2, s)]) for s in sorted(self.owners)]
        merged: dict[str, list[tuple[int, int]]] = {}
        for name, ranks in layout:
            merged.setdefault(name, []).extend(ranks)
        shapes = [PyAnswerShape("t", BLOCK, list(merged.items()))]
        shapes.append(new_shape("t", BLOCK, list(merged.items())))
        answer = shapes[0].shape_json(want)
        assert self.ref.match_tokens_json(tokens, BLOCK, SEED, listed, shapes[0]) == answer
        assert self.rust.match_tokens_json(tokens, BLOCK, SEED, listed, shapes[1]) == answer
        assert self.rust.match_identities_json(idents, listed, shapes[1]) == answer

    # -------------------------------------------------------- invariants

    @invariant()
    def same_state(self) -> None:
        assert self.rust.dump() == self.ref.dump()
        for name in ("content_len", "retired_len", "export_retired", "retired_limit"):
            self.both(methodcaller(name))
        for slot in self.owners:
            self.both(methodcaller("owner_size", slot))
        for pid in self.pools:
            self.both(methodcaller("pool_len", pid))
        for ident in IDENTS:
            self.both(methodcaller("pool_holds", ident))
        for seq in SEQS:
            self.both(methodcaller("ident", seq))
        # Versions differ in value (two counters) but change together.
        versions = (self.ref.retired_version(), self.rust.retired_version())
        changed = [now != then for now, then in zip(versions, self.versions, strict=True)]
        assert changed[0] == changed[1]
        self.versions = versions


Stores.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestStores = Stores.TestCase


# ------------------------------------------ found by the random walk once


_both_stores = pytest.mark.parametrize(
    "make", [pytest.param(PyBlockStore, id="reference"), pytest.param(_compiled, id="compiled")]
)


@_both_stores
def test_load_takes_retired_content_back(make: Callable[[int, float], BlockStore]) -> None:
    # A load is "the same result as placing block by block": the catalog's
    # identity wins and the entry leaves the retired queue.
    store = make(10, 1e9)
    store.remember(5, 50)
    store.add_owner(0)
    store.load_owner(0, HOST, pack_u64([5]), pack_u64([51]))
    assert store.ident(5) == 50
    assert retired_items(store) == []
    assert _pairs(store.export_owner(0, HOST)) == [(5, 50)]


@_both_stores
def test_clear_retires_in_hash_order(make: Callable[[int, float], BlockStore]) -> None:
    store = make(10, 1e9)
    store.add_owner(0)
    store.place_owner(0, DEVICE, [3, 1, 2], [30, 10, 20], 10)
    store.clear_owner(0)
    assert [seq for seq, _, _ in retired_items(store)] == [1, 2, 3]


@_both_stores
def test_restore_at_limit_zero(make: Callable[[int, float], BlockStore]) -> None:
    store = make(0, 1e9)
    restore_retired(store, 5, 50, 0.0)
    assert store.content_len() == 0


# ------------------------------------------------------------ edge cases


@pytest.mark.parametrize("make", [PyBlockStore, _compiled])
def test_errors(make: Callable[[int, float], BlockStore]) -> None:
    store = make(10, 1e9)
    with pytest.raises(KeyError):
        store.place_owner(3, DEVICE, [1], [1], 10)
    with pytest.raises(KeyError):
        store.remove_pool(3, 1)
    store.add_owner(3)
    with pytest.raises(ValueError):
        store.load_owner(3, DEVICE, pack_u64([1, 2]), pack_u64([1]))
    with pytest.raises(ValueError):
        store.load_owner(3, DEVICE, b"\0" * 9, b"\0" * 9)
    store.add_pool(1, HOST)
    with pytest.raises(ValueError):
        store.load_pool(1, pack_u64([1]), b"")
    with pytest.raises(KeyError):
        store.release(99)
    with pytest.raises(ValueError):
        store.load_retired(pack_u64([1]), pack_u64([1]), b"")


def test_wide_slots_and_full_range_hashes() -> None:
    """Owners in many words and u64 extremes: the masks are Python ints
    over every slot, and the walk sees all words."""
    ref, rust = PyBlockStore(10, 1e9), _compiled(10, 1e9)
    slots = [0, 64, 1000, 4095]
    top = 2**64 - 1
    chain = CHAINS[0][:4]
    for store in (ref, rust):
        for k, slot in enumerate(slots):
            store.add_owner(slot)
            store.place_owner(slot, DEVICE, [top - i for i in range(k + 1)], chain[: k + 1], 10)
    assert rust.dump() == ref.dump()
    listed = sum(1 << s for s in slots) | (1 << 2000)
    tokens = pack_tokens(PROMPTS[0])
    want = ref.match_tokens(tokens, BLOCK, SEED, listed)
    assert want == [(0, 1, 1, 1), (64, 2, 2, 2), (1000, 3, 3, 3), (2000, 0, 0, 0), (4095, 4, 4, 4)]
    assert rust.match_tokens(tokens, BLOCK, SEED, listed) == want


def test_heavy_churn_in_large_maps() -> None:
    """Thousands of placements and removals in random order over a few
    owners and pools: the compiled query maps (open addressing, deletion by
    backward shift) grow, wrap runs around and shrink to empty, and must
    hold exactly what the reference holds, probe for probe."""
    rng = random.Random(5)
    ref, rust = PyBlockStore(0, 1e9), _compiled(0, 1e9)
    seqs = [rng.getrandbits(64) | 1 for _ in range(6000)]
    for store in (ref, rust):
        for slot in (0, 1, 70):
            store.add_owner(slot)
        store.add_pool(1, HOST)
    for step in range(40):
        for store in (ref, rust):
            rng_s = random.Random(step)
            for slot in (0, 1, 70):
                tier = (DEVICE, HOST)[rng_s.randrange(2)]
                picked = rng_s.sample(seqs, 300)
                # Identities shared between owners: the masks hold several bits.
                store.place_owner(slot, tier, picked, [s % 2500 for s in picked], 10**9)
                gone = rng_s.sample(picked, 200)
                store.remove_owner(slot, tier, gone)
            pooled = rng_s.sample(seqs, 200)
            store.place_pool(1, pooled, [s % 2500 for s in pooled], 10**9, [])
            store.remove_pool(1, rng_s.choice(pooled))
        assert ref.dump() == rust.dump(), step
        prompt = [s % 2500 for s in rng.sample(seqs, 64)]
        for listed in (1, 3, (1 << 70) | 3):
            assert ref.match_identities(prompt, listed) == rust.match_identities(prompt, listed)
    for store in (ref, rust):
        for slot in (0, 1, 70):
            store.clear_owner(slot)
        store.clear_pool(1)
    assert ref.dump() == rust.dump()


def test_maps_split_into_shards_past_their_threshold() -> None:
    """Past 65,536 keys the compiled catalog and query maps split into
    shards that grow one at a time (kernel/core/src/maps/sharded.rs): through the
    split, single shards' growth, removals and a bulk load they hold what
    the reference holds, and queries agree."""
    rng = random.Random(11)
    ref, rust = PyBlockStore(5000, 1e9), _compiled(5000, 1e9)
    n = 90_000
    seqs = [rng.getrandbits(64) | 1 for _ in range(n)]
    idents = [rng.getrandbits(64) | 1 for _ in range(n)]
    for store in (ref, rust):
        for slot in (0, 1):
            store.add_owner(slot)
        store.add_pool(1, HOST)
        for i in range(0, n, 3000):  # a record at a time: the split falls mid-way
            store.place_owner(0, DEVICE, seqs[i : i + 3000], idents[i : i + 3000], 10**9)
        store.place_owner(1, HOST, seqs[::2], idents[::2], 10**9)
        store.place_pool(1, seqs[1::3], idents[1::3], 10**9, [])
        store.remove_owner(0, DEVICE, seqs[: 2 * n // 3 : 2])
        for seq in seqs[1:30_000:3]:
            store.remove_pool(1, seq)
    assert ref.dump() == rust.dump()
    for start in (0, 1, 40_000, 70_000):
        prompt = idents[start : start + 64]
        for listed in (1, 2, 3):
            assert rust.match_identities(prompt, listed) == ref.match_identities(prompt, listed)
    loaded = _compiled(5000, 1e9)
    loaded.add_owner(0)
    loaded.load_owner(0, DEVICE, *rust.export_owner(0, DEVICE))
    assert sorted(unpack_u64(loaded.export_owner(0, DEVICE)[0])) == sorted(
        unpack_u64(rust.export_owner(0, DEVICE)[0])
    )
    assert loaded.match_identities(idents[70_000:70_064], 1) == rust.match_identities(
        idents[70_000:70_064], 1
    )


@pytest.mark.parametrize("make", [PyBlockStore, _compiled])
def test_a_cut_keeps_the_identities_it_saw(make: Callable[[int, float], BlockStore]) -> None:
    """A snapshot exports hashes at its cut and reads their identities
    after it, with records applied in between: content the catalog forgets
    meanwhile (by count, by age, cleared, or learnt again under another
    identity) is still read as it was at the cut."""
    store = make(2, 10.0)
    store.add_owner(0)
    seqs = [11, 12, 13, 14]
    store.place_owner(0, DEVICE, seqs, [101, 102, 103, 104], 10)
    with pytest.raises(AssertionError):
        store.cut_identities(pack_u64(seqs))
    store.begin_cut()
    store.freeze_owner(0)
    at_cut = store.cut_owner_seqs(0, DEVICE)
    assert sorted(unpack_u64(at_cut)) == seqs
    store.remove_owner(0, DEVICE, seqs)  # all retired; the bound of 2 forgets two
    store.set_now(100.0)
    store.expire(100.0)  # and age forgets the rest
    assert store.content_len() == 0
    store.place_owner(0, DEVICE, [11], [999], 10)  # learnt again, another identity
    want = {11: 101, 12: 102, 13: 103, 14: 104}
    assert unpack_u64(store.cut_identities(at_cut)) == [want[s] for s in unpack_u64(at_cut)]
    with pytest.raises(KeyError):
        store.cut_identities(pack_u64([15]))
    store.end_cut()
    assert store.ident(11) == 999
    with pytest.raises(AssertionError):
        store.end_cut()


@pytest.mark.parametrize("make", [PyBlockStore, _compiled])
def test_a_cut_reads_frozen_blocks_as_they_were(make: Callable[[int, float], BlockStore]) -> None:
    """A snapshot's final round only freezes owner and pool units; their
    hashes are read after it, with records applied in between. A tier or
    pool changed (or dropped) before it is read still reads as it was at
    the freeze; one left alone reads live; each is read once."""
    store = make(100, 10.0)
    for slot in (0, 1, 2):
        store.add_owner(slot)
        store.place_owner(slot, DEVICE, [slot * 10 + 1, slot * 10 + 2], [7, 8], 10)
    store.place_owner(0, HOST, [5], [9], 10)
    store.add_pool(4, HOST)
    store.place_pool(4, [41, 42], [7, 8], 10, None)
    with pytest.raises(AssertionError):
        store.freeze_owner(0)  # no cut open
    store.begin_cut()
    with pytest.raises(KeyError):
        store.freeze_owner(9)
    with pytest.raises(KeyError):
        store.freeze_pool(9)
    for slot in (0, 1, 2):
        store.freeze_owner(slot)
    store.freeze_pool(4)
    store.place_owner(0, DEVICE, [3], [9], 10)  # changed: kept as at the freeze
    store.remove_owner(0, HOST, [5])
    store.clear_owner(1)
    store.drop_owner(1)  # changed, then gone
    store.remove_pool(4, 41)
    store.place_pool(4, [43], [9], 10, None)
    store.add_owner(1)  # the slot again, another owner
    store.place_owner(1, DEVICE, [99], [9], 10)

    def read(slot: int, tier: int) -> list[int]:
        return sorted(unpack_u64(store.cut_owner_seqs(slot, tier)))

    assert read(0, DEVICE) == [1, 2]
    assert read(0, HOST) == [5]
    assert read(0, DISK) == []
    assert read(1, DEVICE) == [11, 12]
    assert read(2, DEVICE) == [21, 22]  # untouched: read live
    assert sorted(unpack_u64(store.cut_pool_seqs(4))) == [41, 42]
    with pytest.raises(AssertionError):
        store.cut_owner_seqs(0, DEVICE)  # read once
    with pytest.raises(AssertionError):
        store.cut_pool_seqs(4)
    store.place_owner(2, HOST, [23], [9], 10)  # no longer frozen: nothing kept
    store.end_cut()
    store.begin_cut()
    with pytest.raises(AssertionError):
        store.cut_owner_seqs(1, HOST)  # frozen at the cut before: forgotten at its end
    store.end_cut()


@pytest.mark.parametrize(
    ("seqs", "error"),
    [
        ([1, -1], OverflowError),
        ([1, 2**64], OverflowError),
        ([1, "2"], TypeError),
        ([1.0], TypeError),
    ],
)
def test_the_compiled_store_refuses_hashes_outside_u64(
    seqs: list[object], error: type[Exception]
) -> None:
    """Hash lists are read in place when every item is an exact int; any
    other item takes the per-item conversion, which raises as before."""
    store = _compiled(8, 10.0)
    store.add_owner(0)
    with pytest.raises(error):
        store.place_owner(0, DEVICE, seqs, None, 10)
    with pytest.raises(error):
        store.count_new(0, DEVICE, seqs)
    # An int subclass is an int: taken the slow way, with the same result.
    assert store.count_new(0, DEVICE, [True, 2]) == store.count_new(0, DEVICE, [1, 2]) == 2
