"""Query replicas: rebuilt from the snapshot topic, they answer like the daemon.

- `apply_units` (how follow="snapshots" applies a generation) leaves the
  index exactly as a full `restore` of the same units, internals included;
- a replica restored from the snapshot topic alone equals the daemon at the
  same source offsets (full state and queries), in every follow mode;
- replicas started while events flow converge to the uninterrupted result;
- a follow="snapshots" replica equals the daemon at every generation it
  applies;
- the snapshot read stops at the end offsets it took, so a generation
  committed meanwhile is never half restored.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvconductor.config import Config
from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.service.daemon import Daemon
from kvconductor.service.replica import Replica, SnapshotUnusable
from kvconductor.service.replica_server import run_replica
from kvconductor.snapshots.store import SnapshotPublisher, chunk_key, read_snapshot
from kvconductor.snapshots.units import (
    SCHEMA_VERSION,
    GenerationUnit,
    InstanceUnit,
    Unit,
    UnitKey,
    UnitValue,
    all_unit_ids,
    apply_units,
    decode_unit,
    encode_unit,
    export_unit,
    replace_unit,
    restore,
    state_fingerprint,
)
from kvconductor.tools.kafka_local import broker as kafka_local
from tests.harness import (
    daemon_config,
    engine_headers,
    http_json,
    produce,
    running,
    stored,
    vllm_payload,
    wait_for,
)
from tests.streams import (
    end_offsets,
    fingerprint_diff,
    mixed_stream,
    oracle,
    sample_queries,
)

ROOT = Path(__file__).resolve().parent.parent

# ------------------------------------------------- apply_units, no Kafka


def _units(index: Index) -> dict[UnitKey, Unit]:
    out: dict[UnitKey, Unit] = {}
    for kind, uid in all_unit_ids(index):
        key, unit = export_unit(index, kind, uid)
        if unit is not None:
            out[key] = unit
    return out


def structure(index: Index) -> dict[Any, Any]:
    """An index's internals in a form independent of slot numbers and dict order."""
    out: dict[Any, Any] = {}
    for key, ns in index.namespaces.items():
        slots = {o.slot: (o.instance, o.rank) for r in ns.owners.values() for o in r.values()}
        dump: dict[str, Any] = ns.store.dump()
        masks = [
            {
                ident: sorted(slots[s] for s in range(m.bit_length()) if m >> s & 1)
                for ident, m in tier.items()
            }
            for tier in dump["masks"]
        ]
        out[key] = {
            "content": dump["content"],
            "refs": dump["refs"],
            "masks": masks,
            "pool_counts": dump["pool_counts"],
            "waiting": {s: sorted(t) for s, t in ns.waiting.items()},
            "unresolved": dict(ns.unresolved),
            "children": {s: sorted(c) for s, c in ns.children.items()},
            "dups": {slots[slot]: dups for slot, (_, dups) in dump["owners"].items() if dups},
            "pending": sorted(k for k, _ in ns.pending),
            "retired": sorted(seq for seq, _ in dump["retired"]),
        }
    instances = {
        name: (dict(s.last_seq), sorted(s.groups.items()), sorted(s.namespaces, key=repr))
        for name, s in index.instances.items()
    }
    return {"namespaces": out, "instances": instances}


@pytest.mark.parametrize("seed", [1, 2, 3, 4])
def test_apply_units_equals_a_full_restore_after_every_generation(seed: int) -> None:
    """A daemon-like index changes; after each "generation" the changed units
    (minimal diffs, or everything again) go through `apply_units` into a
    follower; the follower equals a fresh restore of all units, internals
    (catalog references, owner masks, pool counts, joins) included."""
    engine, pool = mixed_stream(seed, 2500)
    rng = random.Random(seed)
    records = [("e", r) for r in engine] + [("p", r) for r in pool]
    rng.shuffle(records)
    daemon = Conductor()
    follower = Index()
    published: dict[UnitKey, bytes] = {}
    i = generations = 0
    while i < len(records):
        n = rng.randrange(1, 80)
        for kind, (key, value, headers) in records[i : i + n]:
            ingest = daemon.ingest_engine_record if kind == "e" else daemon.ingest_pool_record
            ingest(key, headers, value, 1.0 + i / 100)
        i += n
        units = _units(daemon.snapshot_state())
        encoded = {k: encode_unit(u) for k, u in units.items()}
        if rng.random() < 0.1:  # republishing unchanged units is harmless
            changes: dict[UnitKey, Unit | None] = dict(units)
        else:
            changes = {k: units[k] for k in encoded if published.get(k) != encoded[k]}
        changes.update({k: None for k in published if k not in encoded})
        apply_units(follower, changes)
        published = encoded
        fresh = Index()
        restore(fresh, units)
        assert (
            fingerprint_diff(
                state_fingerprint(follower), state_fingerprint(daemon.snapshot_state())
            )
            == []
        )
        assert structure(follower) == structure(fresh)
        generations += 1
    assert generations > 20


