"""Hand-worked cases for each rule of contract sections 1 to 4, on the pure core."""

from __future__ import annotations

import pytest

from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    PoolBatch,
    PoolEvent,
)
from kvconductor.wire.hashing import (
    MASK64,
    chain_identities,
    local_block_hash,
    lora_seed,
    pack_tokens,
)
from kvconductor.wire.query import HashQuery, InvalidQuery, TokenQuery
from kvconductor.wire.records import EngineMeta, PoolMeta

BS = 4
PROMPT = list(range(100, 124))  # six full blocks of four tokens


def meta(offload_pool: bool = False, **kw: object) -> EngineMeta:
    base = {
        "model": "m",
        "block_size": BS,
        "source": "vllm",
        "seq": None,
        "tenant": "default",
        "salt": "",
        "dp_rank": 0,
        "offload_pool": offload_pool,
    }
    base.update(kw)
    return EngineMeta(**base)  # type: ignore[arg-type]


POOL = PoolMeta("m", BS, "default", "", None)


def seq(i: int) -> int:
    """The engine's name for block i of PROMPT (any stable u64 works)."""
    return 1000 + i


def stored(first: int, last: int, medium: str | None = None, tokens: bool = True) -> BlockStored:
    return BlockStored(
        block_hashes=[seq(i) for i in range(first, last)],
        parent_block_hash=seq(first - 1) if first else None,
        token_ids=PROMPT[first * BS : last * BS] if tokens else None,
        block_size=BS,
        medium=medium,
    )


def engine(ix: Index, instance: str, *events: object, rank: int = 0, **kw: object) -> int:
    return ix.apply_engine(instance, meta(**kw), EngineBatch(1.0, list(events), rank), 1.0)  # type: ignore[arg-type]


def pool(ix: Index, *events: PoolEvent, backend: str = "mc-0") -> int:
    return ix.apply_pool(backend, POOL, PoolBatch(1.0, list(events)), 1.0)


def confirm(first: int, last: int, medium: str = "cpu") -> PoolEvent:
    return PoolEvent("stored", [seq(i) for i in range(first, last)], medium=medium)


def ask(ix: Index, tokens: list[int] = PROMPT, **kw: object) -> dict[str, object]:
    return ix.query(TokenQuery(model="m", block_size=BS, token_ids=tokens, **kw))  # type: ignore[arg-type]


def hits(ix: Index, instance: str = "a", **kw: object) -> tuple[int, int, int]:
    row = ask(ix, **kw)["default"][instance]  # type: ignore[index]
    return row["GPU"], row["CPU"], row["DISK"]  # type: ignore[index]


# ---------------------------------------------------------------- section 1


def test_local_hash_is_the_contract_scheme() -> None:
    import struct

    import xxhash

    tokens = [1, 2, 3, 70000]
    raw = struct.pack("<4I", *tokens)
    assert local_block_hash(tokens) == xxhash.xxh3_64_intdigest(raw, 1337)
    lora = (1337 + xxhash.xxh3_64_intdigest(b"adapter", 0)) & MASK64
    assert lora_seed("adapter") == lora
    assert local_block_hash(tokens, lora) == xxhash.xxh3_64_intdigest(raw, lora)


def test_first_identity_is_the_local_hash_and_chains_differ_by_parent() -> None:
    a = chain_identities(pack_tokens(PROMPT[:8]), 2, BS, lora_seed(None))
    assert a[0] == local_block_hash(PROMPT[:4])
    b = chain_identities(pack_tokens(PROMPT[4:8] + PROMPT[4:8]), 2, BS, lora_seed(None))
    assert a[1] != b[1]  # same tokens, different parent chain


def test_namespaces_never_match_each_other() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 6), salt="s1", tenant="t1")
    assert ask(ix) == {}
    assert ask(ix, tenant_id="t1") == {}
    assert ask(ix, tenant_id="t1", cache_salt="s1")["t1"]["a"]["GPU"] == 24  # type: ignore[index]
    assert ix.query(TokenQuery(model="m", block_size=8, token_ids=PROMPT)) == {}
    assert ask(ix, tenant_id="t1", cache_salt="s1", lora_name="x") == {}


def test_lora_blocks_index_under_their_adapter() -> None:
    ix = Index()
    ev = BlockStored([1, 2], None, PROMPT[:8], BS, lora_name="ad")
    engine(ix, "a", ev)
    assert ask(ix) == {}
    assert ask(ix, lora_name="ad")["default"]["a"]["GPU"] == 8  # type: ignore[index]


