"""The snapshot format (contract section 5): index state as compactable units.

The index is cut into units, each the latest state of one thing a Kafka
key can name, so that log compaction keeps exactly the current state:

| unit | key | holds |
|---|---|---|
| owner | `["o", ns..., instance, rank]` | one (instance, dp rank)'s device, host, disk tiers |
| pool | `["p", ns..., backend, medium]` | one pool store's blocks |
| pending | `["q", ns...]` | the namespace's pending halves, oldest first |
| instance | `["i", instance]` | kv-seq positions, skipped groups, namespaces |
| generation | `["g", name]` | source offsets and clock the units reflect |

`ns...` is the namespace's five fields (tenant, model, block_size,
lora_name, salt). Keys and values are msgpack (msgspec). Blocks are packed as
two little-endian u64 arrays (sequence hashes, identities), 16 bytes a
block. A unit that is gone is a tombstone (null value). Large units are cut
into chunks; see `snapshot_store` for chunk keys and the transaction that
makes a generation atomic.

This module is pure: `export_*` reads units out of an `Index`, `restore`
builds an `Index` from decoded units.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Generator, Iterator
from typing import Any, NamedTuple, overload

import msgspec

from kvconductor.index.block_store import BlockStore
from kvconductor.index.cache_groups import Group, new_group
from kvconductor.index.fleet import Index, InstanceState
from kvconductor.index.namespace import (
    NO_EXTRAS,
    NamespaceIndex,
    NamespaceKey,
    Owner,
    OwnerExtras,
    PoolStore,
    Unresolved,
)
from kvconductor.index.pending import INTENT, UNRESOLVED, WAITING
from kvconductor.wire.media import DEVICE, DISK, HOST
from kvconductor.wire.packing import pack_f64, pack_u64, unpack_f64, unpack_u64

# 2: tiers hold copies, owners their non-primary KV-cache groups (v1 units
# read as sets without groups: docs/snapshot-format.md).
SCHEMA_VERSION = 2
# Packed hashes `completing` reads identities for in one step: small enough
# that records waiting for the step do not notice it.
CUT_PIECE_BYTES = 8 * 16_384


class GroupUnit(msgspec.Struct, array_like=True, frozen=True):
    """One non-primary KV-cache group of an owner (`cache_groups.GroupState`)."""

    group: int
    kind: str
    block_size: int
    window: int | None
    # Packed u64, one entry per engine hash held: the hash, its key, copies.
    seqs: bytes
    keys: bytes
    copies: bytes


class OwnerUnit(msgspec.Struct, tag="owner", frozen=True):
    instance: str
    rank: int
    # Per tier (device, host, disk): packed u64 sequence hashes and identities.
    seqs: list[bytes]
    idents: list[bytes]
    # (tier, sequence hash, copies beyond the first), in that order.
    copies: list[tuple[int, int, int]] = []
    groups: list[GroupUnit] = []
    # The primary group's largest block size seen; 0: none (or a v1 unit).
    primary_block: int = 0


class PoolUnit(msgspec.Struct, tag="pool", frozen=True):
    backend: str
    medium: str
    tier: int
    seqs: bytes
    idents: bytes


class PendingIntent(msgspec.Struct, tag="i", array_like=True, frozen=True):
    seq: int
    ident: int
    ts: float


class PendingUnresolved(msgspec.Struct, tag="u", array_like=True, frozen=True):
    seq: int
    parent: int
    block: bytes
    extra: int | None
    pin: bool
    ts: float


class PendingWaiting(msgspec.Struct, tag="w", array_like=True, frozen=True):
    seq: int
    target: tuple[str, str, int | str, int]
    ts: float


PendingEntry = PendingIntent | PendingUnresolved | PendingWaiting


class RetiredContent(msgspec.Struct, array_like=True, frozen=True):
    seq: int
    ident: int
    ts: float


class PendingUnit(msgspec.Struct, tag="pending", frozen=True):
    now: float
    entries: list[PendingEntry]
    # Written before the retired entries were packed; read, never written.
    retired: list[RetiredContent] = []
    # The retired entries oldest first (`BlockStore.export_retired`), packed:
    # a list of structs made a generation's cut grow with every entry.
    retired_seqs: bytes = b""
    retired_idents: bytes = b""
    retired_ts: bytes = b""


class InstanceUnit(msgspec.Struct, tag="instance", frozen=True):
    instance: str
    last_seq: dict[int, int]
    namespaces: list[tuple[str, str, int, str | None, str]]
    last_event_ts: float
    # KV-cache group -> its spec kind (v1's `skip_groups` is not read).
    groups: dict[int, str] = {}


class GenerationUnit(msgspec.Struct, tag="generation", frozen=True):
    generation: int
    # (topic, partition) -> next offset to read; what the units reflect.
    offsets: list[tuple[str, int, int]]
    clock: float
    written_at: float


Unit = OwnerUnit | PoolUnit | PendingUnit | InstanceUnit | GenerationUnit


class UnitValue(msgspec.Struct, frozen=True):
    """A snapshot record's value: one unit (or a chunk of one), versioned."""

    v: int
    generation: int
    chunk: int
    chunks: int
    data: bytes  # msgpack of the Unit; chunked units split these bytes


