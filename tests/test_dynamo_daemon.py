"""Dynamo's remote-indexer query at the daemon on the real broker: engine and
pool records in through Kafka, `POST /query_tiered_by_hash` as Dynamo's
router sends it, checked against `/query` for the same tokens."""

from __future__ import annotations

import pytest

from kvconductor.wire.dynamo import worker_id
from kvconductor.wire.hashing import local_block_hash
from tests.harness import (
    daemon_config,
    engine_headers,
    http_json,
    pool_payload,
    produce,
    running,
    stored,
    vllm_payload,
    wait_for,
)

pytestmark = pytest.mark.kafka

BS = 4
TOKENS = list(range(201, 201 + 4 * BS))
SEQS = [0xD000 + i for i in range(4)]


def signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


# What Dynamo's router sends: i64 local hashes of the full blocks.
DYNAMO = {
    "block_hashes": [signed(local_block_hash(TOKENS[i * BS : (i + 1) * BS])) for i in range(4)],
    "model_name": "m",
    "routing_group": "default",
}


async def test_daemon_answers_dynamo_like_query(kafka_bootstrap: str) -> None:
    cfg = daemon_config(kafka_bootstrap, KVCONDUCTOR_INDEX_LOCAL_HASH_MAP="100000")
    # vllm-0: blocks 0-1 on GPU, 2 in its own CPU; the pool: block 3 in host
    # memory, its tokens from the pool event. 12: blocks 0-3 on GPU, rank 1.
    engine = [
        ("vllm-0", vllm_payload([stored(SEQS[:2], TOKENS[: 2 * BS])]), engine_headers()),
        (
            "vllm-0",
            vllm_payload([stored(SEQS[2:3], TOKENS[2 * BS : 3 * BS], SEQS[1], "CPU")]),
            engine_headers(),
        ),
        ("12", vllm_payload([stored(SEQS, TOKENS)], rank=1), engine_headers()),
    ]
    pool_event = {
        "event_type": "stored",
        "seq_hashes": SEQS[3:],
        "parent_hash": SEQS[2],
        "token_ids": TOKENS[3 * BS :],
        "medium": "cpu",
    }
    pool = [("mooncake-0", pool_payload([pool_event]), engine_headers())]
    async with running(cfg) as daemon:
        port = daemon.http_port
        assert port is not None
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine)
        await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool)
        query = {"model": "m", "block_size": BS, "token_ids": TOKENS}

        async def indexed() -> bool:
            _, body = await http_json(port, "POST", "/query", query)
            rows = body.get("default", {})
            return rows.get("vllm-0", {}).get("CPU") == 16 and "12" in rows

        await wait_for(indexed, 30, "engine and pool records indexed")
        status, contract = await http_json(port, "POST", "/query", query)
        assert status == 200
        assert contract["default"]["vllm-0"]["GPU"] == 8
        status, answer = await http_json(port, "POST", "/query_tiered_by_hash", DYNAMO)
        assert status == 200
        v0 = {"worker_id": worker_id("vllm-0"), "dp_rank": 0}
        twelve = {"worker_id": 12, "dp_rank": 1}
        expected_device = sorted([[v0, 2], [twelve, 4]], key=lambda p: p[0]["worker_id"])
        assert answer == {
            "block_size": BS,
            "tiered": {
                "device": {"scores": expected_device, "frequencies": []},
                "lower_tier": [
                    # Own CPU block 2, then the pool's host block 3.
                    ["host_pinned", {"hits": [[twelve, 0], [v0, 2]]}],
                    ["disk", {"hits": [[twelve, 0], [v0, 0]]}],
                ],
            },
        }
        # Per rank, the tiers add up to /query's DP for the same tokens.
        assert contract["default"]["vllm-0"]["DP"] == {"0": (2 + 2) * BS}
        assert contract["default"]["12"]["DP"] == {"1": 4 * BS}