def test_unnamed_lora_is_skipped_and_counted() -> None:
    ix = Index()
    engine(ix, "a", BlockStored([1, 2], None, PROMPT[:8], BS, lora_id=3))
    assert ask(ix) == {}
    assert ix.counters["unnamed_lora_skipped"] == 2


def test_extra_keys_keep_content_apart() -> None:
    ix = Index()
    ev = BlockStored([1, 2], None, PROMPT[:8], BS, extra_keys=[12345, None])
    engine(ix, "a", ev)
    # Same tokens without the image hash: no match on tokens.
    assert hits(ix) == (0, 0, 0)
    # By engine hash the block is found.
    q = HashQuery(model="m", block_size=BS, seq_hashes=[1, 2])
    assert ix.query(q)["default"]["a"]["GPU"] == 8  # type: ignore[index]


def test_partial_trailing_block_is_skipped() -> None:
    ix = Index()
    engine(ix, "a", BlockStored([1, 2, 3], None, PROMPT[:10], BS))
    assert hits(ix) == (8, 8, 8)
    assert ix.counters["partial_blocks_skipped"] == 1


# ---------------------------------------------------------------- section 2


def test_chain_across_batches_and_middle_removal() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 3))
    engine(ix, "a", stored(3, 6))
    assert hits(ix) == (24, 24, 24)
    engine(ix, "a", BlockRemoved([seq(2)]))
    assert hits(ix) == (8, 8, 8)
    # Blocks after the hole still count again once the hole is refilled.
    engine(ix, "a", stored(2, 3))
    assert hits(ix) == (24, 24, 24)


@pytest.mark.parametrize("report_full", [False, True])
def test_a_store_of_held_blocks_from_the_first(report_full: bool) -> None:
    """A re-announcement where the engine declares it re-announces
    (`kv-report-mode: full`), copies where it does not (vLLM's default)."""
    ix = Index()
    engine(ix, "a", stored(0, 2), report_full=report_full)
    engine(ix, "a", stored(0, 2), report_full=report_full)
    engine(ix, "a", BlockRemoved([seq(1)]), report_full=report_full)
    assert hits(ix) == ((4, 4, 4) if report_full else (8, 8, 8))


def test_media_map_to_tiers_and_unknown_is_skipped() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 2))
    engine(ix, "a", stored(2, 4, medium="cpu_pinned"))
    engine(ix, "a", stored(4, 5, medium="NVMe"))
    engine(ix, "a", stored(5, 6, medium="EXTERNAL"))
    assert hits(ix) == (8, 16, 20)
    assert ix.counters["unknown_medium"] == 1


def test_host_continuation_after_gpu_breakpoint_only() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 2))
    engine(ix, "a", stored(3, 6))  # GPU again after a hole: does not count
    engine(ix, "a", stored(2, 3, medium="CPU"))
    assert hits(ix) == (8, 12, 12)


def test_tokenless_store_takes_content_from_earlier_event() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 4))
    engine(ix, "a", stored(0, 4, medium="CPU", tokens=False))
    engine(ix, "a", BlockRemoved([seq(0), seq(1), seq(2), seq(3)]))
    assert hits(ix) == (0, 16, 16)


def test_tokenless_store_waits_for_later_content() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 4, medium="CPU", tokens=False))
    assert ask(ix) == {}  # nothing of known content yet
    engine(ix, "b", stored(0, 4))
    assert hits(ix, "a") == (0, 16, 16)
    assert hits(ix, "b") == (16, 16, 16)


def test_all_blocks_cleared_clears_every_tier_of_that_rank_only() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 3), rank=0)
    engine(ix, "a", stored(3, 6, medium="DISK"), rank=0)
    engine(ix, "a", stored(0, 2), rank=1)
    engine(ix, "a", AllBlocksCleared(), rank=0)
    row = ask(ix)["default"]["a"]  # type: ignore[index]
    assert row == {"longest_matched": 8, "GPU": 8, "CPU": 8, "DISK": 8, "DP": {"1": 8}}


def test_dp_ranks_and_best_rank() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 2), rank=0)
    engine(ix, "a", stored(2, 4, medium="CPU"), rank=0)
    engine(ix, "a", stored(0, 3), rank=1)
    row = ask(ix)["default"]["a"]  # type: ignore[index]
    assert row == {"longest_matched": 16, "GPU": 8, "CPU": 16, "DISK": 16, "DP": {"0": 16, "1": 12}}


