"""Figure 4: end to end through a real broker and the real daemon.

Each run starts `kvconductor run` as a subprocess on topics of its own and,
once it is ready, produces the workload's pre-encoded vLLM 0.33 payloads
with a producer set up like the bridge's (acks all, idempotent, its linger
and request size, no compression):

1. sustained: the same records as the apply figure, as fast as the producer
   takes them; the rate is block events over the time from the first send
   to the moment the daemon's /metrics shows every record consumed. The
   consumer counts a record just before applying it, in the same turn of
   the event loop, and /metrics is served on that loop, so a scrape that
   sees the count sees the records applied: the signal is exact, and the
   scrape interval bounds its resolution.
2. half load: the records that follow, paced at half the run's sustained
   rate. After one engine record in every `PROBE_EVERY_S`, a probe follows
   on the same partition: a one-block store of an instance of its own,
   which the daemon can only apply after that record. Produce-to-queryable
   of the record is the time from its send to the first `/query_by_hash`
   answer that shows the probe's block; one task asks for all open probes
   at once every `POLL_S`, so the resolution is that interval plus one
   round of queries (its median is reported). The daemon answers queries
   between two batches, so a round also waits for the batch in hand: that
   is part of "queryable".

Records are stamped by the producer's clock, as the bridge's are (the
simulated clock's 2023 timestamps would fall outside the topics' retention
and the broker would delete them unread).

Between the phases the daemon's answers to the workload's first queries are
compared with an in-process index fed the same records: nothing lost on the
way. Every run reports the records dead-lettered and probes never seen.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner
from prometheus_client.parser import text_string_to_metric_families

from kvconductor.bridge.config import BridgeSettings
from kvconductor.tools.bench import raw_http

# The simulated engines' own BlockStored shape, for the probes.
from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.dynamo_indexer import RATE_CLIENTS, RATE_REQUESTS, Http
from kvconductor.tools.bench.measure import forked, jit_cpu_s, percentile, process_cpu_s, summary
from kvconductor.tools.bench.peers import KvconductorPeer
from kvconductor.tools.bench.restore import broker_pid
from kvconductor.tools.bench.runners import per_unit
from kvconductor.tools.bench.workload import Workload
from kvconductor.tools.kafka_local import broker as kafka_local
from kvconductor.wire.encode import vllm_payload, vllm_stored
from kvconductor.wire.records import KV_BLOCK_SIZE, KV_MODEL, KV_SOURCE

SCRAPE_S = 0.05  # /metrics poll while waiting for the daemon to catch up
# The prequeued figure's poll: its clock starts and stops on a scrape.
BACKLOG_SCRAPE_S = 0.01
POLL_S = 0.002  # probe poll: the latency figure's resolution, with one round trip
PROBE_EVERY_S = 0.025
# Delivery futures are checked (and the settled ones dropped) after this many
# sends while sending: gathering a whole half-load phase's at its end held the
# driver in one long step, which the phase's last probes waited out.
ACKS_CHECKED_EVERY = 1024
STALL_S = 120.0  # no progress for this long: the run failed
# Warm-up runs end once the broker's just-in-time compiler took less than
# this share of a core in one's half load. A broker the benchmark has just
# started compiles its hot code through its first runs, with up to a core
# at times, and probes wait whenever it does (docs/bench/history.md).
JIT_SETTLED = 0.05
PROBE_TAG = 1 << 62  # probe block hashes: far from the simulated engines' hashes
STOP_EVENT = "signal received: finishing the batch in hand, committing, closing"


class DaemonProcess:
    """`kvconductor run` as an operator runs it, on fresh topics and group."""

    PARTITIONS = 6  # the daemon's default for the topics it creates

    def __init__(self, bootstrap: str, folder: Path) -> None:
        tag = uuid.uuid4().hex[:8]
        (self.port,) = kafka_local.free_ports(1)
        self.engine_topic = f"kv-events-bench-{tag}"
        self.pool_topic = f"kv-pool-events-bench-{tag}"
        self.partitions = self.PARTITIONS
        self.snapshot_interval_s = 10.0  # its default too: snapshots are part of the cost
        self.env = {
            **os.environ,
            "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
            "KVCONDUCTOR_KAFKA_ENGINE_TOPIC": self.engine_topic,
            "KVCONDUCTOR_KAFKA_POOL_TOPIC": self.pool_topic,
            "KVCONDUCTOR_KAFKA_SNAPSHOT_TOPIC": f"kv-index-snapshots-bench-{tag}",
            "KVCONDUCTOR_KAFKA_DEAD_LETTER_TOPIC": f"kv-dead-letters-bench-{tag}",
            "KVCONDUCTOR_KAFKA_GROUP_ID": f"kvc-bench-{tag}",
            "KVCONDUCTOR_KAFKA_PARTITIONS": str(self.partitions),
            "KVCONDUCTOR_SNAPSHOT_INTERVAL_S": str(self.snapshot_interval_s),
            "KVCONDUCTOR_HTTP_PORT": str(self.port),
            "KVCONDUCTOR_LOG_FORMAT": "json",
        }
        self.log_path = folder / f"daemon-{tag}.log"
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log_path.open("wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "kvconductor.tools.cli", "run"],
                env=self.env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the daemon commits and closes), SIGKILL if it hangs."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        proc.terminate()
        try:
            return proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            return proc.wait(timeout)

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise RuntimeError("the daemon is not running")
        return self.proc.pid

    def _check_alive(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            raise RuntimeError(f"the daemon exited; its log:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(text[-lines:])

    def log_events(self, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                entry = json.loads(line)
                if isinstance(entry, dict) and entry.get("event") == event:
                    out.append(entry)
        return out

    async def wait_ready(self, session: aiohttp.ClientSession, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{self.url}/ready") as resp:
                    if resp.status == 200:
                        return
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon not ready after {timeout:.0f} s:\n{self.log_tail()}")
            await asyncio.sleep(0.1)

    async def counts(self, session: aiohttp.ClientSession) -> tuple[int, int]:
        """(records consumed from the event topics, records that failed)."""
        async with session.get(f"{self.url}/metrics") as resp:
            text = await resp.text()
        consumed = bad = 0.0
        for family in text_string_to_metric_families(text):
            if family.name == "kvconductor_records_consumed":
                consumed = sum(s.value for s in family.samples if s.name.endswith("_total"))
            elif family.name == "kvconductor_bad_records":
                bad = sum(s.value for s in family.samples if s.name.endswith("_total"))
        return int(consumed), int(bad)

    async def wait_consumed(self, session: aiohttp.ClientSession, n: int) -> tuple[float, int]:
        """Wait until `n` records were applied; (perf_counter then, failed)."""
        last, since = -1, time.monotonic()
        while True:
            consumed, bad = await self.counts(session)
            now = time.perf_counter()
            if consumed >= n:
                return now, bad
            if consumed != last:
                last, since = consumed, time.monotonic()
            elif time.monotonic() - since > STALL_S:
                self._check_alive()
                raise RuntimeError(
                    f"daemon stuck at {consumed:,} of {n:,} records for {STALL_S:.0f} s "
                    f"(its log: {self.log_path}):\n{self.log_tail()}"
                )
            await asyncio.sleep(SCRAPE_S)


def bridge_like_producer(bootstrap: str) -> AIOKafkaProducer:
    """The bridge's producer settings (kvconductor/bridge/sink.py)."""
    b = BridgeSettings()
    return AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        client_id="kvc-bench-e2e",
        acks="all",
        enable_idempotence=True,
        linger_ms=b.linger_ms,
        max_request_size=b.max_request_size,
        max_batch_size=b.batch_size,
    )