UnitKey = tuple[Any, ...]

_unit_encoder = msgspec.msgpack.Encoder()
_unit_decoder = msgspec.msgpack.Decoder(Unit)


def encode_unit(unit: Unit) -> bytes:
    return _unit_encoder.encode(unit)


def decode_unit(data: bytes) -> Unit:
    return _unit_decoder.decode(data)


def ns_fields(key: NamespaceKey) -> tuple[str, str, int, str | None, str]:
    return (key.tenant, key.model, key.block_size, key.lora_name, key.salt)


def owner_key(ns: NamespaceKey, instance: str, rank: int) -> UnitKey:
    return ("o", *ns_fields(ns), instance, rank)


def pool_key(ns: NamespaceKey, backend: str, medium: str) -> UnitKey:
    return ("p", *ns_fields(ns), backend, medium)


def pending_key(ns: NamespaceKey) -> UnitKey:
    return ("q", *ns_fields(ns))


def instance_key(instance: str) -> UnitKey:
    return ("i", instance)


def generation_key(name: str) -> UnitKey:
    return ("g", name)


# --------------------------------------------------------------- export


def _owner_at(
    index: Index, ns_key: NamespaceKey, instance: str, rank: int
) -> tuple[NamespaceIndex, Owner] | None:
    ns = index.namespaces.get(ns_key)
    owner = ns.owners.get(instance, {}).get(rank) if ns is not None else None
    return None if ns is None or owner is None else (ns, owner)


def _pool_at(
    index: Index, ns_key: NamespaceKey, backend: str, medium: str
) -> tuple[NamespaceIndex, PoolStore] | None:
    ns = index.namespaces.get(ns_key)
    pool = ns.pools.get((backend, medium)) if ns is not None else None
    return None if ns is None or pool is None else (ns, pool)


def export_owner(
    index: Index, ns_key: NamespaceKey, instance: str, rank: int, at_cut: bool
) -> OwnerUnit | CutUnit | None:
    found = _owner_at(index, ns_key, instance, rank)
    if found is None:
        return None
    ns, owner = found
    store = ns.store
    copies = sorted((tier, seq, n) for (tier, seq), n in owner.copies.items())
    groups = [_group_unit(i, g) for i, g in sorted(owner.groups.items())]
    if at_cut:
        store.freeze_owner(owner.slot)
        part = OwnerUnit(instance, rank, [], [], copies, groups, owner.primary_block)
        return CutUnit(store, part, owner.slot)
    tiers = [store.export_owner(owner.slot, tier) for tier in (DEVICE, HOST, DISK)]
    return OwnerUnit(
        instance,
        rank,
        [t[0] for t in tiers],
        [t[1] for t in tiers],
        copies,
        groups,
        owner.primary_block,
    )


def _group_unit(idx: int, group: Group) -> GroupUnit:
    held = group.export()
    return GroupUnit(
        idx,
        group.kind,
        group.block_size,
        group.window,
        pack_u64(seq for seq, _, _ in held),
        pack_u64(key for _, key, _ in held),
        pack_u64(n for _, _, n in held),
    )


