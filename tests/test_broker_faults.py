"""Broker faults while events flow (issue #7): the daemon rides them out.

A broker of this module's own (it is stopped, killed and frozen, so never the
session's) serves one daemon per test while a producer keeps writing a
deterministic mixed stream (`tests.streams`). Each fault is injected in the
middle of the stream: SIGTERM and restart, SIGKILL and restart, SIGSTOP for
30 s then SIGCONT, and a broker that is down when the daemon restarts (the
old daemon must stop without it, the new one start without it).

While the broker is away the daemon must report not ready (503 with a
reason) once it notices, and keep answering queries from the index it has:
exactly the records it had applied, checked against an in-memory run over
that prefix of each partition. Afterwards its full state, and the state a
replica restores from its snapshots, must equal an undisturbed run over the
records in the topics, and the topics must hold the stream exactly once and
in order per key: the producer (acks=all, idempotent) counts only
acknowledged records and resends the others after checking which of them did
land.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiokafka import AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from kvconductor.config import Config
from kvconductor.kafka.topics import ensure_topics_on, topic_specs
from kvconductor.service.daemon import Daemon
from kvconductor.service.replica import Replica
from kvconductor.snapshots.units import UnitKey, state_fingerprint
from kvconductor.tools.kafka_local import broker as kafka_local
from tests.harness import Record, daemon_config, http_json, running, wait_for
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

SEED = 11
STEPS = 1500
FREEZE_S = 30.0  # the figure
CHUNK = 10  # records per acknowledged round
PACE_S = 0.05  # between rounds: ~200 records/s, so records are in flight at every fault
FEED_TAG = "feed-n"  # not a kv- header: the daemon ignores it; it names each record once

Item = tuple[str, Record]  # topic, record
Held = tuple[dict[TopicPartition, int], dict[UnitKey, bytes]]


# ------------------------------------------------------------------ the broker


@dataclass
class Broker:
    """This module's broker: restarted on the same folder and ports after each fault."""

    data_dir: Path
    port: int
    controller_port: int
    bootstrap: str = ""

    def start(self, attempts: int = 3) -> None:
        """`kafka_local.start`, retried: now and then its liveness check takes
        a starting broker for dead and gives up on it, leaving it running
        untracked; that broker is a child of this process, stopped before the
        next attempt. A fresh folder can also fail to format (a cluster id
        drawn with a leading "-")."""
        for attempt in range(attempts):
            before = set(kafka_local._CHILDREN)
            try:
                self.bootstrap = kafka_local.start(self.data_dir, self.port, self.controller_port)
                return
            except kafka_local.KafkaLocalError:
                if attempt == attempts - 1:
                    raise
            for pid in set(kafka_local._CHILDREN) - before:
                child = kafka_local._CHILDREN.pop(pid)
                child.kill()
                child.wait(30)

    def pid(self) -> int:
        return int((self.data_dir / kafka_local.PID_FILE).read_text())

    def stop(self) -> None:
        """SIGTERM: a controlled shutdown (kafka_local waits for the exit)."""
        assert kafka_local.stop(self.data_dir)

    def kill(self) -> None:
        os.kill(self.pid(), signal.SIGKILL)
        # Reaps the dead broker and forgets its pid file.
        kafka_local.stop(self.data_dir)

    def freeze(self) -> None:
        os.kill(self.pid(), signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid(), signal.SIGCONT)


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    port, controller_port = kafka_local.free_ports(2)
    b = Broker(tmp_path_factory.mktemp("faulty-kafka"), port, controller_port)
    b.start()
    try:
        yield b
    finally:
        with contextlib.suppress(OSError, ValueError):
            b.thaw()  # never stop a frozen broker: SIGTERM would wait on it
        kafka_local.stop(b.data_dir)


# ---------------------------------------------------------------- the producer


def tag_of(headers: Any) -> int:
    return int(dict(headers)[FEED_TAG])


