"""vLLM 0.33 engine events, encoded as vLLM publishes them (contract section 2).

The demo's engines, the soak's traffic, the benchmarks and the tests all
write engine payloads through this module, so that they send one shape: the
map form of `docs/wire-formats.md` section 3.2 (vLLM >= 0.24). Events are
msgspec Structs tagged under `"type"` with `omit_defaults`, like vLLM's own
`kv_events.py`: fields without a default are always written (possibly nil),
the later ones only when set, in vLLM's field order. The batch is the
positional `[ts, [events], data_parallel_rank]`.

    vllm_payload([vllm_stored([h1, h2], None, tokens, "GPU", 16), VllmAllBlocksCleared()])

The other engines' forms the benchmark's varied fleet sends are here too:
digest hashes (`vllm_bytes_hashes`), vLLM <= 0.23 tagged arrays
(`vllm_array_payload`) and SGLang's map form (`sglang_payload`), each from
the same events. This module only encodes; `kvconductor.wire.engine`
decodes every form.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

__all__ = [
    "SglangBlockRemoved",
    "SglangBlockStored",
    "VllmAllBlocksCleared",
    "VllmBlockRemoved",
    "VllmBlockStored",
    "VllmEvent",
    "digest_hash",
    "sglang_payload",
    "vllm_array_payload",
    "vllm_bytes_hashes",
    "vllm_offloaded",
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
    hashes: Sequence[Hash],
    parent: Hash | None,
    tokens: Sequence[int],
    medium: str,
    block_size: int,
    lora: tuple[int, str] | None = None,
) -> VllmBlockStored:
    """A `BlockStored` as vLLM 0.33 sends it for a model of one
    full-attention KV-cache group (fixture 0.33.0 `stored.msgpack`).

    `lora` (adapter id, name): a LoRA request's blocks, with both the id and
    the name set and the name as each block's extra keys (`(name,)`), as
    vLLM's `generate_block_hash_extra_keys` puts it into the block hash."""
    lora_id, lora_name = lora if lora is not None else (None, None)
    return VllmBlockStored(
        hashes,
        parent,
        tokens,
        block_size,
        lora_id,
        medium,
        lora_name,
        extra_keys=[[lora_name]] * len(hashes) if lora_name is not None else None,
        group_idx=0,
        kv_cache_spec_kind="full_attention",
    )


def vllm_offloaded(hashes: Sequence[Hash], medium: str = "CPU") -> VllmBlockStored:
    """The offloading connector's store of blocks into its own tier, without
    `self_describing_kv_events`: hashes only (`docs/wire-formats.md` 3.5)."""
    return VllmBlockStored(hashes, None, [], 0, None, medium, None)


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


# ------------------------------------------------ other generations and engines


def digest_hash(h: int) -> bytes:
    """A 32-byte block hash whose low 8 bytes are `h` (vLLM's sha256 digests
    with `VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES` off: the int form is the
    digest's low 64 bits, fixtures 0.33.0 vs 0.33.0-bytes-hashes). The high
    24 bytes are derived from `h`, so digests look like digests."""
    low = h.to_bytes(8, "big")
    return hashlib.blake2b(low, digest_size=24).digest() + low


def vllm_bytes_hashes(ev: VllmEvent, digest: Callable[[int], bytes] = digest_hash) -> VllmEvent:
    """`ev` with its int hashes as digests (`digest`: a caching variant)."""
    if isinstance(ev, VllmAllBlocksCleared):
        return ev
    hashes = [digest(h) if isinstance(h, int) else h for h in ev.block_hashes]
    if isinstance(ev, VllmBlockRemoved):
        return msgspec.structs.replace(ev, block_hashes=hashes)
    parent = ev.parent_block_hash
    if isinstance(parent, int):
        parent = digest(parent)
    return msgspec.structs.replace(ev, block_hashes=hashes, parent_block_hash=parent)


class _ArrayBlockStored(msgspec.Struct, array_like=True, tag="BlockStored"):
    block_hashes: Sequence[Hash]
    parent_block_hash: Hash | None
    token_ids: Sequence[int] | None
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None
    group_idx: int | None
    kv_cache_spec_kind: str | None
    kv_cache_spec_sliding_window: int | None


class _ArrayBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved"):
    block_hashes: Sequence[Hash]
    medium: str | None
    group_idx: int | None


class _ArrayAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared"):
    pass


def _as_array(ev: VllmEvent) -> _ArrayBlockStored | _ArrayBlockRemoved | _ArrayAllBlocksCleared:
    if isinstance(ev, VllmBlockStored):
        return _ArrayBlockStored(*msgspec.structs.astuple(ev))
    if isinstance(ev, VllmBlockRemoved):
        return _ArrayBlockRemoved(*msgspec.structs.astuple(ev))
    return _ArrayAllBlocksCleared()


def vllm_array_payload(events: Sequence[VllmEvent], rank: int | None = 0, ts: float = 1.0) -> bytes:
    """The same events as vLLM 0.10-0.23 published them: tagged positional
    arrays, every field written (fixture 0.22.0: a `BlockStored` of 12
    elements, a `BlockRemoved` of 4)."""
    return _encode((ts, [_as_array(ev) for ev in events], rank))


class SglangBlockStored(msgspec.Struct, tag_field="type", tag="BlockStored", omit_defaults=True):
    """SGLang's map-era `BlockStored` (`docs/wire-formats.md` section 4)."""

    block_hashes: Sequence[int]
    parent_block_hash: int | None
    token_ids: Sequence[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None


class SglangBlockRemoved(msgspec.Struct, tag_field="type", tag="BlockRemoved", omit_defaults=True):
    block_hashes: Sequence[int]
    medium: str | None = None


def _signed(h: Hash) -> int:
    """SGLang's `hash_str_to_int64`: the same 64 bits, read as signed."""
    assert isinstance(h, int)
    return h - (1 << 64) if h >= 1 << 63 else h


def _as_sglang(ev: VllmEvent) -> SglangBlockStored | SglangBlockRemoved | VllmAllBlocksCleared:
    if isinstance(ev, VllmBlockStored):
        parent = ev.parent_block_hash
        return SglangBlockStored(
            [_signed(h) for h in ev.block_hashes],
            None if parent is None else _signed(parent),
            ev.token_ids or [],
            ev.block_size,
            ev.lora_id,
            ev.medium,
        )
    if isinstance(ev, VllmBlockRemoved):
        return SglangBlockRemoved([_signed(h) for h in ev.block_hashes], ev.medium)
    return ev


def sglang_payload(events: Sequence[VllmEvent], rank: int | None = 0, ts: float = 1.0) -> bytes:
    """The same events as SGLang publishes them (map era, `attn_dp_rank` in
    the envelope): its own keys, hashes as signed int64."""
    return _encode((ts, [_as_sglang(ev) for ev in events], rank))