def owner_extras(unit: OwnerUnit) -> OwnerExtras:
    """An owner unit's state beyond its tiers, for the namespace."""
    groups: dict[int, Group] = {}
    for g in unit.groups:
        if g.block_size <= 0 or (g.window is not None and g.window < 0):
            raise ValueError("a group's block size or window is out of range")
        state = groups[g.group] = new_group(g.kind, g.block_size, g.window)
        seqs, keys, copies = unpack_u64(g.seqs), unpack_u64(g.keys), unpack_u64(g.copies)
        if not len(seqs) == len(keys) == len(copies):
            raise ValueError("a group's arrays differ in length")
        for seq, key, n in zip(seqs, keys, copies, strict=True):
            for _ in range(n):
                state.add(seq, key)
    return OwnerExtras({(t, seq): n for t, seq, n in unit.copies}, groups, unit.primary_block)


def export_pool(
    index: Index, ns_key: NamespaceKey, backend: str, medium: str, at_cut: bool
) -> PoolUnit | CutUnit | None:
    found = _pool_at(index, ns_key, backend, medium)
    if found is None:
        return None
    ns, pool = found
    store = ns.store
    if at_cut:
        store.freeze_pool(pool.pid)
        return CutUnit(store, PoolUnit(backend, medium, pool.tier, b"", b""), pool.pid)
    seqs, idents = store.export_pool(pool.pid)
    return PoolUnit(backend, medium, pool.tier, seqs, idents)


class CutUnit(NamedTuple):
    """An owner or pool unit frozen at a cut, its blocks not read yet:
    `completing` reads its hashes and their identities (a random lookup in
    the namespace's catalog each) after the cut, while records apply again,
    from what the store kept as it was at the cut (`BlockStore.begin_cut`,
    `freeze_owner`). Reading the hashes at the cut held records back for
    as long as the largest units took (docs/benchmarks.md)."""

    store: BlockStore
    unit: OwnerUnit | PoolUnit  # without blocks
    at: int  # the owner's slot or the pool's id


def export_unit_at_cut(index: Index, kind: str, uid: Any) -> tuple[UnitKey, Unit | CutUnit | None]:
    """`export_unit`, with owner and pool units as `CutUnit`s; every
    namespace's store must have a cut open."""
    return export_unit(index, kind, uid, at_cut=True)


def completing(unit: Unit | CutUnit | None) -> Generator[None, None, Unit | None]:
    """A unit exported at a cut, with the blocks and identities it had
    there, the identities read `CUT_PIECE_BYTES` of packed hashes a step: a
    large pool unit in one piece made records wait it out. Returns the unit."""
    if not isinstance(unit, CutUnit):
        return unit
    store, part, at = unit

    def identities(seqs: bytes) -> Generator[None, None, bytes]:
        if len(seqs) <= CUT_PIECE_BYTES:
            return store.cut_identities(seqs)
        pieces = []
        for at in range(0, len(seqs), CUT_PIECE_BYTES):
            pieces.append(store.cut_identities(seqs[at : at + CUT_PIECE_BYTES]))
            yield
        return b"".join(pieces)

    if isinstance(part, OwnerUnit):
        tiers, idents = [], []
        for tier in (DEVICE, HOST, DISK):
            seqs = store.cut_owner_seqs(at, tier)
            yield
            tiers.append(seqs)
            idents.append((yield from identities(seqs)))
            yield
        return msgspec.structs.replace(part, seqs=tiers, idents=idents)
    seqs = store.cut_pool_seqs(at)
    yield
    return msgspec.structs.replace(part, seqs=seqs, idents=(yield from identities(seqs)))


