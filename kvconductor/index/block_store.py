"""A namespace's per-block state, behind one interface with two builds.

`BlockStore` holds everything a namespace keeps per block: the content
catalog (sequence hash -> identity, with its holders' reference count, and
the retired entries kept for late halves), the owner tiers, the pool stores,
and the per-tier owner bitmasks and pool counts that queries walk. The
two-phase rules (what waits for what) stay in `NamespaceIndex`; the store
only does the per-block work, one call per event, so that its loops can run
compiled.

`PyBlockStore` (here) is the reference, in plain dicts; the compiled one
(`kernel/py/src/store.rs`) must behave exactly the same (tests/test_block_store.py
drives both with the same random operations and compares `dump()`s).
`new_store` picks the compiled one when the kernel is built and allowed.

Owners are addressed by slot (their bit in the masks), pool stores by an id
the namespace gives them. Packed arrays are little-endian u64, the snapshot
format's.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from typing import Protocol

import xxhash

from kvconductor.index.pending import RETIRED, PendingKey, PendingQueue
from kvconductor.kernel import KERNEL
from kvconductor.wire.media import DEVICE, DISK, HOST
from kvconductor.wire.packing import pack_f64, pack_u64, unpack_f64, unpack_u64

if KERNEL is not None:
    from kvconductor import _kernel

_xxh3 = xxhash.xxh3_64_intdigest

# (slot, GPU, CPU, DISK) blocks matched, per listed owner slot.
Matched = list[tuple[int, int, int, int]]
# place_*: (placed, dropped at capacity, hash conflicts, hashes left to wait)
Placed = tuple[int, int, int, list[int]]


class JsonShape(Protocol):
    """What the `*_json` walks need of an `answer_shape.AnswerShape`."""

    def shape_json(self, lengths: Matched) -> bytes: ...


class BlockStore(Protocol):
    # --------------------------------------------------------- catalog
    def set_now(self, now: float) -> None:
        """The event clock retired entries age by."""

    def ident(self, seq: int) -> int | None: ...

    def identities_of(self, seqs: Sequence[int]) -> list[int]:
        """Identities of `seqs` up to the first unknown one."""

    def acquire(self, seq: int, ident: int) -> int:
        """Take a reference on `seq`'s content; its canonical identity."""

    def release(self, seq: int) -> None: ...

    def remember(self, seq: int, ident: int) -> None:
        """Known content nobody holds: keep it (retired) for late halves."""

    def pool_holds(self, ident: int) -> bool:
        """Whether any pool store holds this content."""

    def content_len(self) -> int: ...

    # --------------------------------------------------------- retired
    def expire(self, now: float) -> None: ...

    def retired_len(self) -> int: ...

    def retired_version(self) -> int:
        """Changes whenever the retired entries change."""

    def export_retired(self) -> tuple[bytes, bytes, bytes]:
        """The retired entries oldest first, as packed arrays: sequence
        hashes and identities (`pack_u64`), times retired (`pack_f64`)."""

    def load_retired(self, seqs: bytes, idents: bytes, ts: bytes) -> None:
        """Retire `export_retired`'s entries in that order, each unless the
        catalog knows its hash."""

    def clear_retired(self) -> None: ...

    def begin_cut(self) -> None:
        """From now until `end_cut`, the identity each sequence hash has now
        stays readable by `cut_identities`, whatever the catalog forgets
        meanwhile (a snapshot exports hashes at its cut and their
        identities after it, with records applied in between)."""

    def end_cut(self) -> None: ...

    def cut_identities(self, seqs: bytes) -> bytes:
        """The identities the packed hashes had at `begin_cut`, packed;
        KeyError for one the catalog did not know then."""

    def retired_limit(self) -> int: ...

    def set_retired_limit(self, limit: int) -> None: ...

    # ---------------------------------------------------------- owners
    def add_owner(self, slot: int) -> None: ...

    def drop_owner(self, slot: int) -> None:
        """Free an empty owner's slot."""

    def owner_size(self, slot: int) -> int: ...

    def tier_len(self, slot: int, tier: int) -> int: ...

    def count_new(self, slot: int, tier: int, seqs: Sequence[int]) -> int:
        """How many of `seqs` the owner's tier does not hold."""

    def place_owner(
        self, slot: int, tier: int, seqs: Sequence[int], idents: Sequence[int] | None, room: int
    ) -> Placed:
        """Place blocks in an owner's tier, at most `room` new ones.

        With `idents` every block's content is given; without, the blocks
        whose content the catalog knows are placed and the others neither
        known nor held are returned, to wait."""

    def remove_owner(self, slot: int, tier: int, seqs: Sequence[int]) -> list[int]:
        """Remove blocks; returns the hashes the tier did not hold."""

    def clear_owner(self, slot: int) -> int: ...

    def export_owner(self, slot: int, tier: int) -> tuple[bytes, bytes]:
        """(seqs, identities), packed."""

    def freeze_owner(self, slot: int) -> None:
        """At an open cut: `cut_owner_seqs` reads the owner's tiers as they
        are now, whatever changes them (or drops the owner) before; the
        first change of a tier keeps a copy of its hashes."""

    def cut_owner_seqs(self, slot: int, tier: int) -> bytes:
        """A frozen tier's hashes at its freeze, packed, once (their
        identities: `cut_identities`)."""

    def load_owner(self, slot: int, tier: int, seqs: bytes, idents: bytes) -> None:
        """Bulk-load a snapshot's tier into an empty owner tier."""

    # ----------------------------------------------------------- pools
    def add_pool(self, pid: int, tier: int) -> None: ...

    def drop_pool(self, pid: int) -> None: ...

    def pool_len(self, pid: int) -> int: ...

    def place_pool(
        self,
        pid: int,
        seqs: Sequence[int],
        idents: Sequence[int] | None,
        room: int,
        placed_out: list[int] | None,
    ) -> Placed:
        """`place_owner` for a pool store; the hashes it newly holds are
        appended to `placed_out` (their offload intents are consumed)."""

    def remove_pool(self, pid: int, seq: int) -> bool: ...

    def clear_pool(self, pid: int) -> int: ...

    def export_pool(self, pid: int) -> tuple[bytes, bytes]: ...

    def freeze_pool(self, pid: int) -> None:
        """`freeze_owner` for a pool store."""

    def cut_pool_seqs(self, pid: int) -> bytes: ...

    def load_pool(self, pid: int, seqs: bytes, idents: bytes) -> None: ...

    # ----------------------------------------------------------- query
    def match_tokens(self, data: bytes, block_size: int, seed: int, listed: int) -> Matched:
        """The tier walk of `kvconductor.index.query` over packed u32 tokens."""

    def match_identities(self, idents: Sequence[int], listed: int) -> Matched: ...

    def match_tokens_json(
        self, data: bytes, block_size: int, seed: int, listed: int, shape: JsonShape
    ) -> bytes:
        """`shape.shape_json(match_tokens(...))`, the HTTP API's answer: the
        compiled store never makes the lengths Python objects (at 10,000
        owners their tuples were most of an answer listing them all). The
        shape is of the same build as the store."""

    def match_identities_json(self, idents: Sequence[int], listed: int, shape: JsonShape) -> bytes:
        """`shape.shape_json(match_identities(...))`, likewise."""

    # ----------------------------------------------------------- tests
    def dump(self) -> dict[str, object]:
        """Every map, as plain Python, for comparing stores in tests."""


