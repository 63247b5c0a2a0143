"""Identities of a prompt named by Dynamo's local block hashes.

Dynamo's router names a prompt's blocks by their local hashes, each block's
tokens hashed alone (contract section 1), while an identity chains from the
block before (`hashing`). Without a salt the first block's identity is its
local hash; a later one cannot be computed from local hashes, so it is
learnt: whenever blocks with tokens are stored, each (parent identity, local
hash) -> identity edge is kept here. In a salted namespace Dynamo seeds every
local hash with the salt (`hashing.dynamo_seed`) while identities chain from
the unsalted seed, so the first block's identity is learnt too, as an edge
from `ROOT` (a `rooted` map).

Bounded, oldest first out: an evicted or stale edge only shortens an answer,
never makes it wrong, because an identity the map yields still has to be
held in a tier to match. Not snapshotted: a restored index learns the edges
again as blocks are stored.

Pure; imports nothing of kvconductor.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

# The parent of a first block's edge in a rooted map: not a u64, so never an
# identity.
ROOT = -1


class LocalHashMap:
    """(parent identity, local hash) -> identity, at most `capacity` edges.
    `rooted`: a first block's identity is not its local hash but an edge
    from ROOT."""

    __slots__ = ("capacity", "edges", "rooted")

    def __init__(self, capacity: int, rooted: bool = False) -> None:
        if capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.rooted = rooted
        # Insertion order is age order: the first key is the oldest edge.
        self.edges: dict[tuple[int, int], int] = {}

    def __len__(self) -> int:
        return len(self.edges)

    def learn(self, parent: int | None, local: Sequence[int], idents: Sequence[int]) -> None:
        """Edges of a chain of blocks hanging from `parent` (None: the chain
        starts at the prompt's first block): block k's local hash `local[k]`
        and identity `idents[k]`."""
        if parent is None:
            if self.rooted:
                parent = ROOT
            else:
                # A first block's identity is its local hash: no edge to keep.
                if not idents:
                    return
                parent, local, idents = idents[0], local[1:], idents[1:]
        edges = self.edges
        for h, ident in zip(local, idents, strict=False):
            key = (parent, h)
            if key in edges:
                # Learnt again: now the youngest, so live chains stay.
                del edges[key]
            edges[key] = ident
            parent = ident
        excess = len(edges) - self.capacity
        if excess > 0:
            for key in list(islice(edges, excess)):
                del edges[key]

    def identities(self, local: Sequence[int]) -> list[int]:
        """Identities of a prompt from its first block, up to the first edge
        not known."""
        if not local:
            return []
        get = self.edges.get
        if self.rooted:
            first = get((ROOT, local[0]))
            if first is None:
                return []
            ident = first
        else:
            ident = local[0]
        out = [ident]
        for h in local[1:]:
            nxt = get((ident, h))
            if nxt is None:
                break
            out.append(nxt)
            ident = nxt
        return out
