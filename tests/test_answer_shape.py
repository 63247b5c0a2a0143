"""Both builds of `AnswerShape` give the contract's answer: per instance the
best rank's row (largest DISK, then GPU, then CPU, then the lowest rank)
with every listed rank under `DP`, instances in name order, in tokens.

The oracle below is the answer written out the long way (it is how
`query.respond` made it before the shape was laid out per namespace)."""

from __future__ import annotations

import json

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvconductor.index.answer_shape import AnswerShape, Layout, PyAnswerShape, new_shape
from kvconductor.index.block_store import Matched
from kvconductor.kernel import KERNEL


def oracle(tenant: str, layout: Layout, lengths: Matched, bs: int, hits_only: bool) -> object:
    owner = {slot: (name, rank) for name, ranks in layout for rank, slot in ranks}
    by_instance: dict[str, list[tuple[int, int, int, int]]] = {}
    for slot, g, c, d in lengths:
        if hits_only and not d:
            continue
        name, rank = owner[slot]
        by_instance.setdefault(name, []).append((rank, g, c, d))
    out = {}
    for name in sorted(by_instance):
        ranks = sorted(by_instance[name])
        best = min(ranks, key=lambda r: (-r[3], -r[1], -r[2], r[0]))
        out[name] = {
            "longest_matched": best[3] * bs,
            "GPU": best[1] * bs,
            "CPU": best[2] * bs,
            "DISK": best[3] * bs,
            "DP": {str(r[0]): r[3] * bs for r in ranks},
        }
    return {tenant: out} if out else {}


def builds(tenant: str, bs: int, layout: Layout) -> list[AnswerShape]:
    shapes: list[AnswerShape] = [PyAnswerShape(tenant, bs, layout)]
    if KERNEL is not None:
        shapes.append(new_shape(tenant, bs, layout))
    return shapes


@st.composite
def cases(draw: st.DrawFn) -> tuple[Layout, Matched, int, bool]:
    # Any text: quotes, backslashes, control and non-ASCII characters must
    # come out of the compiled JSON exactly as msgspec writes them.
    names = draw(st.lists(st.text(min_size=1, max_size=4), unique=True, max_size=8))
    slots = iter(draw(st.permutations(range(64 * 3)))[: 24 * len(names)])
    layout = [
        (
            name,
            [
                (rank, next(slots))
                for rank in sorted(draw(st.sets(st.integers(0, 9), min_size=1, max_size=3)))
            ],
        )
        for name in sorted(names)
    ]
    held = [slot for _, ranks in layout for _, slot in ranks]
    listed = draw(st.lists(st.sampled_from(held), unique=True)) if held else []
    lengths = []
    for slot in sorted(listed):
        d = draw(st.integers(0, 6))
        c = draw(st.integers(0, d))
        lengths.append((slot, draw(st.integers(0, c)), c, d))
    return layout, lengths, draw(st.sampled_from([1, 16])), draw(st.booleans())


@given(cases(), st.text(max_size=3))
def test_every_build_gives_the_oracles_answer(
    case: tuple[Layout, Matched, int, bool], tenant: str
) -> None:
    layout, lengths, bs, hits_only = case
    want = oracle(tenant, layout, lengths, bs, hits_only)
    for shape in builds(tenant, bs, layout):
        got = shape.shape(lengths, hits_only)
        # Key order is part of the wire answer: compare it too.
        assert json.dumps(got) == json.dumps(want), type(shape).__name__
        every = oracle(tenant, layout, lengths, bs, False)
        assert shape.shape_json(lengths) == msgspec.json.encode(every), type(shape).__name__


@pytest.mark.parametrize("hits_only", [False, True])
def test_ties_go_to_the_lowest_rank_and_unlisted_instances_are_left_out(hits_only: bool) -> None:
    layout = [("a", [(0, 5), (1, 2), (3, 70)]), ("b", [(0, 1)]), ("c", [(2, 3)])]
    lengths = [(1, 0, 0, 0), (2, 2, 3, 3), (5, 1, 3, 3), (70, 2, 3, 3)]
    for shape in builds("t", 16, layout):
        got = shape.shape(lengths, hits_only)
        row_a = {"longest_matched": 48, "GPU": 32, "CPU": 48, "DISK": 48}
        want: dict[str, object] = {"a": {**row_a, "DP": {"0": 48, "1": 48, "3": 48}}}
        if not hits_only:
            want["b"] = {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}}
        assert got == {"t": want}
        assert list(got["t"]["a"]["DP"]) == ["0", "1", "3"]
        assert shape.shape([], hits_only) == {}
        assert shape.shape_json([]) == b"{}"