@dataclass
class _Probe:
    sent: float  # perf_counter when the engine record it follows was sent
    seq_hash: int
    instance: str
    acked: float | None = None  # perf_counter when the broker acknowledged the probe


@dataclass
class _Paced:
    """What the half-load phase sent and saw."""

    records: int = 0
    blocks: int = 0
    probes: int = 0
    seconds: float = 0.0
    producing: bool = True
    open: list[_Probe] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    sent_wall: list[float] = field(default_factory=list)  # each latency's send, epoch seconds
    to_ack: list[float] = field(default_factory=list)  # the Kafka write's part
    round_trips: list[float] = field(default_factory=list)


class _ProbeClient:
    """The probe queries' connections to the daemon, one a query in flight.

    `kvconductor.tools.bench.raw_http`'s, not aiohttp's client: at a round every `POLL_S`
    with a few probes open, aiohttp's CPU per query took a tenth of a core
    from the two the daemon and the broker run on, and most when probes
    pile up, that is, when the daemon is slowest."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.idle: list[raw_http.RawConnection] = []

    async def post(self, path: str, body: bytes) -> bytes:
        conn = self.idle.pop() if self.idle else await raw_http.connect(self.port)
        status, answer = await conn.exchange(raw_http.post(self.port, path, body))
        self.idle.append(conn)
        if status != 200:
            raise RuntimeError(f"{path} answered {status}: {answer[:200]!r}")
        return answer

    def close(self) -> None:
        for conn in self.idle:
            conn.close()


def _delivered(ack: asyncio.Future[Any]) -> bool:
    """Whether a record's delivery is settled; raises if it failed."""
    if not ack.done():
        return False
    ack.result()
    return True


