"""`POST /query_tiered_by_hash`, NVIDIA Dynamo's remote-indexer query.

Requests are shaped as Dynamo's router sends them (lib/kv-router,
`TieredQueryByHashRequest`: `block_hashes` as i64, `model_name`,
`routing_group`); answers are read as its `TieredQueryResponse` and checked
against `/query` for the same tokens.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import pytest
import xxhash

from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import IndexLimits
from kvconductor.snapshots.units import all_unit_ids, export_unit, restore
from kvconductor.wire.dynamo import worker_id
from kvconductor.wire.events import BlockStored, EngineBatch
from kvconductor.wire.hashing import MASK64, dynamo_seed, local_block_hash, lora_seed
from kvconductor.wire.local_hashes import ROOT, LocalHashMap
from kvconductor.wire.query import TokenQuery
from tests import test_http_api
from tests.test_http_api import BS, HASHES, TOKENS, assert_error, meta, post_json, query, store

if TYPE_CHECKING:
    from tests.test_http_api import Client, MakeClient

make_client = test_http_api.make_client

ON = IndexLimits(local_hash_map=1000)
PATH = "/query_tiered_by_hash"


def i64(value: int) -> int:
    """A u64 hash as Dynamo's router sends it (`hash.0 as i64`)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def dynamo_hashes(tokens: list[int], seed: int = lora_seed(None)) -> list[int]:
    """Dynamo's local block hashes of a prompt's full blocks."""
    full = len(tokens) // BS
    return [i64(local_block_hash(tokens[i * BS : (i + 1) * BS], seed)) for i in range(full)]


def body(hashes: list[int] | None = None, **extra: Any) -> dict[str, Any]:
    hashes = dynamo_hashes(TOKENS) if hashes is None else hashes
    return {"block_hashes": hashes, "model_name": "m", "routing_group": "default", **extra}


def fed(limits: IndexLimits = ON) -> Conductor:
    """test_http_api's index (`fed_conductor`) plus an instance with a
    decimal id: vllm-0 rank 0 GPU 0-1, CPU 2, DISK 3; rank 1 GPU 0; vllm-1
    GPU 0-3; 7 GPU 0-1."""
    conductor = Conductor(limits)
    store(conductor, "vllm-0", 0, 1, None)
    store(conductor, "vllm-0", 2, 2, "CPU")
    store(conductor, "vllm-0", 3, 3, "DISK")
    store(conductor, "vllm-0", 0, 0, "GPU", rank=1)
    store(conductor, "vllm-1", 0, 3, "GPU")
    store(conductor, "7", 0, 1, "GPU")
    return conductor


def worker(instance: str, rank: int = 0) -> dict[str, int]:
    return {"worker_id": worker_id(instance), "dp_rank": rank}


def by_worker(pairs: list[list[Any]]) -> dict[tuple[int, int], int]:
    return {(w["worker_id"], w["dp_rank"]): n for w, n in pairs}


def tiers(answer: dict[str, Any]) -> dict[str, dict[tuple[int, int], int]]:
    """Device scores and each lower tier's hits, keyed by (worker, rank)."""
    tiered = answer["tiered"]
    out = {"device": by_worker(tiered["device"]["scores"])}
    for name, hits in tiered["lower_tier"]:
        out[name] = by_worker(hits["hits"])
    return out


async def device_hits(client: Client) -> dict[tuple[int, int], int]:
    """The device scores of Dynamo's query for the whole of TOKENS."""
    status, answer, _ = await post_json(client, PATH, body())
    assert status == 200, answer
    return tiers(answer)["device"]


# ------------------------------------------------------------- answers


