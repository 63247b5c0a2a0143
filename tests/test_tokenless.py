"""vLLM's own block names from a hash profile (`engine_hashes`), checked
against real vLLM output, and the answer-time reading of token-less
holdings by those names (`tokenless`): in process, and through the daemon
with a registration binding the profile over a real registrations topic.

The fixtures' vLLM (0.32.0) hashes with `sha256` and, `PYTHONHASHSEED`
being unset, its fixed seed `"vllm-none-hash"`, and publishes int hashes."""

from __future__ import annotations

import base64
import hashlib
import json
import uuid
from collections.abc import Iterator
from typing import Any

import aiohttp
import msgspec
import pytest

from kvconductor.index.conductor import Conductor
from kvconductor.registry.bodies import HashProfile, check_hash_profile, root_digest
from kvconductor.snapshots.units import state_fingerprint
from kvconductor.wire.engine_hashes import (
    DEFAULT_NONE_HASH_SEED,
    BlockNames,
    VllmProfile,
    encode,
    none_hash,
)
from kvconductor.wire.events import PoolBatch, PoolEvent
from kvconductor.wire.query import TokenQuery
from kvconductor.wire.records import PoolMeta
from tests.harness import (
    FIXTURE_ROOT,
    daemon_config,
    engine_headers,
    produce,
    running,
    stored,
    vllm_payload,
    wait_for,
)
from tests.test_hybrid_models import live_messages
from tests.test_registrations import conductor_body, post_msgpack

VLLM = VllmProfile("sha256", DEFAULT_NONE_HASH_SEED)
PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256",
    "python_hash_seed": DEFAULT_NONE_HASH_SEED,
    "index_projection": "low64_be",
}


# ------------------------------------------------------------ the names


