"""SIGKILL the real daemon at random points of a long stream; nothing is lost
or applied twice.

The daemon runs as a subprocess (`python -m kvconductor.tools.cli run`), snapshotting
every 0.3 s, while a producer keeps writing a long mixed stream. It is killed
with SIGKILL after random delays (at start-up, while restoring, while catching
up, between and during snapshot transactions) and restarted each time. After
the stream ends, the last daemon catches up; then its full state, read three
ways, equals an uninterrupted in-memory run over the same records:

- a replica following the snapshot topic through every crash (it sees only
  committed generations; aborted transactions of killed daemons never show);
- the daemon's own HTTP answers, for every sample query;
- after a final SIGTERM, a replica restored from the snapshot topic alone, and
  one that tails the event topics from the snapshot's offsets.

State is compared in full (`state_fingerprint`: every owner's tiers, pool
stores, pending halves, retired content, instance positions).
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import time
import uuid
from array import array
from pathlib import Path
from typing import Any

import msgspec
import pytest

from kvconductor.config import load_config
from kvconductor.service.replica import Replica
from kvconductor.snapshots.units import (
    OwnerUnit,
    PendingUnit,
    PoolUnit,
    decode_unit,
    retired_entries,
    state_fingerprint,
)
from kvconductor.tools.kafka_local import broker as kafka_local
from tests.harness import (
    DaemonLives,
    create_event_topics,
    http_json,
    produce,
    wait_for,
    write_daemon_config,
)
from tests.streams import (
    end_offsets,
    fingerprint_diff,
    mixed_stream,
    oracle,
    oracle_from_kafka,
    read_topics,
    sample_queries,
)

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parent.parent
SEQ_GAP = "kv-seq gap: messages missing from the engine's stream"
KILLS = 24
SEED = 21


def blocks(packed: bytes) -> set[int]:
    return set(array("Q", packed))


def explain(got: dict[Any, bytes], want: dict[Any, bytes]) -> list[str]:
    """What differs, unit by unit: blocks or entries extra and missing."""
    out = []
    for key in fingerprint_diff(got, want)[:6]:
        if key not in got or key not in want:
            out.append(f"{key}: only in {'got' if key in got else 'want'}")
            continue
        a, b = decode_unit(got[key]), decode_unit(want[key])
        if isinstance(a, OwnerUnit) and isinstance(b, OwnerUnit):
            detail = [
                (
                    t,
                    len(blocks(a.seqs[t]) - blocks(b.seqs[t])),
                    len(blocks(b.seqs[t]) - blocks(a.seqs[t])),
                )
                for t in range(3)
                if a.seqs[t] != b.seqs[t]
            ]
            out.append(f"{key}: (tier, extra, missing) {detail}")
        elif isinstance(a, PoolUnit) and isinstance(b, PoolUnit):
            extra, missing = blocks(a.seqs) - blocks(b.seqs), blocks(b.seqs) - blocks(a.seqs)
            out.append(f"{key}: pool blocks extra {len(extra)} missing {len(missing)}")
        elif isinstance(a, PendingUnit) and isinstance(b, PendingUnit):
            ea, eb = set(map(repr, a.entries)), set(map(repr, b.entries))
            ra, rb = set(map(repr, retired_entries(a))), set(map(repr, retired_entries(b)))
            out.append(
                f"{key}: pending extra {sorted(ea - eb)[:3]} missing {sorted(eb - ea)[:3]}; "
                f"retired extra {len(ra - rb)} missing {len(rb - ra)}"
            )
        else:
            out.append(f"{key}: got {a!r} want {b!r}")
    return out


async def test_sigkill_at_random_points_loses_nothing_and_applies_nothing_twice(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    started = time.monotonic()
    rng = random.Random(SEED)
    (port,) = kafka_local.free_ports(1)
    config = tmp_path / "kvconductor.toml"
    write_daemon_config(config, kafka_bootstrap, port)
    cfg = load_config(config)
    k = cfg.kafka
    await create_event_topics(kafka_bootstrap, cfg)
    engine, pool = mixed_stream(SEED, 6000)
    slices = 100

    async def feed() -> None:
        # Paced by the kills: every life sees new records, and the last slices
        # go to the last life.
        for s in range(slices):
            while s >= slices * lives.n // (KILLS + 1):
                await asyncio.sleep(0.05)
            lo_e, hi_e = len(engine) * s // slices, len(engine) * (s + 1) // slices
            lo_p, hi_p = len(pool) * s // slices, len(pool) * (s + 1) // slices
            await produce(kafka_bootstrap, k.engine_topic, engine[lo_e:hi_e])
            await produce(kafka_bootstrap, k.pool_topic, pool[lo_p:hi_p])
            await asyncio.sleep(0.3)

    follower = Replica(cfg, follow="snapshots")
    await follower.start()
    lives = DaemonLives(config, tmp_path)
    feeding = asyncio.create_task(feed())
    # The snapshot producer's transactional id is "<group_id>-<client_id>".
    # A killed daemon stays in its consumer group until its session times out
    # (10 s), and a successor in the same group waits for that before it gets
    # partitions; so that lives are short and still reach the consuming and
    # publishing phases, most lives join a group of their own while keeping
    # the one transactional id (which fences the dead predecessor and aborts
    # its open transaction). The daemon ignores committed group offsets (it
    # seeks to the snapshot's), so nothing else differs. Some lives do restart
    # in their predecessor's group, as an operator's restart would.
    txn_parts = [f"crash{uuid.uuid4().hex[:6]}", *(str(i) for i in range(KILLS + 2))]

    def identity(life: int) -> tuple[str, str]:
        return "-".join(txn_parts[:life]), "-".join(txn_parts[life:])

    same_group = set(rng.sample(range(3, KILLS), 3))
    group, client = identity(1)
    kills = 0
    try:
        while kills < KILLS:
            life = lives.n + 1
            if life not in same_group:
                group, client = identity(life)
            lives.start(group, client)
            if life in same_group:
                delay = rng.uniform(11.0, 14.0)  # past the dead member's session
            elif rng.random() < 0.6:
                delay = rng.uniform(0.3, 3.0)  # start-up, restore, join, catch-up
            else:
                delay = rng.uniform(3.0, 8.0)  # many generations
            await asyncio.sleep(delay)
            code = lives.kill(signal.SIGKILL)
            assert code == -signal.SIGKILL, f"life {lives.n} ended on its own: {code}"
            kills += 1
        killed_while_streaming = not feeding.done()
        lives.start(*identity(lives.n + 1))  # the last life
        await feeding
        ends = await end_offsets(kafka_bootstrap, [k.engine_topic, k.pool_topic])
        records = await read_topics(kafka_bootstrap, [k.engine_topic, k.pool_topic])
        want = oracle_from_kafka(records, k.pool_topic)
        assert state_fingerprint(want.snapshot_state()) == state_fingerprint(
            oracle(engine, pool).snapshot_state()
        )
        want_fp = state_fingerprint(want.snapshot_state())

        async def ready() -> bool:
            try:
                status, _ = await http_json(port, "GET", "/ready")
            except OSError:
                return False
            return status == 200

        await wait_for(ready, 90, "the last daemon caught up")

        def follower_at_end() -> bool:
            return {tp: o for tp, o in follower.offsets().items() if o} == ends

        await wait_for(follower_at_end, 60, "a generation reflecting the whole stream")
        problems: dict[str, Any] = {}
        got = state_fingerprint(follower.conductor.snapshot_state())
        if fingerprint_diff(got, want_fp):
            problems["snapshot follower"] = explain(got, want_fp)
        async with Replica(cfg, follow="none") as fresh:
            restored = state_fingerprint(fresh.conductor.snapshot_state())
        if fingerprint_diff(restored, want_fp):
            problems["restored from the snapshot topic"] = explain(restored, want_fp)
        hits = 0
        for q in sample_queries(SEED):
            path = "/query" if hasattr(q, "token_ids") else "/query_by_hash"
            status, body = await http_json(port, "POST", path, msgspec.to_builtins(q))
            expected = want.query(q) if path == "/query" else want.query_by_hash(q)
            if status != 200 or body != expected:
                problems.setdefault("daemon's answers", []).append((path, q, body, expected))
            hits += bool(expected)
        gaps = sum(events.count(SEQ_GAP) for events in lives.events())
        if gaps:
            problems["kv-seq gaps logged (records skipped)"] = gaps
        if problems:
            keep = Path(f"/tmp/kvc-crash-{int(time.time())}")
            shutil.copytree(tmp_path, keep)
            print(f"\n{lives.summary()}\nlogs kept in {keep}")
        assert not problems, problems
        assert hits > 10
        assert lives.kill(signal.SIGTERM) == 0
    finally:
        feeding.cancel()
        await follower.stop()
        if lives.proc is not None:
            lives.kill(signal.SIGKILL)
    # Read back from Kafka alone, after the graceful stop.
    for follow in ("none", "events"):
        async with Replica(cfg, follow=follow) as replica:  # type: ignore[arg-type]
            await replica.wait_caught_up(30)
            diff = fingerprint_diff(state_fingerprint(replica.conductor.snapshot_state()), want_fp)
            assert diff == [], f"follow={follow} replica differs: {diff[:8]}"
            assert {tp: o for tp, o in replica.offsets().items() if o} == ends
    phases = lives.phases()
    elapsed = time.monotonic() - started
    print("\n" + lives.summary())
    print(
        f"\n{kills} SIGKILLs, {len(engine)} engine + {len(pool)} pool records, "
        f"lives by how far they got: {phases}, {elapsed:.0f}s"
    )
    assert killed_while_streaming
    assert phases["published"] >= 5, phases
