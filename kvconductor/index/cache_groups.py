"""KV-cache groups of hybrid models (contract section 2, v2): what each group
holds and the prefix hit vLLM computes from them.

A hybrid vLLM instance keeps one KV-cache group per kind of layer (full or
MLA attention, sliding window, Mamba state, ...), each with its own block
size, and publishes events per group. Its prefix hit is the longest prefix,
on the instance's alignment `A` (the namespace's `kv-block-size`), that
*every* group can serve (vLLM's `HybridKVCacheCoordinator`; the rules are
in docs/hybrid-models.md).

The index keeps an instance's primary group (`primary_group`: its
full-attention group of the lowest index, whatever its place among the
others; a dense instance's only group) in the namespace's block store like
any dense instance, so that the walk over the owner bitmasks gives its
full-attention prefix. Every other group of an owner is a `GroupState`
here. vLLM numbers groups by the first layer of each kind in layer order, so
Gemma 3 (five sliding-window layers, then a full one) has its full-attention
group last and GPT-OSS at 1: group order carries no meaning. Engine hashes
name a prefix end position for every group (vLLM puts no group in the hash),
so a group's block is keyed by the content of the prefix it ends,
independent of the group:

- a block ending on a multiple of `A` by that prefix's identity, the one the
  store's chains give (`hashing`);
- a block ending inside an `A` unit (a group whose blocks are smaller than
  `A`) by the hash of the tokens since the last multiple of `A`, seeded with
  the identity there (`Prefix.key`).

Pure: no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import xxhash

from kvconductor.wire.events import Tokens
from kvconductor.wire.hashing import chain_identities, pack_tokens

_xxh3 = xxhash.xxh3_64_intdigest

# Kinds looked up like full attention: every block of the prefix.
FULL_KINDS = frozenset(
    {"full_attention", "mla_attention", "sink_full_attention", "full", "FullAttentionSpec"}
)
# A window's tail blocks ending at the hit point.
WINDOW_KINDS = frozenset({"sliding_window", "sliding_window_mla"})
# The state block ending exactly at the hit point.
STATE_KINDS = frozenset({"mamba"})
# The blocks from the start of the chunk that holds the hit point.
LOCAL_KINDS = frozenset({"chunked_local_attention", "chunked_local"})
# Not prefix-cacheable: vLLM neither caches nor looks these groups up.
UNCACHED_KINDS = frozenset({"encoder_only_attention", "cross_attention"})
KNOWN_KINDS = FULL_KINDS | WINDOW_KINDS | STATE_KINDS | LOCAL_KINDS | UNCACHED_KINDS


def primary_group(groups: dict[int, str]) -> int:
    """The index of an instance's primary group, from its groups' kinds as
    stores named them: the lowest full-attention one; with none, group 0
    (a dense instance that names no kind)."""
    return min((g for g, kind in groups.items() if kind in FULL_KINDS), default=0)


def is_primary(group: int, kind: str | None, primary: int) -> bool:
    return group == primary and (kind is None or kind in FULL_KINDS)


def is_hybrid(groups: dict[int, str]) -> bool:
    """Whether an instance's stores named a group beside its primary one."""
    primary = primary_group(groups)
    return any(not is_primary(g, kind, primary) for g, kind in groups.items())


# A window or chunk beyond this many tokens is taken as a bad spec.
MAX_WINDOW = 1 << 24
_SUB_SEED = 0x6B76_6361_6368_6521
_UNIT_SEED = 0x6B76_756E_6974_7321


def unit_seqs(seqs: Sequence[int], units: int) -> list[int]:
    """The names of a primary group's blocks of `units` namespace blocks
    each, unit by unit: the last unit of block `h` is `h` itself (the name
    later events chain from), the ones before it are derived from `h`."""
    if units == 1:
        return list(seqs)
    out: list[int] = []
    for h in seqs:
        tail = h.to_bytes(8, "little")
        out.extend(_xxh3(j.to_bytes(4, "little") + tail, _UNIT_SEED) for j in range(1, units))
        out.append(h)
    return out


