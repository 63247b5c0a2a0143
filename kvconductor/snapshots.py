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
from array import array
from collections.abc import Iterator
from typing import Any

import msgspec

from kvconductor.index import Index, InstanceState
from kvconductor.media import DEVICE, DISK, HOST
from kvconductor.namespace_index import NamespaceIndex, NamespaceKey, Owner, Unresolved
from kvconductor.pending import INTENT, RETIRED, UNRESOLVED, WAITING

SCHEMA_VERSION = 1

_SWAP = sys.byteorder == "big"


class OwnerUnit(msgspec.Struct, tag="owner", frozen=True):
    instance: str
    rank: int
    # Per tier (device, host, disk): packed u64 sequence hashes and identities.
    seqs: list[bytes]
    idents: list[bytes]


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
    retired: list[RetiredContent] = []


class InstanceUnit(msgspec.Struct, tag="instance", frozen=True):
    instance: str
    last_seq: dict[int, int]
    skip_groups: list[int]
    namespaces: list[tuple[str, str, int, str | None, str]]
    last_event_ts: float


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


def _pack(values: Iterator[int] | list[int]) -> bytes:
    arr = array("Q", values)
    if _SWAP:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _unpack(data: bytes) -> list[int]:
    arr = array("Q")
    arr.frombytes(data)
    if _SWAP:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()


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


def export_owner(index: Index, ns_key: NamespaceKey, instance: str, rank: int) -> OwnerUnit | None:
    ns = index.namespaces.get(ns_key)
    owner = ns.owners.get(instance, {}).get(rank) if ns is not None else None
    if owner is None:
        return None
    return OwnerUnit(
        instance,
        rank,
        [_pack(list(t.keys())) for t in owner.tiers],
        [_pack(list(t.values())) for t in owner.tiers],
    )


def export_pool(index: Index, ns_key: NamespaceKey, backend: str, medium: str) -> PoolUnit | None:
    ns = index.namespaces.get(ns_key)
    store = ns.pools.get((backend, medium)) if ns is not None else None
    if store is None:
        return None
    return PoolUnit(
        backend,
        medium,
        store.tier,
        _pack(list(store.blocks.keys())),
        _pack(list(store.blocks.values())),
    )


def export_pending(index: Index, ns_key: NamespaceKey) -> PendingUnit | None:
    ns = index.namespaces.get(ns_key)
    if ns is None or not (ns.pending or ns.retired):
        return None
    entries: list[PendingEntry] = []
    for key, ts in ns.pending:
        kind, seq = key[0], key[1]
        if kind == INTENT:
            entries.append(PendingIntent(seq, ns.content[seq], ts))
        elif kind == UNRESOLVED:
            u = ns.unresolved[seq]
            entries.append(PendingUnresolved(seq, u.parent, u.block, u.extra, u.pin, ts))
        else:
            entries.append(PendingWaiting(seq, key[2], ts))
    retired = [RetiredContent(key[1], ns.content[key[1]], ts) for key, ts in ns.retired]
    return PendingUnit(ns.now, entries, retired)


def export_instance(index: Index, instance: str) -> InstanceUnit | None:
    state = index.instances.get(instance)
    if state is None:
        return None
    return InstanceUnit(
        instance,
        dict(state.last_seq),
        sorted(state.skip_groups),
        sorted((ns_fields(k) for k in state.namespaces), key=repr),
        state.last_event_ts,
    )


def all_unit_ids(index: Index) -> Iterator[tuple[str, Any]]:
    """Every unit the index holds now, as (kind, id) for `export_unit`."""
    for ns_key, ns in index.namespaces.items():
        for instance, ranks in ns.owners.items():
            for rank in ranks:
                yield "o", (ns_key, instance, rank)
        for backend, medium in ns.pools:
            yield "p", (ns_key, backend, medium)
        if ns.pending or ns.retired:
            yield "q", ns_key
    for instance in index.instances:
        yield "i", instance