async def test_answer_in_dynamos_shape(make_client: MakeClient) -> None:
    client = await make_client(fed())
    resp = await client.post(PATH, data=json.dumps(body()))
    assert resp.status == 200
    assert resp.content_type == "application/json"
    answer = await resp.json()
    assert list(answer) == ["block_size", "tiered"]
    assert answer["block_size"] == BS
    assert list(answer["tiered"]) == ["device", "lower_tier"]
    assert list(answer["tiered"]["device"]) == ["scores", "frequencies"]
    assert answer["tiered"]["device"]["frequencies"] == []
    # Tuples are arrays, tiers in Dynamo's walk order, workers sorted.
    assert [t for t, _ in answer["tiered"]["lower_tier"]] == ["host_pinned", "disk"]
    scores = answer["tiered"]["device"]["scores"]
    assert scores == sorted(scores, key=lambda p: (p[0]["worker_id"], p[0]["dp_rank"]))
    v0, v0r1, v1, seven = worker("vllm-0"), worker("vllm-0", 1), worker("vllm-1"), worker("7")
    assert seven == {"worker_id": 7, "dp_rank": 0}
    assert tiers(answer) == {
        "device": {
            (v0["worker_id"], 0): 2,
            (v0r1["worker_id"], 1): 1,
            (v1["worker_id"], 0): 4,
            (7, 0): 2,
        },
        # Every rank of the device walk, then the blocks each continues
        # with past the tier above: vllm-0 rank 0's block 2 in its host
        # tier, block 3 on its disk.
        "host_pinned": {
            (v0["worker_id"], 0): 1,
            (v0r1["worker_id"], 1): 0,
            (v1["worker_id"], 0): 0,
            (7, 0): 0,
        },
        "disk": {
            (v0["worker_id"], 0): 1,
            (v0r1["worker_id"], 1): 0,
            (v1["worker_id"], 0): 0,
            (7, 0): 0,
        },
    }