def _mark_acked(probe: _Probe, _ack: object) -> None:
    probe.acked = time.perf_counter()


class _Run:
    """One daemon, one producer, both phases."""

    def __init__(
        self,
        w: Workload,
        bootstrap: str,
        daemon: DaemonProcess,
        producer: AIOKafkaProducer,
        session: aiohttp.ClientSession,
    ) -> None:
        self.cfg = w.config
        self.bootstrap = bootstrap
        self.daemon = daemon
        self.producer = producer
        self.session = session
        self.topics = (daemon.engine_topic, daemon.pool_topic)
        self.sent = 0  # records and probes produced
        self.acks: list[asyncio.Future[Any]] = []
        self._check_acks_at = ACKS_CHECKED_EVERY

    async def send(self, r: Record, partition: int | None = None) -> Any:
        """Produce one record (stamped now); returns its delivery future."""
        ack = await self.producer.send(
            self.topics[r.pool], r.payload, key=r.key, partition=partition, headers=r.headers
        )
        self.acks.append(ack)
        self.sent += 1
        if len(self.acks) >= self._check_acks_at:
            self.acks = [a for a in self.acks if not _delivered(a)]
            # The unsettled stay: counting from them, a burst of sends (the
            # sustained phase) checks each future a few times, not every send.
            self._check_acks_at = len(self.acks) + ACKS_CHECKED_EVERY
        return ack

    async def flush(self) -> None:
        await self.producer.flush()
        await asyncio.gather(*self.acks)  # raises if any record was not written
        self.acks.clear()
        self._check_acks_at = ACKS_CHECKED_EVERY

    async def sustained(self, records: Sequence[Record]) -> dict[str, Any]:
        blocks = sum(r.blocks for r in records)
        started = time.perf_counter()
        for r in records:
            await self.send(r)
        await self.flush()
        acked = time.perf_counter() - started
        done, _ = await self.daemon.wait_consumed(self.session, self.sent)
        seconds = done - started
        return {
            "records": len(records),
            "blocks": blocks,
            "acked_s": acked,
            "applied_s": seconds,
            "rate": blocks / seconds,
        }

    async def answers(self, prompts: Sequence[list[int]]) -> list[Any]:
        out = []
        for tokens in prompts:
            body = {"model": self.cfg.model, "block_size": self.cfg.block_size, "token_ids": tokens}
            async with self.session.post(f"{self.daemon.url}/query", json=body) as resp:
                out.append(await resp.json())
        return out

    def _probe_record(self, n: int, partition: int, ts: float) -> tuple[Record, int, str]:
        """Probe `n` for `partition`: its record, block hash and instance."""
        cfg = self.cfg
        instance = f"bench-probe-{partition}"
        seq_hash = PROBE_TAG + n
        tokens = [n % 65_536, partition, *range(cfg.block_size - 2)]
        event = vllm_stored([seq_hash], None, tokens, "GPU", cfg.block_size)
        headers = [
            (KV_MODEL, cfg.model.encode()),
            (KV_BLOCK_SIZE, str(cfg.block_size).encode()),
            (KV_SOURCE, b"vllm"),
        ]
        payload = vllm_payload([event], 0, ts)
        return Record(False, instance.encode(), headers, payload, ts, 1, 1), seq_hash, instance

    async def _visible(self, probes: _ProbeClient, probe: _Probe) -> bool:
        body = {
            "model": self.cfg.model,
            "block_size": self.cfg.block_size,
            "seq_hashes": [probe.seq_hash],
            "instance_id": probe.instance,
        }
        answer = msgspec.json.decode(await probes.post("/query_by_hash", msgspec.json.encode(body)))
        return any(
            fig.get("GPU", 0) >= self.cfg.block_size
            for tenant in answer.values()
            for fig in tenant.values()
        )

    async def half_load(
        self, records: Sequence[Record], rate: float, seconds: float
    ) -> dict[str, Any]:
        parts = sorted(await self.producer.partitions_for(self.topics[0]))
        state = _Paced()
        probes = _ProbeClient(self.daemon.port)
        # Shares of one core while producing: how full the daemon was, what
        # the broker and this driver took from the cores they share with it.
        pids = {"daemon": self.daemon.pid, "broker": broker_pid(self.bootstrap)}
        watched = {k: pid for k, pid in pids.items() if pid is not None}
        before = {k: sum(process_cpu_s(pid)) for k, pid in watched.items()}
        broker = watched.get("broker")
        jit_before = None if broker is None else jit_cpu_s(broker)
        driver_before = time.process_time()
        started = time.perf_counter()
        try:
            await asyncio.gather(
                self._paced(state, records, rate, seconds, parts), self._poll(state, probes)
            )
        finally:
            probes.close()
        wall = time.perf_counter() - started
        cpu = {k: (sum(process_cpu_s(pid)) - before[k]) / wall for k, pid in watched.items()}
        jit_after = None if broker is None else jit_cpu_s(broker)
        jit = None if jit_before is None or jit_after is None else (jit_after - jit_before) / wall
        driver_cpu = (time.process_time() - driver_before) / wall
        _, bad = await self.daemon.wait_consumed(self.session, self.sent)
        ms = sorted(x * 1000 for x in state.latencies)
        ack_ms = sorted(x * 1000 for x in state.to_ack)
        return {
            "target_rate": rate,
            "rate": state.blocks / state.seconds if state.seconds else None,
            "records": state.records,
            "blocks": state.blocks,
            "seconds": state.seconds,
            "probes": state.probes,
            "lost": len(state.open),
            "p50_ms": percentile(ms, 50),
            "p99_ms": percentile(ms, 99),
            "max_ms": ms[-1] if ms else None,
            "probe_times": list(zip(state.sent_wall, state.latencies, strict=True)),
            "ack_p50_ms": percentile(ack_ms, 50),
            "ack_p99_ms": percentile(ack_ms, 99),
            "rtt_ms": percentile(sorted(x * 1000 for x in state.round_trips), 50),
            "bad_records": bad,  # over the daemon's life: both phases
            "daemon_cpu": cpu["daemon"],
            "broker_cpu": cpu.get("broker"),  # None: not a broker this benchmark started
            # Of which its just-in-time compiler: how far from warm it was.
            "broker_jit_cpu": jit,
            "driver_cpu": driver_cpu,
        }

    async def _paced(
        self,
        state: _Paced,
        records: Sequence[Record],
        rate: float,
        seconds: float,
        parts: list[int],
    ) -> None:
        """Send `records` at `rate` block events/s for `seconds`, probes among them."""
        partitioner = DefaultPartitioner()
        started = time.perf_counter()
        next_probe = started
        try:
            for r in records:
                due = started + state.blocks / rate
                if due - started >= seconds:
                    break
                wait = due - time.perf_counter()
                if wait > 0:
                    await asyncio.sleep(wait)
                t = time.perf_counter()
                await self.send(r)
                state.blocks += r.blocks
                state.records += 1
                if not r.pool and t >= next_probe:
                    partition = partitioner(r.key, parts, parts)
                    record, seq_hash, instance = self._probe_record(state.probes, partition, r.ts)
                    probe = _Probe(t, seq_hash, instance)
                    ack = await self.send(record, partition)
                    ack.add_done_callback(functools.partial(_mark_acked, probe))
                    state.open.append(probe)
                    state.probes += 1
                    next_probe = max(next_probe + PROBE_EVERY_S, t)
            state.seconds = time.perf_counter() - started
            await self.flush()
        finally:
            state.producing = False

    async def _poll(self, state: _Paced, client: _ProbeClient) -> None:
        """Ask for every open probe at once, every `POLL_S`, until each shows.

        All of a round's queries are in flight together: the daemon answers
        between two batches, so asking one probe after the other would add
        a batch's apply time per open probe to the later ones."""
        wall = time.time() - time.perf_counter()  # the daemon logs epoch times
        while state.producing or state.open:
            probes = list(state.open)
            t = time.perf_counter()
            seen = await asyncio.gather(*(self._visible(client, p) for p in probes))
            now = time.perf_counter()
            if probes:
                state.round_trips.append(now - t)
            for probe, visible in zip(probes, seen, strict=True):
                if visible:
                    state.latencies.append(now - probe.sent)
                    state.sent_wall.append(probe.sent + wall)
                    if probe.acked is not None:
                        state.to_ack.append(probe.acked - probe.sent)
                    state.open.remove(probe)
            if not state.producing and any(now - p.sent > STALL_S for p in state.open):
                return  # never seen: reported as lost
            await asyncio.sleep(POLL_S)


