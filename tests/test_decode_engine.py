"""Engine payload decoding: real vLLM fixtures, SGLang, TensorRT-LLM, errors."""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconductor.wire import engine as engine_wire
from kvconductor.wire import hash_norm
from kvconductor.wire import pool as pool_wire
from kvconductor.wire.engine import decode_engine_payload, extra_keys_fingerprint
from kvconductor.wire.errors import DecodeError, InvalidHeader, RejectedEvent
from kvconductor.wire.events import AllBlocksCleared, BlockRemoved, BlockStored, EngineBatch
from kvconductor.wire.hash_norm import (
    HashError,
    hash_from_hex,
    normalize_hash,
    normalize_hashes,
    normalize_wire_hashes,
)
from kvconductor.wire.hashing import pack_tokens
from tests.harness import FIXTURES

VERSIONS = ["0.9.0", "0.10.2", "0.22.0", "0.28.0", "0.33.0", "0.33.0-bytes-hashes"]
MASK = (1 << 64) - 1
enc = msgspec.msgpack.encode


def fp(keys: Any) -> int:
    return xxhash.xxh3_64_intdigest(msgspec.msgpack.encode(keys))


# --------------------------------------------------------------- fixtures

# Independent statement of the array positions (docs/wire-formats.md).
STORED_POS = [
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
]
REMOVED_POS = ["block_hashes", "medium", "group_idx"]


def _json_hash(h: Any) -> int:
    if isinstance(h, dict):
        return int.from_bytes(bytes.fromhex(h["bytes_hex"]), "big") & MASK
    assert isinstance(h, int)
    return h & MASK


def packed(tokens: list[int] | None) -> bytes | None:
    """Tokens as the decoder gives them: packed, None when there are none."""
    return pack_tokens(tokens) if tokens else None


def _expected_event(ev: Any) -> Any:
    if isinstance(ev, list):
        tag, rest = ev[0], ev[1:]
        names = {"BlockStored": STORED_POS, "BlockRemoved": REMOVED_POS}.get(tag, [])
        fields = dict(zip(names, rest, strict=False))
    else:
        tag = ev["type"]
        fields = {k: v for k, v in ev.items() if k != "type"}
    if tag == "BlockStored":
        return BlockStored(
            block_hashes=[_json_hash(h) for h in fields["block_hashes"]],
            parent_block_hash=(
                None
                if fields.get("parent_block_hash") is None
                else _json_hash(fields["parent_block_hash"])
            ),
            token_ids=packed(fields.get("token_ids")),
            block_size=fields.get("block_size") or None,
            lora_id=fields.get("lora_id"),
            medium=fields.get("medium"),
            lora_name=fields.get("lora_name"),
            extra_keys=None,
            group_idx=fields.get("group_idx"),
            spec_kind=fields.get("kv_cache_spec_kind"),
        )
    if tag == "BlockRemoved":
        return BlockRemoved(
            block_hashes=[_json_hash(h) for h in fields["block_hashes"]],
            medium=fields.get("medium"),
            group_idx=fields.get("group_idx"),
        )
    assert tag == "AllBlocksCleared"
    return AllBlocksCleared(medium=fields.get("medium"))


def _expected_batch(decoded: list[Any]) -> EngineBatch:
    return EngineBatch(
        ts=decoded[0],
        events=[_expected_event(e) for e in decoded[1]],
        dp_rank=decoded[2] if len(decoded) > 2 else None,
    )


def _fixture_cases() -> list[tuple[str, str]]:
    return [(v, f.name) for v in VERSIONS for f in sorted((FIXTURES / v).glob("*.msgpack"))]


def test_every_fixture_folder_is_present() -> None:
    for v in VERSIONS:
        names = {f.name for f in (FIXTURES / v).glob("*.msgpack")}
        assert names == {"stored.msgpack", "removed.msgpack", "cleared.msgpack", "mixed.msgpack"}


@pytest.mark.parametrize(("version", "name"), _fixture_cases())
def test_real_vllm_payloads_match_decoded_json(version: str, name: str) -> None:
    folder = FIXTURES / version
    decoded = json.loads((folder / "decoded.json").read_text())["payloads"][name]
    got = decode_engine_payload((folder / name).read_bytes(), "vllm")
    assert got == _expected_batch(decoded)
    for ev in got.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(0 <= h <= MASK and type(h) is int for h in ev.block_hashes)