def _hybrid_stores() -> Iterator[tuple[str, dict[str, Any]]]:
    """(instance, BlockStored) of the full-attention groups whose blocks are
    vLLM's hash blocks, in produce order (a larger block is named by the
    hash of its last hash block)."""
    folder = FIXTURE_ROOT / "vllm-hybrid"
    plain = {
        inst["instance"]
        for inst in json.loads((folder / "instances.json").read_text())
        if inst["groups"][0]["block_size"] == inst["hash_block_size"]
    }
    for line in (folder / "records.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["key"] not in plain:
            continue
        _, events, _ = msgspec.msgpack.decode(base64.b64decode(record["value_b64"]))
        for ev in events:
            if ev["type"] == "BlockStored" and not ev.get("group_idx"):
                yield record["key"], ev


def _live_stores(run: str) -> Iterator[tuple[str, dict[str, Any]]]:
    for frames in live_messages(run):
        _, events, _ = msgspec.msgpack.decode(frames[2])
        for ev in events:
            if ev["type"] == "BlockStored":
                yield "vllm-cpu-0", ev


def _recomputed(stores: Iterator[tuple[str, dict[str, Any]]]) -> tuple[int, list[str]]:
    """Every store's hashes recomputed from its prompt's tokens (its
    parent's chain from the first block, then its own): (blocks checked,
    mismatches)."""
    prefixes: dict[tuple[str, int], list[int]] = {}
    checked = 0
    wrong: list[str] = []
    for instance, ev in stores:
        hashes, tokens, bs = ev["block_hashes"], ev["token_ids"], ev["block_size"]
        if not hashes or len(tokens) != len(hashes) * bs:
            continue  # a partial-block key: not a block of this size
        parent = ev["parent_block_hash"]
        before = [] if parent is None else prefixes[(instance, parent)]
        prompt = before + tokens
        names = BlockNames(VLLM, prompt, bs)
        first = len(before) // bs
        for i, h in enumerate(hashes):
            prefixes[(instance, h)] = prompt[: (first + i + 1) * bs]
            checked += 1
            if names[first + i] != h:
                wrong.append(f"{instance} block {first + i}: {names[first + i]} != {h}")
    return checked, wrong


def test_names_are_vllms_in_its_hybrid_fixture() -> None:
    checked, wrong = _recomputed(_hybrid_stores())
    assert wrong == [] and checked > 1000


@pytest.mark.parametrize("run", ["scripted", "random-seed3"])
def test_names_are_a_running_vllms(run: str) -> None:
    checked, wrong = _recomputed(_live_stores(run))
    assert wrong == [] and checked > 50


def test_the_root_and_the_encodings() -> None:
    # vLLM's NONE_HASH: its hash function of the seed text.
    assert none_hash(VLLM) == hashlib.sha256(encode("sha256", DEFAULT_NONE_HASH_SEED)).digest()
    check_hash_profile(HashProfile(**PROFILE))  # vLLM's own seed is taken too
    seeded = HashProfile(**{**PROFILE, "python_hash_seed": "0"})
    assert root_digest(seeded) == none_hash(VllmProfile("sha256", "0")).hex()
    # Canonical CBOR, RFC 8949 appendix A's examples.
    cases: list[tuple[Any, str]] = [
        (0, "00"),
        (23, "17"),
        (24, "1818"),
        (1000000, "1a000f4240"),
        (2**64 - 1, "1bffffffffffffffff"),
        (-1, "20"),
        (-1000, "3903e7"),
        (None, "f6"),
        (b"\x01\x02\x03\x04", "4401020304"),
        ("IETF", "6449455446"),
        ("\u00fc", "62c3bc"),
        ((1, (2, 3), (4, 5)), "8301820203820405"),
        (tuple(range(1, 26)), "98190102030405060708090a0b0c0d0e0f101112131415161718181819"),
    ]
    for value, want in cases:
        assert encode("sha256_cbor", value).hex() == want
    with pytest.raises(ValueError, match="unsupported"):
        encode("xxhash", 1)


def test_extra_keys_change_the_names() -> None:
    tokens = list(range(32))
    plain = BlockNames(VLLM, tokens, 16)
    salted = BlockNames(VLLM, tokens, 16, cache_salt="s")
    lora = BlockNames(VLLM, tokens, 16, lora_name="a")
    assert len({plain[0], salted[0], lora[0]}) == 3
    assert len({plain[1], salted[1], lora[1]}) == 3  # the salt reaches later blocks by the chain
    with pytest.raises(IndexError):
        plain[2]


# ------------------------------------------------------------ the answer

BS = 16
MODEL = "dense/llama-like-16"


def _prompt() -> list[int]:
    """A real prompt of the fixture's and vLLM's names for its blocks."""
    _, ev = next(_hybrid_stores())
    return list(ev["token_ids"])


def _record(instance: str, events: list[dict[str, Any]], seq: int) -> tuple[str, bytes, Any]:
    headers = engine_headers(MODEL, BS, **{"kv-seq": str(seq)})
    return instance, vllm_payload(events), headers


def _other_prompt() -> list[int]:
    return [3000 + i for i in range(4 * BS)]


def _tokenless_fleet() -> list[tuple[str, bytes, Any]]:
    """On the fixture's prompt: `mix-0` stored blocks 0-3 on its GPU with
    token ids (so their content is known), then 4-5 without; `tl-0` holds
    0-7 on its GPU and 8-11 in its CPU tier, all without; `cpu-0` holds 0-1
    on its GPU with token ids and 2-5 in its CPU tier without. On another
    prompt, `only-0` holds blocks 0-3 without token ids, content never
    seen."""
    tokens = _prompt()
    names = BlockNames(VLLM, tokens, BS)
    h = [names[i] for i in range(12)]
    other = BlockNames(VLLM, _other_prompt(), BS)
    return [
        _record("mix-0", [stored(h[:4], tokens[: 4 * BS], block_size=BS)], 0),
        _record("mix-0", [stored(h[4:6], None, h[3], block_size=BS)], 1),
        _record("tl-0", [stored(h[:8], None, block_size=BS)], 0),
        _record("tl-0", [stored(h[8:12], None, h[7], "CPU", BS)], 1),
        _record("cpu-0", [stored(h[:2], tokens[: 2 * BS], block_size=BS)], 0),
        _record("cpu-0", [stored(h[2:6], None, h[1], "CPU", BS)], 1),
        _record("only-0", [stored([other[i] for i in range(4)], None, block_size=BS)], 0),
    ]


def _fed() -> Conductor:
    conductor = Conductor()
    for key, value, headers in _tokenless_fleet():
        conductor.ingest_engine_record(key, headers, value, 1.0)
    return conductor


def _rows(answer: Any) -> dict[str, tuple[int, int, int]]:
    """The instances that match, by (GPU, CPU, DISK)."""
    rows = answer.get("default", {}).items()
    return {k: (v["GPU"], v["CPU"], v["DISK"]) for k, v in rows if v["DISK"]}


CONTENT = {"mix-0": (64, 64, 64), "tl-0": (64, 64, 64), "cpu-0": (32, 64, 64)}
WITH_NAMES = {"mix-0": (96, 96, 96), "tl-0": (128, 192, 192), "cpu-0": (32, 96, 96)}


def test_tokenless_holdings_answer_with_a_profile() -> None:
    conductor = _fed()
    req = TokenQuery(model=MODEL, block_size=BS, token_ids=_prompt()[: 12 * BS + 5])
    # Content alone: the blocks stored with token ids, and those whose
    # content another store showed.
    assert _rows(conductor.query(req)) == CONTENT
    before = state_fingerprint(conductor.snapshot_state())
    pending = conductor.pending()
    answer = conductor.snapshot_state().query(req, profiles=[VLLM])
    assert _rows(answer) == WITH_NAMES
    assert answer["default"]["tl-0"]["DP"] == {"0": 192}
    # Read only: nothing placed, nothing resolved; the next query is the same.
    assert conductor.pending() == pending
    assert state_fingerprint(conductor.snapshot_state()) == before
    assert _rows(conductor.query(req)) == CONTENT
    assert conductor.counters["tokenless_answers"] == 1
    assert conductor.counters["tokenless_blocks_answered"] == 8 + 2 + 2
    # The JSON body and the per-rank form say the same.
    assert msgspec.json.decode(conductor.snapshot_state().query_json(req, None, [VLLM])) == answer
    assert conductor.snapshot_state().query_ranks(req, None, [VLLM])["tl-0"] == {0: (128, 192, 192)}


def test_an_owner_holding_only_tokenless_blocks() -> None:
    conductor = _fed()
    req = TokenQuery(model=MODEL, block_size=BS, token_ids=_other_prompt())
    assert _rows(conductor.query(req)) == {}
    answer = conductor.snapshot_state().query(req, profiles=[VLLM])
    assert _rows(answer) == {"only-0": (64, 64, 64)}
    assert conductor.snapshot_state().query_ranks(req, None, [VLLM])["only-0"] == {0: (64, 64, 64)}
    # It has no slot of its own in the namespace: nothing of it is held.
    assert not any("only-0" in ns.owners for ns in conductor.snapshot_state().namespaces.values())


def test_only_what_the_profile_names() -> None:
    conductor = _fed()
    req = TokenQuery(model=MODEL, block_size=BS, token_ids=_prompt()[: 12 * BS])
    # Another seed names other blocks: nothing more.
    other = VllmProfile("sha256", "0")
    assert _rows(conductor.snapshot_state().query(req, profiles=[other])) == CONTENT
    assert _rows(conductor.snapshot_state().query(req, profiles=[other, VLLM])) == WITH_NAMES
    # One instance only, and a prompt that differs in its first block.
    alone = TokenQuery(model=MODEL, block_size=BS, token_ids=req.token_ids, instance_id="tl-0")
    assert _rows(conductor.snapshot_state().query(alone, profiles=[VLLM])) == {
        "tl-0": (128, 192, 192)
    }
    changed = TokenQuery(model=MODEL, block_size=BS, token_ids=[7, *req.token_ids[1:]])
    assert _rows(conductor.snapshot_state().query(changed, profiles=[VLLM])) == {}
    # A cut of the prompt answers its blocks only.
    short = TokenQuery(model=MODEL, block_size=BS, token_ids=req.token_ids[: 6 * BS])
    assert _rows(conductor.snapshot_state().query(short, profiles=[VLLM]))["tl-0"] == (96, 96, 96)


def test_hybrid_instances_are_left_to_content() -> None:
    """A hybrid rank's device hit needs its other groups' blocks too, which
    no token-less store places: names never extend it."""
    conductor = _fed()
    h = [BlockNames(VLLM, _other_prompt(), BS)[i] for i in range(4)]
    kinds = [
        {**stored(h, None, block_size=BS), "group_idx": 0, "kv_cache_spec_kind": "full_attention"},
        {
            **stored(h, None, block_size=BS),
            "group_idx": 1,
            "kv_cache_spec_kind": "sliding_window",
            "kv_cache_spec_sliding_window": 32,
        },
    ]
    key, value, headers = _record("hyb-0", kinds, 0)
    conductor.ingest_engine_record(key, headers, value, 1.0)
    req = TokenQuery(model=MODEL, block_size=BS, token_ids=_other_prompt())
    assert _rows(conductor.snapshot_state().query(req, profiles=[VLLM])) == {"only-0": (64, 64, 64)}


def test_pool_confirmations_and_per_request_salts() -> None:
    """A pool confirmation waiting for its content continues every rank's
    host tier; a query's `cache_salt` is in its first block's name, where
    vLLM puts it (the unsalted namespace's blocks answer it)."""
    conductor = _fed()
    tokens = _other_prompt()
    longer = tokens + [3100 + i for i in range(2 * BS)]
    names = BlockNames(VLLM, longer, BS)
    confirm = PoolEvent("stored", [names[4], names[5]], medium="cpu")
    conductor.snapshot_state().apply_pool(
        "mc-0", PoolMeta(MODEL, BS, "default", "", None), PoolBatch(1.0, [confirm]), 1.0
    )
    req = TokenQuery(model=MODEL, block_size=BS, token_ids=longer)
    assert _rows(conductor.snapshot_state().query(req, profiles=[VLLM]))["only-0"] == (64, 96, 96)
    salted = BlockNames(VLLM, tokens, BS, cache_salt="s")
    key, value, headers = _record(
        "salt-0", [stored([salted[0], salted[1]], None, block_size=BS)], 0
    )
    conductor.ingest_engine_record(key, headers, value, 1.0)
    ask = TokenQuery(model=MODEL, block_size=BS, token_ids=tokens, cache_salt="s")
    assert _rows(conductor.snapshot_state().query(ask, profiles=[VLLM])) == {"salt-0": (32, 32, 32)}
    assert conductor.snapshot_state().query_ranks(ask, None, [VLLM]) == {
        "salt-0": {0: (32, 32, 32)}
    }


# ------------------------------------------------------- through the daemon


@pytest.mark.kafka
async def test_a_registered_profile_finds_tokenless_blocks(kafka_bootstrap: str) -> None:
    topic = f"kv-bridge-registrations-{uuid.uuid4().hex[:8]}"
    cfg = daemon_config(kafka_bootstrap, KVCONDUCTOR_HTTP_REGISTRATIONS_TOPIC=topic)
    query = {"model": MODEL, "block_size": BS, "token_ids": _prompt()[: 12 * BS]}
    async with running(cfg) as daemon:
        assert daemon.http_port is not None and daemon.registrations is not None
        await wait_for(daemon.registrations.loaded.is_set, 30, "the daemon's registrations")
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, _tokenless_fleet())
        await wait_for(
            lambda: daemon.conductor.applied[("vllm", "GPU")] >= 6, 30, "the stores applied"
        )
        await wait_for(lambda: daemon.conductor.pending()["waiting"] >= 16, 30, "the waits")
        port = daemon.http_port
        status, before = await post_msgpack(port, "/query", query)
        assert status == 200 and before["instances"]["tl-0"]["gpu"] == 64

        body = conductor_body(
            instance_id="tl-0", modelname=MODEL, block_size=BS, hash_profile=dict(PROFILE)
        )
        assert (await post_msgpack(port, "/register", body))[0] == 200
        status, after = await post_msgpack(port, "/query", query)
        assert status == 200
        assert after["instances"]["tl-0"] == {
            "longest_matched": 192,
            "gpu": 128,
            "cpu": 192,
            "disk": 192,
            "dp": {"0": 128},
            "rank_matches": {"0": {"gpu": 128, "cpu": 192, "disk": 192}},
        }
        assert after["instances"]["mix-0"]["gpu"] == 96
        # An instance holding nothing of known content is listed once it matches.
        other = {"model": MODEL, "block_size": BS, "token_ids": _other_prompt()}
        assert (await post_msgpack(port, "/query", other))[1]["instances"]["only-0"]["gpu"] == 64
        json_answer = await _post_json(port, "/query", query)
        assert json_answer["default"]["tl-0"]["GPU"] == 128
        assert json_answer["default"]["cpu-0"]["CPU"] == 96


async def _post_json(port: int, path: str, body: object) -> Any:
    async with (
        aiohttp.ClientSession() as session,
        session.post(f"http://127.0.0.1:{port}{path}", json=body) as r,
    ):
        assert r.status == 200
        return await r.json()