class _Owner:
    __slots__ = ("bit", "dups", "tiers")

    def __init__(self, slot: int) -> None:
        self.bit = 1 << slot
        self.tiers: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        # (tier, identity) -> holders beyond the first, when two sequence
        # hashes of one owner name the same content.
        self.dups: dict[tuple[int, int], int] = {}


class _Pool:
    __slots__ = ("blocks", "tier")

    def __init__(self, tier: int) -> None:
        self.tier = tier
        self.blocks: dict[int, int] = {}


class PyBlockStore:
    """The reference store: dicts keyed by sequence hash and identity.

    - `content` / `refs`: the catalog and its holders' counts; an entry
      without holders is retired, queued by age and count;
    - `masks[tier]`: identity -> bitmask of owner slots holding it;
    - `pool_counts[tier]`: identity -> pool stores holding it (a pool serves
      every rank of the namespace, so it needs no owner bits);
    - owners' tiers and pool stores: sequence hash -> identity, always the
      catalog's identity for that hash (the first one it learnt)."""

    def __init__(self, max_retired: int, max_age_s: float) -> None:
        self.content: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.retired = PendingQueue(max_retired, max_age_s, self._on_retired_drop)
        self.masks: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        self.pool_counts: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        self.owners: dict[int, _Owner] = {}
        self.pools: dict[int, _Pool] = {}
        self.now = 0.0
        # While a cut is open: what the catalog forgot since, with its identity.
        self.forgotten: dict[int, int] | None = None
        self.cuts = 0
        # Frozen at the open cut, not read yet; and kept, once changed.
        self.frozen_tiers: set[tuple[int, int]] = set()
        self.frozen_pools: set[int] = set()
        self.kept_tiers: dict[tuple[int, int], bytes] = {}
        self.kept_pools: dict[int, bytes] = {}

    # --------------------------------------------------------- catalog

    def set_now(self, now: float) -> None:
        self.now = now

    def ident(self, seq: int) -> int | None:
        return self.content.get(seq)

    def identities_of(self, seqs: Sequence[int]) -> list[int]:
        content = self.content
        out: list[int] = []
        for seq in seqs:
            ident = content.get(seq)
            if ident is None:
                break
            out.append(ident)
        return out

    def acquire(self, seq: int, ident: int) -> int:
        cur = self.content.get(seq)
        if cur is None:
            self.content[seq] = ident
            self.refs[seq] = 1
            return ident
        held = self.refs.get(seq)
        if held is None:
            self.retired.discard((RETIRED, seq))
            self.refs[seq] = 1
        else:
            self.refs[seq] = held + 1
        return cur

    def release(self, seq: int) -> None:
        left = self.refs[seq] - 1
        if left:
            self.refs[seq] = left
        else:
            del self.refs[seq]
            self.retired.add((RETIRED, seq), self.now)

    def remember(self, seq: int, ident: int) -> None:
        self._retire_new(seq, ident, self.now)

    def _retire_new(self, seq: int, ident: int, ts: float) -> None:
        """Known content nobody holds, retired at `ts`, unless the catalog has it."""
        if seq not in self.content:
            # Content first: at a bound of 0 the add evicts it at once.
            self.content[seq] = ident
            self.retired.add((RETIRED, seq), ts)

    def _on_retired_drop(self, key: PendingKey, why: str) -> None:
        seq: int = key[1]
        if seq not in self.refs:
            self._forget(seq)

    def _forget(self, seq: int) -> None:
        ident = self.content.pop(seq, None)
        if ident is not None and self.forgotten is not None:
            self.forgotten.setdefault(seq, ident)

    def pool_holds(self, ident: int) -> bool:
        return ident in self.pool_counts[HOST] or ident in self.pool_counts[DISK]

    def content_len(self) -> int:
        return len(self.content)

    # --------------------------------------------------------- retired

    def expire(self, now: float) -> None:
        self.retired.expire(now)

    def retired_len(self) -> int:
        return len(self.retired)

    def retired_version(self) -> int:
        return self.retired.version

    def export_retired(self) -> tuple[bytes, bytes, bytes]:
        items = [(key[1], ts) for key, ts in self.retired]
        return (
            pack_u64(seq for seq, _ in items),
            pack_u64(self.content[seq] for seq, _ in items),
            pack_f64(ts for _, ts in items),
        )

    def load_retired(self, seqs: bytes, idents: bytes, ts: bytes) -> None:
        s, i, t = unpack_u64(seqs), unpack_u64(idents), unpack_f64(ts)
        if not len(s) == len(i) == len(t):
            raise ValueError("retired arrays of different lengths")
        for seq, ident, at in zip(s, i, t, strict=True):
            self._retire_new(seq, ident, at)

    def clear_retired(self) -> None:
        for key, _ in self.retired:
            self.retired.discard(key)
            seq = key[1]
            if seq not in self.refs:
                self._forget(seq)

    def begin_cut(self) -> None:
        self.cuts += 1
        if self.forgotten is None:
            self.forgotten = {}

    def end_cut(self) -> None:
        if not self.cuts:
            raise AssertionError("end_cut without begin_cut")
        self.cuts -= 1
        if not self.cuts:
            self.forgotten = None
            self.frozen_tiers.clear()
            self.frozen_pools.clear()
            self.kept_tiers.clear()
            self.kept_pools.clear()

    def _cut_open(self) -> None:
        if not self.cuts:
            raise AssertionError("no cut is open")

    def freeze_owner(self, slot: int) -> None:
        self._cut_open()
        if slot not in self.owners:
            raise KeyError(slot)
        for tier in (DEVICE, HOST, DISK):
            self.kept_tiers.pop((slot, tier), None)
            self.frozen_tiers.add((slot, tier))

    def cut_owner_seqs(self, slot: int, tier: int) -> bytes:
        self._keep_tier(slot, tier)  # unchanged since the freeze: kept as it is
        kept = self.kept_tiers.pop((slot, tier), None)
        if kept is None:
            raise AssertionError("owner tier not frozen at this cut")
        return kept

    def freeze_pool(self, pid: int) -> None:
        self._cut_open()
        if pid not in self.pools:
            raise KeyError(pid)
        self.kept_pools.pop(pid, None)
        self.frozen_pools.add(pid)

    def cut_pool_seqs(self, pid: int) -> bytes:
        self._keep_pool(pid)  # unchanged since the freeze: kept as it is
        kept = self.kept_pools.pop(pid, None)
        if kept is None:
            raise AssertionError("pool not frozen at this cut")
        return kept

    def _keep_tier(self, slot: int, tier: int) -> None:
        """Before an owner's tier changes or goes."""
        frozen = self.frozen_tiers
        if frozen and (slot, tier) in frozen:
            frozen.discard((slot, tier))
            self.kept_tiers[(slot, tier)] = pack_u64(list(self.owners[slot].tiers[tier]))

    def _keep_pool(self, pid: int) -> None:
        """Before a pool store's blocks change or go."""
        frozen = self.frozen_pools
        if frozen and pid in frozen:
            frozen.discard(pid)
            self.kept_pools[pid] = pack_u64(list(self.pools[pid].blocks))

    def cut_identities(self, seqs: bytes) -> bytes:
        kept = self.forgotten
        if kept is None:
            raise AssertionError("no cut is open")
        content = self.content
        return pack_u64(kept[s] if s in kept else content[s] for s in unpack_u64(seqs))

    def retired_limit(self) -> int:
        return self.retired.max_entries

    def set_retired_limit(self, limit: int) -> None:
        self.retired.max_entries = limit

    # ---------------------------------------------------------- owners

    def add_owner(self, slot: int) -> None:
        self.owners[slot] = _Owner(slot)

    def drop_owner(self, slot: int) -> None:
        for tier in (DEVICE, HOST, DISK):
            self._keep_tier(slot, tier)
        del self.owners[slot]

    def owner_size(self, slot: int) -> int:
        t = self.owners[slot].tiers
        return len(t[0]) + len(t[1]) + len(t[2])

    def tier_len(self, slot: int, tier: int) -> int:
        return len(self.owners[slot].tiers[tier])

    def count_new(self, slot: int, tier: int, seqs: Sequence[int]) -> int:
        held = self.owners[slot].tiers[tier]
        return sum(1 for s in seqs if s not in held)

    def place_owner(
        self, slot: int, tier: int, seqs: Sequence[int], idents: Sequence[int] | None, room: int
    ) -> Placed:
        self._keep_tier(slot, tier)
        owner = self.owners[slot]

        def place(seqs: Sequence[int], idents: Sequence[int] | None) -> tuple[int, int, int]:
            return self._place_owner(owner, tier, seqs, idents, room)

        return self._place_known(seqs, idents, owner.tiers[tier], place)

    def _place_known(
        self,
        seqs: Sequence[int],
        idents: Sequence[int] | None,
        held: Container[int],
        place: Callable[[Sequence[int], Sequence[int] | None], tuple[int, int, int]],
    ) -> Placed:
        """`place` all of `seqs` when `idents` gives their content; else the
        ones the catalog knows, and return the rest (not held) to wait."""
        if idents is not None:
            return (*place(seqs, idents), [])
        content = self.content
        placed = place([seq for seq in seqs if seq in content], None)
        return (*placed, [seq for seq in seqs if seq not in content and seq not in held])

    def _place_owner(
        self,
        owner: _Owner,
        tier: int,
        seqs: Sequence[int],
        idents: Sequence[int] | None,
        room: int,
    ) -> tuple[int, int, int]:
        tmap = owner.tiers[tier]
        masks = self.masks[tier]
        bit = owner.bit
        content = self.content
        refs = self.refs
        placed = dropped = conflicts = 0
        for k, seq in enumerate(seqs):
            if seq in tmap:
                continue
            if placed >= room:
                dropped = len(seqs) - k
                break
            cur = content.get(seq)
            if cur is None:
                assert idents is not None
                ident = idents[k]
                content[seq] = ident
                refs[seq] = 1
            else:
                ident = cur
                held = refs.get(seq)
                if held is None:
                    self.retired.discard((RETIRED, seq))
                    refs[seq] = 1
                else:
                    refs[seq] = held + 1
                if idents is not None and idents[k] != cur:
                    conflicts += 1
            tmap[seq] = ident
            m = masks.get(ident, 0)
            if m & bit:
                dk = (tier, ident)
                owner.dups[dk] = owner.dups.get(dk, 0) + 1
            else:
                masks[ident] = m | bit
            placed += 1
        return placed, dropped, conflicts

    def remove_owner(self, slot: int, tier: int, seqs: Sequence[int]) -> list[int]:
        self._keep_tier(slot, tier)
        owner = self.owners[slot]
        return [seq for seq in seqs if not self._unplace_owner(owner, tier, seq)]

    def _unplace_owner(self, owner: _Owner, tier: int, seq: int) -> bool:
        ident = owner.tiers[tier].pop(seq, None)
        if ident is None:
            return False
        dk = (tier, ident)
        extra = owner.dups.get(dk)
        if extra:
            if extra == 1:
                del owner.dups[dk]
            else:
                owner.dups[dk] = extra - 1
        else:
            masks = self.masks[tier]
            m = masks[ident] & ~owner.bit
            if m:
                masks[ident] = m
            else:
                del masks[ident]
        self.release(seq)
        return True

    def clear_owner(self, slot: int) -> int:
        owner = self.owners[slot]
        removed = 0
        # In hash order: the order blocks retire in decides which go first
        # at the retired bound, and a hash set (the compiled store) has no
        # other order to keep.
        for tier in (DEVICE, HOST, DISK):
            self._keep_tier(slot, tier)
            for seq in sorted(owner.tiers[tier]):
                self._unplace_owner(owner, tier, seq)
                removed += 1
        return removed

    def export_owner(self, slot: int, tier: int) -> tuple[bytes, bytes]:
        t = self.owners[slot].tiers[tier]
        return pack_u64(list(t.keys())), pack_u64(list(t.values()))

    def load_owner(self, slot: int, tier: int, seqs: bytes, idents: bytes) -> None:
        self._keep_tier(slot, tier)
        owner = self.owners[slot]
        s, i = unpack_u64(seqs), unpack_u64(idents)
        if len(s) != len(i):
            raise ValueError("a tier's hashes and identities differ in count")
        assert not owner.tiers[tier], "load_owner is for an empty tier"
        self._place_owner(owner, tier, s, i, sys.maxsize)

    # ----------------------------------------------------------- pools

    def add_pool(self, pid: int, tier: int) -> None:
        self.pools[pid] = _Pool(tier)

    def drop_pool(self, pid: int) -> None:
        self._keep_pool(pid)
        del self.pools[pid]

    def pool_len(self, pid: int) -> int:
        return len(self.pools[pid].blocks)

    def place_pool(
        self,
        pid: int,
        seqs: Sequence[int],
        idents: Sequence[int] | None,
        room: int,
        placed_out: list[int] | None,
    ) -> Placed:
        self._keep_pool(pid)
        store = self.pools[pid]

        def place(seqs: Sequence[int], idents: Sequence[int] | None) -> tuple[int, int, int]:
            return self._place_pool(store, seqs, idents, room, placed_out)

        return self._place_known(seqs, idents, store.blocks, place)

    def _place_pool(
        self,
        store: _Pool,
        seqs: Sequence[int],
        idents: Sequence[int] | None,
        room: int,
        placed_out: list[int] | None,
    ) -> tuple[int, int, int]:
        blocks = store.blocks
        counts = self.pool_counts[store.tier]
        placed = dropped = conflicts = 0
        for k, seq in enumerate(seqs):
            if seq in blocks:
                continue
            if placed >= room:
                dropped = len(seqs) - k
                break
            given = idents[k] if idents is not None else self.content[seq]
            ident = self.acquire(seq, given)
            if ident != given:
                conflicts += 1
            blocks[seq] = ident
            counts[ident] = counts.get(ident, 0) + 1
            if placed_out is not None:
                placed_out.append(seq)
            placed += 1
        return placed, dropped, conflicts

    def remove_pool(self, pid: int, seq: int) -> bool:
        self._keep_pool(pid)
        store = self.pools[pid]
        ident = store.blocks.pop(seq, None)
        if ident is None:
            return False
        counts = self.pool_counts[store.tier]
        left = counts[ident] - 1
        if left:
            counts[ident] = left
        else:
            del counts[ident]
        self.release(seq)
        return True

    def clear_pool(self, pid: int) -> int:
        seqs = sorted(self.pools[pid].blocks)  # in hash order, as clear_owner
        for seq in seqs:
            self.remove_pool(pid, seq)
        return len(seqs)

    def export_pool(self, pid: int) -> tuple[bytes, bytes]:
        b = self.pools[pid].blocks
        return pack_u64(list(b.keys())), pack_u64(list(b.values()))

    def load_pool(self, pid: int, seqs: bytes, idents: bytes) -> None:
        self._keep_pool(pid)
        store = self.pools[pid]
        s, i = unpack_u64(seqs), unpack_u64(idents)
        if len(s) != len(i):
            raise ValueError("a pool's hashes and identities differ in count")
        assert not store.blocks, "load_pool is for an empty pool store"
        self._place_pool(store, s, i, sys.maxsize, None)

    # ----------------------------------------------------------- query

    def match_tokens(self, data: bytes, block_size: int, seed: int, listed: int) -> Matched:
        return self._match(token_identities(data, block_size, seed), listed)

    def match_identities(self, idents: Sequence[int], listed: int) -> Matched:
        return self._match(idents, listed)

    def match_tokens_json(
        self, data: bytes, block_size: int, seed: int, listed: int, shape: JsonShape
    ) -> bytes:
        return shape.shape_json(self.match_tokens(data, block_size, seed, listed))

    def match_identities_json(self, idents: Sequence[int], listed: int, shape: JsonShape) -> bytes:
        return shape.shape_json(self.match_identities(idents, listed))

    def _match(self, idents: Iterable[int], listed: int) -> Matched:
        """One pass over the prompt with the still-matching owners of each
        tier as bitmasks; a narrowing records where the lost bits ended."""
        dev, host, disk = self.masks
        pool_host = self.pool_counts[HOST]
        pool_disk = self.pool_counts[DISK]
        device_only = not (host or disk or pool_host or pool_disk)
        g = c = d = listed
        ends: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        i = 0
        if device_only:
            for ident in idents:
                ng = g & dev.get(ident, 0)
                if ng != g:
                    _ended(g ^ ng, i, ends[0])
                    g = ng
                    if not g:
                        break
                i += 1
            _ended(g, i, ends[0])
            return [(slot, n, n, n) for slot, n in sorted(ends[0].items())]
        for ident in idents:
            ng = g & dev.get(ident, 0) if g else 0
            lower_c = listed if ident in pool_host else host.get(ident, 0)
            lower_d = listed if ident in pool_disk else lower_c | disk.get(ident, 0)
            nc = ng | (c & lower_c)
            nd = ng | (d & lower_d)
            if ng != g:
                _ended(g ^ ng, i, ends[0])
                g = ng
            if nc != c:
                _ended(c ^ nc, i, ends[1])
                c = nc
            if nd != d:
                _ended(d ^ nd, i, ends[2])
                d = nd
                if not d:
                    break
            i += 1
        _ended(g, i, ends[0])
        _ended(c, i, ends[1])
        _ended(d, i, ends[2])
        gl, cl, dl = ends
        return [(slot, gl[slot], cl[slot], dl[slot]) for slot in sorted(gl)]

    # ----------------------------------------------------------- tests

    def dump(self) -> dict[str, object]:
        return {
            "content": dict(self.content),
            "refs": dict(self.refs),
            "retired": [(key[1], ts) for key, ts in self.retired],
            "masks": [dict(m) for m in self.masks],
            "pool_counts": [dict(c) for c in self.pool_counts],
            "owners": {
                slot: ([dict(t) for t in o.tiers], dict(o.dups)) for slot, o in self.owners.items()
            },
            "pools": {pid: (p.tier, dict(p.blocks)) for pid, p in self.pools.items()},
        }


def _ended(bits: int, at: int, into: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        into[low.bit_length() - 1] = at
        bits ^= low


def token_identities(data: bytes, block_size: int, seed: int) -> Iterator[int]:
    """The prompt's block identities, hashed only as far as they are read."""
    step = block_size * 4
    ident = seed
    for start in range(0, len(data) - step + 1, step):
        ident = _xxh3(data[start : start + step], ident)
        yield ident


def new_store(max_retired: int, max_age_s: float) -> BlockStore:
    """The compiled store when the kernel is built and allowed, else the reference."""
    if KERNEL is not None:
        # Held equal to PyBlockStore, step by step, by tests/test_block_store.py.
        return _kernel.BlockStore(max_retired, max_age_s)
    return PyBlockStore(max_retired, max_age_s)
