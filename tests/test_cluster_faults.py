"""Node faults on a real three-broker KRaft cluster while events flow (issue #26).

A local cluster of `kvconductor kafka-local start --brokers 3` (its own, on free
ports) serves a daemon while a producer writes the deterministic mixed stream of
tests/test_broker_faults.py at acks=all, and snapshots publish every 0.1-0.3 s.
One node at a time, always restored before the next, at random points of the
stream: SIGKILL of the leader of a busy partition, SIGTERM of the node that
coordinates the snapshot producer's transactions, SIGKILL of the controller
quorum's leader, SIGSTOP of a leader for 5-20 s, and a rolling restart of all
three. The same again with the daemon, a process of its own, SIGKILLed during
each fault and restarted.

Throughout, queries are answered; during a stall past `kafka.stale_after_s`,
`/ready` is 503 naming the stale partitions. After each run the topics hold
the stream exactly once, and the daemon's state, its answers and a replica
rebuilt from the snapshot topic equal an undisturbed run. Each run prints, per
fault kind, how long the daemon took to be ready again after the fault.

Slow (a few minutes): run only with KVCONDUCTOR_TEST_CLUSTER=1 (.ci/run does);
KVCONDUCTOR_TEST_CLUSTER_DIR names the folder of a running local cluster to use
instead of starting one; KVCONDUCTOR_TEST_CLUSTER_ROUNDS=N injects each fault
N times a run; KVCONDUCTOR_TEST_CLUSTER_KAFKA, a JSON object of `[kafka]` keys,
sets them in both daemons' configuration, to measure the failover timeouts
(docs/operations.md, "Failover and timeouts") with others than the defaults:

    KVCONDUCTOR_TEST_CLUSTER=1 KVCONDUCTOR_TEST_CLUSTER_ROUNDS=2 \
    KVCONDUCTOR_TEST_CLUSTER_KAFKA='{"session_timeout_ms": 6000, "heartbeat_interval_ms": 2000}' \
    .venv/bin/python -m pytest -s -m cluster tests/test_cluster_faults.py -k faults_on_a_cluster
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import statistics
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import pytest
from aiokafka.client import CoordinationType

from kvconductor.config import KafkaConfig, load_config
from kvconductor.kafka.clients import LiveAdminClient
from kvconductor.kafka.topics import ensure_topics_on, topic_specs
from kvconductor.snapshots.units import state_fingerprint
from kvconductor.tools.kafka_local import broker as kafka_local
from tests.harness import (
    DaemonLives,
    daemon_config,
    http_json,
    running,
    wait_for,
    write_daemon_config,
)
from tests.streams import end_offsets, fingerprint_diff, sample_queries
from tests.test_broker_faults import (
    SEED,
    Run,
    answers,
    check_outcome,
    daemon_port,
    expected_answers,
    new_run,
    snapshot_at,
    stream_in_topics,
    wait_ready,
)

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.cluster,
    pytest.mark.skipif(
        not (
            os.environ.get("KVCONDUCTOR_TEST_CLUSTER")
            or os.environ.get("KVCONDUCTOR_TEST_CLUSTER_DIR")
        ),
        reason="slow: set KVCONDUCTOR_TEST_CLUSTER=1 to run the three-broker tests",
    ),
]

NODES = (1, 2, 3)
# Each fault kind this many times a run (more for measurements).
ROUNDS = int(os.environ.get("KVCONDUCTOR_TEST_CLUSTER_ROUNDS", "1"))
STALE_AFTER_S = 3.0
# The undisturbed run (`oracle_from_kafka`) never expires pending halves; the
# daemon drops those older than this (in record time), and several rounds of
# faults outlast the default 300 s.
MAX_PENDING_AGE_S = "86400"
READY_WITHIN_S = 120.0
# `[kafka]` keys over the daemon's configuration, as the env vars that set them.
KAFKA_ENV: dict[str, str] = {
    f"KVCONDUCTOR_KAFKA_{key.upper()}": value if isinstance(value, str) else json.dumps(value)
    for key, value in json.loads(os.environ.get("KVCONDUCTOR_TEST_CLUSTER_KAFKA", "{}")).items()
}


# ----------------------------------------------------------------- the cluster


@dataclass
class Cluster:
    """The local cluster; each node a process of its own in `<dir>/node-<i>`."""

    data_dir: Path
    bootstrap: str = ""
    down: set[int] = field(default_factory=set)

    def start(self, ports: list[int] | None = None) -> None:
        """Every node (again): `start_cluster` restarts the nodes that are down.
        A new cluster takes its client ports, then its controller ports, from
        `ports`."""
        n = len(NODES)
        self.bootstrap = kafka_local.start_cluster(
            self.data_dir,
            n,
            ports=ports[:n] if ports else None,
            controller_ports=ports[n:] if ports else None,
        )
        self.down.clear()

    def folder(self, node: int) -> Path:
        return kafka_local.node_dir(self.data_dir, node)

    def pid(self, node: int) -> int:
        return int((self.folder(node) / kafka_local.PID_FILE).read_text())

    def signal(self, node: int, sig: int) -> None:
        os.kill(self.pid(node), sig)

    def kill(self, node: int) -> None:
        self.signal(node, signal.SIGKILL)
        self.down.add(node)

    async def terminate(self, node: int) -> None:
        """SIGTERM: a controlled shutdown, waited for."""
        self.signal(node, signal.SIGTERM)
        self.down.add(node)
        folder = self.folder(node)
        await wait_for(lambda: kafka_local.running_pid(folder) is None, 60, f"node {node} to exit")

    async def restore(self) -> None:
        await asyncio.to_thread(self.start)
        await self.healthy()

    def quorum_leader(self) -> int:
        """The controller quorum's leader, as a running node's metadata log has it."""
        for node in NODES:
            if node in self.down:
                continue
            state = self.folder(node) / "kraft-logs" / "__cluster_metadata-0" / "quorum-state"
            with contextlib.suppress(OSError, ValueError, KeyError):
                leader = int(json.loads(state.read_text())["leaderId"])
                if leader in NODES:
                    return leader
        raise AssertionError("no node knows the quorum's leader")

    @contextlib.asynccontextmanager
    async def admin(self) -> AsyncIterator[LiveAdminClient]:
        admin = LiveAdminClient(bootstrap_servers=self.bootstrap, request_timeout_ms=10_000)
        await admin.start()
        try:
            yield admin
        finally:
            await admin.close()

    async def leader_of(self, topic: str, partition: int) -> int:
        async with self.admin() as admin:
            (meta,) = await admin.describe_topics([topic])
        return int(next(p["leader"] for p in meta["partitions"] if p["partition"] == partition))

    async def transaction_coordinator(self, transactional_id: str) -> int:
        async with self.admin() as admin:
            node = await admin.find_coordinator(transactional_id, CoordinationType.TRANSACTION)
        return int(node)

    async def healthy(self) -> None:
        """Every node back in every partition's in-sync replicas, so the next
        fault takes one node of three again."""

        async def full() -> bool:
            try:
                async with self.admin() as admin:
                    topics = await admin.describe_topics()
            except Exception:
                return False
            return all(
                len(p["isr"]) == len(p["replicas"])
                for t in topics
                for p in t["partitions"]
                if len(p["replicas"]) > 1
            )

        await wait_for(full, 120, "every replica in sync")


@pytest.fixture(scope="session")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    given = os.environ.get("KVCONDUCTOR_TEST_CLUSTER_DIR")
    if given:
        c = Cluster(Path(given))
        c.start()
        yield c
        return
    c = Cluster(tmp_path_factory.mktemp("cluster"))
    c.start(kafka_local.free_ports(2 * len(NODES)))
    try:
        yield c
    finally:
        for node in NODES:
            with contextlib.suppress(OSError, ValueError):
                c.signal(node, signal.SIGCONT)  # never stop a frozen node
        kafka_local.stop(c.data_dir)


# ------------------------------------------------------------------ watching


@dataclass
class Watch:
    """/ready and one query, four times a second, against whichever daemon
    listens on `port`: the readiness timeline and the queries not answered."""

    port: int
    timeline: list[tuple[float, int, str]] = field(default_factory=list)
    unanswered: int = 0
    asked: int = 0
    daemon_down: bool = False

    async def run(self) -> None:
        query = sample_queries(SEED)[0]
        path = "/query" if hasattr(query, "token_ids") else "/query_by_hash"
        body = msgspec.to_builtins(query)
        while True:
            try:
                status, ready = await http_json(self.port, "GET", "/ready")
                self.timeline.append((time.monotonic(), status, ready["reason"]))
                self.asked += 1
                code, _ = await http_json(self.port, "POST", path, body)
                if code != 200:
                    self.unanswered += 1
            except (TimeoutError, OSError):
                if not self.daemon_down:
                    self.unanswered += 1
            await asyncio.sleep(0.25)

    def ready_again(self, since: float) -> float:
        """Seconds from `since` until /ready was last 200 after a 503 (0: never 503)."""
        seen = [(t, status) for t, status, _ in self.timeline if t >= since]
        last_503 = max((t for t, status in seen if status != 200), default=None)
        if last_503 is None:
            return 0.0
        back = min((t for t, status in seen if t > last_503 and status == 200), default=None)
        assert back is not None, "never ready again"
        return back - since

    def stale_reasons(self, since: float) -> list[str]:
        return [r for t, s, r in self.timeline if t >= since and r.startswith("index stale on")]


@contextlib.asynccontextmanager
async def watching(port: int) -> AsyncIterator[Watch]:
    watch = Watch(port)
    task = asyncio.create_task(watch.run())
    try:
        yield watch
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


# -------------------------------------------------------------------- faults


Fault = Callable[[Cluster, Run, random.Random], Awaitable[None]]


async def busy_leader_killed(cluster: Cluster, run: Run, rng: random.Random) -> None:
    cluster.kill(await cluster.leader_of(run.cfg.kafka.engine_topic, 0))
    await asyncio.sleep(rng.uniform(2.0, 6.0))
    await cluster.restore()


async def transaction_coordinator_terminated(
    cluster: Cluster, run: Run, rng: random.Random
) -> None:
    k = run.cfg.kafka
    # The snapshot producer's transactional id (daemon._snapshot_producer).
    await cluster.terminate(await cluster.transaction_coordinator(f"{k.group_id}-{k.client_id}"))
    await asyncio.sleep(rng.uniform(2.0, 6.0))
    await cluster.restore()


async def quorum_leader_killed(cluster: Cluster, run: Run, rng: random.Random) -> None:
    cluster.kill(cluster.quorum_leader())
    await asyncio.sleep(rng.uniform(2.0, 6.0))
    await cluster.restore()


async def leader_frozen(cluster: Cluster, run: Run, rng: random.Random) -> None:
    node = await cluster.leader_of(run.cfg.kafka.engine_topic, 1)
    cluster.signal(node, signal.SIGSTOP)
    try:
        await asyncio.sleep(rng.uniform(5.0, 20.0))
    finally:
        cluster.signal(node, signal.SIGCONT)
    await cluster.healthy()


async def rolling_restart(cluster: Cluster, run: Run, rng: random.Random) -> None:
    for node in NODES:
        await cluster.terminate(node)
        await cluster.restore()


FAULTS: list[tuple[str, Fault]] = [
    ("SIGKILL of a busy partition's leader", busy_leader_killed),
    ("SIGTERM of the transaction coordinator", transaction_coordinator_terminated),
    ("SIGKILL of the quorum leader", quorum_leader_killed),
    ("SIGSTOP of a leader for 5-20 s", leader_frozen),
    ("rolling restart", rolling_restart),
]


@dataclass
class Figures:
    """Per fault kind, the seconds to ready again after each injection."""

    ready_after: dict[str, list[float]] = field(default_factory=dict)
    stale_seen: dict[str, list[str]] = field(default_factory=dict)

    def report(self, title: str, kafka: KafkaConfig) -> None:
        timeouts = ("session_timeout_ms", "heartbeat_interval_ms", "request_timeout_ms")
        settings = ", ".join(
            f"{key} {getattr(kafka, key)}" for key in (*timeouts, "metadata_max_age_ms")
        )
        print(f"\n{title} ({settings}):")
        for kind, times in self.ready_after.items():
            print(
                f"  {kind}: {len(times)} injected, ready again after median "
                f"{statistics.median(times):.1f} s, max {max(times):.1f} s "
                f"(each: {', '.join(f'{t:.1f}' for t in times)})"
            )


async def inject_all(
    cluster: Cluster,
    run: Run,
    watch: Watch,
    rng: random.Random,
    during: Callable[[], Awaitable[None]] | None = None,
) -> Figures:
    """Each fault ROUNDS times, in random order, at a random point of its
    slice of the stream; `during` runs (a daemon SIGKILL) while the node is
    down."""
    figures = Figures()
    feeder = run.feeder
    order = [f for _ in range(ROUNDS) for f in rng.sample(FAULTS, len(FAULTS))]
    for i, (kind, fault) in enumerate(order):
        feeder.allow(len(feeder.items) * (i + 1) // (len(order) + 1))
        await asyncio.sleep(rng.uniform(0.3, 1.5))  # records in flight
        since = time.monotonic()
        injected = asyncio.create_task(fault(cluster, run, rng))
        if during is not None:
            await asyncio.sleep(rng.uniform(0.5, 3.0))
            await during()
        await injected
        await wait_for(
            lambda: bool(watch.timeline) and watch.timeline[-1][1] == 200,
            READY_WITHIN_S,
            f"ready after {kind}",
        )
        figures.ready_after.setdefault(kind, []).append(round(watch.ready_again(since), 1))
        figures.stale_seen.setdefault(kind, []).extend(watch.stale_reasons(since))
    feeder.allow(len(feeder.items))
    await wait_for(lambda: feeder.done, 180, "the whole stream acknowledged")
    return figures


@contextlib.asynccontextmanager
async def feeding(run: Run) -> AsyncIterator[None]:
    task = asyncio.create_task(run.feeder.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def check_stale_reported(figures: Figures, run: Run) -> None:
    """A leader frozen past the bound: /ready named the partitions it leads."""
    reasons = figures.stale_seen["SIGSTOP of a leader for 5-20 s"]
    assert reasons, "no 'index stale' reason while a leader was frozen"
    assert any(f"{run.cfg.kafka.engine_topic}/1 (" in r for r in reasons), reasons


# --------------------------------------------------------------------- tests


async def test_local_cluster_status_covers_every_node(cluster: Cluster) -> None:
    st = await asyncio.to_thread(kafka_local.status, cluster.data_dir)
    assert st.running and st.answering
    assert st.bootstrap is not None and len(st.bootstrap.split(",")) == len(NODES)
    run = await new_run(cluster.bootstrap)
    async with cluster.admin() as admin:
        topics = await admin.describe_topics(run.topics)
    # Created by the daemon's specs on three brokers: three replicas each.
    assert {len(p["replicas"]) for t in topics for p in t["partitions"]} == {3}


async def test_topics_are_checked_past_a_frozen_node(cluster: Cluster) -> None:
    """Creating and checking topics asks a broker that answers: a frozen one
    (it accepts connections, answers nothing) costs seconds, not the request
    timeout per request."""
    run = await new_run(cluster.bootstrap)
    frozen = NODES[-1]  # not the first bootstrap server: bootstrapping is aiokafka's
    cluster.signal(frozen, signal.SIGSTOP)
    try:
        started = time.monotonic()
        specs = topic_specs(run.cfg)
        assert await ensure_topics_on(cluster.bootstrap, "faults-check", {}, specs) == []
        took = time.monotonic() - started
    finally:
        cluster.signal(frozen, signal.SIGCONT)
    await cluster.healthy()
    assert took < 15.0, f"{took:.1f} s with a node frozen (aiokafka's request timeout is 40 s)"


async def test_broker_faults_on_a_cluster(cluster: Cluster) -> None:
    rng = random.Random(SEED)
    cfg = daemon_config(
        cluster.bootstrap,
        KVCONDUCTOR_SNAPSHOT_INTERVAL_S="0.1",
        KVCONDUCTOR_KAFKA_STALE_AFTER_S=str(STALE_AFTER_S),
        KVCONDUCTOR_INDEX_MAX_PENDING_AGE_S=MAX_PENDING_AGE_S,
        **KAFKA_ENV,
    )
    run = await new_run(cluster.bootstrap, cfg)
    async with feeding(run), running(run.cfg) as daemon:
        await wait_ready(daemon_port(daemon), 90)
        async with watching(daemon_port(daemon)) as watch:
            figures = await inject_all(cluster, run, watch, rng)
        # The figures first: a failed check below still leaves them.
        figures.report("broker faults on three nodes", run.cfg.kafka)
        assert (watch.unanswered, watch.asked > 100) == (0, True)
        await check_outcome(run, daemon, [])
    check_stale_reported(figures, run)


async def test_broker_and_daemon_faults_on_a_cluster(
    cluster: Cluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rng = random.Random(SEED + 1)
    (port,) = kafka_local.free_ports(1)
    config = tmp_path / "kvconductor.toml"
    write_daemon_config(config, cluster.bootstrap, port)
    monkeypatch.setenv("KVCONDUCTOR_KAFKA_STALE_AFTER_S", str(STALE_AFTER_S))
    monkeypatch.setenv("KVCONDUCTOR_INDEX_MAX_PENDING_AGE_S", MAX_PENDING_AGE_S)
    for name, value in KAFKA_ENV.items():
        monkeypatch.setenv(name, value)
    run = await new_run(cluster.bootstrap, load_config(config))
    k = run.cfg.kafka
    lives = DaemonLives(config, tmp_path)
    restarts: list[float] = []

    async def daemon_killed() -> None:
        watch.daemon_down = True
        lives.kill(signal.SIGKILL)
        started = time.monotonic()
        lives.start(k.group_id, k.client_id)
        await wait_ready(port, READY_WITHIN_S)
        watch.daemon_down = False
        restarts.append(round(time.monotonic() - started, 1))

    async with feeding(run):
        lives.start(k.group_id, k.client_id)
        await wait_ready(port, 90)
        async with watching(port) as watch:
            figures = await inject_all(cluster, run, watch, rng, during=daemon_killed)
        figures.ready_after["daemon SIGKILL + restart during the fault"] = restarts
        figures.report("broker faults with daemon SIGKILLs on three nodes", run.cfg.kafka)
        ends = await end_offsets(cluster.bootstrap, run.topics)
        _, want = await stream_in_topics(run)

        async def answers_exact() -> bool:
            return await answers(port) == expected_answers(want)

        await wait_for(answers_exact, 120, "the daemon's answers to equal an undisturbed run")
        assert watch.unanswered == 0
        # Its final generation holds its whole state: a replica rebuilt from it.
        assert lives.kill(signal.SIGTERM) == 0
        assert (
            fingerprint_diff(await snapshot_at(run, ends), state_fingerprint(want.snapshot_state()))
            == []
        )
