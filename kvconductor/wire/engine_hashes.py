"""vLLM v1's own block names for a prompt, from its hash profile.

kvconductor matches blocks on their content (contract section 1) and never
needs an engine's names to answer; but an engine store without token ids
whose content no event showed can only be placed by its name. Given how the
engine names blocks (Mooncake Conductor's `hash_profile`), the names of a
query's blocks can be computed and looked up (`tokenless`).

vLLM v1 (`vllm/v1/core/kv_cache_utils.py`, `vllm/utils/hashing.py`):

- the chain's root `NONE_HASH` is `H(seed)`, the seed being the text of
  `PYTHONHASHSEED` when it is set and otherwise, for the cryptographic
  algorithms, the fixed text `"vllm-none-hash"` (`DEFAULT_NONE_HASH_SEED`);
- block i's hash is `H((parent, tuple(block's token ids), extra_keys))`, the
  parent being block i-1's whole 32-byte digest (the root for block 0);
- `H` is SHA-256 of the value's pickle (protocol 5, `sha256`) or of its
  canonical CBOR (`sha256_cbor`);
- events carry `int.from_bytes(digest, "big") & (2**64 - 1)`, the digest's
  low 64 bits (`low64_be`), as the index keeps every engine hash.

Extra keys follow Conductor's recipe (`hash_strategy.cpp`): the LoRA name on
every block, then the cache salt on the first block only, as text; none is
`None`. Multimodal and prompt-embedding keys are not expressible in a query.
"""

from __future__ import annotations

import functools
import hashlib
import pickle
import struct
from collections.abc import Sequence
from typing import NamedTuple

# The seed vLLM takes for sha256 and sha256_cbor when PYTHONHASHSEED is unset.
DEFAULT_NONE_HASH_SEED = "vllm-none-hash"

HashValue = None | int | str | bytes | tuple["HashValue", ...]


class VllmProfile(NamedTuple):
    """How one vLLM process names blocks: its algorithm and seed text."""

    algorithm: str  # "sha256" | "sha256_cbor"
    seed: str


def encode(algorithm: str, value: HashValue) -> bytes:
    """The bytes `algorithm` digests for `value`."""
    if algorithm == "sha256":
        return pickle.dumps(value, protocol=5)
    if algorithm == "sha256_cbor":
        return _cbor(value)
    raise ValueError(f"unsupported hash algorithm: {algorithm}")


def _cbor_head(major: int, n: int) -> bytes:
    """A canonical CBOR head: major type and argument, shortest form."""
    if n < 24:
        return bytes([major << 5 | n])
    for extra, width in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if n < 1 << (8 * width):
            return bytes([major << 5 | extra]) + n.to_bytes(width, "big")
    raise ValueError("argument does not fit CBOR")


@functools.lru_cache(maxsize=1 << 18)
def _uint(n: int) -> bytes:
    # Token ids repeat across blocks and queries: a vocabulary's worth cached.
    return _cbor_head(0, n)


def _cbor(value: HashValue) -> bytes:
    """Canonical CBOR for exactly the shapes of vLLM's hash inputs."""
    if type(value) is int and value >= 0:
        return _uint(value)
    if value is None:
        return b"\xf6"
    if isinstance(value, bool):
        raise TypeError("a boolean is not a hash input")
    if isinstance(value, int):
        return _cbor_head(1, -1 - value)
    if isinstance(value, bytes):
        return _cbor_head(2, len(value)) + value
    if isinstance(value, str):
        text = value.encode("utf-8")
        return _cbor_head(3, len(text)) + text
    return _cbor_head(4, len(value)) + b"".join(map(_cbor, value))


def none_hash(profile: VllmProfile) -> bytes:
    """vLLM's `NONE_HASH` for the profile: the digest of its seed text."""
    return hashlib.sha256(encode(profile.algorithm, profile.seed)).digest()


def block_digest(
    algorithm: str, parent: bytes, tokens: tuple[int, ...], extra: tuple[str, ...] | None
) -> bytes:
    return hashlib.sha256(encode(algorithm, (parent, tokens, extra))).digest()


def low64(digest: bytes) -> int:
    """The int an event carries for a digest (`low64_be`)."""
    return int.from_bytes(digest[-8:], "big")


def extra_keys(index: int, lora_name: str | None, cache_salt: str | None) -> tuple[str, ...] | None:
    keys = ([lora_name] if lora_name else []) + ([cache_salt] if index == 0 and cache_salt else [])
    return tuple(keys) or None


class BlockNames:
    """One profile's names (`low64`) of a prompt's full blocks, each
    computed when first asked for: the chain hashes every block before it,
    so a walk that stops early never hashes the rest."""

    __slots__ = ("_algorithm", "_block_size", "_lora", "_names", "_parent", "_salt", "_tokens")

    def __init__(
        self,
        profile: VllmProfile,
        tokens: Sequence[int],
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> None:
        self._algorithm = profile.algorithm
        self._parent = none_hash(profile)
        self._tokens = tokens
        self._block_size = block_size
        self._lora = lora_name
        self._salt = cache_salt
        self._names: list[int] = []

    @classmethod
    def of_packed(
        cls,
        profile: VllmProfile,
        packed: bytes,
        block_size: int,
        lora_name: str | None = None,
        cache_salt: str | None = None,
    ) -> BlockNames:
        """From the prompt's whole blocks as little-endian u32 tokens."""
        tokens = struct.unpack(f"<{len(packed) // 4}I", packed)
        return cls(profile, tokens, block_size, lora_name, cache_salt)

    def __len__(self) -> int:
        return len(self._tokens) // self._block_size

    def __getitem__(self, i: int) -> int:
        names = self._names
        bs = self._block_size
        while len(names) <= i:
            n = len(names)
            block = tuple(self._tokens[n * bs : (n + 1) * bs])
            if len(block) < bs:
                raise IndexError(i)
            digest = block_digest(
                self._algorithm, self._parent, block, extra_keys(n, self._lora, self._salt)
            )
            self._parent = digest
            names.append(low64(digest))
        return names[i]
