"""Mooncake Conductor's msgpack query form at /query and /query_by_hash
(contract v2 section 4, last paragraph; Conductor's `indexer-api-design.md`),
on aiohttp's site and on the daemon's front, against the JSON answer of the
same index."""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING, Any

import msgspec
import pytest

from kvconductor.index.fleet import Index
from kvconductor.wire.events import BlockStored
from kvconductor.wire.hashing import extra_keys_fingerprint
from kvconductor.wire.query import TokenQuery
from tests import test_http_api
from tests.test_http_api import BS, HASHES, TOKENS, post_json, query
from tests.test_index_rules import BS as RULES_BS
from tests.test_index_rules import PROMPT, engine, stored

if TYPE_CHECKING:
    from tests.test_http_api import MakeClient

# Both sites: aiohttp's and the daemon's front.
make_client = test_http_api.make_client

MSGPACK = {"Content-Type": "application/msgpack"}

# fed_conductor(): vllm-0 rank 0 GPU blocks 0-1, own CPU block 2, own DISK
# block 3; rank 1 GPU block 0; vllm-1 rank 0 GPU blocks 0-3.
VLLM0 = {
    "longest_matched": 16,
    "gpu": 8,
    "cpu": 12,
    "disk": 16,
    "dp": {"0": 8, "1": 4},
    "rank_matches": {"0": {"gpu": 8, "cpu": 12, "disk": 16}, "1": {"gpu": 4, "cpu": 4, "disk": 4}},
}
VLLM1 = {
    "longest_matched": 16,
    "gpu": 16,
    "cpu": 16,
    "disk": 16,
    "dp": {"0": 16},
    "rank_matches": {"0": {"gpu": 16, "cpu": 16, "disk": 16}},
}
FULL = {"instances": {"vllm-0": VLLM0, "vllm-1": VLLM1}}


def packed(tokens: list[int]) -> bytes:
    return struct.pack(f"<{len(tokens)}i", *tokens)


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "block_size": BS, "token_ids": packed(TOKENS), **extra}


async def post(
    client: Any, path: str, payload: object, headers: dict[str, str] = MSGPACK
) -> tuple[int, Any, str]:
    data = payload if isinstance(payload, bytes) else msgspec.msgpack.encode(payload)
    resp = await client.post(path, data=data, headers=headers)
    raw = await resp.read()
    return resp.status, msgspec.msgpack.decode(raw), resp.content_type


async def test_bin_and_array_token_ids_answer_conductors_shape(make_client: MakeClient) -> None:
    client = await make_client()
    for token_ids in (packed(TOKENS), TOKENS):
        status, answer, content_type = await post(client, "/query", body(token_ids=token_ids))
        assert (status, content_type) == (200, "application/msgpack")
        assert answer == FULL


async def test_same_match_as_the_json_answer(make_client: MakeClient) -> None:
    client = await make_client()
    _, by_json, _ = await post_json(client, "/query", query())
    _, by_msgpack, _ = await post(client, "/query", body())
    for name, row in by_json["default"].items():
        mine = by_msgpack["instances"][name]
        assert mine["longest_matched"] == row["longest_matched"]
        assert {r: m["disk"] for r, m in mine["rank_matches"].items()} == row["DP"]
        assert mine["dp"] == {r: m["gpu"] for r, m in mine["rank_matches"].items()}


async def test_filters_defaults_and_nothing_listed(make_client: MakeClient) -> None:
    client = await make_client()
    one = await post(client, "/query", body(instance_id="vllm-1"))
    assert one[1] == {"instances": {"vllm-1": VLLM1}}
    defaults = body(tenant_id="", lora_name="", cache_salt=None)
    assert (await post(client, "/query", defaults))[1] == FULL
    for miss in (
        body(instance_id="nobody"),
        body(model="other"),
        body(block_size=8),
        body(tenant_id="t"),
        body(lora_name="ad"),
    ):
        assert (await post(client, "/query", miss))[:2] == (200, {"instances": {}})


async def test_empty_and_partial_prompts(make_client: MakeClient) -> None:
    client = await make_client()
    status, answer, _ = await post(client, "/query", body(token_ids=b""))
    assert status == 200
    zeros = {"gpu": 0, "cpu": 0, "disk": 0}
    assert answer["instances"]["vllm-0"]["rank_matches"] == {"0": zeros, "1": zeros}
    # A trailing partial block is not hashed; one full block matches one block.
    _, answer, _ = await post(client, "/query", body(token_ids=packed(TOKENS[: BS + 2])))
    assert answer["instances"]["vllm-1"]["longest_matched"] == BS


