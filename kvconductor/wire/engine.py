"""Engine KV-event payloads (contract section 2) -> `kvconductor.wire.events`.

One function, `decode_engine_payload`, accepts the third ZMQ frame of every
engine generation the contract names, in one code path:

* the batch envelope `[ts, [events], dp_rank]` (vLLM >= 0.10, SGLang,
  TensorRT-LLM), `[ts, [events]]` (vLLM 0.9) or, tolerated, a map envelope
  `{"ts", "events", "data_parallel_rank" | "attn_dp_rank" | "dp_rank"}`;
* events as tagged positional arrays (vLLM <= 0.23, SGLang before its map
  switch) or tagged maps with a `"type"` key (vLLM >= 0.24, SGLang after
  #37482, TensorRT-LLM's streaming publisher), even mixed in one batch;
* block hashes as ints of either sign or digest bytes.

Field tables per release are in `docs/wire-formats.md`.

Speed: the payload is decoded by one msgspec call straight into the array-
or map-form Structs below (whichever form the source sent last is tried
first). Only when that fails (a mixed batch, SGLang EAGLE bigram tokens, or a
bad payload) does the slow path decode the envelope with each event left raw
and decode event by event, which also names the failing event precisely.
Hashes are touched in Python only when some hash is negative or bytes.

Errors: `DecodeError` for anything that is not a batch of known events
(garbage, wrong types, unknown tags, missing fields); `RejectedEvent` for
values that decode but break the contract (token ids outside [0, 2**32),
negative ranks/sizes, extra_keys or token counts that do not fit the
blocks) or that no engine sends and the index would have to keep (a group
index above 2**16, a name longer than `MAX_NAME` characters). Both carry the
event index and field. Nothing partial is returned.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Final

import msgspec

from kvconductor.wire.errors import BadRecord, DecodeError, InvalidHeader, RejectedEvent
from kvconductor.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    EngineEvent,
)
from kvconductor.wire.hash_norm import HashError, normalize_hash, normalize_wire_hashes
from kvconductor.wire.hashing import extra_keys_fingerprint, pack_tokens, tokens_from_msgpack
from kvconductor.wire.records import MAX_NAME

__all__ = [
    "MAX_GROUP_IDX",
    "MAX_NAME",
    "SOURCES",
    "U32_MAX",
    "decode_engine_payload",
    "extra_keys_fingerprint",
]

SOURCES: Final = frozenset({"vllm", "sglang", "trtllm"})
U32_MAX: Final = (1 << 32) - 1
# The index keeps every group index it is told to skip, per instance, and
# every name (MAX_NAME: in a namespace, a pool store, the media cache), so
# absurd ones are rejected here: what one record can make it keep is bounded.
# Engines number their KV cache groups from 0, a handful at most, like ranks.
MAX_GROUP_IDX: Final = 1 << 16

# ---------------------------------------------------------------- wire types

WireHash = int | bytes
TokenId = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0)]
GroupIdx = Annotated[int, msgspec.Meta(ge=0, le=MAX_GROUP_IDX)]
Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME)]
# NB: msgspec 0.23 corrupts the constraints of an Annotated int placed in a
# union with a fixed-length tuple (observed: `ge=0` read back as `ge=2`, then
# a segfault). Constrained ints are therefore only ever used alone, in lists,
# or with None; EAGLE bigram tokens are decoded as plain `Any` instead.


_NO_TOKENS: Final = msgspec.Raw()


class SGLangMetadata(msgspec.Struct, gc=False):
    """SGLang `BlockStoredMetadata`: trailing map of a salted array event
    (index 7), or the `metadata` key of a map event in some builds."""

    cache_salt: str | None = None
    session_id: str | None = None


class ArrayBlockStored(msgspec.Struct, array_like=True, tag="BlockStored", gc=False):
    """Positional `BlockStored` of vLLM 0.9-0.23 and array-era SGLang.

    Index 0 is the tag; the fields follow in this order. Absent trailing
    fields take their defaults, extra trailing elements are ignored."""

    block_hashes: list[WireHash]  # 1
    parent_block_hash: WireHash | None = None  # 2
    # A msgpack array of token ids, left raw: see `_tokens`.
    token_ids: msgspec.Raw = _NO_TOKENS  # 3
    block_size: int | None = None  # 4
    lora_id: int | None = None  # 5
    medium: Name | None = None  # 6  (vLLM >= 0.10, SGLang)
    # 7: vLLM's lora_name, or SGLang's BlockStoredMetadata map (cache_salt)
    lora_name: Name | SGLangMetadata | None = None
    extra_keys: list[Any] | None = None  # 8  one entry per block
    group_idx: GroupIdx | None = None  # 9
    kv_cache_spec_kind: str | None = None  # 10
    kv_cache_spec_sliding_window: int | None = None  # 11


class ArrayBlockRemoved(msgspec.Struct, array_like=True, tag="BlockRemoved", gc=False):
    block_hashes: list[WireHash]  # 1
    medium: Name | None = None  # 2
    group_idx: GroupIdx | None = None  # 3


class ArrayAllBlocksCleared(msgspec.Struct, array_like=True, tag="AllBlocksCleared", gc=False):
    pass


class MapBlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    """`{"type": "BlockStored", ...}` of vLLM >= 0.24, SGLang, TensorRT-LLM.

    Unknown keys are ignored, so fields added later never break decoding."""

    block_hashes: list[WireHash]
    parent_block_hash: WireHash | None = None
    token_ids: msgspec.Raw = _NO_TOKENS  # see `_tokens`
    block_size: int | None = None
    lora_id: int | None = None
    medium: Name | None = None
    lora_name: Name | None = None
    extra_keys: list[Any] | None = None
    group_idx: GroupIdx | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None  # vLLM >= 0.26: "LOCAL" | "REMOTE"
    ownership: str | None = None  # vLLM: secondary offloading tier id
    session_id: str | None = None  # vLLM / SGLang: request that caused it
    cache_salt: str | None = None  # SGLang (map era)
    metadata: SGLangMetadata | None = None  # SGLang builds with nested metadata


class MapBlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[WireHash]
    medium: Name | None = None
    group_idx: GroupIdx | None = None
    locality: str | None = None
    ownership: str | None = None


class MapAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    medium: Name | None = None


# Slow-path variants: tokens decoded as `Any` so SGLang's EAGLE bigram pairs
# decode and a bad token is named. (Overriding a field's type is how msgspec
# Structs vary one field; the checker sees a Liskov break, which it is not
# here: these are only ever decoded into, never used as the fast types.)
class _LaxArrayBlockStored(ArrayBlockStored, tag="BlockStored"):
    token_ids: list[Any] | None = None  # type: ignore[assignment]


class _LaxMapBlockStored(MapBlockStored, tag="BlockStored"):
    token_ids: list[Any] | None = None  # type: ignore[assignment]


_LAX_STORED_TYPES = (_LaxArrayBlockStored, _LaxMapBlockStored)
_LaxStored = _LaxArrayBlockStored | _LaxMapBlockStored
_NIL: Final = b"\xc0"

ArrayEvent = ArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
MapEvent = MapBlockStored | MapBlockRemoved | MapAllBlocksCleared
_WireStored = ArrayBlockStored | MapBlockStored
_WireRemoved = ArrayBlockRemoved | MapBlockRemoved


class _ArrayFormBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[ArrayEvent]
    dp_rank: NonNegInt | None = None


class _MapFormBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[MapEvent]
    dp_rank: NonNegInt | None = None


class _RawEventsBatch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[msgspec.Raw]
    dp_rank: NonNegInt | None = None


class _MapEnvelope(msgspec.Struct, gc=False):
    ts: float
    events: list[msgspec.Raw]
    data_parallel_rank: NonNegInt | None = None
    attn_dp_rank: NonNegInt | None = None
    dp_rank: NonNegInt | None = None


_decode_array_form = msgspec.msgpack.Decoder(_ArrayFormBatch).decode
_decode_map_form = msgspec.msgpack.Decoder(_MapFormBatch).decode
_decode_raw_batch = msgspec.msgpack.Decoder(_RawEventsBatch).decode
_decode_map_envelope = msgspec.msgpack.Decoder(_MapEnvelope).decode
_decode_lax_array_event = msgspec.msgpack.Decoder(
    _LaxArrayBlockStored | ArrayBlockRemoved | ArrayAllBlocksCleared
).decode
_decode_lax_map_event = msgspec.msgpack.Decoder(
    _LaxMapBlockStored | MapBlockRemoved | MapAllBlocksCleared
).decode

# Which event form each source sent last: tried first next time.
_prefer_map: dict[str, bool] = {"vllm": True, "sglang": True, "trtllm": True}

# ---------------------------------------------------------------- errors

_CONSTRAINT = re.compile(r"^Expected `[^`]*`(?: of length)? (?:>=|<=|>|<) ")
_AT = re.compile(r" - at `\$(.*)`$")
_IN_BATCH = re.compile(r"^(?:\[1\]|\.events)\[(\d+)\](.*)$")
_POSITION = re.compile(r"^\[(\d+)\](.*)$")
_BATCH_FIELDS = {"[0]": "ts", ".ts": "ts", "[1]": "events", ".events": "events"}
# Positional field names of the array form, by tag (index 0 is the tag).
ARRAY_FIELDS: Final[dict[str, tuple[str, ...]]] = {
    "BlockStored": (
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
    ),
    "BlockRemoved": ("type", "block_hashes", "medium", "group_idx"),
    "AllBlocksCleared": ("type",),
}


def bad_record(
    exc: msgspec.ValidationError,
    *,
    event: int | None = None,
    array_tag: str | None = None,
    what: str = "",
) -> BadRecord:
    """Turn a msgspec validation error into `DecodeError` or `RejectedEvent`.

    The reason names the event index and field. Violated constraints (a
    token id >= 2**32, a negative rank, a name too long) are absurd values
    decoded fine: `RejectedEvent`. Anything else (wrong type, unknown tag,
    missing field) is undecodable: `DecodeError`.

    `event` is given when the error comes from decoding one event on its
    own; otherwise the path is read as relative to a `[ts, [events], rank]`
    batch. `array_tag` names an array-form event's positions."""
    msg = str(exc)
    m = _AT.search(msg)
    core = msg[: m.start()] if m else msg
    path = m.group(1) if m else ""
    if event is None:
        mb = _IN_BATCH.match(path)
        if mb:
            event, path = int(mb.group(1)), mb.group(2)
        elif path in _BATCH_FIELDS:
            path = "." + _BATCH_FIELDS[path]
        elif path in ("[2]", ".data_parallel_rank", ".attn_dp_rank", ".dp_rank"):
            path = ".dp_rank"
    if array_tag is not None:
        mp = _POSITION.match(path)
        names = ARRAY_FIELDS.get(array_tag, ("type",))
        if mp and int(mp.group(1)) < len(names):
            path = "." + names[int(mp.group(1))] + mp.group(2)
    field = path.lstrip(".")
    parts = [p for p in (what, f"event {event}" if event is not None else "") if p]
    if field:
        parts.append(f"field {field}")
    reason = f"{', '.join(parts)}: {core}" if parts else core
    if _CONSTRAINT.match(core):
        return RejectedEvent(reason)
    return DecodeError(reason)


