"""Normalised KV events: what every wire form decodes to.

Decoders in `kvconductor/consumers/` turn vLLM, SGLang, TensorRT-LLM and Mooncake pool
payloads into these Structs. By then every block hash is an unsigned 64-bit
int (contract section 1), so the index never sees a wire quirk.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Tokens = bytes | list[int]


class BlockStored(msgspec.Struct, frozen=True, gc=False):
    """Engine blocks stored in one medium; block i's parent is block i-1."""

    block_hashes: list[int]
    parent_block_hash: int | None = None
    # The blocks' tokens, packed (little-endian u32, `hashing.pack_tokens`)
    # as the decoders give them, or a list of ints when built by hand. None
    # or empty: a token-less store (vLLM's offloading connector); the
    # content comes from the catalog.
    token_ids: Tokens | None = None
    block_size: int | None = None
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block (None when that block has none), already reduced to
    # a u64 fingerprint by the decoder; mixed into the block's identity.
    extra_keys: list[int | None] | None = None
    group_idx: int | None = None
    spec_kind: str | None = None
    # The window of a sliding-window group (tokens), or a chunked local
    # group's chunk; vLLM's `kv_cache_spec_sliding_window`.
    sliding_window: int | None = None


class BlockRemoved(msgspec.Struct, frozen=True, gc=False):
    block_hashes: list[int]
    medium: str | None = None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, frozen=True, gc=False):
    medium: str | None = None


EngineEvent = BlockStored | BlockRemoved | AllBlocksCleared


class EngineBatch(msgspec.Struct, frozen=True, gc=False):
    ts: float
    events: list[EngineEvent]
    dp_rank: int | None = None


PoolEventType = Literal["stored", "removed", "cleared"]


class PoolEvent(msgspec.Struct, frozen=True, gc=False):
    """One pool backend event in Mooncake RFC #1527's shape, normalised.

    `token_ids` None or empty on a `stored` event makes it a confirmation
    only (phase two of the two-phase join)."""

    event_type: PoolEventType
    seq_hashes: list[int] = []
    parent_hash: int | None = None
    base_block_idx: int | None = None
    token_ids: list[int] | None = None
    medium: str | None = None
    backend_id: str | None = None
    tenant_id: str | None = None
    model_name: str | None = None
    block_size: int | None = None
    lora_name: str | None = None
    additional_salt: str | None = None
    object_key: str | None = None
    event_id: int | None = None
    # Set when the hash was read from `object_key` (`wire.mooncake_keys`): the
    # key's rank/group/layer part, one of possibly several per block.
    holder: str | None = None


class PoolBatch(msgspec.Struct, frozen=True, gc=False):
    ts: float
    events: list[PoolEvent]
    dp_rank: int | None = None