def test_replace_unit_replaces_and_deletes_one_unit() -> None:
    engine, pool = mixed_stream(5, 600)
    daemon = oracle(engine, pool)
    units = _units(daemon.snapshot_state())
    follower = Index()
    restore(follower, units)
    owners = [k for k in units if k[0] == "o"]
    pools = [k for k in units if k[0] == "p"]
    assert owners and pools
    # Delete an owner and a pool, then put them back one at a time.
    for key in (owners[0], pools[0]):
        replace_unit(follower, key, None)
        assert key not in state_fingerprint(follower)
    for key in (owners[0], pools[0]):
        replace_unit(follower, key, units[key])
    assert state_fingerprint(follower) == state_fingerprint(daemon.snapshot_state())
    assert structure(follower) == structure(daemon.snapshot_state())


class FakeTxnProducer:
    """Enough of a transactional producer for `SnapshotPublisher.publish`:
    records of committed transactions, in order."""

    def __init__(self) -> None:
        self.log: list[tuple[bytes, bytes | None]] = []
        self._open: list[tuple[bytes, bytes | None]] | None = None

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        self._open = []
        yield
        self.log.extend(self._open)
        self._open = None

    async def send(self, topic: str, key: bytes, value: bytes | None = None) -> None:
        assert self._open is not None
        self._open.append((key, value))

    async def send_offsets_to_transaction(self, offsets: Any, group_id: str) -> None:
        return None

    def units(self, since: int = 0) -> dict[UnitKey, Unit | None]:
        """The topic as a table (newest value per key) from record `since` on:
        units, None for those tombstoned."""
        latest: dict[bytes, bytes | None] = {}
        for key, value in self.log[since:]:
            latest[key] = value
        chunks: dict[UnitKey, dict[int, UnitValue | None]] = {}
        for raw, value in latest.items():
            key = msgspec.msgpack.decode(raw)
            decoded = None if value is None else msgspec.msgpack.decode(value, type=UnitValue)
            chunks.setdefault(tuple(key[:-1]), {})[key[-1]] = decoded
        out: dict[UnitKey, Unit | None] = {}
        for unit_key, by_chunk in chunks.items():
            head = by_chunk.get(0)
            if head is None:
                out[unit_key] = None
                continue
            parts = [by_chunk[c] for c in range(head.chunks)]
            out[unit_key] = decode_unit(b"".join(p.data for p in parts if p is not None))
        return out


@pytest.mark.parametrize(("seed", "max_age"), [(1, 5.0), (2, 30.0), (3, 300.0)])
async def test_the_publishers_generations_restore_and_follow_to_the_live_state(
    seed: int, max_age: float
) -> None:
    """The real `SnapshotPublisher` (its dirty tracking, pending versions,
    tombstones) over a stream with pending halves ageing out: after every
    generation, a restore of the whole topic and a follower applying each
    generation with `apply_units` both equal the live index."""
    engine, pool = mixed_stream(seed, 3000)
    rng = random.Random(seed)
    records = [("e", r) for r in engine] + [("p", r) for r in pool]
    rng.shuffle(records)
    live = Conductor(IndexLimits(max_pending_age_s=max_age))
    producer = FakeTxnProducer()
    publisher = SnapshotPublisher(producer, "snapshots", "group")
    follower = Index()
    now = 0.0
    generations = 0
    for i, (kind, (key, value, headers)) in enumerate(records):
        now += rng.expovariate(1.0)
        ingest = live.ingest_engine_record if kind == "e" else live.ingest_pool_record
        ingest(key, headers, value, now)
        if rng.random() < 0.3:
            live.expire(now)
        if rng.random() < 0.05 or i == len(records) - 1:
            start = len(producer.log)
            await publisher.publish(live, {TopicPartition("events", 0): i + 1})
            generations += 1
            apply_units(follower, producer.units(since=start))
            table = {k: u for k, u in producer.units().items() if u is not None}
            fresh = Index(live.snapshot_state().limits)
            restore(fresh, table)
            want = state_fingerprint(live.snapshot_state())
            assert fingerprint_diff(state_fingerprint(fresh), want) == [], i
            assert fingerprint_diff(state_fingerprint(follower), want) == [], i
    assert generations > 50
    assert live.counters["pending_dropped_intent_age"] or max_age > 100


