"""vLLM 0.33 engine events, encoded as vLLM publishes them (contract section 2).

The demo's engines, the soak's traffic, the benchmarks and the tests all
write engine payloads through this module, so that they send one shape: the
map form of `docs/wire-formats.md` section 3.2 (vLLM >= 0.24). Events are
msgspec Structs tagged under `"type"` with `omit_defaults`, like vLLM's own
`kv_events.py`: fields without a default are always written (possibly nil),
the later ones only when set, in vLLM's field order. The batch is the
positional `[ts, [events], data_parallel_rank]`.

    vllm_payload([vllm_stored([h1, h2], None, tokens, "GPU", 16), VllmAllBlocksCleared()])

This module only encodes; `kvconductor.wire.engine` decodes every form.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

__all__ = [
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEvent",
    "vllm_payload",
    "vllm_removed",
    "vllm_stored",
]

Hash = int | bytes


class VllmBlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    block_hashes: Sequence[Hash]
    parent_block_hash: Hash | None
    token_ids: Sequence[int] | None  # `[]` in hash-only offload stores
    block_size: int  # 0 in hash-only offload stores
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class VllmBlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: Sequence[Hash]
    medium: str | None
    group_idx: int | None = None


class VllmAllBlocksCleared(
    msgspec.Struct, tag_field="type", tag="AllBlocksCleared", omit_defaults=True
):
    medium: str | None = None


VllmEvent = VllmBlockStored | VllmBlockRemoved | VllmAllBlocksCleared

_encode = msgspec.msgpack.Encoder().encode


def vllm_stored(
    hashes: Sequence[Hash], parent: Hash | None, tokens: Sequence[int], medium: str, block_size: int
) -> VllmBlockStored:
    """A `BlockStored` as vLLM 0.33 sends it for a model of one
    full-attention KV-cache group (fixture 0.33.0 `stored.msgpack`)."""
    return VllmBlockStored(
        hashes,
        parent,
        tokens,
        block_size,
        None,
        medium,
        None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def vllm_removed(hashes: Sequence[Hash], medium: str) -> VllmBlockRemoved:
    """A `BlockRemoved` of that model (fixture 0.33.0 `removed.msgpack`)."""
    return VllmBlockRemoved(hashes, medium, group_idx=0)


def vllm_payload(
    events: Sequence[VllmEvent | Mapping[str, Any]], rank: int | None = 0, ts: float = 1.0
) -> bytes:
    """One engine record's value: vLLM's `EventBatch` `[ts, events, rank]`
    (`rank`: its `data_parallel_rank`). An event may also be a map, for a
    payload that breaks the contract on purpose (a test's bad record)."""
    return _encode((ts, events, rank))
