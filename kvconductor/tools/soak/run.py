"""`kvconductor soak`: the demo's traffic under periodic faults, then proof.

    kvconductor soak --minutes 10                 # faults every 20 s
    kvconductor soak --minutes 1 --fault-every 3 --json soak.json

It starts a private Kafka broker (the one of `kvconductor kafka-local`, in a
temporary folder on free ports), the daemon as a subprocess (`kvconductor run
--config`), and the demo's simulated engines and pool backend, whose every
record is acknowledged by the broker before the next is sent (retried across
any fault: see `soak_traffic`). Every `--fault-every` seconds after the system
recovered from the previous fault, it injects the next of, in turn:

- `broker-sigterm`: the broker stopped (controlled shutdown), restarted;
- `broker-sigkill`: the broker killed, restarted (log recovery);
- `broker-sigstop`: the broker frozen for 2-12 s (SIGSTOP, then SIGCONT);
- `daemon-sigkill`: the daemon killed and restarted in its group, half the
  time killed again while it starts, restores or rejoins;
- `poison`: a burst of hostile records (undecodable, missing and invalid
  headers, absurd values, no key, 512 KiB of noise, ...), which the daemon
  must dead-letter, and nothing else;
- `flood`: 3-8 s of requests back to back, besides the paced traffic.

A fault is survived when the broker acknowledges new records again and the
daemon says it is ready, within three minutes. The soak lasts `--minutes`, or
longer until every kind of fault has been injected once. Then the traffic
stops, the daemon catches up, and the checks run: no acknowledged record is
missing from the log; the dead-letter topic holds exactly the hostile records;
the daemon's `/workers` and its answers to a few hundred queries equal those
of an undisturbed replay of every record in the topics from offset 0 (same
`[index]` configuration, see `soak_check.replay`); and after a SIGTERM, the
daemon's last snapshot holds exactly the replay's full state at the log's end
offsets. Verdict PASS (exit 0) or FAIL (exit 1), with the figures; the work
folder (broker data, daemon logs) is kept after a FAIL, or with `--keep`.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import shutil
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

import aiohttp
import msgspec

from kvconductor.config import Config, kafka_client_options, load_config
from kvconductor.kafka.topics import Replication, ensure_topics_on, topic_specs
from kvconductor.tools.api_client import metric_sum, parse_metrics
from kvconductor.tools.demo.engines import (
    DEMO_BLOCK_SIZE,
    DEMO_MODEL,
    SYSTEM_PROMPTS,
    KafkaSink,
    Traffic,
    default_fleet,
    text_tokens,
)
from kvconductor.tools.kafka_local import broker as kafka_local
from kvconductor.tools.soak.check import (
    Partitions,
    daemon_answers,
    daemon_final_state,
    dead_letters,
    differing_units,
    lost,
    pending_differences,
    read_topics,
    replay,
)
from kvconductor.tools.soak.procs import Broker, DaemonLives
from kvconductor.tools.soak.traffic import (
    HOSTILE_KINDS,
    AckedProducer,
    Where,
    flood,
    hostile_records,
    keep_pool_blocks,
)
from kvconductor.wire.query import TokenQuery

PROG = "kvconductor soak"
FAULT_KINDS = (
    "broker-sigterm",
    "broker-sigkill",
    "broker-sigstop",
    "daemon-sigkill",
    "poison",
    "flood",
)
SNAPSHOT_INTERVAL_S = 2.0
START_TIMEOUT_S = 120.0
RECOVERY_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 300.0
STATUS_EVERY_S = 10.0
SAMPLE_EVERY_S = 1.0
SAMPLE_QUERIES = 300
# Longer than the backlog any fault survived leaves the daemon: that backlog
# is at most the recovery time (see SlowEvictingLru).
POOL_KEEP_S = RECOVERY_TIMEOUT_S + 60.0
# How much later than an undisturbed run the daemon may stamp a pending half:
# the same backlog, and a batch's worth (see soak_check.pending_differences).
PENDING_BAND_S = RECOVERY_TIMEOUT_S + 10.0


class SoakError(Exception):
    """The soak itself could not go on (a broker that does not come back, a
    daemon that never gets ready): a FAIL with this reason."""


class Fault(msgspec.Struct):
    """One fault, as the JSON report lists it."""

    n: int
    kind: str
    at_s: float  # since the soak started
    detail: str = ""
    survived: bool = False
    recovered_s: float | None = None  # from injection to recovered


class Report(msgspec.Struct):
    """What `--json` writes."""

    verdict: str = "FAIL"
    problems: list[str] = msgspec.field(default_factory=list)
    figures: dict[str, Any] = msgspec.field(default_factory=dict)
    faults: list[Fault] = msgspec.field(default_factory=list)
    work_dir: str = ""


def write_config(path: Path, bootstrap: str, http_port: int) -> Config:
    """The daemon's configuration: the defaults, on the private broker, with
    snapshots every 2 s so that kills land between and inside generations."""
    path.write_text(
        f'[kafka]\nbootstrap_servers = "{bootstrap}"\nclient_id = "kvconductor-soak"\n'
        f'group_id = "kvconductor-soak"\n\n[http]\nport = {http_port}\n\n'
        f"[snapshot]\ninterval_s = {SNAPSHOT_INTERVAL_S}\n\n"
        '[log]\nlevel = "info"\nformat = "json"\n'
    )
    return load_config(path, {})


class Soak:
    def __init__(self, args: argparse.Namespace, work: Path, out: IO[str]) -> None:
        self.args = args
        self.work = work
        self.out = out
        self.rng = random.Random(args.seed)
        self.started = time.monotonic()
        self.broker = Broker(work / "kafka")
        (work / "logs").mkdir()
        self.broker_frozen = False
        self.daemon: DaemonLives | None = None
        self.cfg: Config | None = None
        self.url = ""
        self.producer: AckedProducer | None = None
        self.traffic: Traffic | None = None
        self.poison: dict[Where, str] = {}  # hostile record -> its kind
        self.faults: list[Fault] = []
        self.flooded = 0
        self.max_lag = 0.0
        self._last_metrics: dict[str, float] = {}
        self._status_mark = (self.started, 0)  # time, events: the rate since

    # ------------------------------------------------------------ output

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def say(self, message: str) -> None:
        print(f"soak: [{self.elapsed():6.0f}s] {message}", file=self.out, flush=True)

    def status_line(self, rss_kib: int, ready: str) -> str:
        assert self.traffic is not None and self.daemon is not None
        s = self.traffic.stats
        now = time.monotonic()
        rate = (s.events - self._status_mark[1]) / max(now - self._status_mark[0], 1e-6)
        self._status_mark = (now, s.events)
        m = self._last_metrics
        return (
            f"{s.events} events acked ({rate:.0f}/s), {s.engine_records + s.pool_records} "
            f"records, {len(self.poison)} hostile | {len(self.faults)} faults | daemon life "
            f"{self.daemon.lives} {ready}, rss {rss_kib / 1024:.0f} MB (peak "
            f"{self.daemon.max_rss_kib / 1024:.0f}), lag {m.get('lag', 0):.0f}, dead letters "
            f"{m.get('dead_letters', 0):.0f} (this life)"
        )

    # ----------------------------------------------------------- daemon

    async def _get(self, session: aiohttp.ClientSession, path: str) -> tuple[int, str]:
        async with session.get(f"{self.url}{path}") as resp:
            return resp.status, await resp.text()

    async def ready(self) -> bool:
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                status, _ = await self._get(s, "/ready")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return False
        return status == 200

    async def lag(self) -> dict[tuple[str, str], float] | None:
        """Consumer lag per partition as the daemon reports it; None if unreachable."""
        try:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
                _, text = await self._get(s, "/metrics")
        except (aiohttp.ClientError, OSError, TimeoutError):
            return None
        metrics = parse_metrics(text)
        self._last_metrics = {
            "lag": metric_sum(metrics, "kvconductor_consumer_lag"),
            "dead_letters": metric_sum(metrics, "kvconductor_dead_letters_total"),
        }
        self.max_lag = max(self.max_lag, self._last_metrics["lag"])
        return {
            (labels.get("topic", ""), labels.get("partition", "")): value
            for labels, value in metrics.get("kvconductor_consumer_lag", [])
        }

    async def wait_ready(self, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not await self.ready():
            if time.monotonic() > deadline:
                raise SoakError(f"the daemon was not ready within {timeout_s:.0f} s {what}")
            await asyncio.sleep(0.5)

    async def monitor(self) -> None:
        """Samples the daemon's memory and lag every second (and notices a
        daemon that exited by itself); a status line every few seconds."""
        assert self.daemon is not None
        last_status = time.monotonic()
        while True:
            await asyncio.sleep(SAMPLE_EVERY_S)
            if not self.daemon.check_alive():
                self.say(f"the daemon exited by itself: {self.daemon.unexpected_exits[-1]}")
            rss = self.daemon.sample()
            await self.lag()
            if time.monotonic() - last_status >= STATUS_EVERY_S:
                last_status = time.monotonic()
                ready = "ready" if await self.ready() else "not ready"
                self.say(self.status_line(rss, ready))

    # ----------------------------------------------------------- faults

    async def _broker(self, action: str) -> None:
        await asyncio.to_thread(getattr(self.broker, action))

    async def inject(self, fault: Fault) -> None:
        rng = self.rng
        assert self.daemon is not None and self.traffic is not None
        if fault.kind in ("broker-sigterm", "broker-sigkill"):
            down = rng.uniform(0.5, 5.0)
            await self._broker("stop" if fault.kind == "broker-sigterm" else "kill")
            await asyncio.sleep(down)
            began = time.monotonic()
            await self._broker("start")
            fault.detail = (
                f"broker down {down:.1f} s, back in {time.monotonic() - began:.1f} s after restart"
            )
        elif fault.kind == "broker-sigstop":
            frozen = rng.uniform(2.0, 12.0)
            self.broker.freeze()
            self.broker_frozen = True
            try:
                await asyncio.sleep(frozen)
            finally:
                self.broker.thaw()
                self.broker_frozen = False
            fault.detail = f"broker frozen {frozen:.1f} s"
        elif fault.kind == "daemon-sigkill":
            self.daemon.signal(signal.SIGKILL)
            self.daemon.start()
            if rng.random() < 0.5:
                again = rng.uniform(0.2, 4.0)
                await asyncio.sleep(again)
                self.daemon.signal(signal.SIGKILL)
                self.daemon.start()
                fault.detail = f"killed, restarted, killed again {again:.1f} s later, restarted"
            else:
                fault.detail = "killed, restarted"
            fault.detail += f" (life {self.daemon.lives})"
        elif fault.kind == "poison":
            await self.send_poison(rng.randint(len(HOSTILE_KINDS), 2 * len(HOSTILE_KINDS)), fault)
        elif fault.kind == "flood":
            seconds = rng.uniform(3.0, 8.0)
            served = await flood(self.traffic, seconds)
            self.flooded += served
            fault.detail = f"{served} extra requests in {seconds:.1f} s"

    async def send_poison(self, count: int, fault: Fault) -> None:
        assert self.producer is not None and self.cfg is not None
        k = self.cfg.kafka
        keys = sorted({s.instance for s in default_fleet()})
        for h in hostile_records(self.rng, count, keys):
            topic = k.pool_topic if h.pool else k.engine_topic
            at = await self.producer.send(topic, key=h.key, value=h.value, headers=h.headers)
            self.poison[at] = h.kind
        fault.detail = f"{count} hostile records"

    async def recover(self, fault: Fault, injected: float) -> None:
        """Until new records are acknowledged and the daemon is ready."""
        assert self.producer is not None
        acked = len(self.producer.acked)
        deadline = time.monotonic() + RECOVERY_TIMEOUT_S
        while len(self.producer.acked) <= acked or not await self.ready():
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(0.2)
        fault.recovered_s = round(time.monotonic() - injected, 1)
        fault.survived = True

    async def faults_loop(self) -> None:
        end = self.started + self.args.minutes * 60
        n = 0
        while True:
            await asyncio.sleep(self.args.fault_every)
            if time.monotonic() >= end and n >= len(FAULT_KINDS):
                return
            fault = Fault(n + 1, FAULT_KINDS[n % len(FAULT_KINDS)], round(self.elapsed(), 1))
            n += 1
            self.faults.append(fault)
            injected = time.monotonic()
            await self.inject(fault)
            await self.recover(fault, injected)
            if not fault.survived:
                self.say(f"fault {fault.n} {fault.kind}: {fault.detail}; NOT recovered")
                raise SoakError(
                    f"no recovery within {RECOVERY_TIMEOUT_S:.0f} s of fault {fault.n} "
                    f"({fault.kind})"
                )
            self.say(
                f"fault {fault.n} {fault.kind}: {fault.detail}; recovered in "
                f"{fault.recovered_s:.1f} s"
            )

    # --------------------------------------------------------------- run

    async def setup(self) -> None:
        self.say(f"starting a private Kafka broker in {self.broker.data_dir}")
        await self._broker("start")
        (http_port,) = kafka_local.free_ports(1)
        config = self.work / "kvconductor.toml"
        self.cfg = cfg = write_config(config, self.broker.bootstrap, http_port)
        k = cfg.kafka
        # Before the first record: a producer would otherwise auto-create them
        # with the broker's defaults.
        await ensure_topics_on(
            k.bootstrap_servers,
            k.client_id,
            kafka_client_options(k),
            topic_specs(cfg),
            Replication.of(k),
        )
        self.url = f"http://127.0.0.1:{http_port}"
        self.daemon = DaemonLives(config, self.work / "logs")
        self.daemon.start()
        await self.wait_ready(START_TIMEOUT_S, "after its start")
        self.producer = AckedProducer(k, f"{k.client_id}-engines")
        sink = KafkaSink(self.producer, k.engine_topic, k.pool_topic)
        self.traffic = Traffic(sink, rate=self.args.rate, seed=self.args.seed, poison=False)
        keep_pool_blocks(self.traffic, POOL_KEEP_S)
        self.say(
            f"broker {self.broker.bootstrap}, daemon {self.url} (pid {self.daemon.pid}), "
            f"traffic {self.args.rate:g} requests/s, a fault every {self.args.fault_every:g} s"
        )

    async def run(self, report: Report) -> None:
        try:
            await self.setup()
            assert self.traffic is not None
            stop = asyncio.Event()
            traffic = asyncio.create_task(self.traffic.run(stop))
            monitor = asyncio.create_task(self.monitor())
            try:
                await self.faults_loop()
            finally:
                stop.set()
                monitor.cancel()
                if not traffic.done():
                    await asyncio.wait_for(traffic, RECOVERY_TIMEOUT_S)
            traffic.result()
        finally:
            if self.producer is not None:
                await self.producer.stop()
        self.say("traffic stopped; waiting for the daemon to reach the end of the topics")
        await self.check(report)

    # ----------------------------------------------------------- checks

    async def settle(self, partitions: Partitions) -> None:
        """Until the daemon reports no lag on any partition with records."""
        assert self.daemon is not None
        want = {(tp.topic, str(tp.partition)) for tp, recs in partitions.items() if recs}
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            self.daemon.check_alive()
            lag = await self.lag()
            if lag is not None and all(lag.get(tp) == 0 for tp in want) and await self.ready():
                return
            if time.monotonic() > deadline:
                raise SoakError(f"the daemon did not catch up within {SETTLE_TIMEOUT_S:.0f} s")
            await asyncio.sleep(0.5)

    def sample_queries(self) -> list[TokenQuery]:
        assert self.traffic is not None
        texts = list(SYSTEM_PROMPTS.values())
        texts += [self.traffic.workload.sample_query()[1] for _ in range(SAMPLE_QUERIES)]
        return [TokenQuery(DEMO_MODEL, DEMO_BLOCK_SIZE, text_tokens(t)) for t in texts]

    async def check(self, report: Report) -> None:
        assert self.cfg is not None and self.daemon is not None
        assert self.producer is not None and self.traffic is not None
        cfg, k, problems = self.cfg, self.cfg.kafka, report.problems
        events = await read_topics(k, [k.engine_topic, k.pool_topic])
        await self.settle(events)
        ends = {tp: recs[-1].offset + 1 for tp, recs in events.items() if recs}
        loss = lost(self.producer.acked, events)
        if loss.lost:
            problems.append(f"{len(loss.lost)} acknowledged records lost, e.g. {loss.lost[:5]}")
        rerun = await asyncio.to_thread(replay, cfg.index, events, k.pool_topic)
        del events
        if rerun.rejected.keys() != self.poison.keys():
            accepted = sorted(self.poison.keys() - rerun.rejected.keys())
            refused = sorted(rerun.rejected.keys() - self.poison.keys())
            problems.append(
                f"the replay accepted {len(accepted)} hostile records ({accepted[:5]}) and "
                f"rejected {len(refused)} others ({refused[:5]})"
            )
        dlq = dead_letters(await read_topics(k, [k.dead_letter_topic]))
        if dlq.sources.keys() != self.poison.keys():
            missing = sorted(self.poison.keys() - dlq.sources.keys())
            extra = sorted(dlq.sources.keys() - self.poison.keys())
            problems.append(
                f"dead letters: {len(missing)} hostile records missing ({missing[:5]}), "
                f"{len(extra)} others dead-lettered ({extra[:5]})"
            )
        wrong_kind = [w for w, kind in dlq.sources.items() if rerun.rejected.get(w, kind) != kind]
        if wrong_kind:
            problems.append(f"{len(wrong_kind)} dead letters of another kind than the replay's")
        queries = self.sample_queries()
        answers = await daemon_answers(self.url, rerun.conductor, queries)
        problems.extend(answers[:10])
        code = self.daemon.signal(signal.SIGTERM)
        if code != 0:
            problems.append(f"the daemon exited with code {code} on SIGTERM")
        final = await daemon_final_state(cfg)
        units, compared = differing_units(final.restored, rerun.conductor)
        if units:
            problems.append(f"{len(units)} snapshot units differ from the replay: {units[:8]}")
        pending = pending_differences(
            final.restored, rerun.conductor, cfg.index.max_pending_age_s, PENDING_BAND_S
        )
        if pending.problems:
            problems.append(
                f"{len(pending.problems)} pending halves differ from the replay: "
                f"{pending.problems[:5]}"
            )
        offsets = {tp: o for tp, o in final.offsets.items() if o}
        if offsets != ends:
            problems.append(f"the last snapshot reflects offsets {offsets}, the log ends at {ends}")
        problems.extend(self.daemon.unexpected_exits)
        s = self.traffic.stats
        by_kind = Counter(f.kind for f in self.faults)
        survived = Counter(f.kind for f in self.faults if f.survived)
        recoveries = [f.recovered_s for f in self.faults if f.recovered_s is not None]
        report.figures.update(
            {
                "events_acked": s.events,
                "engine_records_acked": s.engine_records,
                "pool_records_acked": s.pool_records,
                "requests": s.requests,
                "flood_requests": self.flooded,
                "hostile_records": len(self.poison),
                "hostile_kinds": len(set(self.poison.values())),
                "records_in_log": rerun.records,
                "unacknowledged_copies_in_log": loss.unacknowledged,
                "acknowledged_lost": len(loss.lost),
                "producer_failed_attempts": self.producer.failed_attempts,
                "producer_clients": self.producer.clients,
                "faults": {
                    kind: {"injected": by_kind[kind], "survived": survived[kind]}
                    for kind in FAULT_KINDS
                },
                "faults_injected": len(self.faults),
                "faults_survived": sum(survived.values()),
                "recovery_max_s": round(max(recoveries, default=0.0), 1),
                "dead_letters": dlq.copies,
                "dead_lettered_records": len(dlq.sources),
                "daemon_lives": self.daemon.lives,
                "broker_starts_retried": self.broker.failed_starts,
                "daemon_max_rss_mb": round(self.daemon.max_rss_kib / 1024, 1),
                "max_consumer_lag": int(self.max_lag),
                "queries_compared": len(queries),
                "snapshot_units_compared": compared,
                "pending_entries_compared": pending.compared,
                "pending_entries_at_age_cutoff": pending.at_cutoff,
                "pending_max_time_skew_s": round(pending.max_skew_s, 1),
            }
        )

    def finish(self, report: Report) -> None:
        """Stop whatever still runs: the daemon, then the broker (thawed first)."""
        if self.broker_frozen:
            self.broker.thaw()
        if self.daemon is not None and self.daemon.proc is not None:
            self.daemon.signal(signal.SIGKILL)
        try:
            self.broker.stop()
        except kafka_local.KafkaLocalError as exc:
            report.problems.append(f"stopping the broker: {exc}")
        report.faults = self.faults
        report.figures["duration_s"] = round(self.elapsed())


def print_report(report: Report, out: IO[str]) -> None:
    f = report.figures
    faults = f.get("faults", {})
    rows = [
        ("duration", f"{f.get('duration_s', 0)} s"),
        ("KV events acknowledged", str(f.get("events_acked", "-"))),
        (
            "records acknowledged",
            f"{f.get('engine_records_acked', '-')} engine, {f.get('pool_records_acked', '-')} "
            f"pool, {f.get('hostile_records', '-')} hostile ({f.get('hostile_kinds', '-')} kinds)",
        ),
        ("records in the log", str(f.get("records_in_log", "-"))),
        ("acknowledged records lost", str(f.get("acknowledged_lost", "-"))),
        (
            "faults survived / injected",
            f"{f.get('faults_survived', '-')} / {f.get('faults_injected', '-')} (slowest "
            f"recovery {f.get('recovery_max_s', '-')} s)",
        ),
        *((f"  {kind}", f"{n['survived']} / {n['injected']}") for kind, n in faults.items()),
        (
            "dead letters",
            f"{f.get('dead_letters', '-')} ({f.get('dead_lettered_records', '-')} records)",
        ),
        ("daemon lives", str(f.get("daemon_lives", "-"))),
        ("daemon peak RSS", f"{f.get('daemon_max_rss_mb', '-')} MB"),
        ("largest consumer lag", str(f.get("max_consumer_lag", "-"))),
        (
            "compared with the replay",
            f"{f.get('queries_compared', '-')} queries, /workers, "
            f"{f.get('snapshot_units_compared', '-')} snapshot units, "
            f"{f.get('pending_entries_compared', '-')} pending entries "
            f"({f.get('pending_entries_at_age_cutoff', '-')} at the age cutoff)",
        ),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"  {name.ljust(width)}  {value}", file=out)
    for problem in report.problems:
        print(f"  problem: {problem}", file=out)
    if report.work_dir:
        print(f"  broker data and daemon logs kept in {report.work_dir}", file=out)
    print(f"soak: {report.verdict}", file=out, flush=True)


def _quiet_logs() -> None:
    from kvconductor.obs.logs import setup_logging

    setup_logging("warning", "console")
    # The producer's and consumers' complaints while the broker is down are
    # the point of the exercise, not news.
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)


def run(args: argparse.Namespace) -> int:
    """Entry of `kvconductor soak`."""
    out = sys.stdout
    if args.minutes < 0 or args.fault_every <= 0 or args.rate <= 0:
        print(f"{PROG}: error: --minutes >= 0, --fault-every > 0 and --rate > 0", file=sys.stderr)
        return 2
    _quiet_logs()
    work = Path(tempfile.mkdtemp(prefix="kvconductor-soak-"))
    soak = Soak(args, work, out)
    report = Report()
    try:
        asyncio.run(soak.run(report))
    except SoakError as exc:
        report.problems.append(str(exc))
    except KeyboardInterrupt:
        report.problems.append("interrupted")
    except Exception as exc:
        report.problems.append(f"the soak failed: {type(exc).__name__}: {exc}")
    finally:
        soak.finish(report)
    report.verdict = "PASS" if not report.problems else "FAIL"
    if report.verdict == "FAIL" or args.keep:
        report.work_dir = str(work)
    else:
        shutil.rmtree(work, ignore_errors=True)
    print_report(report, out)
    if args.json:
        Path(args.json).write_bytes(msgspec.json.format(msgspec.json.encode(report)) + b"\n")
    return 0 if report.verdict == "PASS" else 1
