"""Block hashes read from mooncake_master's object keys (`wire.mooncake_keys`)
and what the index does with them: one block per key set, intents confirmed,
unreadable keys counted, resyncs by the events' backend id."""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
from hypothesis import given
from hypothesis import strategies as st

from kvconductor.index.conductor import Conductor
from kvconductor.wire.events import BlockStored, EngineBatch
from kvconductor.wire.mooncake_keys import parse_object_key
from kvconductor.wire.pool import decode_pool_payload
from kvconductor.wire.records import EngineMeta

MASK = (1 << 64) - 1
BS = 4
PROMPT = list(range(100, 124))


def vllm_int(digest: bytes) -> int:
    """How vLLM publishes a bytes block hash in its KV events."""
    return int.from_bytes(digest, "big") & MASK


def vllm_key(model: str, digest: bytes, tp: int = 0, group: int = 0, prefix: str = "") -> str:
    head = f"{prefix}@" if prefix else ""
    return f"{head}{model}@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:{group}@{digest.hex()}"


def ascend_key(model: str, digest: bytes, rank: int = 0) -> str:
    return f"{model}@pcp0@dcp0@head_or_tp_rank:{rank}@pp_rank:0@{digest.hex()}"


digests = st.binary(min_size=8, max_size=32)
models = st.text(
    st.characters(exclude_characters="@", exclude_categories=["Cs"]), min_size=1, max_size=40
)


@given(models, digests, st.integers(0, 63), st.integers(0, 7), st.sampled_from(["", "deployA"]))
def test_vllm_key_names_the_hash_vllm_publishes(
    model: str, digest: bytes, tp: int, group: int, prefix: str
) -> None:
    got = parse_object_key(vllm_key(model, digest, tp, group, prefix))
    assert got is not None and got.seq_hash == vllm_int(digest)


@given(models, digests, st.integers(0, 63))
def test_ascend_key_names_the_hash(model: str, digest: bytes, rank: int) -> None:
    got = parse_object_key(ascend_key(model, digest, rank))
    assert got is not None and got.seq_hash == vllm_int(digest)


@given(models, digests, st.integers(0, 80))
def test_ascend_layer_keys_name_one_block_with_distinct_holders(
    model: str, digest: bytes, layer: int
) -> None:
    suffix = f"{model}@pcp0@dcp0@head_or_tp_rank:1@{digest.hex()}@{layer}"
    named = f"{model}@pcp0@dcp0@head_or_tp_rank:1@group:0@layer_id:{layer}@{digest.hex()}"
    a, b = parse_object_key(suffix), parse_object_key(named)
    assert a is not None and b is not None
    assert a.seq_hash == b.seq_hash == vllm_int(digest)
    other = parse_object_key(f"{model}@pcp0@dcp0@head_or_tp_rank:1@{digest.hex()}@{layer + 1}")
    assert other is not None and other.holder != a.holder


@given(models, digests)
def test_tp_ranks_share_the_hash_not_the_holder(model: str, digest: bytes) -> None:
    keys = [parse_object_key(vllm_key(model, digest, tp)) for tp in range(4)]
    assert len({k.seq_hash for k in keys if k}) == 1
    assert len({k.holder for k in keys if k}) == 4


@given(st.text(max_size=200))
def test_any_text_parses_or_names_nothing(key: str) -> None:
    got = parse_object_key(key)
    assert got is None or 0 <= got.seq_hash <= MASK


def test_keys_that_name_no_block() -> None:
    digest = hashlib.sha256(b"x").digest()
    for key in [
        "other",
        "prefix/abc",
        digest.hex(),  # a bare hash: no connector wrote it
        f"m@{digest.hex()}",  # no rank segment
        f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{digest.hex().upper()}",
        f"m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@{digest.hex()[:-1]}",  # odd length
        "m@tp_rank:0@pcp0@dcp0@pp_rank:0@group:0@abcd",  # under 8 bytes
        "m@tp_rank:0@" + "ab" * 3000,
    ]:
        assert parse_object_key(key) is None, key


# ------------------------------------------------------------ index


def master_event(event_type: str, key: str | None, **kw: Any) -> dict[str, Any]:
    """An event exactly as mooncake_master 0.3.14 publishes it."""
    ev: dict[str, Any] = {
        "event_id": 1,
        "timestamp": 1796433603854,
        "event_type": event_type,
        "type": {"stored": "BlockStored", "removed": "BlockRemoved"}.get(
            event_type, "AllBlocksCleared"
        ),
        "model_name": None,
        "block_size": None,
        "additional_salt": None,
        "lora_name": None,
        "tenant_id": "default",
        "backend_id": "mc0",
        "medium": None if event_type == "cleared" else "cpu",
        "dp_rank": 0,
    }
    if event_type != "cleared":
        ev.update(object_key=key, seq_hashes=[], block_hashes=[], base_block_idx=None)
        ev.update(group_id=None)
    if event_type == "stored":
        ev.update(session_id=None, parent_hash=None, token_ids=None, parent_block_hash=None)
    ev.update(kw)
    return ev