@pytest.mark.parametrize("name", ["stored.msgpack", "removed.msgpack", "mixed.msgpack"])
def test_bytes_hashes_name_blocks_like_int_hashes(name: str) -> None:
    """vLLM's int hash is the low 64 bits of its sha256 digest: same names."""
    as_int = decode_engine_payload((FIXTURES / "0.33.0" / name).read_bytes())
    as_bytes = decode_engine_payload((FIXTURES / "0.33.0-bytes-hashes" / name).read_bytes())
    assert as_int == as_bytes


def test_fixture_field_positions_of_0_22() -> None:
    ev = json.loads((FIXTURES / "0.22.0" / "decoded.json").read_text())["payloads"][
        "stored.msgpack"
    ][1][0]
    assert len(ev) == 12  # tag + 11 fields, up to kv_cache_spec_sliding_window
    got = decode_engine_payload((FIXTURES / "0.22.0" / "stored.msgpack").read_bytes())
    stored = got.events[0]
    assert isinstance(stored, BlockStored)
    assert (stored.medium, stored.group_idx, stored.spec_kind) == ("GPU", 0, "full_attention")


def test_live_and_replayed_zmq_frames_of_0_33() -> None:
    frames = json.loads((FIXTURES / "zmq_frames_0.33.0.json").read_text())
    live = [decode_engine_payload(bytes.fromhex(f[2])) for f in frames["live"]]
    assert [len(b.events) for b in live] == [1, 1, 1, 3]
    assert all(b.dp_rank == 0 and b.ts == 1700000000.25 for b in live)
    assert isinstance(live[3].events[0], BlockStored)
    assert isinstance(live[3].events[1], BlockRemoved)
    assert isinstance(live[3].events[2], AllBlocksCleared)
    replayed = [f for f in frames["replay_dealer"] if f[3]]
    for f in replayed:
        seq = int(f[2], 16)
        assert decode_engine_payload(bytes.fromhex(f[3])) == live[seq]


# --------------------------------------------------------------- vLLM shapes


def test_vllm_0_9_two_element_batch_has_no_rank() -> None:
    got = decode_engine_payload(enc([2.5, [["BlockRemoved", [7]]]]))
    assert got == EngineBatch(ts=2.5, events=[BlockRemoved([7])], dp_rank=None)


def test_map_form_newest_fields_and_unknown_keys_are_tolerated() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": 9,
        "token_ids": [1, 2, 3, 4],
        "block_size": 2,
        "lora_id": 3,
        "medium": "CPU",
        "lora_name": "sql",
        "extra_keys": [["sql"], ["sql", ["img-1", 0]]],
        "group_idx": 1,
        "kv_cache_spec_kind": "sliding_window",
        "kv_cache_spec_sliding_window": 4096,
        "locality": "LOCAL",
        "ownership": "fs-tier-0",
        "session_id": "s-1",
        "some_future_field": {"nested": [1, 2, 3]},
    }
    removed = {
        "type": "BlockRemoved",
        "block_hashes": [2],
        "medium": "CPU",
        "locality": "REMOTE",
        "ownership": "x",
        "remaining_copy_counts": [0],
        "future": True,
    }
    cleared = {"type": "AllBlocksCleared", "medium": "CPU", "future": 1}
    got = decode_engine_payload(enc([1.0, [ev, removed, cleared], 3]))
    assert got.dp_rank == 3
    stored = got.events[0]
    assert stored == BlockStored(
        block_hashes=[1, 2],
        parent_block_hash=9,
        token_ids=packed([1, 2, 3, 4]),
        block_size=2,
        lora_id=3,
        medium="CPU",
        lora_name="sql",
        # The adapter name leading each block's keys is the namespace's already.
        extra_keys=[None, fp([["img-1", 0]])],
        group_idx=1,
        spec_kind="sliding_window",
        sliding_window=4096,
    )
    assert got.events[1] == BlockRemoved([2], "CPU", None)
    assert got.events[2] == AllBlocksCleared(medium="CPU")


