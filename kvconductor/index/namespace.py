"""One namespace's index: owners, pool stores and two-phase joins.

The per-block state lives in the namespace's `BlockStore` (see
`block_store`; compiled when the kernel is built), all keyed by block
identity (see `hashing`) or by the engine's sequence hash:

- per tier (device, own host, own disk): identity -> bitmask of the owner
  slots holding it. An owner is one (instance, dp rank); its slot is its
  bit. A hit on an identity implies its whole chain, so these flat maps are
  the radix tree and the continuation edges at once.
- per pool class (host, disk): identity -> number of pool stores (backend,
  medium) holding it. Every rank of the namespace can load from every pool
  backend, so the pool needs no owner bits.
- each owner tier and pool store: the sequence hashes it holds, the names
  engines and pools give their blocks, for removals.
- the catalog: sequence hash -> identity with a reference count of holders
  (placements and pinned intents); it is what token-less stores, pool
  confirmations, chains whose parent is named by hash, and `/query_by_hash`
  resolve through. When its last holder goes, an entry is retired, not
  forgotten: the contract lets content come from an event "before or
  after", and a pool confirmation routinely lands after the engine evicted
  the block from its GPU. Retired content is bounded in count and age like
  the pending halves, in a queue of its own so that ordinary eviction churn
  never pushes out a half that waits.

Here: which owner has which slot, and what waits for its other half
(`pending`, bounded in count and age, with `waiting`, `unresolved` and
`children` holding what each pending key stands for).

Everything is freed when nothing holds it, so a namespace that has seen a
store and the matching removals is empty again (`is_empty`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import msgspec

from kvconductor.index.answer_shape import AnswerShape, new_shape
from kvconductor.index.block_store import BlockStore, Placed, new_store
from kvconductor.index.cache_groups import GroupState, locate, unit_extra, unit_seqs
from kvconductor.index.pending import (
    INTENT,
    UNRESOLVED,
    WAITING,
    PendingKey,
    PendingQueue,
)
from kvconductor.wire.events import Tokens
from kvconductor.wire.hashing import (
    block_identity,
    chain_identities,
    dynamo_seed,
    local_hashes,
    lora_seed,
    pack_tokens,
)
from kvconductor.wire.local_hashes import LocalHashMap


class NamespaceKey(NamedTuple):
    tenant: str
    model: str
    block_size: int
    lora_name: str | None
    salt: str


def namespace_key(
    tenant: str | None, model: str, block_size: int, lora_name: str | None, salt: str | None
) -> NamespaceKey:
    """The key of a namespace as its fields arrive (queries, events,
    registrations): a null or empty tenant is `default`, a null or empty
    LoRA the base model, a null or empty salt none (contract section 1)."""
    return NamespaceKey(tenant or "default", model, block_size, lora_name or None, salt or "")


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
    """One (instance, dp rank) in a namespace; its three tiers are in the
    store under its slot (a set of blocks each), the rest here."""

    __slots__ = ("bit", "copies", "groups", "instance", "primary_block", "rank", "slot")

    def __init__(self, instance: str, rank: int, slot: int) -> None:
        self.instance = instance
        self.rank = rank
        self.slot = slot
        self.bit = 1 << slot
        # (tier, engine hash) -> copies beyond the first: vLLM announces and
        # removes each cached block under one hash, the tier holds the
        # block while a copy remains (contract section 2, v2).
        self.copies: dict[tuple[int, int], int] = {}
        # KV-cache groups other than the primary one (`cache_groups`).
        self.groups: dict[int, GroupState] = {}
        # The primary group's block size (0: none seen): its blocks larger
        # than the namespace's are held as that many units.
        self.primary_block = 0

    def group_blocks(self) -> int:
        return sum(len(g) for g in self.groups.values())


class OwnerExtras(NamedTuple):
    """An owner's state beyond its tiers' sets (see `Owner`)."""

    copies: dict[tuple[int, int], int]
    groups: dict[int, GroupState]
    primary_block: int


NO_EXTRAS = OwnerExtras({}, {}, 0)


class PoolStore:
    """One pool backend's blocks in one medium, in the store under `pid`."""

    __slots__ = ("backend", "medium", "pid", "tier")

    def __init__(self, backend: str, medium: str, tier: int, pid: int) -> None:
        self.backend = backend
        self.medium = medium
        self.tier = tier
        self.pid = pid


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
        max_owners: int = 16_384,
        local_hash_map: int = 0,
    ) -> None:
        self.key = key
        self.dirty = dirty
        self.block_size = key.block_size
        self.seed = lora_seed(key.lora_name)
        self.max_blocks_per_owner = max_blocks_per_owner
        self.max_owners = max_owners
        self.counters = counters
        self.store: BlockStore = new_store(max_retired, max_pending_age_s)
        self.owners: dict[str, dict[int, Owner]] = {}
        self.slots: list[Owner | None] = []
        self.free_slots: list[int] = []
        self.all_bits = 0
        # The owners as a query answer lays them out, told of each change.
        self._shape: AnswerShape = new_shape(key.tenant, key.block_size, ())
        # Slots of owners with non-primary KV-cache groups: their device hit
        # is vLLM's hybrid rule over those groups (`query.match`).
        self.hybrid: set[int] = set()
        self.pools: dict[tuple[str, str], PoolStore] = {}
        self.next_pid = 0
        self.waiting: dict[int, list[Target]] = {}
        self.unresolved: dict[int, Unresolved] = {}
        self.children: dict[int, list[int]] = {}
        self.pending = PendingQueue(max_pending, max_pending_age_s, self._on_pending_drop)
        # Event time of the record being applied: pending halves age by it,
        # so a replay of the same records drops exactly the same halves.
        self.now = 0.0
        # Dynamo's local block hashes -> identities (`local_hashes`); None: off.
        # Dynamo seeds them with the salt, identities chain from `seed`.
        self.local_seed = dynamo_seed(key.lora_name, key.salt)
        self.local_map = (
            LocalHashMap(local_hash_map, rooted=self.local_seed != self.seed)
            if local_hash_map
            else None
        )

    def touch(self, now: float) -> None:
        if now > self.now:
            self.now = now
            self.store.set_now(now)

    def pending_version(self) -> int:
        """Changes whenever a pending half or retired content changes."""
        return self.pending.version << 64 | self.store.retired_version()

    # ----------------------------------------------------------- catalog

    def _acquire(self, seq: int, ident: int) -> int:
        """Take a reference on `seq`'s content; returns its canonical identity."""
        cur = self.store.acquire(seq, ident)
        if cur != ident:
            self.counters["hash_conflicts"] += 1
        return cur

    def _release(self, seq: int) -> None:
        self.store.release(seq)

    def _count(self, placed: Placed, dropped_as: str) -> Placed:
        _, dropped, conflicts, _ = placed
        if dropped:
            self.counters[dropped_as] += dropped
        if conflicts:
            self.counters["hash_conflicts"] += conflicts
        return placed

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
            # Known now but maybe held by nobody (its placement was cancelled
            # while it waited): keep it for late halves like any content.
            self.store.remember(s, i)
            kids = self.children.pop(s, None)
            if kids:
                for k in kids:
                    ku = self.unresolved.get(k)
                    if ku is not None:
                        child = block_identity(ku.block, i, ku.extra)
                        if self.local_map is not None and ku.extra is None:
                            self._learn_local(i, ku.block, [child])
                        stack.append((k, child))

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
        if self.store.pool_holds(ident):
            self.store.remember(seq, ident)
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
        self.store.expire(self.now)

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
            self.store.add_owner(slot)
            self.slots[slot] = owner
            self.all_bits |= owner.bit
            self._reshape(instance)
        self.dirty.owners.add((self.key, instance, rank))
        return owner

    def answer_shape(self) -> AnswerShape:
        """The owners as a query answer lays them out."""
        return self._shape

    def _reshape(self, instance: str) -> None:
        """The answer's shape learns what ranks `instance` has now."""
        ranks = self.owners.get(instance, {})
        listed = [(rank, o.slot) for rank, o in sorted(ranks.items())]
        self._shape.set_instance(instance, msgspec.json.encode(instance), listed)

    def restored_owner(self, instance: str, rank: int) -> Owner:
        owner = self._owner(instance, rank)
        if owner is None:
            raise ValueError("snapshot holds more owners than index.max_owners_per_namespace")
        return owner

    def _retire_if_empty(self, owner: Owner) -> None:
        if self.store.owner_size(owner.slot) or owner.group_blocks():
            return
        self.hybrid.discard(owner.slot)
        self.store.drop_owner(owner.slot)
        ranks = self.owners[owner.instance]
        del ranks[owner.rank]
        if not ranks:
            del self.owners[owner.instance]
        self.slots[owner.slot] = None
        self.all_bits &= ~owner.bit
        self._reshape(owner.instance)
        if self.owners:
            self.free_slots.append(owner.slot)
        else:
            self.slots.clear()
            self.free_slots.clear()

    def _place_owner(
        self, owner: Owner, tier: int, seqs: Sequence[int], idents: Sequence[int] | None
    ) -> Placed:
        """Place blocks in an owner's tier; idents None: those the catalog
        knows (the others are returned, to wait)."""
        room = self.max_blocks_per_owner - self.store.owner_size(owner.slot)
        placed = self.store.place_owner(owner.slot, tier, seqs, idents, room)
        return self._count(placed, "owner_capacity_dropped")

    # ------------------------------------------------------------- pools

    def _pool(self, backend: str, medium: str, tier: int) -> PoolStore | None:
        """The pool store, created if there is room for one more (else None)."""
        store = self.pools.get((backend, medium))
        if store is None:
            if len(self.pools) >= self.max_owners:
                return None
            store = PoolStore(backend, medium, tier, self.next_pid)
            self.next_pid += 1
            self.pools[(backend, medium)] = store
            self.store.add_pool(store.pid, tier)
        self.dirty.pools.add((self.key, backend, medium))
        return store

    def restored_pool(self, backend: str, medium: str, tier: int) -> PoolStore:
        store = self._pool(backend, medium, tier)
        if store is None:
            raise ValueError("snapshot holds more pool stores than index.max_owners_per_namespace")
        return store

    def _place_pool(
        self, store: PoolStore, seqs: Sequence[int], idents: Sequence[int] | None
    ) -> Placed:
        room = self.max_blocks_per_owner - self.store.pool_len(store.pid)
        # Placed blocks consume the offload intents pinned for them.
        placed_out: list[int] | None = [] if self.pending.by_kind[INTENT] else None
        placed = self.store.place_pool(store.pid, seqs, idents, room, placed_out)
        for seq in placed_out or ():
            if (INTENT, seq) in self.pending:
                self._unpin(seq)
        return self._count(placed, "pool_capacity_dropped")

    def _drop_pool_if_empty(self, store: PoolStore) -> None:
        if not self.store.pool_len(store.pid):
            self.pools.pop((store.backend, store.medium), None)
            self.store.drop_pool(store.pid)

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
        token_ids: Tokens,
        extra: Sequence[int | None] | None,
        pin: bool,
    ) -> tuple[list[int], list[int] | None]:
        """Learn the content of a tokened event's full blocks.

        Returns the sequence hashes of the full blocks and their identities,
        or None for identities when the parent's content is not known yet (the
        blocks then wait, unresolved, for it)."""
        bs = self.block_size
        packed = token_ids if isinstance(token_ids, bytes) else pack_tokens(token_ids)
        n = min(len(seqs), len(packed) // (4 * bs))
        if n < len(seqs):
            self.counters["partial_blocks_skipped"] += len(seqs) - n
        full = list(seqs[:n])
        token_bytes = packed[: n * bs * 4]
        root = self.seed if parent is None else self.store.ident(parent)
        if root is not None:
            idents = chain_identities(token_bytes, n, bs, root, extra)
            if self.local_map is not None:
                # Blocks with extra keys never match a plain prompt, nor do
                # their descendants: only the plain blocks before the first.
                plain = n if extra is None else next((k for k, x in enumerate(extra[:n]) if x), n)
                start = None if parent is None else root
                self._learn_local(start, token_bytes, idents[:plain])
            return full, idents
        assert parent is not None
        step = bs * 4
        prev = parent
        for k, seq in enumerate(full):
            if seq not in self.unresolved and self.store.ident(seq) is None:
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

    def _learn_local(self, parent: int | None, token_bytes: bytes, idents: Sequence[int]) -> None:
        """Keep the local-hash edges of a chain from identity `parent` (None:
        from the first block), when on."""
        if self.local_map is not None and idents:
            local = local_hashes(token_bytes, len(idents), self.block_size, self.local_seed)
            self.local_map.learn(parent, local, idents)

    def store_owner(
        self,
        instance: str,
        rank: int,
        tier: int,
        seqs: list[int],
        parent: int | None,
        token_ids: Tokens | None,
        extra: Sequence[int | None] | None,
        block_size: int | None = None,
        reannounces: bool = False,
    ) -> int:
        """An engine stores blocks in its own tier; returns blocks placed now.

        `block_size`: the event's, a multiple of the namespace's (each block
        is held as that many units). `reannounces`: the instance may
        re-announce blocks it holds (`_copies`)."""
        owner = self._owner(instance, rank)
        if owner is None:
            self.counters["owner_limit_dropped"] += len(seqs)
            return 0
        size = block_size or self.block_size
        if size > owner.primary_block:
            owner.primary_block = size
        if size > self.block_size:
            units = size // self.block_size
            seqs, extra = unit_seqs(seqs, units), unit_extra(extra, units)
        copies = 0
        if self.store.count_new(owner.slot, tier, seqs) != len(seqs):
            copies = self._copies(owner, tier, seqs, parent, reannounces)
        if self.store.owner_size(owner.slot) >= self.max_blocks_per_owner:
            # A full owner's store is dropped whole, before any of it can wait
            # in the pending queue for a parent that was itself dropped.
            self.counters["owner_capacity_dropped"] += self.store.count_new(owner.slot, tier, seqs)
            return copies
        idents: list[int] | None = None
        if token_ids:
            seqs, idents = self._chain(seqs, parent, token_ids, extra, False)
        placed = self._then_wait(
            self._place_owner(owner, tier, seqs, idents), ("o", instance, rank, tier)
        )
        if idents is not None:
            self._learn(seqs, idents)
        self._retire_if_empty(owner)
        return placed + copies

    def _copies(
        self, owner: Owner, tier: int, seqs: Sequence[int], parent: int | None, reannounces: bool
    ) -> int:
        """Count a copy of each block of a store that the tier holds already.

        Where the instance may re-announce (vLLM's `kv_cache_report_mode:
        "full"` re-emits the blocks a request reuses, and the caller knows
        it is not hybrid), a store from the first block (no parent) of
        blocks all held is a re-announcement, not new copies. Elsewhere no
        shape tells the two apart and every such store is copies: a prompt
        of one block, fully cached, makes vLLM recompute that block into a
        second copy, and a hybrid instance recomputes whenever its other
        groups cut the hit short."""
        store = self.store
        slot = owner.slot
        held = [seq for seq in seqs if not store.count_new(slot, tier, (seq,))]
        if reannounces and parent is None and len(held) == len(seqs):
            return 0
        copies = owner.copies
        for seq in held:
            copies[(tier, seq)] = copies.get((tier, seq), 0) + 1
        return len(held)

    def _then_wait(self, placed: Placed, target: Target) -> int:
        """The blocks whose content is known are placed; now wait for the rest.

        In this order because a wait can evict from a full pending queue, and
        what that releases can retire, and so push out, known content: placed
        first, the known blocks are held and safe."""
        for seq in placed[3]:
            self._wait(seq, target)
        return placed[0]

    def offload_intent(
        self,
        seqs: list[int],
        parent: int | None,
        token_ids: Tokens | None,
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
            known = self.store.ident(seq)
            if known is None:
                self.counters["intent_without_content"] += 1
            else:
                self._pin(seq, known)
                pinned += 1
        return pinned

    def remove_owner(self, instance: str, rank: int, tier: int, seqs: Iterable[int]) -> list[int]:
        """Remove one copy of each block from an owner's tier; returns the
        hashes not found."""
        owner = self.owners.get(instance, {}).get(rank)
        target: OwnerTarget = ("o", instance, rank, tier)
        seqs = list(seqs)
        if owner is not None:
            self.dirty.owners.add((self.key, instance, rank))
            if owner.primary_block > self.block_size:
                self._remove_units(owner, tier, seqs, owner.primary_block // self.block_size)
            if owner.copies:
                seqs = [seq for seq in seqs if not self._drop_copy(owner, tier, seq)]
            seqs = self.store.remove_owner(owner.slot, tier, seqs)
            self._retire_if_empty(owner)
        return [seq for seq in seqs if not self._cancel_wait(seq, target)]

    def _drop_copy(self, owner: Owner, tier: int, seq: int) -> bool:
        left = owner.copies.pop((tier, seq), 0)
        if left > 1:
            owner.copies[(tier, seq)] = left - 1
        return left > 0

    def _remove_units(self, owner: Owner, tier: int, seqs: Sequence[int], units: int) -> None:
        """A removed block's units but its last (its own hash, removed by
        the caller); a smaller block (a partial store) has none."""
        own = set(seqs)
        rest = [
            unit
            for unit in unit_seqs(seqs, units)
            if unit not in own and not (owner.copies and self._drop_copy(owner, tier, unit))
        ]
        if rest:
            self.store.remove_owner(owner.slot, tier, rest)

    def _cancel_wait(self, seq: int, target: Target) -> bool:
        if not self.pending.discard((WAITING, seq, target)):
            return False
        targets = self.waiting[seq]
        targets.remove(target)
        if not targets:
            del self.waiting[seq]
        return True

    def clear_owner(self, instance: str, rank: int) -> int:
        """AllBlocksCleared: every tier and group of that instance and rank."""
        removed = 0
        owner = self.owners.get(instance, {}).get(rank)
        if owner is not None:
            self.dirty.owners.add((self.key, instance, rank))
            removed = self.store.clear_owner(owner.slot)
            owner.copies.clear()
            for group in owner.groups.values():
                removed += group.clear()
            self._retire_if_empty(owner)
        self._cancel_waits(lambda t: t[0] == "o" and t[1] == instance and t[2] == rank)
        return removed

    def store_group(
        self,
        instance: str,
        rank: int,
        group_idx: int,
        kind: str,
        block_size: int | None,
        window: int | None,
        seqs: Sequence[int],
        parent: int | None,
        token_ids: Tokens | None,
    ) -> int:
        """A non-primary KV-cache group stores blocks on the device; returns
        the blocks (copies) it now holds more."""
        owner = self._owner(instance, rank)
        if owner is None:
            self.counters["owner_limit_dropped"] += len(seqs)
            return 0
        size = block_size or self.block_size
        group = owner.groups.get(group_idx)
        if group is None:
            group = owner.groups[group_idx] = GroupState(kind, size, window)
            self.hybrid.add(owner.slot)
        else:
            group.block_size = max(group.block_size, size)
            if window is not None:
                group.window = window
        placed = 0
        if seqs:
            keys = locate(
                seqs, parent, token_ids or b"", size, self.block_size, self.seed, self.store.ident
            )
            unplaced = 0
            for seq, key in zip(seqs, keys, strict=True):
                if key is None:
                    unplaced += 1
                else:
                    group.add(seq, key)
                    placed += 1
            if unplaced:
                self.counters["group_blocks_unplaced"] += unplaced
        self._retire_if_empty(owner)
        return placed

    def remove_group(
        self, instance: str, rank: int, group_idx: int, seqs: Sequence[int]
    ) -> list[int]:
        """One copy of each block leaves a non-primary group; returns the
        hashes it did not hold."""
        owner = self.owners.get(instance, {}).get(rank)
        group = owner.groups.get(group_idx) if owner is not None else None
        if owner is None or group is None:
            return list(seqs)
        self.dirty.owners.add((self.key, instance, rank))
        missing = [seq for seq in seqs if not group.remove(seq)]
        self._retire_if_empty(owner)
        return missing

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
        token_ids: Tokens | None,
    ) -> int:
        """A pool stored blocks: with tokens it carries its own content,
        without it is a confirmation (phase two) joined through the catalog."""
        store = self._pool(backend, medium, tier)
        if store is None:
            self.counters["pool_limit_dropped"] += len(seqs)
            return 0
        target: PoolTarget = ("p", backend, medium, tier)
        idents: list[int] | None = None
        if token_ids:
            seqs, idents = self._chain(seqs, parent, token_ids, None, False)
        placed = self._then_wait(self._place_pool(store, seqs, idents), target)
        if idents is not None:
            self._learn(seqs, idents)
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
                hit = self.store.remove_pool(store.pid, seq) or hit
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
            removed += self.store.clear_pool(store.pid)
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
        owners: Sequence[tuple[str, int, Sequence[tuple[bytes, bytes]], OwnerExtras]],
        pools: Sequence[tuple[str, str, int, bytes, bytes]],
    ) -> None:
        """Bulk-load owner tiers and pool stores of a snapshot (packed
        arrays) into this fresh namespace. Same result as placing block by
        block."""
        assert not self.store.content_len(), "load() is for a namespace restored from scratch"
        for instance, rank, tiers, extras in owners:
            owner = self.restored_owner(instance, rank)
            self.set_extras(owner, extras)
            for tier, (seqs, idents) in enumerate(tiers):
                if seqs:
                    self.store.load_owner(owner.slot, tier, seqs, idents)
            self._retire_if_empty(owner)
        for backend, medium, tier, seqs, idents in pools:
            store = self.restored_pool(backend, medium, tier)
            self.store.load_pool(store.pid, seqs, idents)
            self._drop_pool_if_empty(store)

    def set_extras(self, owner: Owner, extras: OwnerExtras) -> None:
        """What an owner holds beyond its tiers' sets, as a snapshot has it."""
        owner.copies = dict(extras.copies)
        owner.groups = dict(extras.groups)
        owner.primary_block = extras.primary_block
        if owner.groups:
            self.hybrid.add(owner.slot)
        else:
            self.hybrid.discard(owner.slot)

    # ------------------------------------------------------------ reading

    def is_empty(self) -> bool:
        return not (
            self.owners
            or self.pools
            or self.store.content_len()
            or self.pending
            or self.store.retired_len()
            or self.waiting
            or self.unresolved
            or self.children
        )

    def identities_of(self, seqs: Sequence[int]) -> list[int]:
        """Identities of a prompt named by engine hashes, up to the first unknown."""
        return self.store.identities_of(seqs)