async def test_same_hits_as_query_for_the_same_tokens(make_client: MakeClient) -> None:
    conductor = fed()
    client = await make_client(conductor)
    for n in range(len(TOKENS) // BS + 1):
        tokens = TOKENS[: n * BS]
        status, answer, _ = await post_json(client, PATH, body(dynamo_hashes(tokens)))
        assert status == 200, answer
        got = tiers(answer)
        status, contract, _ = await post_json(client, "/query", query(token_ids=tokens))
        assert status == 200
        ranks = conductor.query_ranks(TokenQuery(model="m", block_size=BS, token_ids=tokens))
        for instance, by_rank in ranks.items():
            for rank, (gpu, cpu, disk) in by_rank.items():
                key = (worker_id(instance), rank)
                device = got["device"].get(key, 0)
                host = got["host_pinned"].get(key, 0)
                lower = got["disk"].get(key, 0)
                assert (device, device + host, device + host + lower) == (
                    gpu // BS,
                    cpu // BS,
                    disk // BS,
                )
                # /query's DP[rank] is the rank's whole continuation.
                dp = contract["default"][instance]["DP"][str(rank)]
                assert (device + host + lower) * BS == dp


async def test_a_hash_not_known_ends_the_prefix(make_client: MakeClient) -> None:
    client = await make_client(fed())
    hashes = dynamo_hashes(TOKENS)
    hashes[2] = 12345
    status, answer, _ = await post_json(client, PATH, body(hashes))
    assert status == 200
    assert tiers(answer)["device"][(worker_id("vllm-1"), 0)] == 2
    assert tiers(answer)["host_pinned"][(worker_id("vllm-0"), 0)] == 0
    # The same blocks in another order are another prompt.
    status, answer, _ = await post_json(client, PATH, body(dynamo_hashes(TOKENS)[1:]))
    assert status == 200
    assert tiers(answer)["device"] == {}


async def test_unsigned_hashes_are_taken_too(make_client: MakeClient) -> None:
    client = await make_client(fed())
    _, signed, _ = await post_json(client, PATH, body())
    unsigned = [h & MASK64 for h in dynamo_hashes(TOKENS)]
    status, answer, _ = await post_json(client, PATH, body(unsigned))
    assert status == 200
    assert answer == signed


async def test_lora_blocks_match_under_the_lora_seed(make_client: MakeClient) -> None:
    conductor = Conductor(ON)
    event = BlockStored(
        block_hashes=HASHES[:3],
        token_ids=TOKENS[: 3 * BS],
        block_size=BS,
        lora_name="adapter-a",
    )
    conductor.snapshot_state().apply_engine("vllm-0", meta(), EngineBatch(1.0, [event], 0), 1.0)
    client = await make_client(conductor)
    lora = dynamo_hashes(TOKENS, lora_seed("adapter-a"))
    status, answer, _ = await post_json(client, PATH, body(lora))
    assert status == 200
    assert answer["block_size"] == BS
    assert tiers(answer)["device"] == {(worker_id("vllm-0"), 0): 3}
    # The base model's hashes of the same tokens are another namespace's.
    assert await device_hits(client) == {}
    # /query for the same tokens and LoRA agrees.
    status, contract, _ = await post_json(client, "/query", query(lora_name="adapter-a"))
    assert contract["default"]["vllm-0"]["GPU"] == 3 * BS


# ------------------------------------------------------------ salted requests

# The first block's local hash of tokens 100..115 (block size 16) as
# ai-dynamo-runtime 1.6.1's `compute_block_hash_for_seq(tokens, 16,
# lora_name=..., cache_namespace=...)` computes it.
DYNAMO_1_6_1 = [
    (None, None, 10823191264391160519),
    ("", "", 10823191264391160519),
    (None, "s1", 13028234901878029932),
    ("ad", None, 682217097734764133),
    ("ad", "s1", 3575278362467983864),
    ("ad", "s\u00e4lz", 968031579386448307),
]


@pytest.mark.parametrize(("lora", "salt", "expected"), DYNAMO_1_6_1)
def test_the_seed_is_dynamos(lora: str | None, salt: str | None, expected: int) -> None:
    tokens = [100 + i for i in range(16)]
    assert local_block_hash(tokens, dynamo_seed(lora, salt)) == expected
    if not salt:
        assert dynamo_seed(lora, salt) == lora_seed(lora or None)


def test_the_seed_is_dynamos_own_when_installed() -> None:
    core = pytest.importorskip("dynamo._core")
    tokens = list(range(7, 7 + 3 * BS))
    for lora in (None, "adapter-a"):
        for salt in (None, "tenant-42", "\u00fcber"):
            theirs = core.compute_block_hash_for_seq(
                tokens, BS, lora_name=lora, cache_namespace=salt
            )
            mine = [
                local_block_hash(tokens[i * BS : (i + 1) * BS], dynamo_seed(lora, salt))
                for i in range(3)
            ]
            assert [h & MASK64 for h in theirs] == mine, (lora, salt)


def store_in(
    conductor: Conductor,
    instance: str,
    blocks: int,
    salt: str = "",
    lora: str | None = None,
    medium: str | None = None,
) -> None:
    """Blocks 0..blocks-1 of TOKENS in the namespace of `salt` (the records'
    `kv-salt`) and `lora`."""
    event = BlockStored(
        block_hashes=HASHES[:blocks],
        token_ids=TOKENS[: blocks * BS],
        block_size=BS,
        lora_name=lora,
        medium=medium,
    )
    batch = EngineBatch(1.0, [event], 0)
    conductor.snapshot_state().apply_engine(instance, meta()._replace(salt=salt), batch, 1.0)


async def test_a_salted_request_is_answered_from_the_salted_namespace(
    make_client: MakeClient,
) -> None:
    conductor = Conductor(ON)
    store_in(conductor, "plain", 2)
    store_in(conductor, "salted", 3, salt="s1")
    client = await make_client(conductor)
    salted = dynamo_hashes(TOKENS, dynamo_seed(None, "s1"))
    status, answer, _ = await post_json(client, PATH, body(salted))
    assert status == 200 and answer["block_size"] == BS
    assert tiers(answer)["device"] == {(worker_id("salted"), 0): 3}
    # Unsalted, the request is the unsalted namespace's only.
    assert await device_hits(client) == {(worker_id("plain"), 0): 2}
    # Another salt is another namespace: nothing.
    other = dynamo_hashes(TOKENS, dynamo_seed(None, "s2"))
    assert tiers((await post_json(client, PATH, body(other)))[1])["device"] == {}
    # /query with the same cache_salt shows the same blocks held.
    status, contract, _ = await post_json(client, "/query", query(cache_salt="s1"))
    assert contract["default"]["salted"]["GPU"] == 3 * BS


async def test_a_salted_lora_request_needs_both_seeds(make_client: MakeClient) -> None:
    conductor = Conductor(ON)
    store_in(conductor, "vllm-0", 4, salt="s1", lora="adapter-a")
    store_in(conductor, "vllm-1", 2, salt="s1", lora="adapter-a", medium="CPU")
    client = await make_client(conductor)
    both = dynamo_hashes(TOKENS, dynamo_seed("adapter-a", "s1"))
    status, answer, _ = await post_json(client, PATH, body(both))
    assert status == 200
    got = tiers(answer)
    assert got["device"] == {(worker_id("vllm-0"), 0): 4}
    assert got["host_pinned"][(worker_id("vllm-1"), 0)] == 2
    for seed in (lora_seed("adapter-a"), dynamo_seed(None, "s1"), lora_seed(None)):
        status, answer, _ = await post_json(client, PATH, body(dynamo_hashes(TOKENS, seed)))
        assert tiers(answer)["device"] == {}
    status, contract, _ = await post_json(
        client, "/query", query(cache_salt="s1", lora_name="adapter-a")
    )
    assert contract["default"]["vllm-0"]["GPU"] == 4 * BS


async def test_a_salted_chain_resolved_late_is_learnt(make_client: MakeClient) -> None:
    conductor = Conductor(ON)
    later = BlockStored(
        block_hashes=HASHES[1:3],
        parent_block_hash=HASHES[0],
        token_ids=TOKENS[BS : 3 * BS],
        block_size=BS,
    )
    salted = meta()._replace(salt="s1")
    conductor.snapshot_state().apply_engine("vllm-0", salted, EngineBatch(1.0, [later], 0), 1.0)
    store_in(conductor, "vllm-0", 1, salt="s1")
    client = await make_client(conductor)
    status, answer, _ = await post_json(
        client, PATH, body(dynamo_hashes(TOKENS, dynamo_seed(None, "s1")))
    )
    assert status == 200 and tiers(answer)["device"] == {(worker_id("vllm-0"), 0): 3}


def test_a_rooted_map_learns_the_first_block_too() -> None:
    edges = LocalHashMap(10, rooted=True)
    edges.learn(None, [50, 51], [10, 11])
    assert edges.edges == {(ROOT, 50): 10, (10, 51): 11}
    assert edges.identities([50, 51, 52]) == [10, 11]
    # Without the first block's edge nothing is known.
    assert edges.identities([10, 51]) == []
    assert LocalHashMap(10).identities([10, 51]) == [10]


EMPTY = b'{"block_size":0,"tiered":{"device":{"scores":[],"frequencies":[]},"lower_tier":[]}}'
NO_HIT = (
    b'{"block_size":4,"tiered":{"device":{"scores":[],"frequencies":[]},'
    b'"lower_tier":[["host_pinned",{"hits":[]}],["disk",{"hits":[]}]]}}'
)


@pytest.mark.parametrize(
    ("payload", "expected"),
    [
        pytest.param(body(model_name="other"), EMPTY, id="unknown-model"),
        pytest.param(body(routing_group="team-b"), EMPTY, id="unknown-routing-group"),
        pytest.param(body([1, 2, 3]), NO_HIT, id="nothing-matches"),
        pytest.param(body([]), NO_HIT, id="no-blocks"),
    ],
)
async def test_empty_answers(make_client: MakeClient, payload: Any, expected: bytes) -> None:
    client = await make_client(fed())
    resp = await client.post(PATH, data=json.dumps(payload))
    assert resp.status == 200
    assert await resp.read() == expected


@pytest.mark.parametrize("group", [None, "", "default", "missing"])
async def test_routing_group_default_is_the_default_tenant(
    make_client: MakeClient, group: str | None
) -> None:
    client = await make_client(fed())
    payload = body(routing_group=group)
    if group == "missing":
        del payload["routing_group"]
    status, answer, _ = await post_json(client, PATH, payload)
    assert status == 200
    assert tiers(answer)["device"][(worker_id("vllm-1"), 0)] == 4


async def test_unknown_fields_are_ignored_as_by_dynamo(make_client: MakeClient) -> None:
    client = await make_client(fed())
    status, answer, _ = await post_json(client, PATH, body(device_only=True))
    assert status == 200
    assert tiers(answer)["device"][(worker_id("vllm-1"), 0)] == 4


# -------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        pytest.param(b"{", "malformed JSON", id="not-json"),
        pytest.param(b"[]", "invalid query", id="not-an-object"),
        pytest.param(json.dumps({"model_name": "m"}).encode(), "block_hashes", id="no-hashes"),
        pytest.param(json.dumps({"block_hashes": [1]}).encode(), "model_name", id="no-model"),
        pytest.param(json.dumps(body(["1"])).encode(), "block_hashes", id="string-hash"),
        pytest.param(json.dumps(body([1 << 64])).encode(), "block_hashes", id="hash-too-big"),
        pytest.param(json.dumps(body([-(1 << 63) - 1])).encode(), "block_hashes", id="too-small"),
        pytest.param(json.dumps(body(model_name=3)).encode(), "model_name", id="model-not-text"),
        pytest.param(json.dumps(body(routing_group=1)).encode(), "routing_group", id="group"),
    ],
)
async def test_bad_bodies_are_400(make_client: MakeClient, raw: bytes, needle: str) -> None:
    client = await make_client(fed())
    resp = await client.post(PATH, data=raw)
    answer = await resp.json()
    assert_error(resp.status, answer, 400)
    assert needle in answer["error"]


