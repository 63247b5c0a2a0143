"""One namespace's index: tiers, content catalog and two-phase joins.

Layout (all keyed by block identity, see `hashing`):

- `masks[tier]`: identity -> bitmask of owner slots holding it in that tier
  (device, own host, own disk). An owner is one (instance, dp rank); its slot
  is its bit. A hit on an identity implies its whole chain, so these flat
  dicts are the radix tree and the continuation edges at once.
- `pool_counts[tier]`: identity -> number of pool stores (backend, medium)
  holding it, for the host and disk classes. Every rank of the namespace can
  load from every pool backend, so the pool needs no owner bits.
- `Owner.tiers[tier]` and `PoolStore.blocks`: sequence hash -> identity, the
  names engines and pools give their blocks, for removals.
- the catalog, `content`: sequence hash -> identity with a reference count of
  holders (placements and pinned intents); it is what token-less stores,
  pool confirmations, chains whose parent is named by hash, and
  `/query_by_hash` resolve through. When its last holder goes, an entry is
  retired, not forgotten: the contract lets content come from an event
  "before or after", and a pool confirmation routinely lands after the
  engine evicted the block from its GPU. Retired content is bounded in count
  and age like the pending halves, in a queue of its own so that ordinary
  eviction churn never pushes out a half that waits.
- `pending`: what waits for its other half, bounded in count and age.

Everything is freed when nothing holds it, so a namespace that has seen a
store and the matching removals is empty again (`is_empty`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Container, Iterable, Sequence
from typing import NamedTuple

from kvconductor.hashing import block_identity, chain_identities, lora_seed, pack_tokens
from kvconductor.media import DEVICE, DISK, HOST
from kvconductor.pending import (
    INTENT,
    RETIRED,
    UNRESOLVED,
    WAITING,
    PendingKey,
    PendingQueue,
)


class NamespaceKey(NamedTuple):
    tenant: str
    model: str
    block_size: int
    lora_name: str | None
    salt: str


# Placement targets waiting for content: an owner's own tier or a pool store.
OwnerTarget = tuple[str, str, int, int]  # ("o", instance, rank, tier)
PoolTarget = tuple[str, str, str, int]  # ("p", backend, medium, tier)
Target = OwnerTarget | PoolTarget


class Unresolved(NamedTuple):
    """A block whose content is known but whose parent's is not (yet)."""

    parent: int  # the parent's sequence hash
    block: bytes  # the block's tokens, packed
    extra: int | None
    pin: bool  # an offload intent: pin the content once resolved


class Owner:
    """One (instance, dp rank) in a namespace: its own three tiers."""

    __slots__ = ("bit", "dups", "instance", "rank", "slot", "tiers")

    def __init__(self, instance: str, rank: int, slot: int) -> None:
        self.instance = instance
        self.rank = rank
        self.slot = slot
        self.bit = 1 << slot
        self.tiers: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        # (tier, identity) -> holders beyond the first, when two sequence
        # hashes of one owner name the same content.
        self.dups: dict[tuple[int, int], int] = {}

    def size(self) -> int:
        t = self.tiers
        return len(t[0]) + len(t[1]) + len(t[2])


class PoolStore:
    """One pool backend's blocks in one medium."""

    __slots__ = ("backend", "blocks", "medium", "tier")

    def __init__(self, backend: str, medium: str, tier: int) -> None:
        self.backend = backend
        self.medium = medium
        self.tier = tier
        self.blocks: dict[int, int] = {}


class Dirty:
    """Units changed since the last snapshot, shared by all namespaces."""

    __slots__ = ("instances", "owners", "pools")

    def __init__(self) -> None:
        self.owners: set[tuple[NamespaceKey, str, int]] = set()
        self.pools: set[tuple[NamespaceKey, str, str]] = set()
        self.instances: set[str] = set()

    def clear(self) -> None:
        """Published, or nothing publishes (else the sets grow for ever)."""
        self.owners.clear()
        self.pools.clear()
        self.instances.clear()