# ---------------------------------------------------------------- extra keys


def _without_lora(keys: Any, lora_name: str | None) -> Any:
    """vLLM leads every block's keys of a LoRA request with the adapter name;
    the namespace already keeps adapters apart, and keeping the name here
    would make LoRA blocks unmatchable by a token query that names it."""
    if lora_name is not None and isinstance(keys, list | tuple) and keys and keys[0] == lora_name:
        return keys[1:]
    return keys


def _fingerprints(
    extra: list[Any] | None, n_blocks: int, where: str, lora_name: str | None = None
) -> list[int | None] | None:
    if extra is None:
        return None
    if len(extra) != n_blocks:
        raise RejectedEvent(
            f"{where}: field extra_keys has {len(extra)} entries for {n_blocks} blocks"
        )
    out: list[int | None] = []
    for k in extra:
        k = _without_lora(k, lora_name)
        empty = k is None or (isinstance(k, list | tuple) and not k)
        out.append(None if empty else extra_keys_fingerprint(k))
    for fp in out:
        if fp is not None:
            return out
    return None  # vLLM sends [None, None, ...] for plain text blocks


# ---------------------------------------------------------------- conversion


def _hashes(hashes: list[WireHash], i: int, tag: str) -> list[int]:
    try:
        return normalize_wire_hashes(hashes)
    except HashError as exc:
        raise RejectedEvent(
            f"event {i} ({tag}): field block_hashes[{exc.index}]: {exc.reason}"
        ) from None