def master(c: Conductor, *events: dict[str, Any], key: bytes = b"pool-A") -> None:
    headers = [("kv-model", b"m"), ("kv-block-size", str(BS).encode())]
    for ev in events:
        c.ingest_pool_record(key, headers, msgspec.msgpack.encode([1796433603854, [ev], 0]), 1.0)


DIGESTS = [hashlib.sha256(bytes([i])).digest() for i in range(6)]


def intent(c: Conductor, first: int, last: int, instance: str = "b") -> None:
    """vLLM rank `instance` offloads blocks first..last into the pool."""
    ev = BlockStored(
        block_hashes=[vllm_int(d) for d in DIGESTS[first:last]],
        parent_block_hash=vllm_int(DIGESTS[first - 1]) if first else None,
        token_ids=PROMPT[first * BS : last * BS],
        block_size=BS,
        medium="CPU",
    )
    meta = EngineMeta("m", BS, "vllm", None, "default", "", 0, True)
    c.snapshot_state().apply_engine(instance, meta, EngineBatch(1.0, [ev], 0), 1.0)


def pool_hit(c: Conductor) -> int:
    """Tokens served from host tiers and up (a's own device block counts)."""
    from kvconductor.wire.query import TokenQuery

    out = c.snapshot_state().query(TokenQuery(model="m", block_size=BS, token_ids=PROMPT))
    rows: dict[str, dict[str, int]] = out.get("default", {})  # type: ignore[assignment]
    return max((row["CPU"] for row in rows.values()), default=0)


def engine_a(c: Conductor) -> None:
    # an instance to answer for: the pool serves every rank of the namespace
    ev = BlockStored([vllm_int(DIGESTS[0])], None, PROMPT[:BS], BS)
    meta = EngineMeta("m", BS, "vllm", None, "default", "", 0, False)
    c.snapshot_state().apply_engine("a", meta, EngineBatch(1.0, [ev], 0), 1.0)


def test_master_stores_confirm_intents_once_per_block_across_tp_ranks() -> None:
    c = Conductor()
    engine_a(c)
    intent(c, 0, 3)
    for tp in range(2):
        master(c, *(master_event("stored", vllm_key("m", d, tp)) for d in DIGESTS[:3]))
    assert pool_hit(c) == 3 * BS
    ns = next(iter(c.snapshot_state().namespaces.values()))
    assert sum(ns.store.pool_len(s.pid) for s in ns.pools.values()) == 3
    # rank 0's copy of block 2 goes: rank 1's still holds it
    master(c, master_event("removed", vllm_key("m", DIGESTS[2], 0)))
    assert pool_hit(c) == 3 * BS
    master(c, master_event("removed", vllm_key("m", DIGESTS[2], 1)))
    assert pool_hit(c) == 2 * BS
    assert c.counters["pool_removal_unknown"] == 0


def test_confirmation_before_intent() -> None:
    c = Conductor()
    engine_a(c)
    master(c, *(master_event("stored", ascend_key("m", d)) for d in DIGESTS[:2]))
    assert pool_hit(c) == BS  # block 0's content is known from a's own store
    intent(c, 0, 2)
    assert pool_hit(c) == 2 * BS


def test_unreadable_keys_are_counted_not_dropped() -> None:
    c = Conductor()
    master(c, master_event("stored", "some-other-object"), master_event("removed", "x"))
    master(c, master_event("stored", None))
    assert c.counters["pool_key_unparsed"] == 2
    assert c.counters["pool_event_without_hashes"] == 1


def test_remove_all_clears_and_resync_clears_by_the_events_backend() -> None:
    c = Conductor()
    engine_a(c)
    intent(c, 0, 2)
    master(c, *(master_event("stored", vllm_key("m", d)) for d in DIGESTS[:2]))
    assert pool_hit(c) == 2 * BS
    # the bridge's record key is the registration's id, not the master's backend_id
    applied = c.ingest_pool_record(b"pool-A", [("kv-control", b"resync")], b"", 2.0)
    assert applied.resync and applied.blocks == 2
    assert pool_hit(c) == BS  # a's own device block 0 only
    intent(c, 0, 2)
    master(c, *(master_event("stored", vllm_key("m", d)) for d in DIGESTS[:2]))
    assert pool_hit(c) == 2 * BS
    # remove_all: the per-object removals, then `cleared`
    master(c, master_event("removed", vllm_key("m", DIGESTS[0])), master_event("cleared", None))
    assert pool_hit(c) == BS
    ns = next(iter(c.snapshot_state().namespaces.values()))
    assert not ns.pools and not ns.pool_holders