def feed_items(cfg: Config) -> list[Item]:
    """The stream, engine and pool records interleaved, each tagged with its place."""
    engine, pool = mixed_stream(SEED, STEPS)
    slices = 50
    items: list[Item] = []
    for s in range(slices):
        for topic, records in ((cfg.kafka.engine_topic, engine), (cfg.kafka.pool_topic, pool)):
            for key, value, headers in records[
                len(records) * s // slices : len(records) * (s + 1) // slices
            ]:
                tagged = [*headers, (FEED_TAG, str(len(items)).encode())]
                items.append((topic, (key, value, tagged)))
    return items


@dataclass
class Feeder:
    """Sends `items` in order, up to `allow()`, in rounds of CHUNK records whose
    acknowledgements it awaits. A record whose send fails is looked up in the
    topic (it may have landed) and resent only if absent, by a new producer."""

    bootstrap: str
    items: list[Item]
    allowed: int = 0
    acked: int = 0
    resent: int = 0
    _more: asyncio.Event = field(default_factory=asyncio.Event)

    def allow(self, n: int) -> None:
        self.allowed = min(n, len(self.items))
        self._more.set()

    @property
    def done(self) -> bool:
        return self.acked == len(self.items)

    async def run(self) -> None:
        producer = await self._producer()
        try:
            while not self.done:
                while self.acked >= self.allowed:
                    self._more.clear()
                    await self._more.wait()
                end = min(self.allowed, self.acked + CHUNK)
                producer = await self._deliver(producer, self.items[self.acked : end])
                self.acked = end
                await asyncio.sleep(PACE_S)
        finally:
            await close(producer)

    async def _producer(self) -> AIOKafkaProducer:
        """A started producer; retried while the broker is away."""
        while True:
            producer = AIOKafkaProducer(
                bootstrap_servers=self.bootstrap,
                acks="all",
                enable_idempotence=True,
                # Batches waiting for a leader expire after this: past any fault here.
                request_timeout_ms=180_000,
                linger_ms=5,
            )
            try:
                await producer.start()
                return producer
            except KafkaError:
                await producer.stop()
                await asyncio.sleep(1.0)

    async def _deliver(self, producer: AIOKafkaProducer, round_: list[Item]) -> AIOKafkaProducer:
        pending = round_
        while pending:
            sent = await self._send(producer, pending)
            failed = [item for item, ok in zip(pending, sent, strict=True) if not ok]
            if not failed:
                return producer
            self.resent += len(failed)
            await close(producer)
            producer = await self._producer()
            landed = await self._landed({topic for topic, _ in failed})
            pending = [item for item in failed if tag_of(item[1][2]) not in landed]
        return producer

    async def _send(self, producer: AIOKafkaProducer, items: list[Item]) -> list[bool]:
        futures: list[asyncio.Future[Any]] = []
        with contextlib.suppress(KafkaError):
            for topic, (key, value, headers) in items:
                futures.append(
                    await producer.send(topic, key=key.encode(), value=value, headers=headers)
                )
        results = await asyncio.gather(*futures, return_exceptions=True)
        acked = [not isinstance(r, BaseException) for r in results]
        return acked + [False] * (len(items) - len(acked))

    async def _landed(self, topics: set[str]) -> set[int]:
        while True:
            try:
                return {tag_of(r.headers) for r in await read_topics(self.bootstrap, [*topics])}
            except KafkaError:
                await asyncio.sleep(1.0)


async def close(producer: AIOKafkaProducer) -> None:
    """Stop a producer; its flush would wait for ever on an absent broker."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(producer.stop(), 30)


# ------------------------------------------------------------------ the daemon


async def ready(port: int) -> tuple[int, str]:
    """/ready's status and reason; (0, "not listening") before the daemon listens."""
    try:
        status, body = await http_json(port, "GET", "/ready")
    except OSError:
        return 0, "not listening"
    return status, body["reason"]


async def wait_ready(port: int, timeout: float) -> float:
    """Seconds until /ready answers 200."""
    started = time.monotonic()

    async def is_ready() -> bool:
        return (await ready(port))[0] == 200

    await wait_for(is_ready, timeout, "daemon ready")
    return time.monotonic() - started