async def test_query_by_hash_in_msgpack(make_client: MakeClient) -> None:
    client = await make_client()
    payload = {"model": "m", "block_size": BS, "seq_hashes": HASHES, "tenant_id": ""}
    status, answer, _ = await post(client, "/query_by_hash", payload)
    assert (status, answer) == (200, FULL)


ERRORS = [
    (body(priority="high"), "unknown_field", "priority", None),
    ({"block_size": BS, "token_ids": b""}, "missing", "model", None),
    ({"model": "m", "token_ids": b""}, "missing", "block_size", None),
    ({"model": "m", "block_size": BS}, "missing", "token_ids", None),
    (body(model=""), "invalid_value", "model", None),
    (body(model=3), "invalid_type", "model", None),
    (body(block_size=0), "out_of_range", "block_size", None),
    (body(block_size=-4), "out_of_range", "block_size", None),
    (body(block_size="4"), "invalid_type", "block_size", None),
    (body(token_ids="1,2"), "invalid_type", "token_ids", None),
    (body(token_ids=b"\x01\x02\x03"), "invalid_value", "token_ids", None),
    (body(token_ids=[1, "a"]), "invalid_type", "token_ids", 1),
    (body(token_ids=[0, 2**31]), "out_of_range", "token_ids", 1),
    (body(token_ids=[-(2**31) - 1]), "out_of_range", "token_ids", 0),
    (body(tenant_id=5), "invalid_type", "tenant_id", None),
    (body(lora_name=[]), "invalid_type", "lora_name", None),
    (body(cache_salt=1), "invalid_type", "cache_salt", None),
    (body(instance_id=1), "invalid_type", "instance_id", None),
]


@pytest.mark.parametrize(("payload", "reason", "field", "index"), ERRORS)
async def test_conductors_validation(
    make_client: MakeClient, payload: dict[str, Any], reason: str, field: str, index: int | None
) -> None:
    client = await make_client()
    status, answer, content_type = await post(client, "/query", payload)
    assert (status, content_type) == (400, "application/msgpack")
    expected = {"error": answer.get("error"), "reason": reason, "field": field}
    if index is not None:
        expected["index"] = index
    assert answer == expected
    assert isinstance(answer["error"], str) and answer["error"]


@pytest.mark.parametrize("raw", [b"\xc1", b"", msgspec.msgpack.encode([1, 2]), b"\x93\x01"])
async def test_not_a_msgpack_map(make_client: MakeClient, raw: bytes) -> None:
    client = await make_client()
    status, answer, _ = await post(client, "/query", raw)
    assert status == 400
    assert answer["reason"] == "invalid_msgpack"
    assert set(answer) == {"error", "reason"}


async def test_negative_int32_tokens_are_the_bins_bytes(make_client: MakeClient) -> None:
    client = await make_client()
    as_array = await post(client, "/query", body(token_ids=[-1] * BS))
    as_bin = await post(client, "/query", body(token_ids=b"\xff" * 4 * BS))
    assert as_array == as_bin
    assert as_array[0] == 200


def test_per_rank_lengths_merge_a_salted_namespace_like_the_json_answer() -> None:
    # A per-request salt lives in the unsalted namespace's extra keys
    # (query.run_query): the per-rank answer takes the same second look.
    ix = Index()
    salt = extra_keys_fingerprint(["s3cret"])
    engine(ix, "a", BlockStored([1, 2], None, PROMPT[:8], RULES_BS, extra_keys=[salt, None]))
    engine(ix, "b", stored(0, 2))
    for cache_salt in (None, "s3cret", "other"):
        req = TokenQuery("m", RULES_BS, PROMPT, cache_salt=cache_salt)
        ranks = ix.query_ranks(req)
        rows = ix.query(req).get("default", {})
        assert {n: r[0][2] for n, r in ranks.items() if r[0][2]} == {
            n: row["DISK"] for n, row in rows.items() if row["DISK"]
        }
    assert ix.query_ranks(TokenQuery("m", RULES_BS, PROMPT, cache_salt="s3cret"))["a"] == {
        0: (8, 8, 8)
    }