def _lax_tokens(tokens: list[Any], where: str) -> list[int]:
    """Tokens of a slow-path event: ints, or SGLang EAGLE bigram pairs
    `[t_i, t_i+1]`, which stand for their first token (the token at i)."""
    out: list[int] = []
    append = out.append
    for j, t in enumerate(tokens):
        if type(t) is list and t:
            t = t[0]
        if type(t) is not int:
            raise DecodeError(
                f"{where}: field token_ids[{j}]: expected an int (or a bigram pair of ints), "
                f"got {type(t).__name__}"
            )
        if not 0 <= t <= U32_MAX:
            raise RejectedEvent(
                f"{where}: field token_ids[{j}]: token id {t} is outside [0, 2**32)"
            )
        append(t)
    return out


class _SlowPath(Exception):
    """Tokens the fast path cannot take: decode the payload the slow way,
    which takes bigram pairs or says exactly what is wrong."""


def _tokens(ev: _WireStored | _LaxStored, i: int) -> bytes | None:
    """The event's tokens, packed (`kvconductor.wire.hashing.pack_tokens`); None
    when it has none. The fast path's arrays arrive raw and are packed
    without a Python int per token (which cost more than the rest of the
    event's decoding)."""
    raw = ev.token_ids
    if raw is None or not len(raw):
        return None
    if isinstance(raw, list):  # the slow path's
        return pack_tokens(_lax_tokens(raw, f"event {i} (BlockStored)"))
    packed = tokens_from_msgpack(raw)
    if packed is None:
        if bytes(raw) == _NIL:
            return None
        raise _SlowPath
    return packed or None


