"""Cache-hit queries (contract section 4).

For every listed (instance, dp rank) of a namespace, in one pass over the
prompt's block identities:

- `GPU`: the longest prefix in the rank's device tier;
- `CPU`: from there, extended while each next block is in the rank's own
  host tier or in any pool store of the host class;
- `DISK`: the same extension when disk-class tiers (own or pool) serve too.

Each of the three is a set of still-matching owners kept as a bitmask over
owner slots, so one block costs a few dict lookups and big-int operations
however many owners there are; the pass stops at the first block that no
owner can serve, and prompt hashing is lazy, so a short hit never hashes the
rest of a long prompt.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple

import xxhash

from kvconductor.hashing import MASK64, extra_keys_fingerprint, pack_tokens
from kvconductor.kernel import KERNEL, Walked
from kvconductor.media import DEVICE, DISK, HOST
from kvconductor.namespace_index import NamespaceIndex, NamespaceKey
from kvconductor.query_wire import HashQuery, InvalidQuery, QueryResponse, TokenQuery

_xxh3 = xxhash.xxh3_64_intdigest


def namespace_of(req: TokenQuery | HashQuery) -> NamespaceKey:
    if req.block_size <= 0:
        raise InvalidQuery("block_size must be a positive integer")
    return NamespaceKey(
        req.tenant_id if req.tenant_id is not None else "default",
        req.model,
        req.block_size,
        req.lora_name,
        req.cache_salt if req.cache_salt is not None else "",
    )


def packed_prompt(req: TokenQuery) -> bytes:
    """The prompt's full blocks as little-endian u32 tokens."""
    n = len(req.token_ids) // req.block_size
    try:
        return pack_tokens(req.token_ids[: n * req.block_size])
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidQuery("token_ids must be integers in [0, 2**32)") from exc


class Packed(NamedTuple):
    """A prompt's full blocks as packed tokens, hashed lazily from `seed`
    (the namespace seed, xor-ed with a per-request salt's fingerprint: only
    block 0 is hashed from the seed, so that is where an engine mixes it)."""

    data: bytes
    seed: int


def token_identities(data: bytes, block_size: int, seed: int) -> Iterator[int]:
    """The prompt's block identities, hashed only as far as they are read."""
    step = block_size * 4
    ident = seed
    for start in range(0, len(data), step):
        ident = _xxh3(data[start : start + step], ident)
        yield ident


def normalise_query_hash(value: int | str) -> int:
    if isinstance(value, int):
        if not -(1 << 63) <= value <= MASK64:
            raise InvalidQuery("seq_hashes must fit in 64 bits")
        return value & MASK64
    try:
        return int.from_bytes(bytes.fromhex(value), "big") & MASK64
    except ValueError as exc:
        raise InvalidQuery("a string seq_hash must be the hex of a digest") from exc


def match(
    ns: NamespaceIndex, prompt: Packed | list[int], listed: int
) -> dict[int, tuple[int, int, int]]:
    """Per listed owner slot: (GPU, CPU, DISK) matched lengths in blocks."""
    host = ns.masks[HOST] or None
    disk = ns.masks[DISK] or None
    pool_host = ns.pool_counts[HOST] or None
    pool_disk = ns.pool_counts[DISK] or None
    device_only = not (host or disk or pool_host or pool_disk)
    dev = ns.masks[DEVICE]
    if KERNEL is not None:
        slots = len(ns.slots)
        tiers = (dev, host, disk, pool_host, pool_disk)
        if isinstance(prompt, Packed):
            walked = KERNEL.walk_tokens(
                prompt.data, ns.block_size, prompt.seed, slots, tiers, listed
            )
        else:
            walked = KERNEL.walk_identities(prompt, slots, tiers, listed)
    else:
        idents = (
            token_identities(prompt.data, ns.block_size, prompt.seed)
            if isinstance(prompt, Packed)
            else prompt
        )
        walked = _walk(ns, idents, listed, device_only)
    return _lengths(walked, device_only)


def _walk(ns: NamespaceIndex, idents: Iterable[int], listed: int, device_only: bool) -> Walked:
    """The tier walk in Python: the same as the kernel's `walk`."""
    dev, host, disk = ns.masks
    pool_host = ns.pool_counts[HOST]
    pool_disk = ns.pool_counts[DISK]
    g = c = d = listed
    changes: list[tuple[int, int, int]] = []
    i = 0
    if device_only:
        for ident in idents:
            ng = g & dev.get(ident, 0)
            if ng != g:
                changes.append((0, i, g ^ ng))
                g = ng
                if not g:
                    break
            i += 1
        return i, g, g, g, changes
    for ident in idents:
        ng = g & dev.get(ident, 0)
        lower_c = host.get(ident, 0)
        if ident in pool_host:
            lower_c = listed
        lower_d = lower_c | disk.get(ident, 0)
        if ident in pool_disk:
            lower_d = listed
        nc = ng | (c & lower_c)
        nd = ng | (d & lower_d)
        if ng != g:
            changes.append((0, i, g ^ ng))
            g = ng
        if nc != c:
            changes.append((1, i, c ^ nc))
            c = nc
        if nd != d:
            changes.append((2, i, d ^ nd))
            d = nd
            if not d:
                break
        i += 1
    return i, g, c, d, changes