async def test_pending_unit_of_a_recreated_namespace_is_republished() -> None:
    live = Conductor(IndexLimits(max_pending_age_s=10.0))
    producer = FakeTxnProducer()
    publisher = SnapshotPublisher(producer, "snapshots", "group")
    offload = engine_headers("m", 4, **{"kv-offload": "pool"})

    def intent(tokens: list[int], now: float) -> None:
        ev = stored([sum(tokens)], tokens, medium="CPU")
        live.ingest_engine_record("offloader", offload, vllm_payload([ev]), now)

    intent([1, 2, 3, 4], 1.0)
    await publisher.publish(live, {TopicPartition("events", 0): 1})
    live.expire(100.0)  # the intent ages out (its content is retired) ...
    live.expire(200.0)  # ... then the retired content: the namespace is empty and goes
    assert not live.snapshot_state().namespaces
    intent([5, 6, 7, 8], 201.0)  # a new namespace object, one pending half again
    await publisher.publish(live, {TopicPartition("events", 0): 2})
    table = {k: u for k, u in producer.units().items() if u is not None}
    fresh = Index(live.snapshot_state().limits)
    restore(fresh, table)
    assert (
        fingerprint_diff(state_fingerprint(fresh), state_fingerprint(live.snapshot_state())) == []
    )


# ------------------------------------------------------ on the broker


def _cfg(bootstrap: str) -> Config:
    return daemon_config(bootstrap, KVCONDUCTOR_SNAPSHOT_INTERVAL_S="0.3")


async def settled(daemon: Daemon, cfg: Config) -> dict[TopicPartition, int]:
    """Wait until the daemon applied everything on its topics and published it."""
    k = cfg.kafka
    ends = await end_offsets(k.bootstrap_servers, [k.engine_topic, k.pool_topic])

    def done() -> bool:
        events = daemon.events
        if events is None:
            return False
        published = daemon._last_published
        return all(
            events.applied_offsets.get(tp) == o and published.get(tp) == o for tp, o in ends.items()
        )

    await wait_for(done, 60, "daemon applied and published everything")
    return ends


def assert_same_state(got: Index, want: Index, what: str) -> None:
    diff = fingerprint_diff(state_fingerprint(got), state_fingerprint(want))
    assert diff == [], f"{what}: units differ: {diff[:8]}"


def assert_same_answers(replica: Replica, daemon: Conductor, seed: int) -> int:
    """Every sample query answered alike; returns how many hit something."""
    hits = 0
    for q in sample_queries(seed):
        if hasattr(q, "token_ids"):
            got, want = replica.query(q), daemon.query(q)
        else:
            got, want = replica.query_by_hash(q), daemon.query_by_hash(q)
        assert got == want, q
        hits += bool(want)
    return hits