async def _one_run(
    w: Workload,
    bootstrap: str,
    first: Sequence[Record],
    rest: Sequence[Record],
    prompts: Sequence[list[int]],
    seconds: float,
    folder: Path,
) -> dict[str, Any]:
    daemon = DaemonProcess(bootstrap, folder)
    daemon.start()
    try:
        async with aiohttp.ClientSession() as session:
            await daemon.wait_ready(session)
            producer = bridge_like_producer(bootstrap)
            await producer.start()
            try:
                for topic in (daemon.engine_topic, daemon.pool_topic):
                    await producer.partitions_for(topic)  # metadata before the clock
                run = _Run(w, bootstrap, daemon, producer, session)
                sustained = await run.sustained(first)
                answers = await run.answers(prompts)
                half = await run.half_load(rest, sustained["rate"] / 2, seconds)
            finally:
                await producer.stop()
    finally:
        code = daemon.stop()
    published = daemon.log_events("snapshot published")
    snapshots = [float(e.get("seconds", 0.0)) for e in published]
    # Generations started while running (the hand-over one at stop holds the
    # lock throughout, by design): the longest time each held the event lock
    # (a daemon that logs no `hold_s` holds it for the whole publish), and
    # when each ran, to split the probes by it.
    stopped = [_epoch(e["timestamp"]) for e in daemon.log_events(STOP_EVENT)]
    ran: list[tuple[float, float]] = []
    holds: list[float] = []
    for e in published:
        end = _epoch(e["timestamp"])
        start = end - float(e.get("seconds", 0.0))
        if not stopped or start < stopped[0]:
            ran.append((start, end))
            holds.append(float(e.get("hold_s", e.get("seconds", 0.0))))
    half.update(by_generation(half.pop("probe_times"), ran))
    return {
        "sustained": sustained,
        "half_load": half,
        "answers": answers,
        "snapshots": len(snapshots),
        "snapshot_max_s": max(snapshots, default=0.0),
        "snapshot_max_hold_s": max(holds, default=0.0),
        "exit_code": code,
        "partitions": daemon.partitions,
        "snapshot_interval_s": daemon.snapshot_interval_s,
    }


