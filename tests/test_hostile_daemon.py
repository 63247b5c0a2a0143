"""Hostile input through a running daemon (issue #7 item 3).

One batch on each event topic mixes absurd records (garbage, 100 000-deep
nesting, 200 000 tokens in one event, dp rank 2**40, token ids past 2**32,
unknown tags, wrong types, NaN timestamps, self-parents, repeated hashes,
hashes at the ends of the u64 range, names of 2 000 characters, hostile
headers) with good ones. Every record is applied or dead-lettered with a
`dlq-reason`, exactly as a `Conductor` fed the same records decides (the
oracle); the daemon ends with the oracle's state, the good records around the
bad ones are applied, and it keeps running.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from kvconductor.index.conductor import Conductor
from kvconductor.snapshots.units import state_fingerprint
from tests.harness import (
    daemon_config,
    engine_headers,
    http_json,
    pool_payload,
    produce,
    read_all,
    running,
    stored,
    vllm_payload,
    wait_for,
)
from tests.test_hostile_input import Record, outcome

pytestmark = pytest.mark.kafka

TOKENS = list(range(101, 113))  # three blocks of four
HUGE = 50_000  # blocks of the 200 000-token event
LONG = "n" * 2_000


def deep_payload(depth: int) -> bytes:
    """`[0.0, [[[...]]]]`: msgspec will not encode what it would not decode."""
    return b"\x92\xcb" + b"\x00" * 8 + b"\x91" * depth + b"\xc0"


# (what the record should come to, value, headers), in the order produced.
ENGINE: list[tuple[str, bytes, list[tuple[str, bytes]]]] = [
    ("applied", vllm_payload([stored([1], TOKENS[:4])]), engine_headers()),
    ("undecodable", b"\xc1\xff garbage", engine_headers()),
    ("undecodable", deep_payload(100_000), engine_headers()),
    (
        "applied",
        vllm_payload([stored(list(range(HUGE)), [i % 100 for i in range(4 * HUGE)])]),
        engine_headers(model="huge"),
    ),
    ("rejected", vllm_payload([stored([3], TOKENS[:4])], rank=1 << 40), engine_headers()),
    ("rejected", vllm_payload([stored([3], [0, 1, 2, 1 << 32])]), engine_headers()),
    ("undecodable", vllm_payload([{"type": "BlockMoved", "block_hashes": [1]}]), engine_headers()),
    ("undecodable", vllm_payload([stored(["1"], TOKENS[:4])]), engine_headers()),
    ("applied", vllm_payload([stored([9], TOKENS[:4])], ts=math.nan), engine_headers()),
    ("applied", vllm_payload([stored([5], TOKENS[:4], parent=5)]), engine_headers()),
    ("applied", vllm_payload([stored([7] * 100, TOKENS[:4] * 100)]), engine_headers()),
    (
        "applied",
        vllm_payload([stored([(1 << 64) - 1, -(1 << 63)], TOKENS[:8], parent=-1)]),
        engine_headers(),
    ),
    (
        "rejected",
        vllm_payload(
            [
                {
                    **stored([3], TOKENS[:4]),
                    "kv_cache_spec_kind": "sliding_window",
                    "group_idx": 1 << 17,
                }
            ]
        ),
        engine_headers(),
    ),
    ("rejected", vllm_payload([stored([3], TOKENS[:4], medium=LONG)]), engine_headers()),
    (
        "rejected",
        vllm_payload([{**stored([3, 4], TOKENS[:8]), "extra_keys": [None]}]),
        engine_headers(),
    ),
    ("invalid_header", vllm_payload([stored([3], TOKENS[:4])]), engine_headers(block_size=0)),
    (
        "invalid_header",
        vllm_payload([stored([3], TOKENS[:4])], rank=None),
        engine_headers(**{"kv-dp-rank": str(1 << 40)}),
    ),
    ("missing_header", vllm_payload([stored([3], TOKENS[:4])]), engine_headers()[1:]),
    (
        "invalid_header",
        vllm_payload([stored([3], TOKENS[:4])]),
        engine_headers(**{"kv-source": "lmcache"}),
    ),
    ("invalid_header", vllm_payload([stored([3], TOKENS[:4])]), engine_headers(model=LONG)),
    (
        "invalid_header",
        vllm_payload([stored([3], TOKENS[:4])]),
        [*engine_headers(), ("kv-tenant", b"\xff\xfe")],
    ),
    ("applied", vllm_payload([stored([2], TOKENS[4:8], parent=1)]), engine_headers()),
]

POOL_HEADERS = engine_headers(model="pm")
POOL: list[tuple[str, bytes, list[tuple[str, bytes]]]] = [
    ("applied", pool_payload([{"event_type": "stored", "seq_hashes": [1]}]), POOL_HEADERS),
    ("undecodable", b"\x93\xff", POOL_HEADERS),
    ("rejected", pool_payload([{"event_type": "removed", "seq_hashes": [1]}]), POOL_HEADERS[1:]),
    (
        "rejected",
        pool_payload([{"event_type": "stored", "seq_hashes": [1], "backend_id": LONG}]),
        POOL_HEADERS,
    ),
    (
        "applied",
        pool_payload(
            [{"event_type": "stored", "seq_hashes": [1], "token_ids": TOKENS[:4]}], ts=math.inf
        ),
        POOL_HEADERS,
    ),
    ("rejected", pool_payload([{"event_type": "stored", "block_size": -4}]), POOL_HEADERS),
    ("undecodable", pool_payload([{"event_type": "updated"}]), POOL_HEADERS),
    ("applied", pool_payload([{"event_type": "cleared", "medium": "disk"}]), POOL_HEADERS),
]


async def test_absurd_records_are_applied_or_dead_lettered_and_good_ones_apply(
    kafka_bootstrap: str,
) -> None:
    cfg = daemon_config(kafka_bootstrap)
    topics = {cfg.kafka.engine_topic: ("h", ENGINE), cfg.kafka.pool_topic: ("mooncake-h", POOL)}
    async with running(cfg) as daemon:
        for topic, (key, records) in topics.items():
            await produce(
                kafka_bootstrap, topic, [(key, value, head) for _, value, head in records]
            )
        # The oracle: the same records, offsets and timestamps, through a Conductor.
        oracle = Conductor()
        expected: dict[tuple[str, int, int], str] = {}
        for topic, (_, records) in topics.items():
            produced = sorted(await read_all(kafka_bootstrap, topic), key=lambda r: r.offset)
            assert len(produced) == len(records)
            for (want, _, _), rec in zip(records, produced, strict=True):
                got = outcome(
                    oracle,
                    Record(
                        topic == cfg.kafka.pool_topic,
                        rec.key,
                        list(rec.headers),
                        rec.value,
                        rec.timestamp / 1000.0,
                    ),
                )
                assert got == want, (topic, rec.offset, got)
                if got != "applied":
                    expected[(topic, rec.partition, rec.offset)] = got
        dead: list[Any] = []

        async def all_dead_letters() -> bool:
            dead[:] = await read_all(kafka_bootstrap, cfg.kafka.dead_letter_topic)
            return len(dead) >= len(expected)

        await wait_for(all_dead_letters, 120, f"{len(expected)} dead letters")
        await wait_for(
            lambda: (
                state_fingerprint(daemon.conductor.snapshot_state())
                == state_fingerprint(oracle.snapshot_state())
            ),
            60,
            "the oracle's state",
        )
        got: dict[tuple[str, int, int], str] = {}
        for letter in dead:
            h = dict(letter.headers)
            assert h["dlq-reason"], h
            where = (
                h["dlq-source-topic"].decode(),
                int(h["dlq-source-partition"]),
                int(h["dlq-source-offset"]),
            )
            got[where] = h["dlq-kind"].decode()
        assert got == expected
        # The good records around the bad ones applied; so did the absurd valid ones.
        port = daemon.http_port
        assert port is not None
        query = {"model": "m", "block_size": 4, "token_ids": TOKENS}
        _, body = await http_json(port, "POST", "/query", query)
        assert body["default"]["h"]["GPU"] == 8
        huge = {"model": "huge", "block_size": 4, "token_ids": [i % 100 for i in range(4000)]}
        _, body = await http_json(port, "POST", "/query", huge)
        assert body["default"]["h"]["GPU"] == 4000
        # And the daemon keeps going: one more good record, and it is ready.
        third = vllm_payload([stored([3], TOKENS[8:], parent=2)])
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, [("h", third, engine_headers())])

        async def third_applied() -> bool:
            _, body = await http_json(port, "POST", "/query", query)
            return bool(body["default"]["h"]["GPU"] == 12)

        await wait_for(third_applied, 60, "a good record after the hostile batch")
        await wait_for(lambda: daemon.ready()[0], 60, "ready")
        status, _ = await http_json(port, "GET", "/ready")
        assert status == 200
