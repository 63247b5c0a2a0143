"""The daemon on the real broker: fixtures in, HTTP answers out, dead letters,
exact restart from snapshots."""

from __future__ import annotations

import random
from typing import Any

import pytest

from kvconductor.index.conductor import Conductor
from kvconductor.snapshots.units import state_fingerprint
from kvconductor.wire.query import TokenQuery
from tests.harness import (
    FIXTURES,
    daemon_config,
    engine_headers,
    http_json,
    pool_payload,
    produce,
    read_all,
    removed,
    running,
    stored,
    vllm_payload,
    wait_for,
)

pytestmark = pytest.mark.kafka

TOKENS = list(range(101, 109))  # the fixtures' prompt: two blocks of four


def query(tokens: list[int], **kw: object) -> dict[str, object]:
    return {"model": "m", "block_size": 4, "token_ids": tokens, **kw}


async def test_real_fixtures_through_kafka_answer_queries(kafka_bootstrap: str) -> None:
    cfg = daemon_config(kafka_bootstrap)
    records = []
    for version in ("0.9.0", "0.10.2", "0.22.0", "0.28.0", "0.33.0", "0.33.0-bytes-hashes"):
        payload = (FIXTURES / version / "stored.msgpack").read_bytes()
        records.append((f"vllm-{version}", payload, engine_headers()))
    async with running(cfg) as daemon:
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, records)
        port = daemon.http_port
        assert port is not None

        async def all_six() -> bool:
            _, body = await http_json(port, "POST", "/query", query(TOKENS))
            return len(body.get("default", {})) == 6

        await wait_for(all_six, 30, "six instances indexed")
        status, body = await http_json(port, "POST", "/query", query(TOKENS))
        assert status == 200
        for version in ("0.9.0", "0.33.0", "0.33.0-bytes-hashes"):
            assert body["default"][f"vllm-{version}"] == {
                "longest_matched": 8,
                "GPU": 8,
                "CPU": 8,
                "DISK": 8,
                "DP": {"0": 8},
            }
        # Removal fixtures take the second block away again.
        removals = [
            (f"vllm-{v}", (FIXTURES / v / "removed.msgpack").read_bytes(), engine_headers())
            for v in ("0.9.0", "0.33.0")
        ]
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, removals)

        async def removed_applied() -> bool:
            _, body = await http_json(port, "POST", "/query", query(TOKENS))
            return body["default"]["vllm-0.33.0"]["GPU"] == 4  # type: ignore[no-any-return]

        await wait_for(removed_applied, 30, "removals applied")
        _, body = await http_json(port, "POST", "/query", query(TOKENS))
        assert body["default"]["vllm-0.9.0"]["GPU"] == 4
        assert body["default"]["vllm-0.10.2"]["GPU"] == 8
        status, body = await http_json(port, "POST", "/query", {"model": "m"})
        assert status == 400 and "error" in body
        await wait_for(lambda: daemon.ready()[0], 30, "ready")
        status, _ = await http_json(port, "GET", "/ready")
        assert status == 200


async def test_poison_records_are_dead_lettered_and_good_ones_applied(
    kafka_bootstrap: str,
) -> None:
    cfg = daemon_config(kafka_bootstrap)
    good1 = vllm_payload([stored([1], TOKENS[:4])])
    good2 = vllm_payload([stored([2], TOKENS[4:], parent=1)])
    records = [
        ("a", good1, engine_headers()),
        ("a", b"\xc1garbage", engine_headers()),
        ("a", good1, [("kv-block-size", b"4")]),  # no kv-model
        ("a", good1, engine_headers(block_size="x")),  # type: ignore[arg-type]
        ("a", vllm_payload([{"type": "BlockStored", "block_hashes": ["no"]}]), engine_headers()),
        ("a", good2, engine_headers()),
    ]
    async with running(cfg) as daemon:
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, records)
        port = daemon.http_port
        assert port is not None

        async def both_applied() -> bool:
            _, body = await http_json(port, "POST", "/query", query(TOKENS))
            return body.get("default", {}).get("a", {}).get("GPU") == 8  # type: ignore[no-any-return]

        await wait_for(both_applied, 30, "good records applied")
        dead: list[Any] = []

        async def four_dead_letters() -> bool:
            # Queries see a batch's records before its dead letters are flushed.
            dead[:] = await read_all(kafka_bootstrap, cfg.kafka.dead_letter_topic)
            return len(dead) >= 4

        await wait_for(four_dead_letters, 60, "four dead letters")
    assert len(dead) == 4
    kinds = []
    for rec in dead:
        h = dict(rec.headers)
        kinds.append(h["dlq-kind"].decode())
        assert h["dlq-source-topic"].decode() == cfg.kafka.engine_topic
        assert int(h["dlq-source-offset"]) in (1, 2, 3, 4)
        assert h["dlq-reason"]
        assert rec.key == b"a"
    assert sorted(kinds) == sorted(["undecodable", "missing_header", "invalid_header", kinds[3]])
    assert kinds[3] in ("undecodable", "rejected")