def export_unit(index: Index, kind: str, uid: Any) -> tuple[UnitKey, Unit | None]:
    """The key of a unit and its current state (None: gone, a tombstone)."""
    if kind == "o":
        ns_key, instance, rank = uid
        return owner_key(ns_key, instance, rank), export_owner(index, ns_key, instance, rank)
    if kind == "p":
        ns_key, backend, medium = uid
        return pool_key(ns_key, backend, medium), export_pool(index, ns_key, backend, medium)
    if kind == "q":
        return pending_key(uid), export_pending(index, uid)
    return instance_key(uid), export_instance(index, uid)


# -------------------------------------------------------------- restore


def restore(index: Index, units: dict[UnitKey, Unit]) -> None:
    """Load decoded units (latest per key) into an empty index."""
    by_ns: dict[NamespaceKey, list[tuple[UnitKey, Unit]]] = {}
    for key, unit in units.items():
        if isinstance(unit, InstanceUnit):
            state = InstanceState()
            state.last_seq = dict(unit.last_seq)
            state.skip_groups = set(unit.skip_groups)
            state.namespaces = {NamespaceKey(*f) for f in unit.namespaces}
            state.last_event_ts = unit.last_event_ts
            index.instances[unit.instance] = state
        elif isinstance(unit, GenerationUnit):
            index.now = max(index.now, unit.clock)
        else:
            ns_key = NamespaceKey(key[1], key[2], key[3], key[4], key[5])
            by_ns.setdefault(ns_key, []).append((key, unit))
    for ns_key, ns_units in by_ns.items():
        ns = index._namespace(ns_key)
        if ns is None:
            raise ValueError("snapshot holds more namespaces than index.max_namespaces")
        pending: PendingUnit | None = None
        for _, unit in ns_units:
            if isinstance(unit, OwnerUnit):
                _restore_owner(ns, unit)
            elif isinstance(unit, PoolUnit):
                store = ns._pool(unit.backend, unit.medium, unit.tier)
                ns._place_pool(store, _unpack(unit.seqs), _unpack(unit.idents))
                ns._drop_pool_if_empty(store)
            elif isinstance(unit, PendingUnit):
                pending = unit
        # Pending last: placing pool blocks consumes intents.
        if pending is not None:
            _restore_pending(ns, pending)
        index._gc(ns)
    index.dirty.owners.clear()
    index.dirty.pools.clear()
    index.dirty.instances.clear()


def _restore_owner(ns: NamespaceIndex, unit: OwnerUnit) -> None:
    owner: Owner = ns._owner(unit.instance, unit.rank)
    for tier in (DEVICE, HOST, DISK):
        seqs = _unpack(unit.seqs[tier])
        if seqs:
            ns._place_owner(owner, tier, seqs, _unpack(unit.idents[tier]))
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
    for r in unit.retired:
        if r.seq not in ns.content and ns.retired.add((RETIRED, r.seq), r.ts):
            ns.content[r.seq] = r.ident


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
            pairs = sorted(zip(_unpack(s), _unpack(i), strict=True))
            seqs.append(_pack([p[0] for p in pairs]))
            idents.append(_pack([p[1] for p in pairs]))
        return OwnerUnit(unit.instance, unit.rank, seqs, idents)
    if isinstance(unit, PoolUnit):
        pairs = sorted(zip(_unpack(unit.seqs), _unpack(unit.idents), strict=True))
        return PoolUnit(
            unit.backend,
            unit.medium,
            unit.tier,
            _pack([p[0] for p in pairs]),
            _pack([p[1] for p in pairs]),
        )
    if isinstance(unit, InstanceUnit):
        return InstanceUnit(unit.instance, unit.last_seq, unit.skip_groups, unit.namespaces, 0.0)
    if isinstance(unit, PendingUnit):
        # Arrival order and times across partitions depend on fetch
        # interleaving: compare what is pending, not when it arrived.
        entries = [msgspec.structs.replace(e, ts=0.0) for e in unit.entries]
        retired = [msgspec.structs.replace(r, ts=0.0) for r in unit.retired]
        return PendingUnit(0.0, sorted(entries, key=repr), sorted(retired, key=repr))
    return unit
