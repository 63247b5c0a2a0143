"""Block-hash normalisation (contract section 1), shared by every decoder.

Engines and pools name their blocks with 64-bit ints of either sign or with
raw digests. The index only ever sees unsigned 64-bit ints:

* a non-negative int in [0, 2**64) is kept as is;
* a negative int in [-2**63, 0) is reinterpreted as unsigned
  (`h & (2**64 - 1)`), which is what SGLang's signed int64 hashes and
  TensorRT-LLM's signed wire hashes mean;
* bytes (vLLM's sha256 digests when `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` is
  off) become `int.from_bytes(digest, "big") & (2**64 - 1)`: the low 64 bits,
  exactly vLLM's own `maybe_convert_block_hash`, so a bytes-hash engine and an
  int-hash engine of the same vLLM name a block identically.

Anything else (bool, float, str, None inside a list, an int outside
[-2**63, 2**64), an empty digest) raises `HashError`, a `ValueError` whose
message says what was wrong. Callers add the event index and field.
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

U64_MASK = (1 << 64) - 1
I64_MIN = -(1 << 63)

__all__ = [
    "I64_MIN",
    "U64_MASK",
    "HashError",
    "hash_from_hex",
    "normalize_hash",
    "normalize_hashes",
    "normalize_wire_hashes",
]


class HashError(ValueError):
    """A value that is not a block hash. `index` is its position in a list."""

    def __init__(self, reason: str, index: int | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.index = index


def normalize_hash(h: object) -> int:
    """One block hash (int of either sign, or digest bytes) as an unsigned u64."""
    if type(h) is int:
        if h >= 0:
            if h > U64_MASK:
                raise HashError(f"hash {h} is not below 2**64")
            return h
        if h < I64_MIN:
            raise HashError(f"hash {h} is below -2**63")
        return h & U64_MASK
    if isinstance(h, bytes | bytearray | memoryview):
        digest = bytes(h)
        if not digest:
            raise HashError("hash is an empty byte string")
        return int.from_bytes(digest, "big") & U64_MASK
    if isinstance(h, bool):
        raise HashError(f"hash is a bool ({h}), not an int or bytes")
    if isinstance(h, int):  # an int subclass (IntEnum, numpy-like): use its value
        return normalize_hash(int(h))
    raise HashError(f"hash must be an int or bytes, not {type(h).__name__}")


def normalize_hashes(hashes: Sequence[object]) -> list[int]:
    """A list of hashes, each normalised; validates ranges of arbitrary ints.

    Returns the input list itself (no copy) when it already holds only ints
    in [0, 2**64)."""
    if isinstance(hashes, list):
        try:
            if not hashes or (
                min(hashes) >= 0 and max(hashes) <= U64_MASK and all(type(h) is int for h in hashes)
            ):
                return hashes
        except TypeError:
            pass
    return _normalize_each(hashes)


def normalize_wire_hashes(hashes: list[int | bytes]) -> list[int]:
    """`normalize_hashes` for lists decoded from msgpack (the hot path).

    msgpack cannot carry an int outside [-2**63, 2**64) and msgspec has
    already checked every element is an int or bytes (never bool), so a list
    of ints whose minimum is >= 0 is returned as is: one C-level `min` per
    event. Otherwise one comprehension masks the ints and folds the digests."""
    if not hashes:
        return []
    if hashes[0].__class__ is int:
        try:
            if min(hashes) >= 0:  # type: ignore[operator]
                return hashes  # type: ignore[return-value]
        except TypeError:  # bytes further on
            pass
    try:
        return [h & U64_MASK if h.__class__ is int else _digest_hash(h) for h in hashes]
    except (HashError, TypeError):
        return _normalize_each(hashes)  # names the offending element


_u64_at = struct.Struct(">Q").unpack_from


def _digest_hash(h: object) -> int:
    """Low 64 bits of a big-endian digest: `int.from_bytes(h, "big") & mask`."""
    if h.__class__ is bytes:
        n = len(h)
        if n >= 8:
            return int(_u64_at(h, n - 8)[0])
        if n:
            return int.from_bytes(h, "big")
    raise HashError("not a non-empty digest")


def _normalize_each(hashes: Sequence[object]) -> list[int]:
    out: list[int] = []
    append = out.append
    for i, h in enumerate(hashes):
        if type(h) is int and 0 <= h <= U64_MASK:
            append(h)
            continue
        try:
            append(normalize_hash(h))
        except HashError as exc:
            raise HashError(exc.reason, i) from None
    return out


def hash_from_hex(text: str) -> int:
    """A hash written as hex text (optionally `0x`-prefixed) as a u64.

    For the hex of a digest this equals `normalize_hash(bytes.fromhex(text))`
    (the low 64 bits); for a `0x`-prefixed u64 literal it is that value."""
    body = text[2:] if text[:2] in ("0x", "0X") else text
    if not body or not all(c in "0123456789abcdefABCDEF" for c in body):
        raise HashError(f"hash text {text!r} is not hexadecimal")
    return int(body, 16) & U64_MASK