def test_listed_with_zeros_and_instance_filter() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 2))
    engine(ix, "b", BlockStored([7], None, [9, 9, 9, 9], BS))
    out = ask(ix)
    assert out["default"]["b"] == {  # type: ignore[index]
        "longest_matched": 0,
        "GPU": 0,
        "CPU": 0,
        "DISK": 0,
        "DP": {"0": 0},
    }
    assert list(ask(ix, instance_id="a")["default"]) == ["a"]  # type: ignore[call-overload]
    assert ask(ix, instance_id="zzz") == {}


def test_dp_rank_from_header_when_payload_rank_is_null() -> None:
    ix = Index()
    ix.apply_engine("a", meta(dp_rank=3), EngineBatch(1.0, [stored(0, 1)], None), 1.0)
    assert ask(ix)["default"]["a"]["DP"] == {"3": 4}  # type: ignore[index]


def test_block_sizes_and_group_specs() -> None:
    """A primary-group block a multiple of `kv-block-size` is held unit by
    unit; a block size that is neither a multiple nor a divisor, a smaller
    primary block (a partial key off the alignment), a sliding window
    without its window and a group that changes kind are skipped and
    counted; non-prefix-cacheable groups are skipped."""
    ix = Index()
    engine(ix, "a", BlockStored([1], None, PROMPT[:8], 2 * BS))
    assert hits(ix) == (8, 8, 8)
    engine(ix, "a", BlockStored([2], None, PROMPT[:6], 6))
    engine(ix, "a", BlockStored([3], None, PROMPT[:2], 2))
    assert ix.counters["block_size_mismatch"] == 1
    assert ix.counters["partial_blocks_skipped"] == 1
    engine(ix, "a", BlockStored([4], None, PROMPT[:4], BS, group_idx=1, spec_kind="sliding_window"))
    assert ix.counters["bad_group_spec"] == 1
    engine(ix, "a", BlockStored([5], None, PROMPT[:4], BS, group_idx=1, spec_kind="mamba"))
    assert ix.counters["group_kind_changed"] == 1
    engine(
        ix, "a", BlockStored([6], None, PROMPT[:4], BS, group_idx=2, spec_kind="cross_attention")
    )
    engine(ix, "a", BlockRemoved([6], group_idx=2))
    assert ix.counters["non_prefix_group_skipped"] == 2
    # The removal of the 8-token block takes both its units.
    engine(ix, "a", BlockRemoved([1], group_idx=0))
    assert ask(ix) == {}


# ---------------------------------------------------------------- section 3


@pytest.mark.parametrize("intent_first", [True, False])
def test_two_phase_either_order(intent_first: bool) -> None:
    ix = Index()
    engine(ix, "a", stored(0, 2))
    intent = stored(2, 6, medium="CPU")
    steps = [
        lambda: engine(ix, "b", intent, offload_pool=True),
        lambda: pool(ix, confirm(2, 6)),
    ]
    if not intent_first:
        steps.reverse()
    steps[0]()
    assert hits(ix) == (8, 8, 8)  # half a join indexes nothing
    steps[1]()
    assert hits(ix) == (8, 24, 24)
    assert "b" not in ask(ix)["default"]  # type: ignore[operator]
    by_kind = ix.namespaces[next(iter(ix.namespaces))].pending.by_kind
    assert by_kind == {"w": 0, "u": 0, "i": 0, "r": 0}


def test_two_phase_split_across_records_and_confirmed_before_parent() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 2))
    pool(ix, confirm(4, 5, "disk"))  # a child confirmed before its parent
    engine(ix, "b", stored(2, 4, medium="CPU"), offload_pool=True)
    engine(ix, "b", stored(4, 6, medium="CPU"), offload_pool=True)
    assert hits(ix) == (8, 8, 8)
    pool(ix, confirm(2, 3))
    assert hits(ix) == (8, 12, 12)
    pool(ix, confirm(3, 4, "disk"))
    assert hits(ix) == (8, 12, 20)  # block 4 kept its chain
    pool(ix, confirm(5, 6, "disk"))
    assert hits(ix) == (8, 12, 24)


def test_confirmation_content_from_any_tokened_store() -> None:
    ix = Index()
    pool(ix, confirm(0, 3))
    engine(ix, "a", stored(0, 1))
    engine(ix, "c", stored(0, 3, medium="DISK"))
    assert hits(ix) == (4, 12, 12)


def test_pool_stored_with_tokens_is_its_own_content() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 1))
    ev = PoolEvent(
        "stored", [seq(1), seq(2)], parent_hash=seq(0), token_ids=PROMPT[4:12], medium="cpu"
    )
    pool(ix, ev)
    assert hits(ix) == (4, 12, 12)