def _epoch(timestamp: str) -> float:
    """The daemon's log time (ISO 8601, UTC) in epoch seconds."""
    return datetime.fromisoformat(timestamp).timestamp()


def by_generation(
    probes: Sequence[tuple[float, float]], generations: Sequence[tuple[float, float]]
) -> dict[str, Any]:
    """p99 of the probes whose wait (send to seen, epoch seconds) overlapped
    a snapshot generation, and of the others: how much of the tail is the
    snapshot's."""
    during: list[float] = []
    outside: list[float] = []
    for sent, latency in probes:
        hit = any(start < sent + latency and sent < end for start, end in generations)
        (during if hit else outside).append(latency * 1000)
    return {
        "probes_during_generations": len(during),
        "p99_during_generations_ms": percentile(sorted(during), 99) if during else None,
        "p99_outside_generations_ms": percentile(sorted(outside), 99) if outside else None,
    }


def _reference(w: Workload, records: Sequence[Record], prompts: Sequence[list[int]]) -> list[Any]:
    peer = KvconductorPeer(w.config.model, w.config.block_size)
    peer.apply(peer.prepare(records))
    return [peer.query(p) for p in prompts]


def frozen_run(main: Coroutine[Any, Any, dict[str, Any]]) -> dict[str, Any]:
    """`asyncio.run(main)` with the workload out of the collector's reach: a
    full collection over its millions of objects stopped the probe loop
    for longer than the figure's target, and that was counted as the
    daemon's latency."""
    gc.collect()
    gc.freeze()
    return asyncio.run(main)