def test_array_form_extra_trailing_elements_are_tolerated() -> None:
    stored = [
        "BlockStored",
        [5],
        None,
        [1, 2],
        2,
        None,
        "GPU",
        None,
        None,
        0,
        "full_attention",
        None,
        "LOCAL",
        "owner",
        "session",
        {"future": 1},
    ]
    removed = ["BlockRemoved", [5], "GPU", 0, "LOCAL", "owner", [1]]
    cleared = ["AllBlocksCleared", "GPU", 123]
    got = decode_engine_payload(enc([1.0, [stored, removed, cleared], 0, "future", 7]))
    assert got.events == [
        BlockStored([5], None, packed([1, 2]), 2, None, "GPU", None, None, 0, "full_attention"),
        BlockRemoved([5], "GPU", 0),
        AllBlocksCleared(),
    ]


def test_array_form_short_events_take_defaults() -> None:
    got = decode_engine_payload(enc([1.0, [["BlockStored", [5]], ["BlockRemoved", [6]]], 0]))
    assert got.events == [BlockStored([5]), BlockRemoved([6])]


def test_mixed_array_and_map_events_in_one_batch() -> None:
    batch = [1.0, [["BlockRemoved", [1], "GPU"], {"type": "BlockRemoved", "block_hashes": [2]}], 0]
    got = decode_engine_payload(enc(batch))
    assert got.events == [BlockRemoved([1], "GPU"), BlockRemoved([2])]


def test_map_envelope_is_tolerated() -> None:
    for key in ("data_parallel_rank", "attn_dp_rank", "dp_rank"):
        payload = enc({"ts": 1.0, "events": [{"type": "AllBlocksCleared"}], key: 2})
        assert decode_engine_payload(payload) == EngineBatch(1.0, [AllBlocksCleared()], 2)


def test_form_preference_switches_back_and_forth() -> None:
    arr = enc([1.0, [["BlockRemoved", [1]]], 0])
    mp = enc([1.0, [{"type": "BlockRemoved", "block_hashes": [1]}], 0])
    for payload in (arr, mp, arr, arr, mp, mp, arr):
        assert decode_engine_payload(payload).events == [BlockRemoved([1])]


def test_heartbeat_batch_with_no_events() -> None:
    assert decode_engine_payload(enc([1.0, [], 0]), "trtllm") == EngineBatch(1.0, [], 0)


def test_hash_only_offload_event_has_unknown_block_size() -> None:
    """vLLM's offloading connector without self_describing_kv_events."""
    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": [],
        "block_size": 0,
        "lora_id": None,
        "medium": "CPU",
        "lora_name": None,
    }
    stored = decode_engine_payload(enc([1.0, [ev], 0])).events[0]
    assert stored == BlockStored([1, 2], None, None, None, None, "CPU", None)


def test_negative_and_bytes_hashes_are_normalised() -> None:
    digest = bytes(range(32))
    ev = ["BlockStored", [-1, digest, 5, -(1 << 63)], digest, [], 4, None, "GPU"]
    stored = decode_engine_payload(enc([1.0, [ev], 0])).events[0]
    assert isinstance(stored, BlockStored)
    low = int.from_bytes(digest, "big") & MASK
    assert stored.block_hashes == [MASK, low, 5, 1 << 63]
    assert stored.parent_block_hash == low


def test_u64_hashes_pass_through_unchanged() -> None:
    got = decode_engine_payload(enc([1.0, [["BlockRemoved", [0, MASK, 1 << 63]]], 0]))
    assert got.events[0] == BlockRemoved([0, MASK, 1 << 63])


def test_empty_lora_name_means_base_model() -> None:
    ev = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": [1],
        "block_size": 1,
        "lora_name": "",
    }
    stored = decode_engine_payload(enc([1.0, [ev]])).events[0]
    assert isinstance(stored, BlockStored) and stored.lora_name is None


# --------------------------------------------------------------- extra keys