def test_pool_removed_and_cleared_evict_pool_only() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 2))
    engine(ix, "a", stored(2, 3, medium="CPU"))
    pool(ix, PoolEvent("stored", [seq(3), seq(4)], parent_hash=seq(2), token_ids=PROMPT[12:20]))
    pool(
        ix,
        PoolEvent("stored", [seq(5)], parent_hash=seq(4), token_ids=PROMPT[20:24], medium="disk"),
    )
    assert hits(ix) == (8, 20, 24)
    pool(ix, PoolEvent("removed", [seq(4)], medium="cpu"))
    assert hits(ix) == (8, 16, 16)
    pool(ix, PoolEvent("cleared", medium="disk"))
    pool(ix, PoolEvent("stored", [seq(4)], medium="cpu"))  # content still known via... nothing
    pool(ix, PoolEvent("cleared"))
    assert hits(ix) == (8, 12, 12)


def test_pool_serves_every_rank_and_instance_of_namespace() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 1), rank=0)
    engine(ix, "b", stored(0, 2), rank=1)
    pool(ix, PoolEvent("stored", [seq(i) for i in range(6)], token_ids=PROMPT))
    out = ask(ix)["default"]  # type: ignore[index]
    assert out["a"]["CPU"] == 24 and out["b"]["CPU"] == 24  # type: ignore[index]
    assert out["a"]["GPU"] == 4 and out["b"]["GPU"] == 8  # type: ignore[index]


def test_pending_bounds_count_and_age() -> None:
    ix = Index(IndexLimits(max_pending=5, max_pending_age_s=10))
    engine(ix, "a", stored(0, 1))
    for i in range(20):
        ix.apply_pool("mc", POOL, PoolBatch(1.0, [PoolEvent("stored", [9000 + i])]), 1.0)
    ns = next(iter(ix.namespaces.values()))
    assert len(ns.pending) == 5
    assert ix.counters["pending_dropped_confirmation_count"] == 15
    ix.expire(100.0)
    assert len(ns.pending) == 0
    assert ix.counters["pending_dropped_confirmation_age"] == 5


def test_pool_event_without_namespace_is_rejected_whole() -> None:
    from kvconductor.wire.errors import RejectedEvent

    ix = Index()
    bad = PoolMeta(None, None, "default", "", None)
    good = PoolEvent("stored", [1], token_ids=[1, 2, 3, 4], model_name="m", block_size=BS)
    with pytest.raises(RejectedEvent):
        ix.apply_pool("mc", bad, PoolBatch(1.0, [good, PoolEvent("stored", [2])]), 1.0)
    assert ix.is_empty()


# ---------------------------------------------------------------- section 4


def test_query_by_hash_normalises_and_stops_at_unknown() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 3))
    q = HashQuery(model="m", block_size=BS, seq_hashes=[seq(0), seq(1), 55, seq(2)])
    assert ix.query(q)["default"]["a"]["GPU"] == 8  # type: ignore[index]
    signed = (1 << 64) - 5
    engine(ix, "b", BlockStored([signed], None, PROMPT[:4], BS))
    q = HashQuery(model="m", block_size=BS, seq_hashes=[-5])
    assert ix.query(q)["default"]["b"]["GPU"] == 4  # type: ignore[index]
    digest = bytes(range(32))
    q = HashQuery(model="m", block_size=BS, seq_hashes=[digest.hex()])
    want = int.from_bytes(digest, "big") & MASK64
    engine(ix, "c", BlockStored([want], None, PROMPT[:4], BS))
    assert ix.query(q)["default"]["c"]["GPU"] == 4  # type: ignore[index]


def test_query_rejects_bad_values() -> None:
    ix = Index()
    with pytest.raises(InvalidQuery):
        ix.query(TokenQuery(model="m", block_size=0, token_ids=[1]))
    with pytest.raises(InvalidQuery):
        ix.query(TokenQuery(model="m", block_size=BS, token_ids=[-1, 2, 3, 4]))
    with pytest.raises(InvalidQuery):
        ix.query(HashQuery(model="m", block_size=BS, seq_hashes=[1 << 64]))
    with pytest.raises(InvalidQuery):
        ix.query(HashQuery(model="m", block_size=BS, seq_hashes=["zz"]))


def test_remove_instance_and_structure_returns_to_empty() -> None:
    ix = Index()
    engine(ix, "a", stored(0, 6))
    engine(ix, "a", stored(0, 3, medium="CPU", tokens=False))
    engine(ix, "b", stored(0, 6, medium="DISK"), rank=2)
    engine(ix, "c", stored(0, 6, medium="CPU"), offload_pool=True)
    pool(ix, confirm(0, 3))
    engine(ix, "d", stored(0, 2, tokens=False))
    ix.remove_instance("a")
    ix.remove_instance("b")
    ix.remove_instance("d")
    pool(ix, PoolEvent("cleared"))
    ix.expire(1e9)  # the rest of c's intents age out...
    assert not ix.is_empty()
    ix.expire(2e9)  # ...and their content, retired then, ages out after them
    assert ix.is_empty()