def _lengths(walked: Walked, device_only: bool) -> dict[int, tuple[int, int, int]]:
    """Each owner's matched length per tier: where its bit was lost, or the
    whole walk for bits still set at its end."""
    length, g, c, d, changes = walked
    ends: list[dict[int, int]] = [{}, {}, {}]
    for tier, at, lost in changes:
        _ended(lost, at, ends[tier])
    _ended(g, length, ends[0])
    if device_only:
        return {slot: (n, n, n) for slot, n in ends[0].items()}
    _ended(c, length, ends[1])
    _ended(d, length, ends[2])
    gl, cl, dl = ends
    return {slot: (gl[slot], cl[slot], dl[slot]) for slot in gl}


def _ended(bits: int, at: int, into: dict[int, int]) -> None:
    while bits:
        low = bits & -bits
        into[low.bit_length() - 1] = at
        bits ^= low


def listed_bits(ns: NamespaceIndex, instance_id: str | None) -> int:
    if instance_id is None:
        return ns.all_bits
    bits = 0
    for owner in ns.owners.get(instance_id, {}).values():
        bits |= owner.bit
    return bits


def respond(
    ns: NamespaceIndex, tenant: str, lengths: dict[int, tuple[int, int, int]]
) -> QueryResponse:
    """Shape per-slot lengths as the contract's answer, in tokens."""
    bs = ns.block_size
    by_instance: dict[str, list[tuple[int, int, int, int]]] = {}
    for slot, (g, c, d) in lengths.items():
        owner = ns.slots[slot]
        assert owner is not None
        by_instance.setdefault(owner.instance, []).append((owner.rank, g, c, d))
    out: dict[str, dict[str, object]] = {}
    for instance in sorted(by_instance):
        ranks = sorted(by_instance[instance])
        # Best rank: largest DISK, then GPU, then CPU, then the lowest rank.
        best = min(ranks, key=lambda r: (-r[3], -r[1], -r[2], r[0]))
        out[instance] = {
            "longest_matched": best[3] * bs,
            "GPU": best[1] * bs,
            "CPU": best[2] * bs,
            "DISK": best[3] * bs,
            "DP": {str(r[0]): r[3] * bs for r in ranks},
        }
    return {tenant: out} if out else {}


def run_query(
    ns: NamespaceIndex | None,
    req: TokenQuery | HashQuery,
    salted: NamespaceIndex | None = None,
) -> QueryResponse:
    """Answer one query against its namespace (None: unknown namespace).

    `salted`: for a token query with a `cache_salt`, the same namespace
    without salt, where an engine that salts per request (vLLM's
    `cache_salt` in the first block's extra keys) keeps its blocks;
    instances that match there are answered too. Inputs are validated
    before any namespace is consulted, so a bad request is a 400 whether or
    not its namespace exists."""
    if isinstance(req, TokenQuery):
        data = packed_prompt(req)
        answer = _answer(ns, req, lambda n: Packed(data, n.seed))
        if salted is not None and req.cache_salt:
            fp = extra_keys_fingerprint([req.cache_salt])
            extra = _answer(salted, req, lambda n: Packed(data, n.seed ^ fp), True)
            answer = _merge(answer, extra)
        return answer
    # Engine hashes already cover a per-request salt: no second namespace.
    hashes = [normalise_query_hash(h) for h in req.seq_hashes]
    return _answer(ns, req, lambda n: n.identities_of(hashes))


def _answer(
    ns: NamespaceIndex | None,
    req: TokenQuery | HashQuery,
    prompt: Callable[[NamespaceIndex], Packed | list[int]],
    hits_only: bool = False,
) -> QueryResponse:
    if ns is None:
        return {}
    listed = listed_bits(ns, req.instance_id)
    if not listed:
        return {}
    lengths = match(ns, prompt(ns), listed)
    if hits_only:
        lengths = {slot: ls for slot, ls in lengths.items() if ls[2]}
    return respond(ns, ns.key.tenant, lengths)


def _merge(a: QueryResponse, b: QueryResponse) -> QueryResponse:
    """Per instance, the better of two answers (by DISK, then GPU, then CPU)."""
    if not b:
        return a
    if not a:
        return b
    tenant = next(iter(a))
    rows = dict(a[tenant])
    for instance, row in b[tenant].items():
        mine = rows.get(instance)
        if mine is None or _rank(row) > _rank(mine):
            rows[instance] = row
    return {tenant: {k: rows[k] for k in sorted(rows)}}


def _rank(row: dict[str, object]) -> tuple[int, int, int]:
    return (int(row["DISK"]), int(row["GPU"]), int(row["CPU"]))  # type: ignore[call-overload]