def test_decoder_fills_hash_and_holder_from_the_key() -> None:
    d = DIGESTS[1]
    ev = master_event("stored", vllm_key("m", d, 3))
    got = decode_pool_payload(msgspec.msgpack.encode([1796433603854, [ev], 0])).events[0]
    assert got.seq_hashes == [vllm_int(d)] and got.holder is not None
    # real hashes win over the key
    ev = master_event("stored", vllm_key("m", d), seq_hashes=[7])
    got = decode_pool_payload(msgspec.msgpack.encode([1, [ev], 0])).events[0]
    assert got.seq_hashes == [7] and got.holder is None


def test_pool_index_drains_to_empty() -> None:
    c = Conductor()
    engine_a(c)
    intent(c, 0, 2)
    for tp in range(3):
        master(c, *(master_event("stored", vllm_key("m", d, tp)) for d in DIGESTS[:2]))
    for tp in range(3):
        master(c, *(master_event("removed", vllm_key("m", d, tp)) for d in DIGESTS[:2]))
    ns = next(iter(c.snapshot_state().namespaces.values()))
    assert not ns.pools and not ns.pool_holders


# ------------------------------------------------------- bridge reconcile


def test_live_keys_follow_the_stream_and_removals_apply_like_the_masters() -> None:
    from kvconductor.bridge.reconcile import LiveKeys

    live = LiveKeys()

    def relay(*events: dict[str, Any]) -> None:
        for ev in events:
            live.observe(msgspec.msgpack.encode([1796433603854, [ev], 0]))

    keys = [vllm_key("m", d, tp) for d in DIGESTS[:3] for tp in (0, 1)]
    relay(*(master_event("stored", k) for k in keys))
    relay(master_event("removed", keys[0]), master_event("stored", "junk"))
    live.observe(b"not msgpack")
    assert set(live.keys) == {*keys[1:], "junk"}
    before = live.generation + 1
    relay(master_event("stored", "late"))  # stored after the list was asked for
    gone = live.gone({keys[1], keys[2]}, before)
    assert sorted(k for k, _ in gone) == sorted([*keys[3:], "junk"])
    assert set(live.keys) == {keys[1], keys[2], "late"}

    # the removals the bridge writes are the master's shape: the index applies them
    c = Conductor()
    engine_a(c)
    intent(c, 0, 3)
    master(c, *(master_event("stored", k) for k in keys))
    assert pool_hit(c) == 3 * BS
    for payload in live.removals(gone):
        c.ingest_pool_record(b"pool-A", [("kv-model", b"m"), ("kv-block-size", b"4")], payload, 2)
    assert pool_hit(c) == 2 * BS  # blocks 0 and 1 keep one rank's key, block 2 none
    relay(master_event("cleared", None))
    assert not live.keys


def test_reconcile_url_is_for_pools_only() -> None:
    import pytest

    from kvconductor.config import ConfigError
    from kvconductor.registry.publishers import publisher_from_mapping

    base = {"id": "mc", "endpoint": "tcp://127.0.0.1:5557", "source": "mooncake"}
    pub = publisher_from_mapping({**base, "reconcile_url": "http://127.0.0.1:9003"}, "p")
    assert pub.reconcile_url == "http://127.0.0.1:9003" and pub.reconcile_interval_s == 30.0
    with pytest.raises(ConfigError, match="reconcile_url: applies to pool"):
        publisher_from_mapping(
            {**base, "source": "vllm", "model": "m", "block_size": 4, "reconcile_url": "http://x"},
            "p",
        )
    with pytest.raises(ConfigError, match="reconcile_url: expected"):
        publisher_from_mapping({**base, "reconcile_url": "127.0.0.1:9003"}, "p")
    with pytest.raises(ConfigError, match="reconcile_interval_s"):
        publisher_from_mapping({**base, "reconcile_interval_s": 0.1}, "p")


def test_a_confirmation_that_ages_out_leaves_no_holder_behind() -> None:
    c = Conductor()
    engine_a(c)
    # rank 0's key of block 1 comes long before any content for it
    master(c, master_event("stored", vllm_key("m", DIGESTS[1], 0)))
    c.expire(1.0 + 10_000)
    ns = next(iter(c.snapshot_state().namespaces.values()))
    assert not ns.pool_holders
    intent(c, 0, 2)
    master(c, master_event("stored", vllm_key("m", DIGESTS[1], 1)))
    assert pool_hit(c) == 2 * BS