def _stored_with_extra(extra: Any, n: int = 2) -> BlockStored:
    ev = {
        "type": "BlockStored",
        "block_hashes": list(range(1, n + 1)),
        "token_ids": list(range(n)),
        "block_size": 1,
        "extra_keys": extra,
    }
    got = decode_engine_payload(enc([1.0, [ev], 0])).events[0]
    assert isinstance(got, BlockStored)
    return got


def test_extra_keys_per_block_fingerprints() -> None:
    got = _stored_with_extra([["lora-a", ["mm-1", 0], "salt"], None])
    assert got.extra_keys == [fp(["lora-a", ["mm-1", 0], "salt"]), None]
    assert got.extra_keys[0] == extra_keys_fingerprint(("lora-a", ("mm-1", 0), "salt"))


def test_extra_keys_all_none_collapse_to_none() -> None:
    assert _stored_with_extra([None, None]).extra_keys is None
    assert _stored_with_extra([[], None]).extra_keys is None


def test_extra_keys_keep_different_content_apart() -> None:
    variants = [
        [["mm-A", 0]],
        [["mm-B", 0]],
        [["mm-A", 4]],
        ["salt-1"],
        ["salt-2"],
        ["lora-x"],
        ["lora-x", "salt-1"],
        [b"\x00" * 32],
        [b"\x01" * 32],
    ]
    fps = {_stored_with_extra([v], 1).extra_keys[0] for v in variants}  # type: ignore[index]
    assert len(fps) == len(variants)


def test_extra_keys_length_must_match_blocks() -> None:
    with pytest.raises(RejectedEvent, match="extra_keys"):
        _stored_with_extra([["a"]], 2)


def test_array_form_extra_keys_at_position_8() -> None:
    ev = [
        "BlockStored",
        [1],
        None,
        [7],
        1,
        None,
        "GPU",
        "lora-a",
        [["lora-a"]],
        0,
        "full_attention",
        None,
    ]
    stored = decode_engine_payload(enc([1.0, [ev], 0])).events[0]
    assert isinstance(stored, BlockStored)
    # Only the adapter name: the LoRA namespace keeps it apart, no fingerprint.
    assert stored.lora_name == "lora-a" and stored.extra_keys is None


# --------------------------------------------------------------- SGLang


class SgEventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Any]
    attn_dp_rank: int | None = None


class SgKVCacheEvent(msgspec.Struct, array_like=True, tag=True):
    pass