async def test_map_off_is_501_with_the_reason(make_client: MakeClient) -> None:
    client = await make_client(fed(IndexLimits()))
    status, answer, _ = await post_json(client, PATH, body())
    assert_error(status, answer, 501)
    assert "index.local_hash_map" in answer["error"]


async def test_the_bearer_token_guards_it(make_client: MakeClient) -> None:
    client = await make_client(fed(), auth_token="tok")
    status, answer, _ = await post_json(client, PATH, body())
    assert_error(status, answer, 401)
    headers = {"Authorization": "Bearer tok"}
    status, _, _ = await post_json(client, PATH, body(), headers=headers)
    assert status == 200


# ------------------------------------------------------ the local map


async def test_a_chain_resolved_late_is_learnt(make_client: MakeClient) -> None:
    # Block 1 arrives before its parent, waits, and resolves with it.
    conductor = Conductor(ON)
    store(conductor, "vllm-0", 1, 1, None)
    store(conductor, "vllm-0", 0, 0, None)
    client = await make_client(conductor)
    assert await device_hits(client) == {(worker_id("vllm-0"), 0): 2}


async def test_a_full_map_shortens_answers_never_falsifies_them(make_client: MakeClient) -> None:
    # Two edges per namespace (a first block needs none): the store of
    # blocks 2-3 pushes out block 1's edge, so the chain breaks there.
    conductor = Conductor(IndexLimits(local_hash_map=2))
    store(conductor, "vllm-0", 0, 1, None)
    store(conductor, "vllm-0", 2, 3, None)
    client = await make_client(conductor)
    assert await device_hits(client) == {(worker_id("vllm-0"), 0): 1}
    # Block 1 stored again is learnt again, and block 2's edge goes.
    store(conductor, "vllm-0", 1, 1, None)
    assert await device_hits(client) == {(worker_id("vllm-0"), 0): 2}