def _run_line(res: dict[str, Any]) -> str:
    s, h = res["sustained"], res["half_load"]
    return (
        f"{s['blocks']:,} block events in "
        f"{s['applied_s']:.2f} s = {s['rate']:,.0f}/s; at {h['rate']:,.0f}/s "
        f"produce-to-queryable p50 {h['p50_ms']:.1f} ms p99 {h['p99_ms']:.1f} ms "
        f"({h['probes'] - h['lost']}/{h['probes']} probes; p99 outside generations "
        f"{_ms_or_none(h['p99_outside_generations_ms'])}, during "
        f"{_ms_or_none(h['p99_during_generations_ms'])} "
        f"({h['probes_during_generations']} probes)); CPU: daemon {h['daemon_cpu']:.0%} "
        f"of a core, broker {_share_or_none(h['broker_cpu'])} (its compiler "
        f"{_share_or_none(h['broker_jit_cpu'])}), driver {h['driver_cpu']:.0%}; answers "
        f"identical: {res['identical']}; longest snapshot lock hold "
        f"{res['snapshot_max_hold_s'] * 1000:.0f} ms"
    )


def _ms_or_none(value: float | None) -> str:
    return "none" if value is None else f"{value:.1f} ms"


def _share_or_none(value: float | None) -> str:
    return "not measured" if value is None else f"{value:.0%}"


def _summary_of(runs: Sequence[dict[str, Any]], key: str) -> dict[str, Any]:
    """`summary` of the runs that have `key` (a run may have no probe in a generation)."""
    return summary([r[key] for r in runs if r[key] is not None])