async def wait_not_ready(port: int, timeout: float) -> str:
    """The reason /ready gives once the daemon notices the broker is away."""
    reason = ""

    async def noticed() -> bool:
        nonlocal reason
        status, reason = await ready(port)
        return status == 503

    await wait_for(noticed, timeout, "the daemon to report not ready")
    return reason


def held(daemon: Daemon) -> Held:
    """What the index holds and the offsets it reflects.

    Not under `events.lock`, which a checkpoint waiting for the absent broker
    holds; so a read can fall in the middle of a batch (the consumer lets
    queries in every few records), and callers read until it stands still."""
    applied = daemon.events.applied_offsets if daemon.events is not None else {}
    offsets = {tp: o for tp, o in applied.items() if o}
    return offsets, state_fingerprint(daemon.conductor.snapshot_state())


async def answers(port: int) -> list[tuple[int, Any]]:
    out = []
    for q in sample_queries(SEED):
        path = "/query" if hasattr(q, "token_ids") else "/query_by_hash"
        out.append(await http_json(port, "POST", path, msgspec.to_builtins(q)))
    return out


def expected_answers(want: Any) -> list[tuple[int, Any]]:
    return [
        (
            200,
            msgspec.to_builtins(
                want.query(q) if hasattr(q, "token_ids") else want.query_by_hash(q)
            ),
        )
        for q in sample_queries(SEED)
    ]


@dataclass
class Outage:
    """What the daemon showed while the broker was away."""

    reason: str
    state: Held
    answers: list[tuple[int, Any]]


async def observe_outage(daemon: Daemon, timeout: float) -> Outage:
    """Wait until the daemon says it is not ready, then ask every query with
    the index standing still (all again if a batch moved it meanwhile)."""
    port = daemon_port(daemon)
    reason = await wait_not_ready(port, timeout)
    while True:
        before = held(daemon)
        got = await answers(port)
        if held(daemon) == before:
            break
    status, still = await ready(port)
    assert status == 503, f"ready again while the broker is away: {still}"
    return Outage(reason, before, got)


# -------------------------------------------------------------------- checks


@dataclass
class Run:
    """One test's daemon, topics and producer."""

    cfg: Config
    feeder: Feeder

    @property
    def topics(self) -> list[str]:
        return [self.cfg.kafka.engine_topic, self.cfg.kafka.pool_topic]


async def new_run(bootstrap: str, cfg: Config | None = None) -> Run:
    """A run on topics of its own (`cfg`'s, else a fresh test config's)."""
    # Frequent generations: some transaction is in flight whenever a fault hits.
    cfg = cfg or daemon_config(bootstrap, KVCONDUCTOR_SNAPSHOT_INTERVAL_S="0.1")
    await ensure_topics_on(bootstrap, "faults-setup", {}, topic_specs(cfg))
    return Run(cfg, Feeder(bootstrap, feed_items(cfg)))


async def check_outcome(run: Run, daemon: Daemon, outages: list[Outage]) -> dict[str, Any]:
    """After recovery: the topics hold the stream exactly once; the daemon
    applied all of it and holds, answers and snapshots what an undisturbed
    run holds; and during each outage it held (and answered from) exactly
    the prefix it had applied."""
    bootstrap = run.feeder.bootstrap
    ends = await end_offsets(bootstrap, run.topics)
    events = daemon.events
    assert events is not None

    def applied_all() -> bool:
        return {tp: o for tp, o in events.applied_offsets.items() if o} == ends

    await wait_for(applied_all, 120, "the daemon to apply the whole stream")
    records, want = await stream_in_topics(run)
    want_fp = state_fingerprint(want.snapshot_state())
    assert fingerprint_diff(held(daemon)[1], want_fp) == []
    assert await answers(daemon_port(daemon)) == expected_answers(want)
    assert fingerprint_diff(await snapshot_at(run, ends), want_fp) == []

    held_during = []
    for outage in outages:
        offsets, during_fp = outage.state
        prefix = [
            r for r in records if r.offset < offsets.get(TopicPartition(r.topic, r.partition), 0)
        ]
        had = oracle_from_kafka(prefix, run.cfg.kafka.pool_topic)
        assert fingerprint_diff(during_fp, state_fingerprint(had.snapshot_state())) == []
        assert outage.answers == expected_answers(had)
        held_during.append(len(prefix))
    return {"records": len(records), "applied before the outage": held_during}