@pytest.mark.kafka
async def test_replica_from_the_snapshot_topic_alone_equals_the_daemon(
    kafka_bootstrap: str,
) -> None:
    seed = 11
    cfg = _cfg(kafka_bootstrap)
    engine, pool = mixed_stream(seed, 1500)
    async with running(cfg) as daemon:
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine)
        await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool)
        ends = await settled(daemon, cfg)
        want = daemon.conductor.snapshot_state()
        assert_same_state(
            want, oracle(engine, pool).snapshot_state(), "daemon vs uninterrupted run"
        )
        assert daemon.publisher is not None
        for follow in ("none", "snapshots", "events"):
            async with Replica(cfg, follow=follow) as replica:  # type: ignore[arg-type]
                await replica.wait_caught_up(30)
                assert replica.generation == daemon.publisher.generation
                assert {tp: o for tp, o in replica.offsets().items() if o} == ends
                assert_same_state(replica.conductor.snapshot_state(), want, f"follow={follow}")
                hits = assert_same_answers(replica, daemon.conductor, seed)
                assert hits > 10
                assert replica.ready() == (True, "ready")
        # And the daemon's own HTTP answers agree with the replica's.
        port = daemon.http_port
        assert port is not None
        async with Replica(cfg, follow="none") as replica:
            for q in sample_queries(seed)[:12]:
                path = "/query" if hasattr(q, "token_ids") else "/query_by_hash"
                status, body = await http_json(port, "POST", path, msgspec.to_builtins(q))
                assert status == 200
                ask = replica.query if hasattr(q, "token_ids") else replica.query_by_hash
                assert body == ask(q)


@pytest.mark.kafka
async def test_a_snapshot_past_the_replicas_limits_is_refused_with_the_reason(
    kafka_bootstrap: str,
) -> None:
    cfg = _cfg(kafka_bootstrap)
    engine, pool = mixed_stream(12, 600)
    async with running(cfg) as daemon:
        await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine)
        await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool)
        await settled(daemon, cfg)
        spaces = len(daemon.conductor.snapshot_state().namespaces)
    assert spaces > 1
    small = msgspec.structs.replace(cfg.index, max_namespaces=spaces - 1)
    replica = Replica(cfg, follow="none", limits=small)
    for _ in range(2):  # and again: nothing is left half started
        with pytest.raises(SnapshotUnusable, match=r"cannot be restored: .*max_namespaces"):
            await replica.start()
        assert not replica.conductor.snapshot_state().namespaces
    # The server says so and stops, where a missing topic is waited for.
    limited = msgspec.structs.replace(cfg, index=small)
    assert await asyncio.wait_for(run_replica(limited, follow="none"), 30) == 1


@pytest.mark.kafka
async def test_replicas_started_while_events_flow_converge(kafka_bootstrap: str) -> None:
    seed = 12
    cfg = _cfg(kafka_bootstrap)
    engine, pool = mixed_stream(seed, 3000)
    slices = 30
    third = asyncio.Event()

    async def feed() -> None:
        for s in range(slices):
            lo_e, hi_e = len(engine) * s // slices, len(engine) * (s + 1) // slices
            lo_p, hi_p = len(pool) * s // slices, len(pool) * (s + 1) // slices
            await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine[lo_e:hi_e])
            await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool[lo_p:hi_p])
            if s == slices // 3:
                third.set()
            await asyncio.sleep(0.1)

    async with running(cfg) as daemon:
        feeding = asyncio.create_task(feed())
        await third.wait()
        by_events = Replica(cfg, follow="events")
        by_snapshots = Replica(cfg, follow="snapshots")
        await by_events.start()
        await by_snapshots.start()
        try:
            assert not feeding.done()  # they really started mid-stream
            await feeding
            ends = await settled(daemon, cfg)
            want = oracle(engine, pool).snapshot_state()
            assert_same_state(
                daemon.conductor.snapshot_state(), want, "daemon vs uninterrupted run"
            )

            def converged(replica: Replica) -> bool:
                got = state_fingerprint(replica.conductor.snapshot_state())
                return got == state_fingerprint(want) and replica.offsets() == ends

            await wait_for(lambda: converged(by_events), 30, "events replica converged")
            await wait_for(lambda: converged(by_snapshots), 30, "snapshots replica converged")
            for replica in (by_events, by_snapshots):
                assert_same_answers(replica, daemon.conductor, seed)
        finally:
            await by_events.stop()
            await by_snapshots.stop()


