"""Arrays of u64 as little-endian bytes: the snapshot format's packed arrays."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable

_SWAP = sys.byteorder != "little"


def pack_u64(values: Iterable[int]) -> bytes:
    arr = array("Q", values)
    if _SWAP:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def unpack_u64(data: bytes) -> list[int]:
    arr = array("Q")
    arr.frombytes(data)
    if _SWAP:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()