def unit_extra(extra: Sequence[int | None] | None, units: int) -> list[int | None] | None:
    """`unit_seqs`'s extra keys: a block's on its first unit."""
    if extra is None or units == 1:
        return None if extra is None else list(extra)
    out: list[int | None] = []
    for key in extra:
        out.append(key)
        out.extend([None] * (units - 1))
    return out


class Prefix:
    """A token prefix's keys at any block end: the identity at each
    multiple of `align` (`idents[m]` ends at `(m + 1) * align`) and, for an
    end inside a unit, the tokens since the unit's start (`packed`, little
    endian u32; None: not known, e.g. a query by engine hashes)."""

    __slots__ = ("_grids", "_keys", "align", "base", "idents", "packed")

    def __init__(self, packed: bytes | None, base: int, align: int, idents: Sequence[int]) -> None:
        self.packed = packed
        self.base = base
        self.align = align
        self.idents = idents
        # One query asks every hybrid owner about the same ends.
        self._keys: dict[int, int | None] = {}
        self._grids: dict[int, list[int | None]] = {}

    def grid(self, step: int, upto: int) -> list[int | None]:
        """The keys of the blocks ending at `step`, `2 * step`, ... up to
        token `upto`."""
        keys = self._grids.get(step)
        if keys is None or len(keys) < upto // step:
            keys = self._grids[step] = [self.key(end) for end in range(step, upto + 1, step)]
        return keys[: upto // step]

    def key(self, end: int) -> int | None:
        """The key of the block ending at token `end` (> 0); None past what
        is known."""
        try:
            return self._keys[end]
        except KeyError:
            key = self._keys[end] = self._key(end)
            return key

    def _key(self, end: int) -> int | None:
        whole, part = divmod(end, self.align)
        if whole > len(self.idents) or end <= 0:
            return None
        ident = self.base if whole == 0 else self.idents[whole - 1]
        if not part:
            return ident
        packed = self.packed
        start = whole * self.align * 4
        if packed is None or len(packed) < end * 4:
            return None
        return _xxh3(packed[start : end * 4], ident ^ _SUB_SEED)


class GroupState:
    """One (instance, dp rank)'s blocks in one non-primary KV-cache group:
    copies per engine hash (vLLM keeps and announces several blocks under
    one hash, each removed by its own `BlockRemoved`) and per key."""

    __slots__ = ("block_size", "held", "keys", "kind", "window")

    def __init__(self, kind: str, block_size: int, window: int | None) -> None:
        self.kind = kind
        self.block_size = block_size
        self.window = window
        self.held: dict[int, list[int]] = {}  # engine hash -> [key, copies]
        self.keys: dict[int, int] = {}  # key -> copies

    def __len__(self) -> int:
        return len(self.held)

    def add(self, seq: int, key: int) -> None:
        """Hold one more copy of a block."""
        entry = self.held.get(seq)
        if entry is None:
            self.held[seq] = [key, 1]
        else:
            entry[1] += 1
            key = entry[0]
        self.keys[key] = self.keys.get(key, 0) + 1

    def remove(self, seq: int) -> bool:
        """One copy of `seq` leaves; False if the group does not hold it."""
        entry = self.held.get(seq)
        if entry is None:
            return False
        key = entry[0]
        entry[1] -= 1
        if not entry[1]:
            del self.held[seq]
        left = self.keys[key] - 1
        if left:
            self.keys[key] = left
        else:
            del self.keys[key]
        return True

    def clear(self) -> int:
        n = len(self.held)
        self.held.clear()
        self.keys.clear()
        return n

    # ---------------------------------------------------------- the hit

    def pointwise(self) -> bool:
        """Checked at each candidate hit point (else its run caps the hit).
        A chunked local group without its chunk size is taken as full
        attention over its own blocks."""
        kind = self.kind
        return (
            kind in STATE_KINDS
            or kind in WINDOW_KINDS
            or (kind in LOCAL_KINDS and bool(self.window))
        )

    def _has(self, end: int, prefix: Prefix) -> bool:
        key = prefix.key(end)
        return key is not None and key in self.keys

    def full_run(self, prefix: Prefix, limit: int) -> int:
        """Full attention's hit over this group's own blocks, in units of
        the prefix's alignment, at most `limit`: its run of blocks from the
        first, floored."""
        bs = self.block_size
        end = bs
        while end <= limit * prefix.align and self._has(end, prefix):
            end += bs
        return (end - bs) // prefix.align

    def serving(self, prefix: Prefix, limit: int) -> list[bool]:
        """Whether this group can serve a hit ending at each multiple of the
        prefix's alignment, `limit` of them from 0 (`full_run` caps
        full-attention kinds), from one lookup a block: a window needs its
        tail blocks ending at the point, a chunk its blocks from the chunk's
        start, a state its block ending exactly there (also a partial state
        at a finer prefix-match unit)."""
        align = prefix.align
        points = range(0, (limit + 1) * align, align)
        kind = self.kind
        if kind in STATE_KINDS:
            return [p > 0 and self._has(p, prefix) for p in points]
        bs = self.block_size
        window = self.window
        if window is None or not (kind in WINDOW_KINDS or kind in LOCAL_KINDS):
            return [True] * (limit + 1)
        # run[j]: held blocks in a row ending at token (j + 1) * bs.
        run: list[int] = []
        last = 0
        held = self.keys
        for key in prefix.grid(bs, limit * align):
            last = last + 1 if key in held else 0
            run.append(last)
        need = -(-(window - 1) // bs)
        out = [True]
        for point in points[1:]:
            if kind in WINDOW_KINDS:
                start = max(point - need * bs, 0)
            else:
                start = (point - 1) // window * window
            span = point - start
            out.append(not span % bs and (point % bs == 0 and run[point // bs - 1] >= span // bs))
        return out


def hybrid_hit(groups: Sequence[GroupState], prefix: Prefix, limit: int) -> int:
    """vLLM's hit in units of the prefix's alignment, at most `limit`: the
    largest multiple of it not above any full-attention group's run at which
    every other group's rule holds (kv_cache_coordinator's fixed point, in
    one pass)."""
    for g in groups:
        if not g.pointwise():
            limit = min(limit, g.full_run(prefix, limit))
    serving = [g.serving(prefix, limit) for g in groups if g.pointwise()]
    for units in range(limit, 0, -1):
        if all(s[units] for s in serving):
            return units
    return 0


def locate(
    seqs: Sequence[int],
    parent: int | None,
    token_ids: Tokens,
    block_size: int,
    align: int,
    seed: int,
    ident_of: Callable[[int], int | None],
) -> list[int | None]:
    """The key of each listed block of a non-primary group's `BlockStored`
    (None: it cannot be placed from what the events say).

    A group's store spans the step's tokens but lists only the blocks the
    group keeps, in position order, with nothing saying which. Listed hashes
    the catalog knows (a dense group named them) are anchors; a hash before
    an anchor is its contiguous predecessor, hashes after the last anchor
    end at the span's end: every run of kept blocks ends on a multiple of
    `A` or at the span's end (vLLM's `reachable_block_mask`). Positions need
    the parent's content: only prefixes ending on a multiple of `A` are in
    the catalog, so the span then starts on one."""
    packed = token_ids if isinstance(token_ids, bytes) else pack_tokens(token_ids)
    span = len(packed) // 4 // block_size * block_size
    n = len(seqs)
    if n * block_size > span and token_ids:
        return [None] * n  # more blocks listed than the tokens hold
    known = [ident_of(seq) for seq in seqs]
    base = seed if parent is None else ident_of(parent)
    if base is None or not span:
        # An anchor still names itself.
        return known
    units = span // align
    prefix = Prefix(packed, base, align, chain_identities(packed, units, align, base, None))
    if n * block_size == span:
        ends: list[int | None] = [(k + 1) * block_size for k in range(n)]
    else:
        at = {ident: (m + 1) * align for m, ident in enumerate(prefix.idents)}
        ends = [None if x is None else at.get(x) for x in known]
        nxt = span
        for k in range(n - 1, -1, -1):
            end = ends[k]
            if end is None or end > nxt:
                end = ends[k] = nxt
            nxt = end - block_size
    return [None if end is None else prefix.key(end) for end in ends]