class SgBlockStored(SgKVCacheEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[Any]
    block_size: int
    lora_id: int | None
    medium: str | None = None


class SgBlockStoredMetadata(msgspec.Struct, omit_defaults=True):
    cache_salt: str


class SgBlockStoredWithMetadata(SgBlockStored, tag="BlockStored", kw_only=True):
    metadata: SgBlockStoredMetadata


class SgBlockRemoved(SgKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None = None


class SgAllBlocksCleared(SgKVCacheEvent, tag="AllBlocksCleared"):
    pass


class SgMapEvent(msgspec.Struct, omit_defaults=True, tag=True):
    pass


class SgMapBlockStored(SgMapEvent, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None = None
    cache_salt: str | None = None
    session_id: str | None = None


def _sglang_hash(i: int) -> int:
    """SGLang's hash_str_to_int64: first 64 bits of a sha256, signed."""
    v = xxhash.xxh3_64_intdigest(str(i).encode())
    return v - (1 << 64) if v >= 1 << 63 else v


def test_sglang_array_form_signed_hashes_and_rank() -> None:
    hashes = [_sglang_hash(i) for i in range(4)]
    assert any(h < 0 for h in hashes)
    batch = SgEventBatch(
        ts=3.5,
        events=[
            SgBlockStored(hashes[:2], None, [1, 2, 3, 4], 2, None, "GPU"),
            SgBlockStored(hashes[2:], hashes[1], [5, 6, 7, 8], 2, None, "CPU_PINNED"),
            SgBlockRemoved(hashes[2:], "DISK"),
            SgBlockRemoved(hashes[:1], "EXTERNAL"),
            SgAllBlocksCleared(),
        ],
        attn_dp_rank=5,
    )
    got = decode_engine_payload(enc(batch), "sglang")
    u = [h & MASK for h in hashes]
    assert got == EngineBatch(
        ts=3.5,
        events=[
            BlockStored(u[:2], None, packed([1, 2, 3, 4]), 2, None, "GPU"),
            BlockStored(u[2:], u[1], packed([5, 6, 7, 8]), 2, None, "CPU_PINNED"),
            BlockRemoved(u[2:], "DISK"),
            BlockRemoved(u[:1], "EXTERNAL"),
            AllBlocksCleared(),
        ],
        dp_rank=5,
    )


def test_sglang_pre_medium_events_without_rank() -> None:
    class OldBatch(msgspec.Struct, array_like=True):
        ts: float
        events: list[Any]

    class OldStored(msgspec.Struct, array_like=True, tag="BlockStored"):
        block_hashes: list[int]
        parent_block_hash: int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None

    got = decode_engine_payload(enc(OldBatch(1.0, [OldStored([-5], None, [1], 1, None)])), "sglang")
    assert got == EngineBatch(1.0, [BlockStored([(-5) & MASK], None, packed([1]), 1, None)], None)


def test_sglang_salted_array_event_puts_salt_in_first_block_key() -> None:
    ev = SgBlockStoredWithMetadata(
        block_hashes=[-1, 2],
        parent_block_hash=None,
        token_ids=[1, 2],
        block_size=1,
        lora_id=None,
        medium="GPU",
        metadata=SgBlockStoredMetadata(cache_salt="tenant-a"),
    )
    cont = SgBlockStoredWithMetadata(
        block_hashes=[3],
        parent_block_hash=2,
        token_ids=[3],
        block_size=1,
        lora_id=None,
        medium="GPU",
        metadata=SgBlockStoredMetadata(cache_salt="tenant-a"),
    )
    got = decode_engine_payload(enc(SgEventBatch(1.0, [ev, cont], 0)), "sglang")
    first, second = got.events
    assert isinstance(first, BlockStored) and isinstance(second, BlockStored)
    assert first.lora_name is None
    # same fingerprint vLLM's extra_keys ("tenant-a",) of block 0 gives
    assert first.extra_keys == [fp(["tenant-a"]), None]
    assert second.extra_keys is None  # a child inherits the salt via its parent


def test_sglang_map_form_with_salt_and_session() -> None:
    ev = SgMapBlockStored(
        [_sglang_hash(1)], None, [1, 2], 2, None, "CPU_PINNED", cache_salt="s", session_id="sess"
    )
    got = decode_engine_payload(enc(SgEventBatch(1.0, [ev], 1)), "sglang")
    assert got.events == [
        BlockStored(
            [_sglang_hash(1) & MASK],
            None,
            packed([1, 2]),
            2,
            None,
            "CPU_PINNED",
            extra_keys=[fp(["s"])],
        )
    ]
    nested = {
        "type": "BlockStored",
        "block_hashes": [1],
        "token_ids": [1],
        "block_size": 1,
        "metadata": {"cache_salt": "s", "session_id": "x"},
    }
    got2 = decode_engine_payload(enc([1.0, [nested], 0]), "sglang")
    assert got2.events[0].extra_keys == [fp(["s"])]  # type: ignore[union-attr]


def test_sglang_eagle_bigram_tokens_stand_for_their_first_token() -> None:
    tokens = [10, 11, 12, 13, 14]
    bigrams = [[tokens[i], tokens[i + 1]] for i in range(4)]
    ev = SgBlockStored([1, 2], None, bigrams, 2, None, "GPU")
    got = decode_engine_payload(enc(SgEventBatch(1.0, [ev], 0)), "sglang")
    assert got.events == [BlockStored([1, 2], None, packed([10, 11, 12, 13]), 2, None, "GPU")]
    bad = SgBlockStored([1], None, [[2**32, 1]], 1, None, "GPU")
    with pytest.raises(RejectedEvent, match=r"token_ids\[0\]"):
        decode_engine_payload(enc(SgEventBatch(1.0, [bad], 0)), "sglang")


# --------------------------------------------------------------- TensorRT-LLM


def _trtllm_wire_hash(h: int) -> int:
    """TensorRT-LLM's `_to_wire_hash`: u64 values become signed int64."""
    return h - (1 << 64) if h >= 1 << 63 else h


def test_trtllm_streaming_publisher_payload() -> None:
    raw = [0xFEDCBA9876543210, 0x0123456789ABCDEF]
    events = [
        {"type": "AllBlocksCleared"},  # resync fence after a loss
        {
            "type": "BlockStored",
            "block_hashes": [_trtllm_wire_hash(h) for h in raw],
            "parent_block_hash": None,
            "token_ids": list(range(64)),
            "block_size": 32,
            "lora_id": None,
            "medium": "GPU",
            "lora_name": None,
            "group_idx": 0,
            "kv_cache_spec_kind": "full_attention",
        },
        {"type": "BlockRemoved", "block_hashes": [_trtllm_wire_hash(raw[1])], "medium": "GPU"},
    ]
    got = decode_engine_payload(enc([1.25, events, 2]), "trtllm")
    assert got == EngineBatch(
        1.25,
        [
            AllBlocksCleared(),
            BlockStored(
                raw, None, packed(list(range(64))), 32, None, "GPU", None, None, 0, "full_attention"
            ),
            BlockRemoved([raw[1]], "GPU"),
        ],
        2,
    )


# --------------------------------------------------------------- sources


@pytest.mark.parametrize("source", ["vllm", "sglang", "trtllm", "VLLM", "SGLang"])
def test_every_source_decodes_every_form(source: str) -> None:
    payload = (FIXTURES / "0.22.0" / "mixed.msgpack").read_bytes()
    assert decode_engine_payload(payload, source) == decode_engine_payload(payload)


@pytest.mark.parametrize("source", ["", "lmcache", "vllm ", None, 3])
def test_unknown_source_is_an_invalid_header(source: Any) -> None:
    with pytest.raises(InvalidHeader):
        decode_engine_payload(enc([1.0, []]), source)


# --------------------------------------------------------------- errors

BAD_PAYLOADS: list[tuple[str, bytes, type[Exception], str]] = [
    ("garbage", b"\xc1\xff\x00", DecodeError, "msgpack"),
    ("empty", b"", DecodeError, "msgpack"),
    ("truncated", enc([1.0, [["BlockRemoved", [1, 2, 3]]], 0])[:-3], DecodeError, ""),
    ("scalar", enc(5), DecodeError, ""),
    ("map without ts", enc({"events": []}), DecodeError, "ts"),
    ("ts not a number", enc(["x", [], 0]), DecodeError, "ts"),
    ("events not a list", enc([1.0, {"a": 1}, 0]), DecodeError, "events"),
    ("rank not an int", enc([1.0, [], "zero"]), DecodeError, "dp_rank"),
    ("negative rank", enc([1.0, [], -1]), RejectedEvent, "dp_rank"),
    ("event scalar", enc([1.0, [7], 0]), DecodeError, "event 0"),
    ("unknown array tag", enc([1.0, [["BlockMoved", [1]]], 0]), DecodeError, "event 0"),
    ("unknown map tag", enc([1.0, [{"type": "BlockMoved"}], 0]), DecodeError, "type"),
    ("map tag missing", enc([1.0, [{"block_hashes": [1]}], 0]), DecodeError, "event 0"),
    ("tag not a string", enc([1.0, [[5, [1]]], 0]), DecodeError, "event 0"),
    ("hashes missing", enc([1.0, [{"type": "BlockRemoved"}], 0]), DecodeError, "block_hashes"),
    ("hash str", enc([1.0, [["BlockRemoved", ["ab"]]], 0]), DecodeError, "block_hashes[0]"),
    ("hash float", enc([1.0, [["BlockRemoved", [1, 2.5]]], 0]), DecodeError, "block_hashes[1]"),
    ("hash bool", enc([1.0, [["BlockRemoved", [True]]], 0]), DecodeError, "block_hashes[0]"),
    ("hash null", enc([1.0, [["BlockRemoved", [None]]], 0]), DecodeError, "block_hashes[0]"),
    ("hash empty bytes", enc([1.0, [["BlockRemoved", [b""]]], 0]), RejectedEvent, "block_hashes"),
    (
        "parent str",
        enc([1.0, [["BlockStored", [1], "p", [1], 1]], 0]),
        DecodeError,
        "parent_block_hash",
    ),
    (
        "token negative",
        enc([1.0, [["BlockStored", [1], None, [-1], 1]], 0]),
        RejectedEvent,
        "token_ids[0]",
    ),
    (
        "token too big",
        enc(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1],
                        "token_ids": [0, 2**32],
                        "block_size": 2,
                    }
                ],
                0,
            ]
        ),
        RejectedEvent,
        "token_ids[1]",
    ),
    (
        "token str",
        enc([1.0, [["BlockStored", [1], None, ["a"], 1]], 0]),
        DecodeError,
        "token_ids[0]",
    ),
    (
        "block size negative",
        enc([1.0, [["BlockStored", [1], None, [], -4]], 0]),
        RejectedEvent,
        "block_size",
    ),
    (
        "group negative",
        enc([1.0, [["BlockRemoved", [1], "GPU", -1]], 0]),
        RejectedEvent,
        "group_idx",
    ),
    ("medium int", enc([1.0, [["BlockRemoved", [1], 5]], 0]), DecodeError, "medium"),
    (
        "second event bad",
        enc([1.0, [["BlockRemoved", [1]], ["BlockRemoved", ["x"]]], 0]),
        DecodeError,
        "event 1",
    ),
    (
        "extra keys count",
        enc(
            [
                1.0,
                [
                    {
                        "type": "BlockStored",
                        "block_hashes": [1, 2],
                        "token_ids": [],
                        "block_size": 1,
                        "extra_keys": [None],
                    }
                ],
                0,
            ]
        ),
        RejectedEvent,
        "extra_keys",
    ),
    (
        "extra keys not list",
        enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "extra_keys": "x"}], 0]),
        DecodeError,
        "extra_keys",
    ),
]