def export_pending(index: Index, ns_key: NamespaceKey) -> PendingUnit | None:
    ns = index.namespaces.get(ns_key)
    if ns is None or not (ns.pending or ns.store.retired_len()):
        return None
    entries: list[PendingEntry] = []
    for key, ts in ns.pending:
        kind, seq = key[0], key[1]
        if kind == INTENT:
            ident = ns.store.ident(seq)
            assert ident is not None, "a pinned intent's content is held"
            entries.append(PendingIntent(seq, ident, ts))
        elif kind == UNRESOLVED:
            u = ns.unresolved[seq]
            entries.append(PendingUnresolved(seq, u.parent, u.block, u.extra, u.pin, ts))
        else:
            entries.append(PendingWaiting(seq, key[2], ts))
    return PendingUnit(ns.now, entries, [], *ns.store.export_retired())


def retired_entries(unit: PendingUnit) -> list[RetiredContent]:
    """A pending unit's retired entries, oldest first, as structs."""
    packed = zip(
        unpack_u64(unit.retired_seqs),
        unpack_u64(unit.retired_idents),
        unpack_f64(unit.retired_ts),
        strict=True,
    )
    return [*unit.retired, *(RetiredContent(*r) for r in packed)]


def export_instance(index: Index, instance: str) -> InstanceUnit | None:
    state = index.instances.get(instance)
    if state is None:
        return None
    return InstanceUnit(
        instance,
        dict(state.last_seq),
        sorted((ns_fields(k) for k in state.namespaces), key=repr),
        state.last_event_ts,
        dict(sorted(state.groups.items())),
    )


def all_unit_ids(index: Index) -> Iterator[tuple[str, Any]]:
    """Every unit the index holds now, as (kind, id) for `export_unit`."""
    for ns_key, ns in index.namespaces.items():
        for instance, ranks in ns.owners.items():
            for rank in ranks:
                yield "o", (ns_key, instance, rank)
        for backend, medium in ns.pools:
            yield "p", (ns_key, backend, medium)
        if ns.pending or ns.store.retired_len():
            yield "q", ns_key
    for instance in index.instances:
        yield "i", instance


def mark_all_changed(index: Index) -> list[NamespaceKey]:
    """Mark every owner, pool and instance unit changed; returns the
    namespaces, whose pending units have versions instead of marks."""
    dirty = index.dirty
    for kind, uid in all_unit_ids(index):
        if kind == "o":
            dirty.owners.add(uid)
        elif kind == "p":
            dirty.pools.add(uid)
        elif kind == "i":
            dirty.instances.add(uid)
    return list(index.namespaces)


def namespace_keys(index: Index) -> set[NamespaceKey]:
    return set(index.namespaces)


def pending_version(index: Index, ns_key: NamespaceKey) -> int:
    """The version of a namespace's pending unit (-1: no namespace)."""
    ns = index.namespaces.get(ns_key)
    return -1 if ns is None else ns.pending_version()


def begin_cut(index: Index) -> list[BlockStore]:
    """Open a cut on every namespace's store (`BlockStore.begin_cut`);
    the caller closes them."""
    stores = [ns.store for ns in index.namespaces.values()]
    for store in stores:
        store.begin_cut()
    return stores


@overload
def export_unit(index: Index, kind: str, uid: Any) -> tuple[UnitKey, Unit | None]: ...


@overload
def export_unit(
    index: Index, kind: str, uid: Any, at_cut: bool
) -> tuple[UnitKey, Unit | CutUnit | None]: ...


def export_unit(
    index: Index, kind: str, uid: Any, at_cut: bool = False
) -> tuple[UnitKey, Unit | CutUnit | None]:
    """The key of a unit and its current state (None: gone, a tombstone);
    `at_cut`: owner and pool units as `CutUnit`s."""
    if kind == "o":
        ns_key, instance, rank = uid
        unit = export_owner(index, ns_key, instance, rank, at_cut)
        return owner_key(ns_key, instance, rank), unit
    if kind == "p":
        ns_key, backend, medium = uid
        pool = export_pool(index, ns_key, backend, medium, at_cut)
        return pool_key(ns_key, backend, medium), pool
    if kind == "q":
        return pending_key(uid), export_pending(index, uid)
    return instance_key(uid), export_instance(index, uid)


# -------------------------------------------------------------- restore


