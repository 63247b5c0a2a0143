"""The contract's answer (section 4) from per-slot matched lengths.

A namespace's owners change rarely and queries come often, so what the
answer needs of them (instances in name order, each one's ranks in rank
order with their slots and their `DP` keys) is laid out once per change of
owners, as an `AnswerShape`; a change names the one instance it changes
(`set_instance`), so that at thousands of owners it costs no pass over
them in Python. Two builds, like the block store's: the
compiled one (`kernel/py/src/shape.rs`), which makes the answer's dicts without
an interpreter loop (at 122 instances it was a third of a query's time) and
writes the HTTP API's JSON answer without making them at all, and
`PyAnswerShape`, the reference (tests/test_answer_shape.py holds them equal).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import msgspec

from kvconductor.index.block_store import Matched
from kvconductor.kernel import KERNEL
from kvconductor.wire.query import QueryResponse

if KERNEL is not None:
    from kvconductor import _kernel

# Per instance, in name order: its name and its (rank, slot)s in rank order.
Layout = Sequence[tuple[str, Sequence[tuple[int, int]]]]

# An answer for fewer owners than one in this many instances visits only
# their instances (both builds; the answer is the same either way).
SPARSE = 8


class AnswerShape(Protocol):
    """One namespace's owners, as its answers lay them out."""

    def shape(self, lengths: Matched, hits_only: bool) -> QueryResponse:
        """`{tenant: {instance: row}}` (or `{}` when no instance is listed)
        for the owners in `lengths`, `(slot, GPU, CPU, DISK)` in blocks;
        each instance's row is its best rank's (largest DISK, then GPU, then
        CPU, then the lowest rank), with every listed rank's DISK under
        `DP`, in tokens. `hits_only`: owners that matched no block are left
        out (as if unlisted)."""

    def shape_json(self, lengths: Matched) -> bytes:
        """`shape(lengths, False)` as the JSON `msgspec.json.encode` makes
        of it, byte for byte (the HTTP API's answer, without the dicts)."""

    def set_instance(self, name: str, name_json: bytes, ranks: Sequence[tuple[int, int]]) -> None:
        """Instance `name`'s (rank, slot)s, in rank order, in place of what
        it had; none: the instance goes. `name_json`: the name as
        `msgspec.json.encode` writes it. The next answer lays the owners
        out again."""


class PyAnswerShape:
    __slots__ = ("block_size", "instances", "layout", "tenant", "where")

    def __init__(self, tenant: str, block_size: int, layout: Layout) -> None:
        self.tenant = tenant
        self.block_size = block_size
        # Per instance, its ranks with their DP keys (made once, not per query).
        self.instances: dict[str, list[tuple[str, int]]] = {}
        self.layout: list[tuple[str, list[tuple[str, int]]]] = []
        # Slot -> its instance's place in `layout`: an answer for a few
        # owners (a query's `instance_id`) visits their instances only, not
        # every instance of the namespace.
        self.where: dict[int, int] | None = None
        for name, ranks in layout:
            self.set_instance(name, b"", ranks)

    def set_instance(self, name: str, name_json: bytes, ranks: Sequence[tuple[int, int]]) -> None:
        if ranks:
            self.instances[name] = [(str(r), slot) for r, slot in ranks]
        else:
            self.instances.pop(name, None)
        self.where = None

    def _lay_out(self) -> dict[int, int]:
        if self.where is None:
            self.layout = sorted(self.instances.items())
            self.where = {slot: i for i, (_, ranks) in enumerate(self.layout) for _, slot in ranks}
        return self.where

    def shape_json(self, lengths: Matched) -> bytes:
        return msgspec.json.encode(self.shape(lengths, False))

    def shape(self, lengths: Matched, hits_only: bool) -> QueryResponse:
        bs = self.block_size
        where = self._lay_out()
        by_slot = {m[0]: m for m in lengths if m[3] or not hits_only}
        out: dict[str, dict[str, object]] = {}
        layout = self.layout
        if len(by_slot) * SPARSE < len(layout):
            places = sorted({where[s] for s in by_slot if s in where})
            layout = [layout[i] for i in places]
        for name, ranks in layout:
            if len(ranks) == 1:  # most instances: one rank, nothing to choose
                key, slot = ranks[0]
                m = by_slot.get(slot)
                if m is None:
                    continue
                d = m[3] * bs
                out[name] = {
                    "longest_matched": d,
                    "GPU": m[1] * bs,
                    "CPU": m[2] * bs,
                    "DISK": d,
                    "DP": {key: d},
                }
                continue
            dp: dict[str, int] = {}
            best: tuple[int, int, int, int] | None = None
            for key, slot in ranks:
                m = by_slot.get(slot)
                if m is None:
                    continue
                dp[key] = m[3] * bs
                if best is None or (m[3], m[1], m[2]) > (best[3], best[1], best[2]):
                    best = m
            if best is None:
                continue
            out[name] = {
                "longest_matched": best[3] * bs,
                "GPU": best[1] * bs,
                "CPU": best[2] * bs,
                "DISK": best[3] * bs,
                "DP": dp,
            }
        return {self.tenant: out} if out else {}


def new_shape(tenant: str, block_size: int, layout: Layout) -> AnswerShape:
    """The compiled shape when the kernel is built, else the reference."""
    if KERNEL is not None:
        encode = msgspec.json.encode
        # Held equal to PyAnswerShape by tests/test_answer_shape.py.
        return _kernel.AnswerShape(
            tenant,
            encode(tenant),
            block_size,
            [(name, encode(name), ranks) for name, ranks in layout],
        )
    return PyAnswerShape(tenant, block_size, layout)
