"""Block hashes from Mooncake store object keys (contract section 3).

`mooncake_master` names the object of a `stored` / `removed` event only by its
`object_key`: `seq_hashes` and `block_hashes` are `[]` (release 0.3.14). The
engines' connectors build that key from the block hash the engine's own KV
events publish, so the hash can be read back:

* vLLM's `MooncakeStoreConnector` (`PoolKey.build_prefix` / `build_key_string`):
  `[cache_prefix@]<model>@tp_rank:N@pcp<p>@dcp<d>@pp_rank:<pp>@group:<g>@<hex>`;
* vllm-ascend's `MooncakeStoreConnectorV1` / Ascend store (`PoolKey.to_string`):
  `<model>@pcp<p>@dcp<d>@head_or_tp_rank:N@pp_rank:<pp>@<hex>`, with optional
  `@group:<g>[:<type>]`, `@cache_role:<r>@cache_family:<f>` before the hash;
* vllm-ascend's per-layer keys: `<model>@pcp<p>@dcp<d>@head_or_tp_rank:N@<hex>@<layer>`
  and `...@layer_id:<layer>@<hex>`.

`<hex>` is `BlockHash.hex()`: the engine's block hash bytes (vLLM's digest,
32 bytes with sha256) in lowercase hex. vLLM publishes that hash in its own
events as `int.from_bytes(digest, "big") & (2**64 - 1)`, the contract's
normalisation, so the key's hash and the engine's hash meet as the same u64.

A key is one (rank, group, layer) part of one block. The part of the key that
is not the hash (its *holder*) tells the parts apart: the pool holds a block
while any holder of it remains (`NamespaceIndex.pool_store`).

A key that matches none of these forms names no block: `parse_object_key`
returns None and the index counts the event (`pool_key_unparsed`).
"""

from __future__ import annotations

import re
import sys
from typing import NamedTuple

__all__ = ["KeyBlock", "parse_object_key"]

# One segment of a connector key that says which rank wrote it: vLLM's
# `tp_rank:N`, vllm-ascend's `head_or_tp_rank:N`, both's `pcp<N>` / `dcp<N>`.
_RANK_SEGMENT = re.compile(r"(?:head_or_)?tp_rank:\d+|[pd]cp\d+")
# A block hash segment: hex of a whole number of bytes, at least 8 (a u64).
# Lowercase only, as `bytes.hex()` writes it: an uppercase segment is no
# connector's and is not guessed at.
_HEX_SEGMENT = re.compile(r"(?:[0-9a-f]{2}){8,64}")
_LAYER_SEGMENT = re.compile(r"\d+")
MASK64 = (1 << 64) - 1
# Longest key read: Mooncake's own limit on object keys is far above any
# connector key; a longer one is junk, not a block.
MAX_KEY = 4096


class KeyBlock(NamedTuple):
    seq_hash: int
    # The key without its hash segment: which rank/group/layer part this is.
    holder: str


def parse_object_key(key: str) -> KeyBlock | None:
    """The block a connector key names, or None when it names none."""
    if len(key) > MAX_KEY or "@" not in key:
        return None
    parts = key.split("@")
    # The hash is the last segment, or the one before a per-layer suffix.
    at = len(parts) - 1
    if _LAYER_SEGMENT.fullmatch(parts[at]) and at >= 2 and _HEX_SEGMENT.fullmatch(parts[at - 1]):
        at -= 1
    digest = parts[at]
    if not _HEX_SEGMENT.fullmatch(digest):
        return None
    # A rank segment before the hash, after the model: a connector's key, not
    # any key that happens to end in hex.
    if not any(_RANK_SEGMENT.fullmatch(p) for p in parts[1:at]):
        return None
    # The low 8 bytes of the big-endian digest are the last 16 hex digits.
    seq_hash = int(digest[-16:], 16) & MASK64
    holder = "@".join([*parts[:at], "*", *parts[at + 1 :]])
    # Interned: every block of one rank shares the same few holder strings.
    return KeyBlock(seq_hash, sys.intern(holder))