def e2e_figure(
    w: Workload,
    bootstrap: str,
    requests: int,
    repeats: int,
    seconds: float,
    logs: Path,
    log: Callable[[str], None] = print,
    check: int = 50,
    warmups: int = 0,
) -> dict[str, Any]:
    """Sustained rate of the first `requests` requests' records, then
    produce-to-queryable at half that rate for `seconds`, per run; the
    daemons' logs go to `logs`.

    Up to `warmups` runs come first, reported apart and left out of the
    figures: they stop once the broker's just-in-time compiler took under
    `JIT_SETTLED` of a core in one's half load (after one, for a broker
    whose compiler cannot be watched)."""
    records = w.streams.records
    cut = w.streams.marks[requests - 1][0] if requests else 0
    first, rest = records[:cut], records[cut:]
    prompts = [q.tolist() for q in w.queries[:check]]
    expected = forked(lambda: _reference(w, first, prompts))
    logs.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    warm: list[dict[str, Any]] = []
    settled = warmups == 0
    while len(runs) < repeats:
        res = forked(
            lambda: frozen_run(_one_run(w, bootstrap, first, rest, prompts, seconds, logs))
        )
        res["identical"] = res.pop("answers") == expected
        if settled:
            runs.append(res)
            which = f"run {len(runs)}/{repeats}"
        else:
            warm.append(res)
            jit = res["half_load"]["broker_jit_cpu"]
            settled = jit is None or jit < JIT_SETTLED or len(warm) == warmups
            which = f"warm-up {len(warm)}" + (" (the last)" if settled else "")
        log(f"  e2e {which}: {_run_line(res)}")
    half = [x["half_load"] for x in runs]
    return {
        "measured": True,
        "requests": requests,
        "records": len(first),
        "block_events": runs[0]["sustained"]["blocks"],
        "rate": summary([x["sustained"]["rate"] for x in runs]),
        "acked_rate": summary([x["sustained"]["blocks"] / x["sustained"]["acked_s"] for x in runs]),
        "half_load": {
            "seconds": seconds,
            "target_rate": summary([h["target_rate"] for h in half]),
            "rate": summary([h["rate"] for h in half]),
            "p50_ms": summary([h["p50_ms"] for h in half]),
            "p99_ms": summary([h["p99_ms"] for h in half]),
            "p99_outside_generations_ms": _summary_of(half, "p99_outside_generations_ms"),
            "p99_during_generations_ms": _summary_of(half, "p99_during_generations_ms"),
            "daemon_cpu": summary([h["daemon_cpu"] for h in half]),
            "broker_cpu": _summary_of(half, "broker_cpu"),
            "broker_jit_cpu": _summary_of(half, "broker_jit_cpu"),
            "driver_cpu": summary([h["driver_cpu"] for h in half]),
            "probes_during_generations": sum(h["probes_during_generations"] for h in half),
            "ack_p50_ms": summary([h["ack_p50_ms"] for h in half]),
            "ack_p99_ms": summary([h["ack_p99_ms"] for h in half]),
            "max_ms": max(h["max_ms"] or 0.0 for h in half),
            "probes": sum(h["probes"] for h in half),
            "lost": sum(h["lost"] for h in half),
            "poll_ms": POLL_S * 1000,
            "rtt_ms": summary([h["rtt_ms"] for h in half]),
        },
        "answers_checked": len(prompts),
        "identical": all(x["identical"] for x in runs + warm),
        "bad_records": sum(x["half_load"]["bad_records"] for x in runs + warm),
        "daemon": {
            "partitions": runs[0]["partitions"],
            "snapshot_interval_s": runs[0]["snapshot_interval_s"],
            "snapshots": [x["snapshots"] for x in runs],
            "snapshot_max_s": max(x["snapshot_max_s"] for x in runs),
            "snapshot_max_hold_s": max(x["snapshot_max_hold_s"] for x in runs),
            "exit_codes": [x["exit_code"] for x in runs],
        },
        "runs": runs,
        "warmup_runs": warm,
    }