@pytest.mark.kafka
async def test_follow_snapshots_equals_the_daemon_at_every_generation(
    kafka_bootstrap: str,
) -> None:
    seed = 13
    cfg = _cfg(kafka_bootstrap)
    engine, pool = mixed_stream(seed, 2500)
    published: dict[int, dict[UnitKey, bytes]] = {}
    async with running(cfg) as daemon:
        await wait_for(lambda: daemon.status == "running", 30, "daemon running")
        publisher = daemon.publisher
        assert publisher is not None

        def observe(conductor: Conductor, generation: int, offsets: Any) -> None:
            published[generation] = state_fingerprint(conductor.snapshot_state())

        publisher.observe_cut = observe
        replica = Replica(cfg, follow="snapshots")
        await replica.start()
        checked: set[int] = set()
        mismatches: list[tuple[int, list[Any]]] = []
        stop = asyncio.Event()

        async def check() -> None:
            while not stop.is_set():
                g = replica.generation
                if g not in checked and g in published:
                    checked.add(g)
                    diff = fingerprint_diff(
                        state_fingerprint(replica.conductor.snapshot_state()), published[g]
                    )
                    if diff:
                        mismatches.append((g, diff[:5]))
                await asyncio.sleep(0.005)

        checker = asyncio.create_task(check())
        try:
            for s in range(25):
                lo_e, hi_e = len(engine) * s // 25, len(engine) * (s + 1) // 25
                lo_p, hi_p = len(pool) * s // 25, len(pool) * (s + 1) // 25
                await produce(kafka_bootstrap, cfg.kafka.engine_topic, engine[lo_e:hi_e])
                await produce(kafka_bootstrap, cfg.kafka.pool_topic, pool[lo_p:hi_p])
                await asyncio.sleep(0.15)
            await settled(daemon, cfg)
            await wait_for(
                lambda: replica.generation == publisher.generation,
                30,
                "replica at the daemon's last generation",
            )
            await asyncio.sleep(0.05)
        finally:
            stop.set()
            await checker
            await replica.stop()
        assert mismatches == []
        assert len(checked) >= 8, checked
        assert_same_state(
            replica.conductor.snapshot_state(), daemon.conductor.snapshot_state(), "last generation"
        )
        assert_same_state(
            replica.conductor.snapshot_state(),
            oracle(engine, pool).snapshot_state(),
            "uninterrupted run",
        )


# ------------------------------------ reading to the end, never past it


def _value(unit: Unit, generation: int) -> bytes:
    return msgspec.msgpack.encode(UnitValue(SCHEMA_VERSION, generation, 0, 1, encode_unit(unit)))


async def _half_generation_setup(bootstrap: str) -> tuple[str, AIOKafkaConsumer, Any]:
    """A snapshot topic with generation 1 (15,000 units); the returned
    consumer's `end_offsets` commits generation 2 (12,000 units) right after
    taking the ends (once), as a daemon publishing during a restore would."""
    topic = f"snap-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        configs = {"cleanup.policy": "compact"}
        await admin.create_topics([NewTopic(topic, 1, 1, topic_configs=configs)])
    finally:
        await admin.close()
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, transactional_id=f"t-{topic}")
    await producer.start()

    async def generation(n: int, units: int) -> None:
        async with producer.transaction():
            for i in range(units):
                name = "a" if i == 0 else f"x{i}"
                unit = InstanceUnit(name, {0: n}, [], 0.0)
                await producer.send(topic, key=chunk_key(("i", name), 0), value=_value(unit, n))
            g = GenerationUnit(n, [("events", 0, 10 * n)], 0.0, 0.0)
            await producer.send(topic, key=chunk_key(("g", "events", 0), 0), value=_value(g, n))

    await generation(1, 15_000)
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=None,
        isolation_level="read_committed",
        fetch_max_wait_ms=50,
    )
    await consumer.start()
    real_end_offsets = consumer.end_offsets

    async def end_offsets_then_publish(tps: Any) -> Any:
        ends = await real_end_offsets(tps)
        consumer.end_offsets = real_end_offsets  # once
        await generation(2, 12_000)
        return ends

    consumer.end_offsets = end_offsets_then_publish
    return topic, consumer, producer