async def stream_in_topics(run: Run) -> tuple[list[Any], Any]:
    """The topics' records, checked to hold the stream exactly once and in
    order per key, and the undisturbed run over them."""
    records = await read_topics(run.feeder.bootstrap, run.topics)
    tags = Counter(tag_of(r.headers) for r in records)
    lost = len(set(range(len(run.feeder.items))) - set(tags))
    duplicated = sum(n - 1 for n in tags.values())
    per_key: dict[tuple[str, bytes], list[int]] = {}
    for r in records:
        per_key.setdefault((r.topic, r.key), []).append(tag_of(r.headers))
    out_of_order = sum(seq != sorted(seq) for seq in per_key.values())
    assert (lost, duplicated, out_of_order) == (0, 0, 0)
    # In the order they were produced: a read interleaves partitions as its
    # fetches return, and the pending halves' expiry follows the event clock,
    # so another interleaving is another (equally valid) end state.
    records.sort(key=lambda r: tag_of(r.headers))
    want = oracle_from_kafka(records, run.cfg.kafka.pool_topic)
    engine, pool = mixed_stream(SEED, STEPS)
    assert state_fingerprint(want.snapshot_state()) == state_fingerprint(
        oracle(engine, pool).snapshot_state()
    )
    return records, want


async def snapshot_at(run: Run, ends: dict[TopicPartition, int]) -> dict[UnitKey, bytes]:
    """The state a replica restores from the snapshot topic, once a
    generation reflects every record up to `ends`."""
    restored: dict[UnitKey, bytes] = {}

    async def at_end() -> bool:
        nonlocal restored
        async with Replica(run.cfg, follow="none") as replica:
            restored = state_fingerprint(replica.conductor.snapshot_state())
            return {tp: o for tp, o in replica.offsets().items() if o} == ends

    await wait_for(at_end, 60, "a snapshot generation of the whole stream")
    return restored


def report(fault: str, figures: dict[str, Any]) -> None:
    print(f"\n{fault}: " + ", ".join(f"{k} {v}" for k, v in figures.items()))


# --------------------------------------------------------------------- tests


Step = Callable[[], Awaitable[None]]


async def ride_out(
    broker: Broker,
    fault: str,
    inject: Step,
    recover: Step,
    *,
    notice_within: float = 90.0,
    restart_daemon: bool = False,
) -> None:
    """A third of the stream; the fault while the producer sends the second
    third; what the daemon shows until `recover()` (with `restart_daemon`,
    it is also stopped and a new one started while the broker is away);
    then the rest, and the outcome."""
    run = await new_run(broker.bootstrap)
    feeder = run.feeder
    third = len(feeder.items) // 3
    feeding = asyncio.create_task(feeder.run())
    figures: dict[str, Any] = {}
    try:
        feeder.allow(third)
        await wait_for(lambda: feeder.acked >= third, 60, "the first third acknowledged")
        async with contextlib.AsyncExitStack() as stack:
            daemon = await stack.enter_async_context(running(run.cfg))
            await wait_ready(daemon_port(daemon), 90)
            feeder.allow(2 * third)
            await asyncio.sleep(1.0)  # records in flight when the fault hits
            started = time.monotonic()
            await inject()
            outages = [await observe_outage(daemon, notice_within)]
            figures["not ready after s"] = round(time.monotonic() - started, 1)
            figures["unacknowledged at the fault"] = 2 * third - feeder.acked
            if restart_daemon:
                started = time.monotonic()
                await stack.aclose()  # `running` allows it 60 s
                figures["daemon stopped in s"] = round(time.monotonic() - started, 1)
                daemon = await stack.enter_async_context(running(run.cfg))
                outages.append(await observe_outage(daemon, notice_within))
            await recover()
            figures["ready after recovery s"] = round(await wait_ready(daemon_port(daemon), 120), 1)
            feeder.allow(len(feeder.items))
            await wait_for(lambda: feeder.done, 120, "the whole stream acknowledged")
            figures |= await check_outcome(run, daemon, outages)
    finally:
        feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeding
    for outage in outages:
        assert "kafka unavailable" in outage.reason, outage.reason
    # The producer had records waiting on the broker all through the fault.
    assert figures["unacknowledged at the fault"] > 0
    figures["reasons"] = [o.reason for o in outages]
    figures["sends failed then checked"] = feeder.resent
    report(fault, figures)


