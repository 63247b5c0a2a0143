"""Pool payload decoding (Mooncake RFC #1527 maps, as mooncake_master sends)."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvconductor.wire.errors import DecodeError, RejectedEvent
from kvconductor.wire.events import PoolBatch, PoolEvent
from kvconductor.wire.pool import decode_pool_payload

MASK = (1 << 64) - 1
TS_MS = 1770000000000
enc = msgspec.msgpack.encode


def envelope(event_type: str, **fields: Any) -> dict[str, Any]:
    """An event as mooncake_master emits it, legacy aliases included."""
    ev: dict[str, Any] = {
        "event_id": 1,
        "timestamp": TS_MS,
        "event_type": event_type,
        "type": {
            "stored": "BlockStored",
            "removed": "BlockRemoved",
            "cleared": "AllBlocksCleared",
        }.get(event_type, "?"),
        "model_name": "llama",
        "block_size": 4,
        "additional_salt": None,
        "lora_name": None,
        "tenant_id": "default",
        "backend_id": "store-0",
        "medium": "cpu",
        "dp_rank": 0,
    }
    ev.update(fields)
    return ev


def decode_one(ev: dict[str, Any]) -> PoolEvent:
    batch = decode_pool_payload(enc([TS_MS, [ev], 0]))
    assert len(batch.events) == 1
    return batch.events[0]


def test_confirmation_without_token_ids() -> None:
    ev = envelope(
        "stored",
        seq_hashes=[11],
        block_hashes=[],
        base_block_idx=None,
        parent_hash=None,
        token_ids=None,
        parent_block_hash=None,
        object_key="11",
        group_id="7",
    )
    got = decode_one(ev)
    assert got == PoolEvent(
        event_type="stored",
        seq_hashes=[11],
        parent_hash=None,
        base_block_idx=None,
        token_ids=None,
        medium="cpu",
        backend_id="store-0",
        tenant_id="default",
        model_name="llama",
        block_size=4,
        lora_name=None,
        additional_salt=None,
        object_key="11",
        event_id=1,
    )


def test_stored_with_tokens_parent_and_depth() -> None:
    ev = envelope(
        "stored",
        seq_hashes=[21, 22],
        base_block_idx=5,
        parent_hash=20,
        token_ids=list(range(8)),
        lora_name="sql",
        additional_salt="w8a8",
    )
    got = decode_one(ev)
    assert got.seq_hashes == [21, 22]
    assert (got.parent_hash, got.base_block_idx) == (20, 5)
    assert got.token_ids == list(range(8))  # the listed blocks' tokens only
    assert (got.lora_name, got.additional_salt) == ("sql", "w8a8")


def test_removed() -> None:
    got = decode_one(envelope("removed", seq_hashes=[21], base_block_idx=5, medium="disk"))
    assert got == PoolEvent(
        event_type="removed",
        seq_hashes=[21],
        base_block_idx=5,
        medium="disk",
        backend_id="store-0",
        tenant_id="default",
        model_name="llama",
        block_size=4,
        event_id=1,
    )


def test_cleared_with_and_without_medium() -> None:
    with_medium = decode_one(envelope("cleared", medium="disk"))
    assert (with_medium.event_type, with_medium.medium, with_medium.seq_hashes) == (
        "cleared",
        "disk",
        [],
    )
    without = decode_one(envelope("cleared", medium=None))
    assert without.medium is None
    bare = decode_one({"event_type": "cleared"})
    assert bare == PoolEvent(event_type="cleared")


def test_null_fields_mean_missing() -> None:
    nulls = {
        k: None
        for k in (
            "seq_hashes",
            "parent_hash",
            "base_block_idx",
            "token_ids",
            "medium",
            "backend_id",
            "tenant_id",
            "model_name",
            "block_size",
            "lora_name",
            "additional_salt",
            "object_key",
            "event_id",
            "block_hashes",
            "parent_block_hash",
        )
    }
    assert decode_one({"event_type": "stored", **nulls}) == decode_one({"event_type": "stored"})
    assert decode_one({"event_type": "stored"}) == PoolEvent(event_type="stored")


def test_empty_strings_mean_missing() -> None:
    ev = {
        "event_type": "stored",
        "seq_hashes": [1],
        "model_name": "",
        "tenant_id": "",
        "lora_name": "",
        "additional_salt": "",
        "backend_id": "",
    }
    got = decode_one(ev)
    assert (got.model_name, got.tenant_id, got.lora_name, got.additional_salt, got.backend_id) == (
        None,
    ) * 5


def test_zero_block_size_is_unknown() -> None:
    got = decode_one(
        {"event_type": "stored", "seq_hashes": [1, 2], "block_size": 0, "token_ids": [1, 2, 3]}
    )
    assert got.block_size is None and got.token_ids == [1, 2, 3]


def test_legacy_aliases_fill_in_missing_rfc_fields() -> None:
    got = decode_one({"event_type": "stored", "block_hashes": [5, 6], "parent_block_hash": 4})
    assert (got.seq_hashes, got.parent_hash) == ([5, 6], 4)
    # mooncake_master's legacy block_hashes is [] beside the real seq_hashes
    both = decode_one({"event_type": "stored", "seq_hashes": [7], "block_hashes": []})
    assert both.seq_hashes == [7]


def test_keyless_mooncake_object_event() -> None:
    got = decode_one(envelope("stored", seq_hashes=[], block_hashes=[], object_key="prefix/abc"))
    assert got.seq_hashes == [] and got.object_key == "prefix/abc"


def test_hashes_normalised_like_engine_hashes() -> None:
    digest = bytes(range(1, 33))
    got = decode_one(
        {"event_type": "stored", "seq_hashes": [-1, digest, 3], "parent_hash": -(1 << 63)}
    )
    assert got.seq_hashes == [MASK, int.from_bytes(digest, "big") & MASK, 3]
    assert got.parent_hash == 1 << 63


def test_unknown_keys_and_trailing_envelope_elements_are_ignored() -> None:
    ev = envelope(
        "removed",
        seq_hashes=[1],
        cache_prefix="dep-a",
        tp_rank=2,
        pcp_rank=1,
        dcp_rank=0,
        pp_rank=3,
        worker_id="w",
        future={"a": [1]},
    )
    batch = decode_pool_payload(enc([TS_MS, [ev], 0, "future", 1]))
    assert batch.events[0].seq_hashes == [1]


def test_timestamp_in_ms_becomes_seconds_and_rank_is_kept() -> None:
    batch = decode_pool_payload(enc([TS_MS, [], 3]))
    assert batch == PoolBatch(ts=TS_MS / 1000, events=[], dp_rank=3)
    assert decode_pool_payload(enc([1770000000.5, []])) == PoolBatch(1770000000.5, [], None)


def test_batch_of_several_events_keeps_order() -> None:
    evs = [
        envelope("stored", seq_hashes=[1], event_id=1),
        envelope("removed", seq_hashes=[1], event_id=2),
        envelope("cleared", event_id=3),
    ]
    batch = decode_pool_payload(enc([TS_MS, evs, 0]))
    assert [(e.event_type, e.event_id) for e in batch.events] == [
        ("stored", 1),
        ("removed", 2),
        ("cleared", 3),
    ]


BAD: list[tuple[str, bytes, type[Exception], str]] = [
    ("garbage", b"\xc1", DecodeError, "msgpack"),
    ("empty", b"", DecodeError, "msgpack"),
    ("not an array", enc({"ts": 1}), DecodeError, ""),
    ("events not list", enc([1, 5, 0]), DecodeError, "events"),
    ("event not a map", enc([1, [["stored"]], 0]), DecodeError, "event 0"),
    ("unknown event_type", enc([1, [{"event_type": "updated"}], 0]), DecodeError, "event_type"),
    (
        "engine tag only",
        enc([1, [{"type": "BlockStored", "block_hashes": [1]}], 0]),
        DecodeError,
        "event_type",
    ),
    ("event_type null", enc([1, [{"event_type": None}], 0]), DecodeError, "event_type"),
    ("event_type case", enc([1, [{"event_type": "Stored"}], 0]), DecodeError, "event_type"),
    (
        "hash str",
        enc([1, [{"event_type": "stored", "seq_hashes": ["0x1"]}], 0]),
        DecodeError,
        "seq_hashes[0]",
    ),
    (
        "hash float",
        enc([1, [{"event_type": "removed", "seq_hashes": [1, 1.5]}], 0]),
        DecodeError,
        "seq_hashes[1]",
    ),
    (
        "hash empty bytes",
        enc([1, [{"event_type": "removed", "seq_hashes": [b""]}], 0]),
        RejectedEvent,
        "seq_hashes[0]",
    ),
    (
        "parent str",
        enc([1, [{"event_type": "stored", "parent_hash": "p"}], 0]),
        DecodeError,
        "parent_hash",
    ),
    (
        "token negative",
        enc([1, [{"event_type": "stored", "token_ids": [-1]}], 0]),
        RejectedEvent,
        "token_ids[0]",
    ),
    (
        "token too big",
        enc([1, [{"event_type": "stored", "token_ids": [2**32]}], 0]),
        RejectedEvent,
        "token_ids[0]",
    ),
    (
        "token count",
        enc(
            [
                1,
                [
                    {
                        "event_type": "stored",
                        "seq_hashes": [1, 2],
                        "token_ids": [1, 2, 3],
                        "block_size": 2,
                    }
                ],
                0,
            ]
        ),
        RejectedEvent,
        "token_ids",
    ),
    (
        "negative depth",
        enc([1, [{"event_type": "stored", "base_block_idx": -1}], 0]),
        RejectedEvent,
        "base_block_idx",
    ),
    (
        "negative block size",
        enc([1, [{"event_type": "stored", "block_size": -16}], 0]),
        RejectedEvent,
        "block_size",
    ),
    ("medium int", enc([1, [{"event_type": "stored", "medium": 1}], 0]), DecodeError, "medium"),
    ("negative rank", enc([1, [], -2]), RejectedEvent, "dp_rank"),
    (
        "second event bad",
        enc([1, [{"event_type": "cleared"}, {"event_type": "x"}], 0]),
        DecodeError,
        "event 1",
    ),
]


@pytest.mark.parametrize(
    ("payload", "error", "words"), [pytest.param(p, e, w, id=n) for n, p, e, w in BAD]
)
def test_bad_pool_payloads_raise_with_a_reason(
    payload: bytes, error: type[Exception], words: str
) -> None:
    with pytest.raises(error) as info:
        decode_pool_payload(payload)
    assert type(info.value) is error
    assert words in str(info.value)


pool_values = st.recursive(
    st.none()
    | st.integers(min_value=-(1 << 63), max_value=MASK)
    | st.floats(allow_nan=False)
    | st.text(max_size=8)
    | st.binary(max_size=12)
    | st.sampled_from(["stored", "removed", "cleared", "cpu"]),
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(
            st.sampled_from(
                [
                    "event_type",
                    "seq_hashes",
                    "parent_hash",
                    "token_ids",
                    "block_size",
                    "base_block_idx",
                    "medium",
                    "block_hashes",
                    "x",
                ]
            ),
            inner,
            max_size=6,
        )
    ),
    max_leaves=30,
)


def _never_crashes(payload: bytes) -> None:
    try:
        batch = decode_pool_payload(payload)
    except (DecodeError, RejectedEvent):
        return
    for ev in batch.events:
        assert ev.event_type in ("stored", "removed", "cleared")
        assert all(type(h) is int and 0 <= h <= MASK for h in ev.seq_hashes)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=200))
def test_arbitrary_bytes_only_raise_decode_errors(payload: bytes) -> None:
    _never_crashes(payload)


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.floats(allow_nan=False), st.lists(pool_values, max_size=4), pool_values)
def test_arbitrary_batches_only_raise_decode_errors(
    ts: float, events: list[Any], rank: Any
) -> None:
    _never_crashes(enc([ts, events, rank]))
