"""The index against a naive reference of vLLM's hybrid hit rule, on
generated workloads.

The reference is written from docs/hybrid-models.md (vLLM's rules), not
from the index: an engine keeps, per KV-cache group, a count of copies per
prefix (a tuple of tokens); a query recomputes, from those dicts alone, the
largest multiple of the alignment that every group can serve. The
generator drives a simulated vLLM instance with groups of every kind and
block size the rules allow (full attention and MLA, sliding windows smaller
and equal to the alignment, Mamba states at the alignment and coarser),
publishing events the way vLLM does: one store per group per step in group
order, dense groups listing every block, sparse groups runs of blocks ending
on the alignment, copies when a prefix is computed again, single-hash
removals of any copy in any group, clears.
"""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import msgspec
import pytest
import xxhash

from kvconductor.index.conductor import Conductor
from kvconductor.wire.query import TokenQuery

MODEL = "hybrid/generated"

# (group kind, block size, window)
Spec = tuple[str, int, int | None]
# The hit alignment (`kv-block-size`) and the groups. vLLM aligns hits to
# the groups' least common multiple, or, with a finer prefix-match unit
# (only without sliding windows), to that unit.
LAYOUTS: list[tuple[int, list[Spec]]] = [
    (4, [("full_attention", 4, None), ("sliding_window", 4, 8)]),
    (4, [("mla_attention", 4, None), ("sliding_window_mla", 2, 8), ("sliding_window_mla", 2, 3)]),
    (4, [("full_attention", 8, None), ("mamba", 8, None)]),
    (4, [("full_attention", 4, None), ("mamba", 4, None), ("sliding_window", 2, 5)]),
    (4, [("sink_full_attention", 4, None), ("mla_attention", 2, None), ("sliding_window", 4, 13)]),
    (8, [("full_attention", 8, None), ("sliding_window", 4, 9), ("mamba", 8, None)]),
    # Group order carries no meaning: Gemma 3's full-attention group is its
    # last, Kimi Linear's follows its state groups.
    (4, [("sliding_window", 4, 8), ("sliding_window", 2, 5), ("full_attention", 4, None)]),
    (4, [("mamba", 4, None), ("mamba", 4, None), ("mla_attention", 4, None)]),
]
FULL = {"full_attention", "mla_attention", "sink_full_attention"}
WINDOW = {"sliding_window", "sliding_window_mla"}


def engine_hash(prefix: tuple[int, ...]) -> int:
    """vLLM's hash names a prefix end, the same in every group."""
    return xxhash.xxh3_64_intdigest(msgspec.msgpack.encode(prefix), 7)


