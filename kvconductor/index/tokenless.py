"""Token-less holdings found at answer time by the engine's own names.

An engine store without token ids whose content the index never saw waits
in its namespace (`NamespaceIndex.waiting`: the engine's sequence hash ->
the owner tiers and pool stores that hold it) until the content arrives or
it ages out. Where the engine's hash profile is known, a token query can
compute the engine's names for its own blocks (`engine_hashes`) and find
them there. This reads; it never places or resolves anything, so the index
stays what its records made it (a replay answers alike) and a query does not
change the next one.

Each listed owner's lengths extend from where content matching left them,
through blocks the owner holds token-less, as the tier walk extends them
(`block_store`): the device prefix through its own device blocks, the
host-tier continuation (from the longer of that and the content-matched
one) through its own host blocks and any host-class pool store's, the disk
continuation through those and disk ones. Blocks held by content after a
token-less block are not looked at: a token-less block's content is
unknown, so the content walk cannot have placed what follows it. An owner
that holds only token-less blocks has no slot in the namespace; it is
answered too, at a slot of this answer only, when it holds the prompt's
first block.

Owners of hybrid models (KV-cache groups beyond the primary one) are left
as they are: their device hit rests on every group, and token-less group
stores are never held.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple, Protocol

from kvconductor.index.answer_shape import AnswerShape, new_shape
from kvconductor.index.block_store import Matched
from kvconductor.index.namespace import NamespaceIndex, Owner, Target
from kvconductor.wire.engine_hashes import BlockNames, VllmProfile
from kvconductor.wire.media import DEVICE, DISK, HOST


class Names(Protocol):
    """A prompt's blocks under one engine's names, from its first."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> int: ...


class PromptNames(NamedTuple):
    """A token query's blocks under each profile its context binds."""

    blocks: Sequence[Names]
    hybrid: Callable[[str], bool]  # an instance with several KV-cache groups


class EngineProfiles(NamedTuple):
    """The hash profiles bound to a query's context (registrations)."""

    profiles: Sequence[VllmProfile]
    hybrid: Callable[[str], bool]

    def names(
        self, packed: bytes, block_size: int, lora_name: str | None, cache_salt: str | None
    ) -> PromptNames:
        """`packed`: the prompt's whole blocks (little-endian u32)."""
        blocks = [
            BlockNames.of_packed(p, packed, block_size, lora_name, cache_salt)
            for p in self.profiles
        ]
        return PromptNames(blocks, self.hybrid)


class Owners(Protocol):
    """What an answer needs of a namespace's owners (`NamespaceIndex` is one)."""

    @property
    def block_size(self) -> int: ...

    @property
    def slots(self) -> Sequence[Owner | None]: ...

    def answer_shape(self) -> AnswerShape: ...


class WithTokenless:
    """A namespace's owners and the token-less-only owners an answer lists,
    each at a slot past the namespace's."""

    __slots__ = ("_ns", "_shape", "slots")

    def __init__(self, ns: NamespaceIndex, extra: Sequence[Owner]) -> None:
        self._ns = ns
        self.slots: list[Owner | None] = [*ns.slots, *extra]
        self._shape: AnswerShape | None = None

    @property
    def block_size(self) -> int:
        return self._ns.block_size

    def answer_shape(self) -> AnswerShape:
        if self._shape is None:
            ranks: dict[str, list[tuple[int, int]]] = {}
            for owner in self.slots:
                if owner is not None:
                    ranks.setdefault(owner.instance, []).append((owner.rank, owner.slot))
            layout = [(name, sorted(ranks[name])) for name in sorted(ranks)]
            self._shape = new_shape(self._ns.key.tenant, self._ns.block_size, layout)
        return self._shape


# A block's waiting targets, and the pool classes among them.
_Row = tuple[frozenset[Target], frozenset[int]]


