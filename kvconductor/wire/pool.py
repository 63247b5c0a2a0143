"""Pool backend payloads (contract section 3) -> `kvconductor.wire.events.PoolBatch`.

The payload is what `mooncake_master` (and any RFC #1527 publisher such as
Yuanrong or TokenSpeed) puts in the third ZMQ frame: `[timestamp,
[event maps], dp_rank]`. Each event is a map in Mooncake RFC #1527's shape:

    {"event_id", "timestamp", "event_type": "stored" | "removed" | "cleared",
     "model_name", "block_size", "additional_salt", "lora_name", "tenant_id",
     "backend_id", "medium", "dp_rank",
     "seq_hashes", "base_block_idx", "parent_hash", "token_ids",   # stored
     "object_key", "group_id",                                     # Mooncake
     "type", "block_hashes", "parent_block_hash"}                  # legacy aliases

Rules (see `docs/wire-formats.md` for sources):

* `event_type` must be one of the three values, else `DecodeError`;
* a null field means the same as a missing one; so does an empty string in
  `model_name`, `tenant_id`, `lora_name`, `additional_salt`, `backend_id`
  (Mooncake writes "unset" as nil, other publishers as "");
* `seq_hashes` falls back to the legacy `block_hashes` alias when it is
  missing or empty, `parent_hash` to `parent_block_hash`;
* when both are empty, the hash is read from `object_key` if it is an engine
  connector's key (`kvconductor.wire.mooncake_keys`; `holder` says which
  rank/group/layer part of the block the key is);
* hashes are normalised exactly as engine hashes (`kvconductor.wire.hash_norm`);
* `token_ids` are the tokens of the listed blocks only (RFC #1527: "tokens
  across all blocks in this event"), so with a known `block_size` their
  count must be `len(seq_hashes) * block_size`, else `RejectedEvent`;
* `block_size` 0 means unknown (Mooncake's "not configured");
* `timestamp` in milliseconds (Mooncake) is turned into seconds;
* a name (`medium`, `backend_id`, `tenant_id`, `model_name`, `lora_name`,
  `additional_salt`) longer than `MAX_NAME` characters is `RejectedEvent`.

Unknown keys are ignored; unknown trailing envelope elements too.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from kvconductor.wire.engine import Name, TokenId, WireHash, bad_record
from kvconductor.wire.errors import DecodeError, RejectedEvent
from kvconductor.wire.events import PoolBatch, PoolEvent
from kvconductor.wire.hash_norm import HashError, normalize_hash, normalize_wire_hashes
from kvconductor.wire.mooncake_keys import parse_object_key

__all__ = ["decode_pool_payload"]

# A timestamp above this many seconds (year 5138) is taken as milliseconds.
MS_THRESHOLD = 1e11


class PoolWireEvent(msgspec.Struct, gc=False):
    event_type: Literal["stored", "removed", "cleared"]
    seq_hashes: list[WireHash] | None = None
    base_block_idx: int | None = None
    parent_hash: WireHash | None = None
    token_ids: list[TokenId] | None = None
    # Names become namespaces and pool stores: at most MAX_NAME characters.
    medium: Name | None = None
    backend_id: Name | None = None
    tenant_id: Name | None = None
    model_name: Name | None = None
    block_size: int | None = None
    lora_name: Name | None = None
    additional_salt: Name | None = None
    object_key: str | None = None
    event_id: int | None = None
    # vLLM/SGLang-compatible aliases Mooncake adds by default
    # (`kv_events_emit_legacy_compat`); `block_hashes` is often [] there.
    block_hashes: list[WireHash] | None = None
    parent_block_hash: WireHash | None = None


class _PoolWireBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[PoolWireEvent]
    dp_rank: int | None = None


_decode_batch = msgspec.msgpack.Decoder(_PoolWireBatch).decode


def _text(value: str | None) -> str | None:
    return value or None


def _convert(ev: PoolWireEvent, i: int) -> PoolEvent:
    where = f"pool event {i} ({ev.event_type})"
    raw = ev.seq_hashes or ev.block_hashes or []
    field = "seq_hashes" if ev.seq_hashes else "block_hashes"
    try:
        hashes = normalize_wire_hashes(raw)
    except HashError as exc:
        raise RejectedEvent(f"{where}: field {field}[{exc.index}]: {exc.reason}") from None
    holder = None
    if not hashes and ev.object_key and ev.event_type != "cleared":
        # mooncake_master (0.3.14) names the object by its key alone: read the
        # block hash the engine's connector put in it. A key naming no block
        # keeps `seq_hashes` empty and the index counts it.
        named = parse_object_key(ev.object_key)
        if named is not None:
            hashes = [named.seq_hash]
            holder = named.holder
    parent = ev.parent_hash if ev.parent_hash is not None else ev.parent_block_hash
    if parent is not None and (type(parent) is not int or parent < 0):
        try:
            parent = normalize_hash(parent)
        except HashError as exc:
            raise RejectedEvent(f"{where}: field parent_hash: {exc.reason}") from None
    block_size = ev.block_size
    if block_size is not None and block_size <= 0:
        if block_size < 0:
            raise RejectedEvent(f"{where}: field block_size: {block_size} is negative")
        block_size = None
    if ev.base_block_idx is not None and ev.base_block_idx < 0:
        raise RejectedEvent(f"{where}: field base_block_idx: {ev.base_block_idx} is negative")
    tokens = ev.token_ids
    if tokens and block_size is not None and len(tokens) != len(hashes) * block_size:
        raise RejectedEvent(
            f"{where}: field token_ids: {len(tokens)} tokens for {len(hashes)} blocks "
            f"of {block_size}"
        )
    return PoolEvent(
        event_type=ev.event_type,
        seq_hashes=hashes,
        parent_hash=parent,
        base_block_idx=ev.base_block_idx,
        token_ids=tokens,
        medium=ev.medium,
        backend_id=_text(ev.backend_id),
        tenant_id=_text(ev.tenant_id),
        model_name=_text(ev.model_name),
        block_size=block_size,
        lora_name=_text(ev.lora_name),
        additional_salt=_text(ev.additional_salt),
        object_key=ev.object_key,
        event_id=ev.event_id,
        holder=holder,
    )


def decode_pool_payload(payload: bytes) -> PoolBatch:
    """Decode one pool ZMQ payload into a normalised `PoolBatch`.

    Raises `DecodeError` (not a batch of RFC #1527 events) or `RejectedEvent`
    (absurd values), naming the event index and field; never partial."""
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError(f"payload must be bytes, not {type(payload).__name__}")
    try:
        batch = _decode_batch(payload)
    except msgspec.ValidationError as exc:
        raise bad_record(exc, what="pool batch") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not valid msgpack: {exc}") from None
    except RecursionError:
        raise DecodeError("payload is nested too deeply") from None
    ts = batch.ts
    if ts > MS_THRESHOLD:
        ts = ts / 1000.0
    if batch.dp_rank is not None and batch.dp_rank < 0:
        raise RejectedEvent(f"pool batch, field dp_rank: {batch.dp_rank} is negative")
    events = [_convert(ev, i) for i, ev in enumerate(batch.events)]
    return PoolBatch(ts=ts, events=events, dp_rank=batch.dp_rank)