class NamespaceIndex:
    def __init__(
        self,
        key: NamespaceKey,
        max_pending: int,
        max_pending_age_s: float,
        max_blocks_per_owner: int,
        max_retired: int,
        counters: Counter[str],
        dirty: Dirty,
        max_owners: int = 4096,
    ) -> None:
        self.key = key
        self.dirty = dirty
        self.block_size = key.block_size
        self.seed = lora_seed(key.lora_name)
        self.max_blocks_per_owner = max_blocks_per_owner
        self.max_owners = max_owners
        self.counters = counters
        self.masks: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        self.pool_counts: tuple[dict[int, int], dict[int, int], dict[int, int]] = ({}, {}, {})
        self.owners: dict[str, dict[int, Owner]] = {}
        self.slots: list[Owner | None] = []
        self.free_slots: list[int] = []
        self.all_bits = 0
        self.pools: dict[tuple[str, str], PoolStore] = {}
        self.content: dict[int, int] = {}
        self.refs: dict[int, int] = {}
        self.waiting: dict[int, list[Target]] = {}
        self.unresolved: dict[int, Unresolved] = {}
        self.children: dict[int, list[int]] = {}
        self.pending = PendingQueue(max_pending, max_pending_age_s, self._on_pending_drop)
        self.retired = PendingQueue(max_retired, max_pending_age_s, self._on_retired_drop)
        # Event time of the record being applied: pending halves age by it,
        # so a replay of the same records drops exactly the same halves.
        self.now = 0.0

    def touch(self, now: float) -> None:
        if now > self.now:
            self.now = now

    # ----------------------------------------------------------- catalog

    def _acquire(self, seq: int, ident: int) -> int:
        """Take a reference on `seq`'s content; returns its canonical identity."""
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
        if cur != ident:
            self.counters["hash_conflicts"] += 1
        return cur

    def _release(self, seq: int) -> None:
        left = self.refs[seq] - 1
        if left:
            self.refs[seq] = left
        else:
            del self.refs[seq]
            self.retired.add((RETIRED, seq), self.now)

    def _on_retired_drop(self, key: PendingKey, why: str) -> None:
        seq: int = key[1]
        if seq not in self.refs:
            del self.content[seq]

    def _learn(self, seqs: Sequence[int], idents: Sequence[int]) -> None:
        """Content of `seqs` is now known: complete whatever waited for it.

        Callers place or pin the event's own blocks first, so a confirmation
        completed here consumes an intent pinned by the same event."""
        if not self.pending:
            return
        waiting = self.waiting
        children = self.children
        unresolved = self.unresolved
        for seq, ident in zip(seqs, idents, strict=False):
            if seq in waiting or seq in children or seq in unresolved:
                self._resolve(seq, ident)

    def _resolve(self, seq: int, ident: int) -> None:
        stack = [(seq, ident)]
        pending = self.pending
        while stack:
            s, i = stack.pop()
            u = self.unresolved.pop(s, None)
            if u is not None:
                pending.discard((UNRESOLVED, s))
                self._unlink_child(u.parent, s)
                if u.pin:
                    self._pin(s, i)
            targets = self.waiting.pop(s, None)
            if targets:
                for t in targets:
                    pending.discard((WAITING, s, t))
                    self._place_target(t, s, i)
            if s not in self.content:
                # Known now but held by nobody (its placement was cancelled
                # while it waited): keep it for late halves like any content.
                self.content[s] = i
                self.retired.add((RETIRED, s), self.now)
            kids = self.children.pop(s, None)
            if kids:
                for k in kids:
                    ku = self.unresolved.get(k)
                    if ku is not None:
                        stack.append((k, block_identity(ku.block, i, ku.extra)))

    def _unlink_child(self, parent: int, child: int) -> None:
        kids = self.children.get(parent)
        if kids is None:
            return
        try:
            kids.remove(child)
        except ValueError:
            return
        if not kids:
            del self.children[parent]

    def _pin(self, seq: int, ident: int) -> None:
        # An intent for content some pool already holds has nothing left to
        # wait for (the join happened the other way round), but it still
        # names that content under its hash.
        if ident in self.pool_counts[HOST] or ident in self.pool_counts[DISK]:
            if seq not in self.content:
                self.content[seq] = ident
                self.retired.add((RETIRED, seq), self.now)
            return
        if self.pending.add((INTENT, seq), self.now):
            self._acquire(seq, ident)

    def _unpin(self, seq: int) -> None:
        if self.pending.discard((INTENT, seq)):
            self._release(seq)

    def _wait(self, seq: int, target: Target) -> None:
        if self.pending.add((WAITING, seq, target), self.now):
            self.waiting.setdefault(seq, []).append(target)

    def _on_pending_drop(self, key: PendingKey, why: str) -> None:
        kind = key[0]
        seq: int = key[1]
        if kind == INTENT:
            self._release(seq)
            self.counters[f"pending_dropped_intent_{why}"] += 1
        elif kind == WAITING:
            targets = self.waiting[seq]
            targets.remove(key[2])
            if not targets:
                del self.waiting[seq]
            label = "confirmation" if key[2][0] == "p" else "placement"
            self.counters[f"pending_dropped_{label}_{why}"] += 1
        else:
            u = self.unresolved.pop(seq)
            self._unlink_child(u.parent, seq)
            self.counters[f"pending_dropped_unresolved_{why}"] += 1

    def expire(self, now: float) -> None:
        self.touch(now)
        self.pending.expire(self.now)
        self.retired.expire(self.now)

    # ------------------------------------------------------------ owners

    def _owner(self, instance: str, rank: int) -> Owner | None:
        """The owner, created if there is room for one more (else None)."""
        ranks = self.owners.get(instance)
        owner = ranks.get(rank) if ranks is not None else None
        if owner is None:
            if len(self.slots) - len(self.free_slots) >= self.max_owners:
                return None
            if ranks is None:
                ranks = self.owners[instance] = {}
            if self.free_slots:
                slot = self.free_slots.pop()
            else:
                slot = len(self.slots)
                self.slots.append(None)
            owner = ranks[rank] = Owner(instance, rank, slot)
            self.slots[slot] = owner
            self.all_bits |= owner.bit
        self.dirty.owners.add((self.key, instance, rank))
        return owner

    def restored_owner(self, instance: str, rank: int) -> Owner:
        owner = self._owner(instance, rank)
        if owner is None:
            raise ValueError("snapshot holds more owners than index.max_owners_per_namespace")
        return owner

    def _retire_if_empty(self, owner: Owner) -> None:
        if owner.size():
            return
        ranks = self.owners[owner.instance]
        del ranks[owner.rank]
        if not ranks:
            del self.owners[owner.instance]
        self.slots[owner.slot] = None
        self.all_bits &= ~owner.bit
        if self.owners:
            self.free_slots.append(owner.slot)
        else:
            self.slots.clear()
            self.free_slots.clear()

    def _place_owner(
        self, owner: Owner, tier: int, seqs: Sequence[int], idents: Sequence[int] | None
    ) -> int:
        """Place known content in an owner's tier; idents None: from the catalog."""
        tmap = owner.tiers[tier]
        masks = self.masks[tier]
        bit = owner.bit
        content = self.content
        refs = self.refs
        room = self.max_blocks_per_owner - owner.size()
        placed = 0
        for k, seq in enumerate(seqs):
            if seq in tmap:
                continue
            if placed >= room:
                self.counters["owner_capacity_dropped"] += len(seqs) - k
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
                    self.counters["hash_conflicts"] += 1
            tmap[seq] = ident
            m = masks.get(ident, 0)
            if m & bit:
                dk = (tier, ident)
                owner.dups[dk] = owner.dups.get(dk, 0) + 1
            else:
                masks[ident] = m | bit
            placed += 1
        return placed

    def _unplace_owner(self, owner: Owner, tier: int, seq: int) -> bool:
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
        self._release(seq)
        return True

    # ------------------------------------------------------------- pools

    def _pool(self, backend: str, medium: str, tier: int) -> PoolStore | None:
        """The pool store, created if there is room for one more (else None)."""
        store = self.pools.get((backend, medium))
        if store is None:
            if len(self.pools) >= self.max_owners:
                return None
            store = self.pools[(backend, medium)] = PoolStore(backend, medium, tier)
        self.dirty.pools.add((self.key, backend, medium))
        return store

    def restored_pool(self, backend: str, medium: str, tier: int) -> PoolStore:
        store = self._pool(backend, medium, tier)
        if store is None:
            raise ValueError("snapshot holds more pool stores than index.max_owners_per_namespace")
        return store

    def _place_pool(
        self, store: PoolStore, seqs: Sequence[int], idents: Sequence[int] | None
    ) -> int:
        blocks = store.blocks
        counts = self.pool_counts[store.tier]
        room = self.max_blocks_per_owner - len(blocks)
        placed = 0
        for k, seq in enumerate(seqs):
            if seq in blocks:
                continue
            if placed >= room:
                self.counters["pool_capacity_dropped"] += len(seqs) - k
                break
            ident = self._acquire(seq, idents[k] if idents is not None else self.content[seq])
            blocks[seq] = ident
            counts[ident] = counts.get(ident, 0) + 1
            if self.pending.by_kind[INTENT] and (INTENT, seq) in self.pending:
                self._unpin(seq)
            placed += 1
        return placed

    def _unplace_pool(self, store: PoolStore, seq: int) -> bool:
        ident = store.blocks.pop(seq, None)
        if ident is None:
            return False
        counts = self.pool_counts[store.tier]
        left = counts[ident] - 1
        if left:
            counts[ident] = left
        else:
            del counts[ident]
        self._release(seq)
        return True

    def _drop_pool_if_empty(self, store: PoolStore) -> None:
        if not store.blocks:
            self.pools.pop((store.backend, store.medium), None)

    def _place_target(self, target: Target, seq: int, ident: int) -> None:
        kind, name, where, tier = target
        if kind == "o":
            assert isinstance(where, int)
            owner = self._owner(name, where)
            if owner is None:
                self.counters["owner_limit_dropped"] += 1
                return
            self._place_owner(owner, tier, (seq,), (ident,))
            self._retire_if_empty(owner)
        else:
            assert isinstance(where, str)
            store = self._pool(name, where, tier)
            if store is None:
                self.counters["pool_limit_dropped"] += 1
                return
            self._place_pool(store, (seq,), (ident,))

    # ---------------------------------------------------- applying events

    def _chain(
        self,
        seqs: Sequence[int],
        parent: int | None,
        token_ids: list[int],
        extra: Sequence[int | None] | None,
        pin: bool,
    ) -> tuple[list[int], list[int] | None]:
        """Learn the content of a tokened event's full blocks.

        Returns the sequence hashes of the full blocks and their identities,
        or None for identities when the parent's content is not known yet (the
        blocks then wait, unresolved, for it)."""
        bs = self.block_size
        n = min(len(seqs), len(token_ids) // bs)
        if n < len(seqs):
            self.counters["partial_blocks_skipped"] += len(seqs) - n
        full = list(seqs[:n])
        token_bytes = pack_tokens(token_ids[: n * bs])
        root = self.seed if parent is None else self.content.get(parent)
        if root is not None:
            return full, chain_identities(token_bytes, n, bs, root, extra)
        assert parent is not None
        step = bs * 4
        prev = parent
        for k, seq in enumerate(full):
            if seq not in self.content and seq not in self.unresolved:
                key = extra[k] if extra is not None and k < len(extra) else None
                self.unresolved[seq] = Unresolved(
                    prev, token_bytes[k * step : (k + 1) * step], key, pin
                )
                self.children.setdefault(prev, []).append(seq)
                self.pending.add((UNRESOLVED, seq), self.now)
            elif pin and (u := self.unresolved.get(seq)) is not None and not u.pin:
                # An intent for a block another event already left waiting
                # for its parent: pin it too once it resolves.
                self.unresolved[seq] = u._replace(pin=True)
            prev = seq
        self.counters["unresolved_parent"] += 1
        return full, None

    def store_owner(
        self,
        instance: str,
        rank: int,
        tier: int,
        seqs: list[int],
        parent: int | None,
        token_ids: list[int] | None,
        extra: Sequence[int | None] | None,
    ) -> int:
        """An engine stores blocks in its own tier; returns blocks placed now."""
        owner = self._owner(instance, rank)
        if owner is None:
            self.counters["owner_limit_dropped"] += len(seqs)
            return 0
        if owner.size() >= self.max_blocks_per_owner:
            # A full owner's store is dropped whole, before any of it can wait
            # in the pending queue for a parent that was itself dropped.
            held = owner.tiers[tier]
            self.counters["owner_capacity_dropped"] += sum(1 for s in seqs if s not in held)
            return 0
        idents: list[int] | None = None
        if token_ids:
            seqs, idents = self._chain(seqs, parent, token_ids, extra, False)
        if idents is not None:
            placed = self._place_owner(owner, tier, seqs, idents)
            self._learn(seqs, idents)
        else:
            placed = self._place_known_or_wait(seqs, owner, tier, ("o", instance, rank, tier))
        self._retire_if_empty(owner)
        return placed

    def _place_known_or_wait(
        self, seqs: Sequence[int], owner: Owner, tier: int, target: Target
    ) -> int:
        def place(known: list[int]) -> int:
            return self._place_owner(owner, tier, known, None)

        return self._known_then_wait(seqs, owner.tiers[tier], target, place)

    def _known_then_wait(
        self,
        seqs: Sequence[int],
        held: Container[int],
        target: Target,
        place: Callable[[list[int]], int],
    ) -> int:
        """Place the blocks whose content is known, then wait for the rest.

        In this order because a wait can evict from a full pending queue, and
        what that releases can retire, and so push out, known content: placed
        first, the known blocks are held and safe."""
        content = self.content
        known = [seq for seq in seqs if seq in content]
        placed = place(known) if known else 0
        for seq in seqs:
            if seq not in content and seq not in held:
                self._wait(seq, target)
        return placed

    def offload_intent(
        self,
        seqs: list[int],
        parent: int | None,
        token_ids: list[int] | None,
        extra: Sequence[int | None] | None,
    ) -> int:
        """Phase one: an engine will offload these blocks into a pool."""
        if token_ids:
            seqs, idents = self._chain(seqs, parent, token_ids, extra, True)
            if idents is None:
                return 0
            for seq, ident in zip(seqs, idents, strict=True):
                self._pin(seq, ident)
            self._learn(seqs, idents)
            return len(seqs)
        pinned = 0
        for seq in seqs:
            known = self.content.get(seq)
            if known is None:
                self.counters["intent_without_content"] += 1
            else:
                self._pin(seq, known)
                pinned += 1
        return pinned

    def remove_owner(self, instance: str, rank: int, tier: int, seqs: Iterable[int]) -> list[int]:
        """Remove blocks from an owner's tier; returns the hashes not found."""
        owner = self.owners.get(instance, {}).get(rank)
        if owner is not None:
            self.dirty.owners.add((self.key, instance, rank))
        missing: list[int] = []
        target: OwnerTarget = ("o", instance, rank, tier)
        for seq in seqs:
            if owner is not None and self._unplace_owner(owner, tier, seq):
                continue
            if self._cancel_wait(seq, target):
                continue
            missing.append(seq)
        if owner is not None:
            self._retire_if_empty(owner)
        return missing

    def _cancel_wait(self, seq: int, target: Target) -> bool:
        if not self.pending.discard((WAITING, seq, target)):
            return False
        targets = self.waiting[seq]
        targets.remove(target)
        if not targets:
            del self.waiting[seq]
        return True

    def clear_owner(self, instance: str, rank: int) -> int:
        """AllBlocksCleared: every tier of that instance and rank."""
        removed = 0
        owner = self.owners.get(instance, {}).get(rank)
        if owner is not None:
            self.dirty.owners.add((self.key, instance, rank))
            for tier in (DEVICE, HOST, DISK):
                for seq in list(owner.tiers[tier]):
                    self._unplace_owner(owner, tier, seq)
                    removed += 1
            self._retire_if_empty(owner)
        self._cancel_waits(lambda t: t[0] == "o" and t[1] == instance and t[2] == rank)
        return removed

    def remove_instance(self, instance: str) -> None:
        for rank in list(self.owners.get(instance, {})):
            self.clear_owner(instance, rank)
        self._cancel_waits(lambda t: t[0] == "o" and t[1] == instance)

    def _cancel_waits(self, match: Callable[[Target], bool]) -> None:
        if not self.waiting:
            return
        for seq, targets in list(self.waiting.items()):
            for t in list(targets):
                if match(t):
                    self._cancel_wait(seq, t)

    def pool_store(
        self,
        backend: str,
        medium: str,
        tier: int,
        seqs: list[int],
        parent: int | None,
        token_ids: list[int] | None,
    ) -> int:
        """A pool stored blocks: with tokens it carries its own content,
        without it is a confirmation (phase two) joined through the catalog."""
        store = self._pool(backend, medium, tier)
        if store is None:
            self.counters["pool_limit_dropped"] += len(seqs)
            return 0
        target: PoolTarget = ("p", backend, medium, tier)
        if token_ids:
            seqs, idents = self._chain(seqs, parent, token_ids, None, False)
            if idents is not None:
                placed = self._place_pool(store, seqs, idents)
                self._learn(seqs, idents)
                self._drop_pool_if_empty(store)
                return placed
        placed = self._known_then_wait(
            seqs, store.blocks, target, lambda known: self._place_pool(store, known, None)
        )
        self._drop_pool_if_empty(store)
        return placed

    def pool_remove(self, backend: str, medium: str | None, seqs: Iterable[int]) -> int:
        stores = self._pool_stores(backend, medium)
        for store in stores:
            self.dirty.pools.add((self.key, backend, store.medium))
        removed = 0
        for seq in seqs:
            hit = False
            for store in stores:
                hit = self._unplace_pool(store, seq) or hit
            if hit:
                removed += 1
            elif not self._cancel_pool_waits(seq, backend, medium):
                self.counters["pool_removal_unknown"] += 1
        for store in stores:
            self._drop_pool_if_empty(store)
        return removed

    def _cancel_pool_waits(self, seq: int, backend: str, medium: str | None) -> bool:
        targets = self.waiting.get(seq)
        if not targets:
            return False
        hit = False
        for t in list(targets):
            if t[0] == "p" and t[1] == backend and (medium is None or t[2] == medium):
                hit = self._cancel_wait(seq, t) or hit
        return hit

    def pool_clear(self, backend: str, medium: str | None) -> int:
        removed = 0
        for store in self._pool_stores(backend, medium):
            self.dirty.pools.add((self.key, backend, store.medium))
            for seq in list(store.blocks):
                self._unplace_pool(store, seq)
                removed += 1
            self._drop_pool_if_empty(store)
        self._cancel_waits(
            lambda t: t[0] == "p" and t[1] == backend and (medium is None or t[2] == medium)
        )
        return removed

    def _pool_stores(self, backend: str, medium: str | None) -> list[PoolStore]:
        if medium is not None:
            store = self.pools.get((backend, medium))
            return [store] if store is not None else []
        return [s for (b, _), s in self.pools.items() if b == backend]

    # ----------------------------------------------------------- restore

    def load(
        self,
        owners: Sequence[tuple[str, int, Sequence[tuple[list[int], list[int]]]]],
        pools: Sequence[tuple[str, str, int, list[int], list[int]]],
    ) -> None:
        """Bulk-load owner tiers and pool stores of a snapshot into this fresh
        namespace: whole dicts at C speed, one pass over identities for the
        bitmasks. Same result as placing block by block."""
        assert not self.content, "load() is for a namespace restored from scratch"
        content = self.content
        held: Counter[int] = Counter()
        for instance, rank, tiers in owners:
            owner = self.restored_owner(instance, rank)
            bit = owner.bit
            for tier, (seqs, idents) in enumerate(tiers):
                if not seqs:
                    continue
                owner.tiers[tier].update(zip(seqs, idents, strict=True))
                content.update(zip(seqs, idents, strict=True))
                held.update(seqs)
                masks = self.masks[tier]
                get = masks.get
                for ident in idents:
                    masks[ident] = get(ident, 0) | bit
                if len(set(idents)) != len(idents):
                    for ident, n in Counter(idents).items():
                        if n > 1:
                            owner.dups[(tier, ident)] = n - 1
            self._retire_if_empty(owner)
        for backend, medium, tier, seqs, idents in pools:
            store = self.restored_pool(backend, medium, tier)
            store.blocks.update(zip(seqs, idents, strict=True))
            content.update(zip(seqs, idents, strict=True))
            held.update(seqs)
            counts = self.pool_counts[tier]
            for ident, n in Counter(idents).items():
                counts[ident] = counts.get(ident, 0) + n
            self._drop_pool_if_empty(store)
        self.refs.update(held)

    # ------------------------------------------------------------ reading

    def is_empty(self) -> bool:
        return not (
            self.owners
            or self.pools
            or self.content
            or self.pending
            or self.retired
            or self.waiting
            or self.unresolved
            or self.children
            or any(self.masks)
            or any(self.pool_counts)
        )

    def identities_of(self, seqs: Iterable[int]) -> list[int]:
        """Identities of a prompt named by engine hashes, up to the first unknown."""
        content = self.content
        out: list[int] = []
        for seq in seqs:
            ident = content.get(seq)
            if ident is None:
                break
            out.append(ident)
        return out