def _stored(ev: _WireStored | _LaxStored, i: int) -> BlockStored:
    """One BlockStored, normalised. Hot path: keep the common case cheap."""
    hashes = _hashes(ev.block_hashes, i, "BlockStored")
    parent = ev.parent_block_hash
    if parent is not None and (parent.__class__ is not int or parent < 0):
        try:
            parent = normalize_hash(parent)
        except HashError as exc:
            raise RejectedEvent(
                f"event {i} (BlockStored): field parent_block_hash: {exc.reason}"
            ) from None
    tokens = _tokens(ev, i)
    block_size = ev.block_size
    if block_size is not None and block_size <= 0:
        if block_size < 0:
            raise RejectedEvent(f"event {i} (BlockStored): field block_size: {block_size} < 0")
        block_size = None  # vLLM's hash-only offload events say 0: unknown
    lora_name = ev.lora_name
    salt: str | None = None
    if lora_name is not None:
        if isinstance(lora_name, SGLangMetadata):  # SGLang array form, index 7
            salt = lora_name.cache_salt
            lora_name = None
        elif not lora_name:
            lora_name = None
    if isinstance(ev, MapBlockStored) and (ev.cache_salt is not None or ev.metadata is not None):
        salt = ev.cache_salt
        if salt is None and ev.metadata is not None:
            salt = ev.metadata.cache_salt
    extra = None
    if ev.extra_keys is not None:
        extra = _fingerprints(ev.extra_keys, len(hashes), f"event {i} (BlockStored)", lora_name)
    if salt and parent is None and hashes:
        # SGLang sends its per-request salt beside the event; vLLM puts it in
        # the first block's extra keys. Same place, same fingerprint.
        if extra is None:
            extra = [None] * len(hashes)
        if extra[0] is None:
            extra[0] = extra_keys_fingerprint([salt])
    # Positional, in kvconductor.wire.events.BlockStored's field order (tested).
    return BlockStored(
        hashes,
        parent,
        tokens,
        block_size,
        ev.lora_id,
        ev.medium,
        lora_name,
        extra,
        ev.group_idx,
        ev.kv_cache_spec_kind,
        ev.kv_cache_spec_sliding_window,
    )


def _removed(ev: _WireRemoved, i: int) -> BlockRemoved:
    return BlockRemoved(_hashes(ev.block_hashes, i, "BlockRemoved"), ev.medium, ev.group_idx)


_CLEARED_NO_MEDIUM = AllBlocksCleared()
_STORED_TYPES = (ArrayBlockStored, MapBlockStored)
_REMOVED_TYPES = (ArrayBlockRemoved, MapBlockRemoved)


def _convert(events: list[Any]) -> list[EngineEvent]:
    out: list[EngineEvent] = []
    append = out.append
    for i, ev in enumerate(events):
        if isinstance(ev, _STORED_TYPES):
            append(_stored(ev, i))
        elif isinstance(ev, _REMOVED_TYPES):
            append(_removed(ev, i))
        elif isinstance(ev, MapAllBlocksCleared) and ev.medium is not None:
            append(AllBlocksCleared(medium=ev.medium))
        else:
            append(_CLEARED_NO_MEDIUM)
    return out