def daemon_port(daemon: Daemon) -> int:
    assert daemon.http_port is not None
    return daemon.http_port


def in_thread(step: Callable[[], None]) -> Step:
    return lambda: asyncio.to_thread(step)


async def test_broker_sigterm_and_restart(broker: Broker) -> None:
    await ride_out(broker, "SIGTERM + restart", in_thread(broker.stop), in_thread(broker.start))


async def test_broker_sigkill_and_restart(broker: Broker) -> None:
    await ride_out(broker, "SIGKILL + restart", in_thread(broker.kill), in_thread(broker.start))


async def test_broker_frozen_for_30_s(broker: Broker) -> None:
    frozen_at = 0.0

    async def freeze() -> None:
        nonlocal frozen_at
        broker.freeze()
        frozen_at = time.monotonic()

    async def thaw() -> None:
        await asyncio.sleep(FREEZE_S - (time.monotonic() - frozen_at))
        broker.thaw()

    # The daemon must notice within the freeze; nothing else tells it.
    await ride_out(broker, "SIGSTOP 30 s + SIGCONT", freeze, thaw, notice_within=FREEZE_S - 5)


async def test_daemon_restarted_while_broker_is_down(broker: Broker) -> None:
    """A running daemon is stopped while the broker is away (its last
    snapshot cannot be written) and a new one starts into the outage:
    tests/test_daemon_lifecycle.py checks a daemon pointed at a closed port;
    here the broker comes back, with records written before and while it was
    away, and the new daemon ends where an undisturbed run does."""
    await ride_out(
        broker,
        "daemon restarted while the broker is down",
        in_thread(broker.stop),
        in_thread(broker.start),
        restart_daemon=True,
    )


async def test_snapshot_producer_renewed_after_a_lost_transaction(broker: Broker) -> None:
    """After a failed generation the daemon replaces its snapshot producer:
    aiokafka gives a transactional producer up for good when the broker drops
    the connection of a coordinator lookup (aio-libs/aiokafka#1151; seen here
    about once in six broker SIGTERMs), and the next transaction then crashed
    the daemon. The failure is staged (the old producer left a transaction
    open, the daemon told it failed); the successor must abort that
    transaction, or read_committed readers of the snapshot topic stall
    behind it, and generations must go on."""
    run = await new_run(broker.bootstrap)
    feeder = run.feeder
    feeding = asyncio.create_task(feeder.run())
    try:
        feeder.allow(len(feeder.items) // 2)
        async with running(run.cfg) as daemon:
            await wait_ready(daemon_port(daemon), 90)
            assert daemon.events is not None and daemon.publisher is not None
            async with daemon.events.lock:
                # Generations are sent outside the lock: let the one in
                # flight end, so the staged transaction is the only one.
                await daemon._settle_publish()
                old = daemon.publisher.producer
                await old.begin_transaction()
                await old.send(run.cfg.kafka.snapshot_topic, key=b"left open", value=b"")
                daemon._renew_snapshot_producer = True
            feeder.allow(len(feeder.items))
            await wait_for(lambda: feeder.done, 120, "the whole stream acknowledged")
            await check_outcome(run, daemon, [])
            assert daemon.publisher.producer is not old
    finally:
        feeding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await feeding