class _Holdings:
    """The waiting targets of each of the prompt's blocks, by any profile's
    name, computed as far as a walk asks."""

    __slots__ = ("_names", "_rows", "_waiting")

    def __init__(self, ns: NamespaceIndex, names: Sequence[Names]) -> None:
        self._waiting = ns.waiting
        self._names = names
        self._rows: list[_Row] = []

    def at(self, i: int) -> _Row:
        rows = self._rows
        while len(rows) <= i:
            n = len(rows)
            targets: set[Target] = set()
            for names in self._names:
                if n < len(names):
                    targets.update(self._waiting.get(names[n], ()))
            pools = frozenset(t[3] for t in targets if t[0] == "p")
            rows.append((frozenset(targets), pools))
        return rows[i]

    def run(self, start: int, end: int, own: frozenset[Target], pools: frozenset[int]) -> int:
        """Where the run of blocks from `start` held in one of `own` or in a
        pool store of one of the `pools` classes ends."""
        i = start
        while i < end:
            targets, classes = self.at(i)
            if own.isdisjoint(targets) and pools.isdisjoint(classes):
                break
            i += 1
        return i


def extend(
    ns: NamespaceIndex, found: Matched, instance_id: str | None, prompt: PromptNames
) -> tuple[Owners, Matched] | None:
    """`found` (the content match of the listed owners) with token-less
    holdings added; None when no owner is listed either way."""
    names = prompt.blocks
    total = min((len(n) for n in names), default=0)
    if not total or not ns.waiting:
        return (ns, found) if found else None
    holdings = _Holdings(ns, names)
    out: Matched = []
    gained = 0
    for slot, gpu, cpu, disk in found:
        owner = ns.slots[slot]
        if owner is None or slot in ns.hybrid or prompt.hybrid(owner.instance):
            out.append((slot, gpu, cpu, disk))
            continue
        row = _walk(holdings, owner.instance, owner.rank, total, gpu, cpu, disk)
        gained += row[2] - disk
        out.append((slot, *row))
    extra: list[Owner] = []
    for instance, rank in _tokenless_owners(ns, holdings, instance_id, prompt.hybrid):
        owner = Owner(instance, rank, len(ns.slots) + len(extra))
        extra.append(owner)
        row = _walk(holdings, instance, rank, total, 0, 0, 0)
        gained += row[2]
        out.append((owner.slot, *row))
    if gained:
        ns.counters["tokenless_answers"] += 1
        ns.counters["tokenless_blocks_answered"] += gained
    if not out:
        return None
    return (WithTokenless(ns, extra) if extra else ns), out


_NO_POOLS: frozenset[int] = frozenset()
_HOST = frozenset({HOST})
_LOWER = frozenset({HOST, DISK})


def _walk(
    holdings: _Holdings, instance: str, rank: int, total: int, gpu: int, cpu: int, disk: int
) -> tuple[int, int, int]:
    device: frozenset[Target] = frozenset({("o", instance, rank, DEVICE)})
    host: frozenset[Target] = frozenset({("o", instance, rank, HOST)})
    lower = host | {("o", instance, rank, DISK)}
    gpu = holdings.run(gpu, total, device, _NO_POOLS)
    cpu = holdings.run(max(cpu, gpu), total, host, _HOST)
    disk = holdings.run(max(disk, cpu), total, lower, _LOWER)
    return gpu, cpu, disk


def _tokenless_owners(
    ns: NamespaceIndex,
    holdings: _Holdings,
    instance_id: str | None,
    hybrid: Callable[[str], bool],
) -> list[tuple[str, int]]:
    """(instance, rank) of the owners without a slot that hold the prompt's
    first block token-less, in name and rank order: only those can match."""
    seen: set[tuple[str, int]] = set()
    for target in holdings.at(0)[0]:
        if target[0] != "o":
            continue
        instance, rank = target[1], int(target[2])
        if instance_id is not None and instance != instance_id:
            continue
        if rank in ns.owners.get(instance, {}) or hybrid(instance):
            continue
        seen.add((instance, rank))
    return sorted(seen)