# ---------------------------------------------------------------- decoding

_ARRAY_HEADS: Final = frozenset(range(0x90, 0xA0)) | {0xDC, 0xDD}
_MAP_HEADS: Final = frozenset(range(0x80, 0x90)) | {0xDE, 0xDF}


def _check_source(source: str) -> str:
    src = source.lower() if isinstance(source, str) else None
    if src not in SOURCES:
        raise InvalidHeader(f"header kv-source must be one of {sorted(SOURCES)}: {source!r}")
    return src


def decode_engine_payload(payload: bytes, source: str = "vllm") -> EngineBatch:
    """Decode one engine ZMQ payload into a normalised `EngineBatch`.

    `source` is `vllm`, `sglang` or `trtllm` (the `kv-source` header; any
    other value raises `InvalidHeader`). Every accepted source is decoded by
    the same code: the wire forms overlap and each is recognised by shape.
    Raises `DecodeError` or `RejectedEvent`, never returns a partial batch."""
    src = _check_source(source)
    if not isinstance(payload, bytes | bytearray | memoryview):
        raise DecodeError(f"payload must be bytes, not {type(payload).__name__}")
    prefer_map = _prefer_map[src]
    first, second = (
        (_decode_map_form, _decode_array_form)
        if prefer_map
        else (_decode_array_form, _decode_map_form)
    )
    batch: _ArrayFormBatch | _MapFormBatch
    try:
        try:
            batch = first(payload)
        except msgspec.ValidationError:
            batch = second(payload)
            _prefer_map[src] = not prefer_map
    except msgspec.ValidationError:
        return _decode_slow(payload)
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not valid msgpack: {exc}") from None
    except RecursionError:
        raise DecodeError("payload is nested too deeply") from None
    try:
        events = _convert(batch.events)
    except _SlowPath:
        return _decode_slow(payload)
    return EngineBatch(ts=batch.ts, events=events, dp_rank=batch.dp_rank)


def _array_tag(view: memoryview) -> str | None:
    """The tag of an array-form event that failed to decode (error path)."""
    try:
        tag = msgspec.msgpack.decode(view)[0]
    except Exception:  # the reason comes from the real decoder anyway
        return None
    return tag if isinstance(tag, str) else None


def _decode_slow(payload: bytes) -> EngineBatch:
    """Envelope first, then event by event: mixed forms, bigram tokens, and
    exact error reasons."""
    head = payload[0] if payload else None
    rank: int | None
    try:
        if head in _MAP_HEADS:
            env = _decode_map_envelope(payload)
            ts, raws = env.ts, env.events
            rank = env.data_parallel_rank
            if rank is None:
                rank = env.attn_dp_rank if env.attn_dp_rank is not None else env.dp_rank
        else:
            batch = _decode_raw_batch(payload)
            ts, raws, rank = batch.ts, batch.events, batch.dp_rank
    except msgspec.ValidationError as exc:
        raise bad_record(exc, what="batch envelope [ts, [events], dp_rank]") from None
    except msgspec.DecodeError as exc:
        raise DecodeError(f"payload is not valid msgpack: {exc}") from None
    except RecursionError:
        raise DecodeError("payload is nested too deeply") from None

    events: list[Any] = []
    for i, raw in enumerate(raws):
        view = memoryview(raw)
        kind = view[0] if len(view) else None
        if kind in _MAP_HEADS:
            decode = _decode_lax_map_event
        elif kind in _ARRAY_HEADS:
            decode = _decode_lax_array_event
        else:
            raise DecodeError(
                f"event {i}: expected a tagged array or map, got msgpack byte 0x{kind:02x}"
            )
        try:
            events.append(decode(view))
        except msgspec.ValidationError as exc:
            tag = _array_tag(view) if decode is _decode_lax_array_event else None
            raise bad_record(exc, event=i, array_tag=tag) from None
        except msgspec.DecodeError as exc:  # pragma: no cover - Raw is already well formed
            raise DecodeError(f"event {i}: {exc}") from None
        except RecursionError:
            raise DecodeError(f"event {i}: nested too deeply") from None
    return EngineBatch(ts=ts, events=_convert(events), dp_rank=rank)