@pytest.mark.parametrize(
    ("payload", "error", "words"),
    [pytest.param(p, e, w, id=name) for name, p, e, w in BAD_PAYLOADS],
)
@pytest.mark.parametrize("source", ["vllm", "sglang"])
def test_bad_payloads_raise_with_a_reason(
    payload: bytes, error: type[Exception], words: str, source: str
) -> None:
    with pytest.raises(error) as info:
        decode_engine_payload(payload, source)
    assert type(info.value) is error
    assert words in str(info.value)


def test_non_bytes_payload_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode_engine_payload("[1.0, []]")  # type: ignore[arg-type]


# --------------------------------------------------------------- hashes


def test_struct_field_orders_the_decoder_relies_on() -> None:
    # BlockStored is built positionally on the hot path.
    assert BlockStored.__struct_fields__ == (
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "spec_kind",
        "sliding_window",
    )
    assert BlockRemoved.__struct_fields__ == ("block_hashes", "medium", "group_idx")
    # The array form's positions, and the lax (bigram) variant keeps them.
    arr = engine_wire.ArrayBlockStored.__struct_fields__
    assert arr == tuple(STORED_POS)
    assert engine_wire.ARRAY_FIELDS["BlockStored"][1:] == arr
    assert vars(engine_wire)["_LaxArrayBlockStored"].__struct_fields__ == arr
    assert engine_wire.ArrayBlockRemoved.__struct_fields__ == tuple(REMOVED_POS)


