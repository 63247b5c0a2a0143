"""The compiled KV-cache groups (kernel/core/src/groups) against their Python
twin (`cache_groups.GroupState`, `hybrid_hit`): the same copies after the
same adds and removals, and the same hit for every owner of a query, on
generated groups of every kind, block size and window, prompts by tokens
and by identities, and keys that land on and between alignment units."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconductor.index.cache_groups import GroupState, Prefix, hybrid_hit, lookup_of
from kvconductor.kernel import KERNEL
from kvconductor.wire.hashing import chain_identities, pack_tokens

if KERNEL is not None:
    from kvconductor import _kernel

pytestmark = pytest.mark.skipif(KERNEL is None, reason="the compiled twin is the kernel's")

KINDS = [
    "full_attention",
    "mla_attention",
    "sliding_window",
    "sliding_window_mla",
    "mamba",
    "chunked_local_attention",
    "some_future_kind",
]


def _pair(kind: str, block_size: int, window: int | None) -> tuple[GroupState, object]:
    return GroupState(kind, block_size, window), _kernel.GroupState(
        kind, block_size, window, lookup_of(kind)
    )


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), by_tokens=st.booleans())
def test_the_twins_answer_alike(seed: int, by_tokens: bool) -> None:
    rng = random.Random(seed)
    align = rng.choice([2, 4, 8])
    units = rng.randrange(0, 9)
    tokens = [rng.randrange(6) for _ in range(units * align + rng.randrange(align))]
    packed = pack_tokens(tokens)
    base = rng.getrandbits(64)
    idents = chain_identities(packed, units, align, base, None)
    ref_prefix = Prefix(packed if by_tokens else None, base, align, idents)
    owners_ref: list[tuple[int, list[GroupState]]] = []
    owners_kernel: list[tuple[int, list[object]]] = []
    for _ in range(rng.randrange(1, 5)):
        ref_groups, kernel_groups = [], []
        for _ in range(rng.randrange(1, 4)):
            kind = rng.choice(KINDS)
            block_size = rng.choice([d for d in (1, 2, 4, 8, 16) if d <= 2 * align])
            window = rng.choice([None, 0, 1, 3, 5, 8, 13, 32])
            ref, kernel = _pair(kind, block_size, window)
            # Blocks at true prefix ends (most), off the grid, and unknown.
            for seq in range(rng.randrange(0, 3 * units + 2)):
                end = rng.randrange(1, units * align + 2) if units else 1
                key = ref_prefix.key(end) if rng.random() < 0.8 else rng.getrandbits(64)
                if key is None:
                    key = rng.getrandbits(64)
                for _ in range(rng.choice([1, 1, 2])):
                    ref.add(seq, key)
                    kernel.add(seq, key)
            for seq in rng.sample(range(3 * units + 3), rng.randrange(0, 3)):
                assert ref.remove(seq) == kernel.remove(seq)
            assert ref.export() == kernel.export()
            assert len(ref) == len(kernel)
            ref_groups.append(ref)
            kernel_groups.append(kernel)
        limit = rng.randrange(0, units + 2)
        owners_ref.append((limit, ref_groups))
        owners_kernel.append((limit, kernel_groups))
    reach = max(limit for limit, _ in owners_ref)
    want = [hybrid_hit(groups, ref_prefix, min(limit, units)) for limit, groups in owners_ref]
    got = _kernel.hybrid_hits(
        packed if by_tokens else None, idents, base, align, min(reach, units), owners_kernel
    )
    assert got == want


def test_bad_specs_are_refused() -> None:
    with pytest.raises(ValueError):
        _kernel.GroupState("sliding_window", 0, 8, 1)
    with pytest.raises(ValueError):
        _kernel.GroupState("sliding_window", 4, 8, 9)
    with pytest.raises(TypeError):
        _kernel.hybrid_hits(None, [1], 0, 4, 1, [(1, [object()])])
