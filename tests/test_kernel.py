"""The compiled kernel gives exactly the pure-Python path's results.

The query walk runs on native u64 or u128 masks when the namespace's owner
slots fit and on Python ints beyond, so slot counts on both sides of 64 and
128 are drawn. Tier dicts are built over the prompt's own identities (plus
strangers) so that walks go deep and every tier meets every other.
"""

from __future__ import annotations

import os
import shutil
from array import array
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvconductor import hashing, query
from kvconductor.hashing import BASE_SEED, pack_tokens
from kvconductor.kernel import KERNEL, STATUS, Kernel, Tiers
from kvconductor.media import DEVICE, DISK, HOST
from kvconductor.namespace_index import Dirty, NamespaceIndex, NamespaceKey

BLOCK = 4


def test_kernel_is_built_where_rust_is() -> None:
    # With cargo on the machine a missing kernel is a broken build, not a
    # machine without Rust: the optional build must not hide it.
    if shutil.which("cargo") and os.environ.get("KVCONDUCTOR_KERNEL", "") != "off":
        assert KERNEL is not None, STATUS


def _kernel() -> Kernel:
    if KERNEL is None:
        pytest.skip(STATUS)
    return KERNEL


def _namespace() -> NamespaceIndex:
    key = NamespaceKey("t", "m", BLOCK, None, "")
    return NamespaceIndex(key, 10, 60.0, 1000, 10, Counter(), Dirty())


@st.composite
def scenes(draw: st.DrawFn) -> tuple[NamespaceIndex, bytes, int, int]:
    slots = draw(st.sampled_from([1, 3, 63, 64, 65, 127, 128, 129, 200]))
    blocks = draw(st.integers(0, 24))
    tokens = draw(st.lists(st.integers(0, 7), min_size=blocks * BLOCK, max_size=blocks * BLOCK))
    data = pack_tokens(tokens)
    seed = draw(st.sampled_from([BASE_SEED, BASE_SEED ^ 0xDEADBEEF]))
    idents = [*query.token_identities(data, BLOCK, seed), 1, 2, 3]
    ns = _namespace()
    ns.slots = [None] * slots
    owner_bits = st.lists(st.integers(0, slots - 1), max_size=4).map(
        lambda bs: sum({1 << b for b in bs})
    )
    lower = draw(st.booleans())
    for tier in (DEVICE, HOST, DISK) if lower else (DEVICE,):
        for ident in draw(st.lists(st.sampled_from(idents), max_size=30)):
            bits = draw(owner_bits)
            if bits:
                ns.masks[tier][ident] = bits
    if lower:
        for tier in (HOST, DISK):
            for ident in draw(st.lists(st.sampled_from(idents), max_size=6)):
                ns.pool_counts[tier][ident] = 1
    listed = draw(st.one_of(st.just((1 << slots) - 1), owner_bits))
    return ns, data, seed, listed


def _python_walk(ns: NamespaceIndex, idents: list[int], listed: int) -> query.Walked:
    device_only = not (any(ns.masks[HOST:]) or any(ns.pool_counts))
    return query._walk(ns, idents, listed, device_only)


def _tiers(ns: NamespaceIndex) -> Tiers:
    """The tier tuple as `query.match` passes it: empty lower tiers as None."""
    return (
        ns.masks[DEVICE],
        ns.masks[HOST] or None,
        ns.masks[DISK] or None,
        ns.pool_counts[HOST] or None,
        ns.pool_counts[DISK] or None,
    )


@settings(max_examples=200, deadline=None)
@given(scenes())
def test_walk_tokens_matches_python(scene: tuple[NamespaceIndex, bytes, int, int]) -> None:
    kernel = _kernel()
    ns, data, seed, listed = scene
    got = kernel.walk_tokens(data, BLOCK, seed, len(ns.slots), _tiers(ns), listed)
    idents = list(query.token_identities(data, BLOCK, seed))
    assert got == _python_walk(ns, idents, listed)


@settings(max_examples=200, deadline=None)
@given(scenes())
def test_walk_identities_matches_python(scene: tuple[NamespaceIndex, bytes, int, int]) -> None:
    kernel = _kernel()
    ns, data, seed, listed = scene
    idents = list(query.token_identities(data, BLOCK, seed))
    got = kernel.walk_identities(idents, len(ns.slots), _tiers(ns), listed)
    assert got == _python_walk(ns, idents, listed)


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 32),
    st.integers(0, 2**64 - 1),
    st.data(),
)
def test_chain_identities_matches_python(block_size: int, parent: int, data: st.DataObject) -> None:
    kernel = _kernel()
    n = data.draw(st.integers(0, 12))
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * block_size))
    packed = pack_tokens(tokens)
    want = hashing._plain_chain(packed, n, block_size, parent)
    assert kernel.chain_identities(packed, n, block_size, parent) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-(2**40), 2**40), st.booleans(), st.floats(), st.text())))
def test_pack_tokens_matches_array(tokens: list[object]) -> None:
    kernel = _kernel()
    try:
        want: bytes | type[Exception] = array("I", tokens).tobytes()  # type: ignore[arg-type]
    except (OverflowError, TypeError) as exc:
        want = type(exc)
    try:
        got: bytes | type[Exception] = kernel.pack_tokens(tokens)  # type: ignore[arg-type]
    except (OverflowError, TypeError) as exc:
        got = type(exc)
    assert got == want


def test_chain_identities_refuses_short_input() -> None:
    kernel = _kernel()
    with pytest.raises(ValueError):
        kernel.chain_identities(b"\0" * 15, 1, 4, 0)