def test_one_normalisation_shared_by_engine_and_pool() -> None:
    for module in (engine_wire, pool_wire):
        assert vars(module)["normalize_wire_hashes"] is hash_norm.normalize_wire_hashes
        assert vars(module)["normalize_hash"] is hash_norm.normalize_hash


def test_normalize_hash_rules() -> None:
    assert normalize_hash(0) == 0
    assert normalize_hash(MASK) == MASK
    assert normalize_hash(-1) == MASK
    assert normalize_hash(-(1 << 63)) == 1 << 63
    assert normalize_hash(b"\x01" + b"\x00" * 8) == 0  # low 64 bits only
    assert normalize_hash(bytes.fromhex("ff" * 32)) == MASK
    assert normalize_hash(b"\x07") == 7
    for bad in (1 << 64, -(1 << 63) - 1, True, 1.0, "1", None, b""):
        with pytest.raises(HashError):
            normalize_hash(bad)


def test_normalize_hashes_keeps_a_clean_list() -> None:
    clean = [1, 2, MASK]
    assert normalize_hashes(clean) is clean
    assert normalize_wire_hashes(clean) is clean  # type: ignore[arg-type]
    assert normalize_hashes([-1, b"\x02"]) == [MASK, 2]
    with pytest.raises(HashError) as info:
        normalize_hashes([1, 2, True])
    assert info.value.index == 2
    with pytest.raises(HashError):
        normalize_hashes([1 << 64])


