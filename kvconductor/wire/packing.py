"""Arrays of u64 and f64 as little-endian bytes: the snapshot format's
packed arrays."""

from __future__ import annotations

import sys
from array import array
from collections.abc import Iterable
from typing import Any

_SWAP = sys.byteorder != "little"


def pack_u64(values: Iterable[int]) -> bytes:
    return _pack("Q", values)


def unpack_u64(data: bytes) -> list[int]:
    return _unpack("Q", data)


def pack_f64(values: Iterable[float]) -> bytes:
    return _pack("d", values)


def unpack_f64(data: bytes) -> list[float]:
    return _unpack("d", data)


def _pack(code: str, values: Iterable[Any]) -> bytes:
    arr = array(code, values)
    if _SWAP:  # pragma: no cover
        arr.byteswap()
    return arr.tobytes()


def _unpack(code: str, data: bytes) -> list[Any]:
    arr = array(code)
    arr.frombytes(data)
    if _SWAP:  # pragma: no cover
        arr.byteswap()
    return arr.tolist()