@pytest.mark.kafka
async def test_replica_restores_whole_generations_while_a_daemon_publishes(
    kafka_bootstrap: str,
) -> None:
    topic, consumer, producer = await _half_generation_setup(kafka_bootstrap)
    try:
        read = await read_snapshot(consumer, topic)
        tp = TopicPartition(topic, 0)
        end = await consumer.position(tp)
        # Then following on from there reads exactly generation 2.
        batch = await consumer.getmany(tp, timeout_ms=5000, max_records=100_000)
        while await consumer.position(tp) < (await consumer.end_offsets([tp]))[tp]:
            more = await consumer.getmany(tp, timeout_ms=5000, max_records=100_000)
            batch.setdefault(tp, []).extend(more.get(tp, []))
    finally:
        await consumer.stop()
        await producer.stop()
    assert read.generation == 1
    assert read.offsets == {TopicPartition("events", 0): 10}
    assert {u.last_seq[0] for u in read.units.values() if isinstance(u, InstanceUnit)} == {1}
    assert len(read.units) == 15_001
    assert batch[tp][0].offset == end
    assert len(batch[tp]) == 12_001


@pytest.mark.kafka
async def test_read_snapshot_returns_whole_generations_while_a_daemon_publishes(
    kafka_bootstrap: str,
) -> None:
    topic, consumer, producer = await _half_generation_setup(kafka_bootstrap)
    try:
        read = await read_snapshot(consumer, topic)
    finally:
        await consumer.stop()
        await producer.stop()
    a = read.units[("i", "a")]
    assert isinstance(a, InstanceUnit)
    # The unit's state must be the one the recorded offsets reflect.
    assert a.last_seq == {0: read.generation}


# ------------------------------------------------------------- the server


@pytest.mark.kafka
async def test_replica_server_waits_for_the_topics_then_answers_like_the_daemon(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    seed = 14
    cfg = _cfg(kafka_bootstrap)
    k = cfg.kafka
    (port,) = kafka_local.free_ports(1)
    config = tmp_path / "replica.toml"
    config.write_text(
        "[kafka]\n"
        + "".join(
            f'{name} = "{getattr(k, name)}"\n'
            for name in ("bootstrap_servers", "engine_topic", "pool_topic", "snapshot_topic")
        )
        + f'[http]\nport = {port}\n[log]\nformat = "json"\n'
    )
    log = (tmp_path / "replica.log").open("wb")
    server = subprocess.Popen(
        [sys.executable, "-m", "kvconductor.tools.cli", "replica", "--config", str(config)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    log.close()

    async def get(path: str) -> tuple[int, Any]:
        try:
            return await http_json(port, "GET", path)
        except OSError:
            return 0, None

    try:
        await wait_for(lambda: _ok(get("/health")), 30, "replica server up")
        # No topics yet: alive, not ready, and it keeps trying.
        status, body = await get("/ready")
        assert status == 503 and not body["ready"], body
        engine, pool = mixed_stream(seed, 1200)
        async with running(cfg) as daemon:
            await wait_for(lambda: daemon.status == "running", 30, "daemon running")
            await produce(kafka_bootstrap, k.engine_topic, engine)
            await produce(kafka_bootstrap, k.pool_topic, pool)
            await settled(daemon, cfg)
            await wait_for(lambda: _ok(get("/ready")), 60, "replica server ready")
            queries = sample_queries(seed)

            async def same_answers() -> bool:
                for q in queries:
                    path = "/query" if hasattr(q, "token_ids") else "/query_by_hash"
                    status, body = await http_json(port, "POST", path, msgspec.to_builtins(q))
                    want = (
                        daemon.conductor.query(q)
                        if path == "/query"
                        else daemon.conductor.query_by_hash(q)
                    )
                    if status != 200 or body != want:
                        return False
                return True

            await wait_for(same_answers, 30, "the replica server's answers equal the daemon's")
            status, body = await http_json(port, "GET", "/workers")
            assert status == 200
            # Everything but each namespace's event clock (a restore starts it
            # at the snapshot's clock).
            for got in body["workers"]:
                got.pop("last_event_ts")
            want = msgspec.to_builtins(daemon.conductor.workers())
            for w in want:
                w.pop("last_event_ts")
            assert body["workers"] == want
    finally:
        server.send_signal(signal.SIGTERM)
        code = server.wait(30)
    assert code == 0, (tmp_path / "replica.log").read_text()[-2000:]


async def _ok(response: Any) -> bool:
    status, _ = await response
    return bool(status == 200)