def random_stream(
    seed: int, n: int
) -> tuple[
    list[tuple[str, bytes, list[tuple[str, bytes]]]],
    list[tuple[str, bytes, list[tuple[str, bytes]]]],
]:
    """Engine and pool records: shared prefixes, removals, offloads, confirmations."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(50) for _ in range(4 * 6)] for _ in range(6)]
    engine: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []
    pool: list[tuple[str, bytes, list[tuple[str, bytes]]]] = []
    held: dict[str, list[int]] = {}
    for _ in range(n):
        inst = f"vllm-{rng.randrange(4)}"
        p = rng.choice(prompts)
        nblocks = rng.randrange(1, 7)
        hashes = [hash(tuple(p[: 4 * (i + 1)])) & ((1 << 64) - 1) for i in range(nblocks)]
        r = rng.random()
        if r < 0.5:
            medium = rng.choice(["GPU", "GPU", "CPU", "DISK"])
            engine.append(
                (
                    inst,
                    vllm_payload([stored(hashes, p[: 4 * nblocks], medium=medium)]),
                    engine_headers(),
                )
            )
            held.setdefault(inst, []).extend(hashes)
        elif r < 0.7 and held.get(inst):
            gone = rng.sample(held[inst], min(2, len(held[inst])))
            engine.append((inst, vllm_payload([removed(gone)]), engine_headers()))
        elif r < 0.85:
            engine.append(
                (
                    "offloader",
                    vllm_payload([stored(hashes, p[: 4 * nblocks], medium="CPU")]),
                    engine_headers(**{"kv-offload": "pool"}),
                )
            )
        else:
            ev = {"event_type": "stored", "seq_hashes": hashes, "medium": "cpu"}
            pool.append(("mooncake-0", pool_payload([ev]), engine_headers()))
    return engine, pool


async def test_restart_resumes_from_snapshot_exactly(kafka_bootstrap: str) -> None:
    cfg = daemon_config(kafka_bootstrap)
    engine, pool = random_stream(7, 300)
    oracle = Conductor()
    for key, value, headers in engine:
        oracle.ingest_engine_record(key, headers, value, 1.0)
    for key, value, headers in pool:
        oracle.ingest_pool_record(key, headers, value, 1.0)
    half_e, half_p = len(engine) // 2, len(pool) // 2
    async with running(cfg) as daemon:
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine[:half_e])
        await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool[:half_p])
        await wait_for(lambda: daemon.ready()[0], 60, "caught up")
    # Second life: restores the snapshot written on shutdown, resumes after it.
    async with running(cfg) as daemon:
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine[half_e:])
        await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool[half_p:])

        def converged() -> bool:
            return state_fingerprint(daemon.conductor.snapshot_state()) == state_fingerprint(
                oracle.snapshot_state()
            )

        try:
            await wait_for(converged, 60, "same state as an uninterrupted run")
        except AssertionError:
            got = state_fingerprint(daemon.conductor.snapshot_state())
            want = state_fingerprint(oracle.snapshot_state())
            diff = sorted(k for k in got.keys() | want.keys() if got.get(k) != want.get(k))
            raise AssertionError(f"units differ: {diff[:10]}") from None
        port = daemon.http_port
        assert port is not None
        for prompt_query in ({"model": "m", "block_size": 4, "token_ids": list(range(24))},):
            _, body = await http_json(port, "POST", "/query", prompt_query)
            assert body == oracle.query(TokenQuery(**prompt_query))  # type: ignore[arg-type]