def test_hash_from_hex() -> None:
    digest = bytes(range(32))
    assert hash_from_hex(digest.hex()) == normalize_hash(digest)
    assert hash_from_hex("0x10") == 16
    assert hash_from_hex("0X" + "f" * 20) == MASK
    for bad in ("", "0x", "xyz", "12 34"):
        with pytest.raises(HashError):
            hash_from_hex(bad)


@given(st.one_of(st.integers(min_value=-(1 << 63), max_value=MASK), st.binary(min_size=1)))
def test_normalisation_matches_the_contract(h: int | bytes) -> None:
    expected = h & MASK if isinstance(h, int) else int.from_bytes(h, "big") & MASK
    assert normalize_hash(h) == expected
    assert normalize_wire_hashes([h]) == [expected]
    assert normalize_wire_hashes([5, h, 6]) == [5, expected, 6]


# --------------------------------------------------------------- fuzzing

OK_ERRORS = (DecodeError, RejectedEvent)
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(1 << 63), max_value=MASK)
    | st.floats(allow_nan=False)
    | st.text(max_size=12)
    | st.binary(max_size=40)
    | st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "GPU", "type"]),
    lambda inner: (
        st.lists(inner, max_size=6)
        | st.dictionaries(
            st.sampled_from(
                [
                    "type",
                    "block_hashes",
                    "parent_block_hash",
                    "token_ids",
                    "block_size",
                    "extra_keys",
                    "medium",
                    "group_idx",
                    "lora_name",
                    "ts",
                    "events",
                    "x",
                ]
            ),
            inner,
            max_size=6,
        )
    ),
    max_leaves=40,
)


def _never_crashes(payload: bytes, source: str = "vllm") -> None:
    try:
        got = decode_engine_payload(payload, source)
    except OK_ERRORS:
        return
    assert isinstance(got, EngineBatch)
    for ev in got.events:
        if isinstance(ev, BlockStored | BlockRemoved):
            assert all(type(h) is int and 0 <= h <= MASK for h in ev.block_hashes)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200), st.sampled_from(["vllm", "sglang", "trtllm"]))
def test_arbitrary_bytes_only_raise_decode_errors(payload: bytes, source: str) -> None:
    _never_crashes(payload, source)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.floats(allow_nan=False) | st.integers(0, 10),
    st.lists(msgpack_values, max_size=5),
    msgpack_values,
)
def test_arbitrary_batches_only_raise_decode_errors(
    ts: float, events: list[Any], rank: Any
) -> None:
    _never_crashes(enc([ts, events, rank]))
    _never_crashes(enc([ts, events]))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(_fixture_cases()), st.data())
def test_mutated_fixtures_only_raise_decode_errors(case: tuple[str, str], data: Any) -> None:
    version, name = case
    raw = bytearray((FIXTURES / version / name).read_bytes())
    for _ in range(data.draw(st.integers(1, 4))):
        i = data.draw(st.integers(0, len(raw) - 1))
        raw[i] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(raw)))
    _never_crashes(bytes(raw[:cut]))
    _never_crashes(bytes(raw))


def test_deep_nesting_is_a_decode_error() -> None:
    with pytest.raises(DecodeError):
        decode_engine_payload(b"\x93\xcb" + b"\x00" * 8 + b"\x91" * 100_000)
    ok = enc([1.0, [{"type": "BlockStored", "block_hashes": [1], "extra_keys": None}], 0])
    assert ok.endswith(b"\xc0\x00")
    deep = ok[:-2] + b"\x91" * 100_000 + b"\xc0" + b"\x00"  # extra_keys nested 100k deep
    for source in ("vllm", "sglang"):
        with pytest.raises(DecodeError):
            decode_engine_payload(deep, source)