def unit_namespace(key: UnitKey) -> NamespaceKey | None:
    """The namespace a unit key belongs to (None: instance and generation units)."""
    if key[0] in ("o", "p", "q"):
        return NamespaceKey(key[1], key[2], key[3], key[4], key[5])
    return None


def restore(
    index: Index,
    units: dict[UnitKey, Unit],
    keep: Callable[[NamespaceKey], bool] | None = None,
) -> None:
    """Load decoded units (latest per key) into the index.

    With `keep`, only the namespaces it accepts (and instances living in
    them) are loaded: a scale-out daemon takes the units of the partitions
    it was assigned, and the index may already hold other namespaces."""
    index.epoch += 1
    by_ns: dict[NamespaceKey, list[tuple[UnitKey, Unit]]] = {}
    restored_instances: set[str] = set()
    for key, unit in units.items():
        if isinstance(unit, InstanceUnit):
            spaces = [NamespaceKey(*f) for f in unit.namespaces]
            if keep is not None and not any(keep(k) for k in spaces):
                continue
            index.instances[unit.instance] = _instance_state(unit)
            restored_instances.add(unit.instance)
        elif isinstance(unit, GenerationUnit):
            index.now = max(index.now, unit.clock)
        else:
            ns_key = NamespaceKey(key[1], key[2], key[3], key[4], key[5])
            if keep is None or keep(ns_key):
                by_ns.setdefault(ns_key, []).append((key, unit))
    for ns_key, ns_units in by_ns.items():
        ns = index._namespace(ns_key)
        if ns is None:
            raise ValueError("snapshot holds more namespaces than index.max_namespaces")
        pending: PendingUnit | None = None
        owners = []
        pools = []
        for _, unit in ns_units:
            if isinstance(unit, OwnerUnit):
                tiers = [(unit.seqs[t], unit.idents[t]) for t in (DEVICE, HOST, DISK)]
                owners.append((unit.instance, unit.rank, tiers, owner_extras(unit)))
            elif isinstance(unit, PoolUnit):
                pools.append((unit.backend, unit.medium, unit.tier, unit.seqs, unit.idents))
            elif isinstance(unit, PendingUnit):
                pending = unit
        ns.load(owners, pools)
        # Pending last: placing pool blocks consumes intents.
        if pending is not None:
            _restore_pending(ns, pending)
        index._gc(ns)
    # What was just restored is on the topic already; other namespaces' marks
    # (a scale-out daemon restoring next to what it holds) stay.
    dirty = index.dirty
    dirty.owners = {u for u in dirty.owners if u[0] not in by_ns}
    dirty.pools = {u for u in dirty.pools if u[0] not in by_ns}
    dirty.instances -= restored_instances


def drop_namespaces(index: Index, drop: Callable[[NamespaceKey], bool]) -> None:
    """Forget namespaces handed over to another daemon, without tombstones:
    their units stay on the snapshot topic for the new owner."""
    index.epoch += 1
    for ns_key in [k for k in index.namespaces if drop(k)]:
        del index.namespaces[ns_key]
    dirty = index.dirty
    dirty.owners = {u for u in dirty.owners if not drop(u[0])}
    dirty.pools = {u for u in dirty.pools if not drop(u[0])}
    for instance in list(index.instances):
        state = index.instances[instance]
        if state.namespaces and all(drop(k) for k in state.namespaces):
            del index.instances[instance]
            dirty.instances.discard(instance)


def _restore_owner(ns: NamespaceIndex, unit: OwnerUnit) -> None:
    """Place one owner unit block by block (into a namespace that holds more)."""
    owner = ns.restored_owner(unit.instance, unit.rank)
    ns.set_extras(owner, owner_extras(unit))
    for tier in (DEVICE, HOST, DISK):
        seqs = unpack_u64(unit.seqs[tier])
        if seqs:
            ns._place_owner(owner, tier, seqs, unpack_u64(unit.idents[tier]))
    ns._retire_if_empty(owner)