def test_local_hash_map_is_bounded_oldest_first() -> None:
    edges = LocalHashMap(3)
    edges.learn(None, [10, 1, 2], [10, 11, 12])  # from a first block: 2 edges
    edges.learn(12, [3], [13])
    assert edges.identities([10, 1, 2, 3]) == [10, 11, 12, 13]
    edges.learn(10, [1], [11])  # learnt again: now the youngest
    edges.learn(13, [4], [14])  # pushes out the oldest, (11, 2)
    assert len(edges) == 3
    assert edges.identities([10, 1, 2, 3, 4]) == [10, 11]
    assert edges.identities([]) == []
    edges.learn(None, [], [])
    with pytest.raises(ValueError):
        LocalHashMap(0)


@pytest.mark.parametrize(
    ("instance", "expected"),
    [
        ("7", 7),
        ("0", 0),
        (str(MASK64), MASK64),
        ("007", None),
        ("+7", None),
        ("-1", None),
        (str(MASK64 + 1), None),
        ("٣", None),  # a digit, but not ASCII
        ("vllm-0", None),
    ],
)
def test_worker_ids(instance: str, expected: int | None) -> None:
    hashed = xxhash.xxh3_64_intdigest(instance.encode("utf-8"), 0)
    assert worker_id(instance) == (hashed if expected is None else expected)


async def test_a_restored_index_learns_the_map_again(make_client: MakeClient) -> None:
    # The map is not in the snapshot: restored, the prompt matches its first
    # block (its identity is its local hash), then all of it once stored again.
    source = Conductor(ON)
    store(source, "vllm-0", 0, 3, None)
    units = dict(
        export_unit(source.snapshot_state(), kind, uid)
        for kind, uid in all_unit_ids(source.snapshot_state())
    )
    restored = Conductor(ON)
    restore(restored.snapshot_state(), {k: u for k, u in units.items() if u is not None})
    client = await make_client(restored)
    assert await device_hits(client) == {(worker_id("vllm-0"), 0): 1}
    assert restored.query_ranks(TokenQuery(model="m", block_size=BS, token_ids=TOKENS)) == {
        "vllm-0": {0: (4 * BS, 4 * BS, 4 * BS)}
    }
    store(restored, "vllm-0", 0, 3, None)
    assert await device_hits(client) == {(worker_id("vllm-0"), 0): 4}