class Engine:
    """A simulated hybrid vLLM instance and the events it publishes."""

    def __init__(self, align: int, layout: list[Spec], rng: random.Random) -> None:
        self.align = align
        self.layout = layout
        self.rng = rng
        self.held: list[Counter[tuple[int, ...]]] = [Counter() for _ in layout]
        self.learnt: set[tuple[int, ...]] = {()}  # prefixes the primary group stored
        self.step = 1 << max(bs for _, bs, _ in layout).bit_length()

    def serve(self, prompt: list[int]) -> list[dict[str, Any]]:
        """One caching step of a request: from a prefix the primary group
        stored before (or the start), every group's newly full blocks."""
        starts = [
            s for s in range(0, len(prompt) + 1, self.step) if tuple(prompt[:s]) in self.learnt
        ]
        start = self.rng.choice(starts)
        events = []
        for g, (kind, bs, window) in enumerate(self.layout):
            end = len(prompt) // bs * bs
            if end <= start:
                continue
            ends = self._listed(kind, bs, window, start, end)
            for e in ends:
                self.held[g][tuple(prompt[:e])] += 1
                if g == 0:
                    self.learnt.add(tuple(prompt[:e]))
            events.append(
                {
                    "type": "BlockStored",
                    "block_hashes": [engine_hash(tuple(prompt[:e])) for e in ends],
                    "parent_block_hash": engine_hash(tuple(prompt[:start])) if start else None,
                    "token_ids": prompt[start:end],
                    "block_size": bs,
                    "medium": "GPU",
                    "group_idx": g,
                    "kv_cache_spec_kind": kind,
                    **({"kv_cache_spec_sliding_window": window} if window else {}),
                }
            )
        return events

    def _listed(self, kind: str, bs: int, window: int | None, start: int, end: int) -> list[int]:
        """Block ends a group keeps: every block for full attention; runs
        ending on the alignment for windows; one state for Mamba."""
        blocks = list(range(start + bs, end + 1, bs))
        rng = self.rng
        if kind in FULL or rng.random() < 0.25:
            return blocks
        points = [e for e in blocks if e % self.align == 0]
        if kind == "mamba":
            return [rng.choice(points)] if points and rng.random() < 0.8 else []
        keep: set[int] = set()
        assert window is not None
        for point in rng.sample(points, k=min(len(points), rng.randrange(0, 3))):
            run = rng.randrange(1, -(-(window - 1) // bs) + 2)
            keep.update(e for e in blocks if point - run * bs < e <= point)
        return sorted(keep)

    def evict(self) -> dict[str, Any] | None:
        held = [(g, p) for g, c in enumerate(self.held) for p, n in c.items() if n]
        if not held:
            return None
        g, prefix = self.rng.choice(sorted(held))
        self.held[g][prefix] -= 1
        return {
            "type": "BlockRemoved",
            "block_hashes": [engine_hash(prefix)],
            "medium": "GPU",
            "group_idx": g,
        }

    def clear(self) -> dict[str, Any]:
        for c in self.held:
            c.clear()
        return {"type": "AllBlocksCleared"}

    # ------------------------------------------------- the reference hit

    def has(self, g: int, prompt: list[int], end: int) -> bool:
        return self.held[g][tuple(prompt[:end])] > 0

    def hit(self, prompt: list[int]) -> int:
        """vLLM's rule over the groups (docs/hybrid-models.md)."""
        limit = len(prompt) // self.align * self.align
        for g, (kind, bs, _) in enumerate(self.layout):
            if kind in FULL:
                run = 0
                while run + bs <= limit and self.has(g, prompt, run + bs):
                    run += bs
                limit = min(limit, run // self.align * self.align)
        for point in range(limit, 0, -self.align):
            if all(self.serves(g, prompt, point) for g in range(len(self.layout))):
                return point
        return 0

    def serves(self, g: int, prompt: list[int], point: int) -> bool:
        kind, bs, window = self.layout[g]
        if kind == "mamba":
            return self.has(g, prompt, point)
        if kind in WINDOW:
            assert window is not None
            need = -(-(window - 1) // bs)
            first = max(point - need * bs, 0) + bs
            return all(self.has(g, prompt, e) for e in range(first, point + 1, bs))
        return True


def index_hit(conductor: Conductor, align: int, prompt: list[int]) -> int:
    answer = conductor.query(
        TokenQuery(model=MODEL, block_size=align, token_ids=prompt, instance_id="gen-0")
    )
    return int(answer.get("default", {}).get("gen-0", {}).get("GPU", 0))


@pytest.mark.parametrize("layout", range(len(LAYOUTS)))
@pytest.mark.parametrize("seed", [1, 2])
def test_the_index_answers_the_reference_hit(layout: int, seed: int) -> None:
    rng = random.Random(seed * 100 + layout)
    align, groups = LAYOUTS[layout]
    engine = Engine(align, groups, rng)
    headers = [("kv-model", MODEL.encode()), ("kv-block-size", str(align).encode())]
    conductor = Conductor()
    roots = [[rng.randrange(4) for _ in range(rng.randrange(8, 40))] for _ in range(4)]
    prompts: list[list[int]] = []
    for _ in range(300):
        op = rng.random()
        if op < 0.55 or not prompts:
            base = (
                rng.choice(prompts + roots) if prompts and rng.random() < 0.6 else rng.choice(roots)
            )
            prompt = base[: rng.randrange(1, len(base) + 1)] + [
                rng.randrange(4) for _ in range(rng.randrange(0, 12))
            ]
            prompts.append(prompt)
            events = engine.serve(prompt)
        elif op < 0.97:
            events = [e for e in (engine.evict() for _ in range(rng.randrange(1, 4))) if e]
        else:
            events = [engine.clear()]
        if events:
            payload = msgspec.msgpack.encode([1.0, events, 0])
            conductor.ingest_engine_record("gen-0", headers, payload, 1.0)
        for prompt in rng.sample(prompts, k=min(4, len(prompts))):
            assert index_hit(conductor, align, prompt) == engine.hit(prompt), (prompt, events)
    assert not conductor.counters["hash_conflicts"]
    assert not conductor.counters["group_blocks_unplaced"]