def _restore_pending(ns: NamespaceIndex, unit: PendingUnit) -> None:
    ns.touch(unit.now)
    pending = ns.pending
    for e in unit.entries:
        if isinstance(e, PendingIntent):
            if pending.add((INTENT, e.seq), e.ts):
                ns._acquire(e.seq, e.ident)
        elif isinstance(e, PendingUnresolved):
            if pending.add((UNRESOLVED, e.seq), e.ts):
                ns.unresolved[e.seq] = Unresolved(e.parent, e.block, e.extra, e.pin)
                ns.children.setdefault(e.parent, []).append(e.seq)
        else:
            target = (e.target[0], e.target[1], e.target[2], e.target[3])
            if pending.add((WAITING, e.seq, target), e.ts):
                ns.waiting.setdefault(e.seq, []).append(target)  # type: ignore[arg-type]
    if unit.retired:
        retired = retired_entries(unit)
        ns.store.load_retired(
            pack_u64(r.seq for r in retired),
            pack_u64(r.ident for r in retired),
            pack_f64(r.ts for r in retired),
        )
    else:
        ns.store.load_retired(unit.retired_seqs, unit.retired_idents, unit.retired_ts)


def state_fingerprint(index: Index) -> dict[UnitKey, bytes]:
    """Every unit's encoded state, for comparing two indexes exactly."""
    out: dict[UnitKey, bytes] = {}
    for kind, uid in all_unit_ids(index):
        key, unit = export_unit(index, kind, uid)
        if unit is not None:
            out[key] = encode_unit(_canonical(unit))
    return out


def _canonical(unit: Unit) -> Unit:
    """Order-independent form of a unit (dict order differs between runs)."""
    if isinstance(unit, OwnerUnit):
        seqs: list[bytes] = []
        idents: list[bytes] = []
        for s, i in zip(unit.seqs, unit.idents, strict=True):
            pairs = sorted(zip(unpack_u64(s), unpack_u64(i), strict=True))
            seqs.append(pack_u64([p[0] for p in pairs]))
            idents.append(pack_u64([p[1] for p in pairs]))
        return msgspec.structs.replace(unit, seqs=seqs, idents=idents)
    if isinstance(unit, PoolUnit):
        pairs = sorted(zip(unpack_u64(unit.seqs), unpack_u64(unit.idents), strict=True))
        return PoolUnit(
            unit.backend,
            unit.medium,
            unit.tier,
            pack_u64([p[0] for p in pairs]),
            pack_u64([p[1] for p in pairs]),
        )
    if isinstance(unit, InstanceUnit):
        return msgspec.structs.replace(unit, last_event_ts=0.0)
    if isinstance(unit, PendingUnit):
        # Arrival order and times across partitions depend on fetch
        # interleaving: compare what is pending, not when it arrived.
        entries = [msgspec.structs.replace(e, ts=0.0) for e in unit.entries]
        retired = sorted(
            zip(unpack_u64(unit.retired_seqs), unpack_u64(unit.retired_idents), strict=True)
        )
        return PendingUnit(
            0.0,
            sorted(entries, key=repr),
            [],
            pack_u64(r[0] for r in retired),
            pack_u64(r[1] for r in retired),
        )
    return unit


# ------------------------------------------------------ live replacement


def apply_units(index: Index, changes: dict[UnitKey, Unit | None]) -> None:
    """Replace units' state in a live index; None means the unit is gone.

    For a follower of the snapshot topic: `changes` is what one or more
    newer generations wrote, the latest per unit key. Afterwards the index
    equals what `restore` would build from the topic as a whole, provided
    the units not in `changes` still hold what the index holds (the
    publisher rewrites every unit whose state changed).

    Per namespace touched: the changed owners' and pools' blocks, every
    pending half and every retired entry are taken out first, releasing
    their catalog references; then the new owner and pool states are
    placed, and the pending state last, as `restore` does: the generation's
    pending unit if it carries one, else the one the index held (unchanged
    on the topic; an empty one is not written at all, so only this keeps
    releases of the old blocks from lingering as retired content). The
    pending and retired bounds are lifted meanwhile, so a transient release
    never evicts anything."""
    index.epoch += 1
    by_ns: dict[NamespaceKey, list[tuple[UnitKey, Unit | None]]] = {}
    for key, unit in changes.items():
        kind = key[0]
        if kind == "i":
            if unit is None:
                index.instances.pop(key[1], None)
            elif isinstance(unit, InstanceUnit):
                index.instances[unit.instance] = _instance_state(unit)
        elif kind == "g":
            if isinstance(unit, GenerationUnit):
                index.now = max(index.now, unit.clock)
        elif kind in ("o", "p", "q"):
            ns_key = NamespaceKey(key[1], key[2], key[3], key[4], key[5])
            by_ns.setdefault(ns_key, []).append((key, unit))
    for ns_key, ns_changes in by_ns.items():
        _apply_namespace(index, ns_key, ns_changes)
    index.dirty.owners.clear()
    index.dirty.pools.clear()
    index.dirty.instances.clear()


