"""Block hashing (contract section 1).

Local hash: `xxh3_64(token ids as little-endian u32, seed)`, seed 1337 for
the base model and `1337 + xxh3_64(lora_name, 0)` (wrapping) for an adapter:
the scheme of Dynamo's router and Mooncake RFC #1527.

Identity: a block is identified by its chain of blocks from the first one.
The index names that chain with one u64, `identity_i = xxh3_64(block_i
bytes, seed=identity_{i-1})`, starting from the namespace's seed. The first
block's identity is therefore exactly its contract local hash, and every
later identity is a fingerprint of (parent identity, block content) — the
contract's `(parent identity, local hash)` pair, computed with one hash per
block instead of two. Flat dicts keyed by identity then act as a radix tree
whose edges are implicit: a hit on identity i implies the whole chain 0..i.

Extra keys (multimodal hashes, per-request cache salt) arrive per block as a
u64 fingerprint and are xor-ed into that block's seed, so the same tokens
with different extra keys get different identities: they never match a
plain token query, and `/query_by_hash` still finds them by engine hash.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence

import msgspec
import xxhash

from kvconductor.kernel import KERNEL

if KERNEL is not None:
    from kvconductor import _kernel

MASK64 = (1 << 64) - 1
BASE_SEED = 1337

_xxh3 = xxhash.xxh3_64_intdigest
_BIG_ENDIAN = sys.byteorder == "big"
if array("I").itemsize != 4:  # pragma: no cover
    raise ImportError("kvconductor needs a platform whose C unsigned int is 32 bits")


def lora_seed(lora_name: str | None) -> int:
    """The chain's root seed for a namespace's LoRA adapter (None: base)."""
    if lora_name is None:
        return BASE_SEED
    return (BASE_SEED + _xxh3(lora_name.encode("utf-8"), 0)) & MASK64


def dynamo_seed(lora_name: str | None, salt: str | None) -> int:
    """The seed of Dynamo's local block hashes for a request: its LoRA seed
    (`lora_seed`), plus, for a request in a cache namespace (Dynamo's
    `cache_namespace`, a vLLM `cache_salt`), `xxh3_64(salt utf-8, seed 1)`,
    wrapping. An empty name is none. Dynamo's rule (lib/kv-hashing
    `compute_salt_hash`, the seed of lib/kv-router's
    `compute_block_hash_for_seq`), as ai-dynamo-runtime 1.6.1 computes it."""
    seed = lora_seed(lora_name or None)
    if salt:
        seed = (seed + _xxh3(salt.encode("utf-8"), 1)) & MASK64
    return seed


def pack_tokens(token_ids: Sequence[int]) -> bytes:
    """Token ids as little-endian u32; OverflowError outside u32, TypeError
    for a non-integer."""
    if KERNEL is not None:
        return _kernel.pack_tokens(token_ids)
    packed = array("I", token_ids)
    if _BIG_ENDIAN:  # pragma: no cover - every supported platform is little-endian
        packed.byteswap()
    return packed.tobytes()


def tokens_from_msgpack(raw: bytes | msgspec.Raw) -> bytes | None:
    """A msgpack array of token ids in [0, 2**32), left undecoded by a wire
    decoder, as packed tokens (`pack_tokens`); None for anything else.

    Decoders keep token arrays raw because a list of Python ints costs more
    than everything else an event carries; this packs them without one."""
    if KERNEL is not None:
        return _kernel.msgpack_tokens(raw)
    return _packed_or_none(_decode_msgpack_tokens, raw)


def tokens_from_json(raw: bytes | msgspec.Raw) -> bytes | None:
    """`tokens_from_msgpack` for a JSON array (a query's prompt)."""
    if KERNEL is not None:
        return _kernel.json_tokens(raw)
    return _packed_or_none(_decode_json_tokens, raw)


_decode_msgpack_tokens = msgspec.msgpack.Decoder(list[int]).decode
_decode_json_tokens = msgspec.json.Decoder(list[int]).decode


def _packed_or_none(
    decode: Callable[[bytes | msgspec.Raw], list[int]], raw: bytes | msgspec.Raw
) -> bytes | None:
    try:
        return pack_tokens(decode(raw))
    except (msgspec.DecodeError, OverflowError):
        return None


def local_block_hash(tokens: Sequence[int], seed: int = BASE_SEED) -> int:
    """The contract's local hash of one full block of tokens."""
    return _xxh3(pack_tokens(tokens), seed)


def chain_identities(
    token_bytes: bytes,
    n_blocks: int,
    block_size: int,
    parent: int,
    extra: Sequence[int | None] | None = None,
) -> list[int]:
    """Identities of the first `n_blocks` full blocks of `token_bytes`.

    `parent` is the identity the first block hangs from (the namespace seed
    at the root)."""
    if extra is None:
        if KERNEL is not None:
            return _kernel.chain_identities(token_bytes, n_blocks, block_size, parent)
        return _plain_chain(token_bytes, n_blocks, block_size, parent)
    step = block_size * 4
    out: list[int] = []
    append = out.append
    ident = parent
    for i in range(n_blocks):
        key = extra[i] if i < len(extra) else None
        seed = ident if key is None else ident ^ key
        ident = _xxh3(token_bytes[i * step : (i + 1) * step], seed)
        append(ident)
    return out


def _plain_chain(token_bytes: bytes, n_blocks: int, block_size: int, parent: int) -> list[int]:
    step = block_size * 4
    out: list[int] = []
    append = out.append
    ident = parent
    for start in range(0, n_blocks * step, step):
        ident = _xxh3(token_bytes[start : start + step], ident)
        append(ident)
    return out


def extra_keys_fingerprint(keys: object) -> int:
    """u64 fingerprint of one block's extra keys: xxh3_64(msgpack(keys)).

    `keys` is the per-block entry vLLM publishes, e.g. `(("mm-uuid", 0),
    "salt")`; tuples and lists encode alike, so a router computes the same
    value for a query. A per-request cache salt alone is `[salt]`."""
    return _xxh3(_encode(keys))


_encode = msgspec.msgpack.encode


def block_identity(block_bytes: bytes, parent: int, extra: int | None) -> int:
    """One step of `chain_identities`, for chains resolved late."""
    return _xxh3(block_bytes, parent if extra is None else parent ^ extra)


def local_hashes(token_bytes: bytes, n_blocks: int, block_size: int, seed: int) -> list[int]:
    """The contract's local hashes of the first `n_blocks` full blocks of
    `token_bytes`, each from `seed` (not chained): the names Dynamo's router
    gives a prompt's blocks."""
    step = block_size * 4
    return [_xxh3(token_bytes[s : s + step], seed) for s in range(0, n_blocks * step, step)]