def test_content_outlives_its_holders_for_late_halves() -> None:
    ix = Index(IndexLimits(max_pending_age_s=60))
    engine(ix, "a", stored(0, 3))
    engine(ix, "a", BlockRemoved([seq(0), seq(1), seq(2)]))
    assert ask(ix) == {}
    pool(ix, confirm(0, 3))  # the engine evicted before the pool confirmed
    engine(ix, "b", BlockStored([1], None, [7, 7, 7, 7], BS))
    assert hits(ix, "b") == (0, 12, 12)
    ix.expire(1.0 + 61)
    pool(ix, PoolEvent("cleared"))
    ix.expire(1.0 + 200)
    engine(ix, "b", AllBlocksCleared())
    ix.expire(1.0 + 400)
    assert ix.is_empty()


def test_bridge_resync_control_record_clears_the_instance() -> None:
    from kvconductor.index.conductor import Conductor

    c = Conductor()
    c.snapshot_state().apply_engine("a", meta(), EngineBatch(1.0, [stored(0, 3)], 0), 1.0)
    c.snapshot_state().apply_engine("a", meta(), EngineBatch(1.0, [stored(0, 2)], 1), 1.0)
    c.snapshot_state().apply_engine("b", meta(), EngineBatch(1.0, [stored(0, 1)], 0), 1.0)
    applied = c.ingest_engine_record(
        b"a", [("kv-control", b"resync"), ("kv-dp-rank", b"0")], b"", 2.0
    )
    assert applied.resync and applied.blocks == 3
    assert ask(c.snapshot_state())["default"]["a"]["DP"] == {"1": 8}  # type: ignore[index]
    c.ingest_engine_record(b"a", [("kv-control", b"resync")], b"", 2.0)
    assert "a" not in ask(c.snapshot_state())["default"]  # type: ignore[operator]
    assert c.counters["resyncs"] == 2


def test_pool_resync_control_record_clears_the_backend() -> None:
    from kvconductor.index.conductor import Conductor

    c = Conductor()
    c.snapshot_state().apply_engine("a", meta(), EngineBatch(1.0, [stored(0, 1)], 0), 1.0)
    pool(
        c.snapshot_state(), PoolEvent("stored", [seq(1)], parent_hash=seq(0), token_ids=PROMPT[4:8])
    )
    pool(c.snapshot_state(), PoolEvent("stored", [seq(1)], medium="disk"), backend="mc-1")
    assert hits(c.snapshot_state()) == (4, 8, 8)
    applied = c.ingest_pool_record(b"mc-0", [("kv-control", b"resync")], b"", 2.0)
    assert applied.resync and applied.blocks == 1
    assert hits(c.snapshot_state()) == (4, 4, 8)


def test_per_request_cache_salt_in_extra_keys_matches_a_salted_query() -> None:
    from kvconductor.wire.hashing import extra_keys_fingerprint

    ix = Index()
    salt = extra_keys_fingerprint(["s3cret"])
    engine(ix, "a", BlockStored([1, 2], None, PROMPT[:8], BS, extra_keys=[salt, None]))
    engine(ix, "b", stored(0, 2))
    assert hits(ix, "b") == (8, 8, 8)
    assert hits(ix, "a") == (0, 0, 0)  # unsalted query: a's blocks are salted
    out = ask(ix, cache_salt="s3cret")
    assert list(out["default"]) == ["a"]  # type: ignore[call-overload]
    assert out["default"]["a"]["GPU"] == 8  # type: ignore[index]
    assert ask(ix, cache_salt="other") == {}


def test_lora_name_in_extra_keys_does_not_hide_lora_blocks() -> None:
    from kvconductor.wire.engine import decode_engine_payload
    from tests.harness import vllm_payload

    ev = {
        "type": "BlockStored",
        "block_hashes": [1, 2],
        "parent_block_hash": None,
        "token_ids": PROMPT[:8],
        "block_size": BS,
        "lora_name": "ad",
        "extra_keys": [["ad", "salt"], ["ad"]],
    }
    batch = decode_engine_payload(vllm_payload([ev]))
    ix = Index()
    ix.apply_engine("a", meta(), batch, 1.0)
    assert ask(ix, lora_name="ad", cache_salt="salt")["default"]["a"]["GPU"] == 8  # type: ignore[index]