def replace_unit(index: Index, key: UnitKey, unit: Unit | None) -> None:
    """Replace one unit's state in a live index (None: the unit is gone).

    Several units of one generation should go through `apply_units`
    together: a namespace's pending unit must be applied after its owners
    and pools, which one call at a time cannot guarantee."""
    apply_units(index, {key: unit})


def _instance_state(unit: InstanceUnit) -> InstanceState:
    state = InstanceState()
    state.last_seq = dict(unit.last_seq)
    state.groups = dict(unit.groups)
    state.namespaces = {NamespaceKey(*f) for f in unit.namespaces}
    state.last_event_ts = unit.last_event_ts
    return state


def _apply_namespace(
    index: Index, ns_key: NamespaceKey, changes: list[tuple[UnitKey, Unit | None]]
) -> None:
    ns = index.namespaces.get(ns_key)
    if ns is None:
        if all(unit is None for _, unit in changes):
            return
        ns = index._namespace(ns_key)
        if ns is None:
            raise ValueError("snapshot holds more namespaces than index.max_namespaces")
    pending: Unit | None = None
    if any(key[0] == "q" for key, _ in changes):
        pending = next(unit for key, unit in changes if key[0] == "q")
    else:
        pending = export_pending(index, ns_key)
    bounds = (ns.pending.max_entries, ns.store.retired_limit())
    ns.pending.max_entries = sys.maxsize
    ns.store.set_retired_limit(sys.maxsize)
    try:
        # Out with the old state.
        for key, _ in changes:
            if key[0] == "o":
                owner = ns.owners.get(key[6], {}).get(key[7])
                if owner is not None:
                    ns.store.clear_owner(owner.slot)
                    ns.set_extras(owner, NO_EXTRAS)
                    ns._retire_if_empty(owner)
            elif key[0] == "p":
                store = ns.pools.get((key[6], key[7]))
                if store is not None:
                    ns.store.clear_pool(store.pid)
                    ns._drop_pool_if_empty(store)
        _clear_pending(ns)
        # In with the new, pending last (placing pool blocks consumes intents).
        for _, unit in changes:
            if isinstance(unit, OwnerUnit):
                _restore_owner(ns, unit)
            elif isinstance(unit, PoolUnit):
                store = ns.restored_pool(unit.backend, unit.medium, unit.tier)
                ns._place_pool(store, unpack_u64(unit.seqs), unpack_u64(unit.idents))
                ns._drop_pool_if_empty(store)
        if isinstance(pending, PendingUnit):
            _restore_pending(ns, pending)
    finally:
        ns.pending.max_entries = bounds[0]
        ns.store.set_retired_limit(bounds[1])
    index._gc(ns)


def _clear_pending(ns: NamespaceIndex) -> None:
    """Take out every pending half and every retired catalog entry."""
    for key, _ in ns.pending:
        kind, seq = key[0], key[1]
        ns.pending.discard(key)
        if kind == INTENT:
            ns._release(seq)
        elif kind == UNRESOLVED:
            u = ns.unresolved.pop(seq)
            ns._unlink_child(u.parent, seq)
        else:
            targets = ns.waiting[seq]
            targets.remove(key[2])
            if not targets:
                del ns.waiting[seq]
    ns.store.clear_retired()