async def create_event_topics(bootstrap: str, daemon: DaemonProcess) -> None:
    """The daemon's event topics, with its partition count, before it runs:
    records produced to them first wait there as a backlog."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(t, daemon.partitions, 1) for t in (daemon.engine_topic, daemon.pool_topic)]
        )
    finally:
        await admin.close()


async def _prequeued_run(
    bootstrap: str,
    records: Sequence[Record],
    prompts: Sequence[list[int]],
    model: str,
    block_size: int,
    folder: Path,
) -> dict[str, Any]:
    daemon = DaemonProcess(bootstrap, folder)
    await create_event_topics(bootstrap, daemon)
    producer = bridge_like_producer(bootstrap)
    await producer.start()
    try:
        for topic in (daemon.engine_topic, daemon.pool_topic):
            await producer.partitions_for(topic)
        acks = [
            await producer.send(
                (daemon.engine_topic, daemon.pool_topic)[r.pool],
                r.payload,
                key=r.key,
                headers=r.headers,
            )
            for r in records
        ]
        await producer.flush()
        await asyncio.gather(*acks)
    finally:
        await producer.stop()
    daemon.start()
    try:
        async with aiohttp.ClientSession() as session:
            first, done, consumed0 = await _timed_backlog(daemon, session, len(records))
            await daemon.wait_ready(session)
            answers = []
            for tokens in prompts:
                body = {"model": model, "block_size": block_size, "token_ids": tokens}
                async with session.post(f"{daemon.url}/query", json=body) as resp:
                    answers.append(await resp.json())
            _, bad = await daemon.counts(session)
        # The same client as Dynamo's standalone indexer gets (nothing else
        # runs on this loop now, so a blocking one is fine).
        client = Http(daemon.port)
        bodies = [
            msgspec.json.encode({"model": model, "block_size": block_size, "token_ids": p})
            for p in prompts
        ]
        query = client.one_client("/query", bodies)
        client.close()
        query["queries_per_s"] = await raw_http.rate(
            daemon.port, "/query", bodies, RATE_CLIENTS, RATE_REQUESTS
        )
        cpu = sum(process_cpu_s(daemon.pid))
    finally:
        code = daemon.stop()
    seconds = done - first
    return {
        "records": len(records) - consumed0,
        "seconds": seconds,
        "daemon_cpu_s": cpu,
        "bad_records": bad,
        "answers": answers,
        "query": query,
        "exit_code": code,
    }


async def _timed_backlog(
    daemon: DaemonProcess, session: aiohttp.ClientSession, n: int
) -> tuple[float, float, int]:
    """Scrape /metrics until the daemon consumed `n` records: (the first
    scrape that saw any consumed, the one that saw all, the count at the
    first). The records before the first scrape are left out of the rate;
    a backlog consumed whole between two scrapes is timed from the last
    scrape that saw none."""
    first: tuple[float, int] | None = None
    none_yet: float | None = None
    since = time.monotonic()
    while True:
        try:
            consumed, _ = await daemon.counts(session)
        except aiohttp.ClientError:  # not serving yet
            daemon._check_alive()
            consumed = -1
        now = time.perf_counter()
        if consumed == 0:
            none_yet = now
        if consumed > 0 and first is None:
            whole = consumed >= n and none_yet is not None
            first = (none_yet, 0) if whole and none_yet is not None else (now, consumed)
        if consumed >= n and first is not None:
            return first[0], now, first[1]
        if time.monotonic() - since > STALL_S + 60:
            got = max(consumed, 0)
            raise RuntimeError(f"daemon consumed {got:,} of {n:,}:\n{daemon.log_tail()}")
        await asyncio.sleep(BACKLOG_SCRAPE_S)


def prequeued_run(
    w: Workload,
    bootstrap: str,
    prompts: Sequence[list[int]],
    expected: list[Any],
    logs: Path,
) -> dict[str, Any]:
    """The real path on a backlog, one run: every record of `w` produced to
    fresh topics first, then `kvconductor run` started on them and timed
    until /metrics shows all consumed; its answers to `prompts` must then
    be `expected` (an in-process index's, fed the same records).

    The clock starts at the first scrape that sees a record consumed, so
    the daemon's start is left out, and so are the records it consumed
    before that scrape (the stream's first ones: per_unit counts the last
    records consumed)."""
    records = w.streams.records
    cfg = w.config
    logs.mkdir(parents=True, exist_ok=True)
    res = forked(
        lambda: frozen_run(
            _prequeued_run(bootstrap, records, prompts, cfg.model, cfg.block_size, logs)
        )
    )
    res["identical"] = res.pop("answers") == expected
    counted = records[len(records) - res["records"] :]
    shape = {
        "records": len(counted),
        "events": sum(x.events for x in counted),
        "blocks": sum(x.blocks for x in counted),
    }
    res["shape"] = shape
    if res["seconds"] > 0:
        res.update(per_unit(shape, res["seconds"]))
    return res


def reference_answers(w: Workload, prompts: Sequence[list[int]]) -> list[Any]:
    """An in-process index's answers after every record of `w`."""
    return forked(lambda: _reference(w, w.streams.records, prompts))
