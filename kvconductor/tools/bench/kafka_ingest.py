"""The real ingest path's speed on vLLM-shaped records: Kafka → daemon.

    python -m kvconductor.tools.bench.kafka_ingest --bootstrap HOST:PORT \
        [--workload fleet] [--mode daemon]

Pre-produces the workload's records to fresh topics, then times the index
from its first fetch to caught up, with the CPU it used:

- `--mode daemon` (default): `kvconductor run` in a process of its own,
  configured by environment to the fresh topics; from its partitions being
  assigned (`/ready` says "catching up") to `/ready` 200, its CPU from
  /proc. Snapshots are on (`--no-snapshots`: off), as in a real daemon.
- `--mode consumer`: the daemon's `EventConsumer`, driven in this process
  with the daemon's consumer options, on uvloop as the daemon.
- `--profile FILE` (consumer mode): cProfile of the catch-up, in FILE.
- `--rounds N` (consumer mode): catch up N times (a fresh group each) on
  the same records, printing the median round's figures and every
  round's CPU a record: on a shared machine one round is noise.
- `--kafka-only` (consumer mode): the core takes the records and applies
  none of them: what the Kafka side and the consume loop cost alone.
- `--set fetch_path=native` (either mode): the daemon's own fetch path
  (kvconductor/consumers/fetcher.py) in place of aiokafka's fetcher.

Two workloads (`--workload`):

- `fleet` (default): figure 7's records, as `kvconductor.tools.bench.lane_profile gen` makes
  them: a vLLM-shaped fleet (`kvconductor.tools.bench.vllm_engine.fleet_workload`, churn
  0.5) stepped until it holds `--entries` blocks (200,000: 24,054
  records, 8.4 events a record), every record with its own timestamp.
  The fairer figure, hence the default: the records are the shape the
  daemon meets (long sessions, stores, evictions, re-stores of evicted
  blocks, several instances' records interleaved), so they take the
  core's paths in the proportions production's do. `--records` takes its first N (default: all).
- `fixture`: the dense instances of the vLLM fixture (`hyb-d0`, `hyb-d1`
  of tests/fixtures/vllm-hybrid: vLLM's own KVCacheManager output, every
  removal one hash, 2-3 events a record), their payloads byte for byte,
  `--instances` at a time, ids interleaved as a fleet produces, each
  replaying one of the two streams with its `kv-seq` consecutive. A
  stream played to its end is played again by a fresh instance id, so no
  instance re-stores blocks it holds (which real engines never do: it
  would send such records off the compiled lane, a bench artifact).
  `--records` default 100,000.

Prints one JSON object: records/s, events/s, CPU seconds, and the
seconds the event loop's thread waited for a core (`runqueue_s`, from
/proc: the machine was busy) and for anything else (`idle_s`: Kafka).
The topics are deleted afterwards.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import cProfile
import json
import os
import pickle
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvconductor.index.engine_lane import Steps
from kvconductor.tools.bench.field_fleet import FIXTURES
from kvconductor.wire.records import KV_SEQ

FIXTURE = FIXTURES / "vllm-hybrid" / "records.jsonl"
DENSE = ("hyb-d0", "hyb-d1")


class Template(msgspec.Struct, frozen=True):
    headers: list[tuple[str, bytes]]  # without kv-seq
    value: bytes
    events: int


def templates(path: Path) -> list[list[Template]]:
    """Each dense instance's records in produce order."""
    streams: dict[str, list[Template]] = {name: [] for name in DENSE}
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if row["key"] not in streams:
            continue
        value = base64.b64decode(row["value_b64"])
        events = len(msgspec.msgpack.decode(value)[1])
        headers = [(k, v.encode()) for k, v in row["headers"].items() if k != KV_SEQ]
        streams[row["key"]].append(Template(headers, value, events))
    return [streams[name] for name in DENSE]


class Produced(NamedTuple):
    """One record to pre-produce (`ts` None: the producer's clock)."""

    pool: bool
    key: bytes
    headers: list[tuple[str, bytes]]
    value: bytes
    events: int
    ts: float | None = None


def fixture_records(
    streams: list[list[Template]], instances: int, records: int
) -> Iterator[Produced]:
    """The fixture's records in produce order: one record per instance slot
    in turn, slot i replaying stream i % 2 from its start, as a fresh
    instance id each time the stream starts again."""
    made = 0
    step = 0
    while True:
        for i in range(instances):
            stream = streams[i % len(streams)]
            life, seq = divmod(step, len(stream))
            key = f"vllm-{i:04d}-{life}".encode()
            t = stream[seq]
            yield Produced(False, key, [*t.headers, (KV_SEQ, str(seq).encode())], t.value, t.events)
            made += 1
            if made == records:
                return
        step += 1


def fleet_records(args: argparse.Namespace) -> list[Produced]:
    """Figure 7's records, the first `args.records`: `args.fleet`'s (a
    `kvconductor.tools.bench.lane_profile gen` output) or generated as it generates them."""
    from kvconductor.tools.bench.cluster import Record

    made: list[Record]
    if args.fleet:
        made = pickle.loads(Path(args.fleet).read_bytes())
    else:
        from kvconductor.tools.bench.lane_profile import fleet_records as generate

        made = generate(args.entries, args.seed)
    # Their clock moved to now, spacing kept: the broker's retention (by
    # record time) would delete records stamped years ago while they are read.
    shift = time.time() - made[0].ts if made else 0.0
    return [
        Produced(r.pool, r.key, r.headers, r.payload, r.events, r.ts + shift)
        for r in made[: args.records]
    ]


def workload(args: argparse.Namespace) -> list[Produced]:
    """The records `args` ask for; `args.records` set to their count."""
    if args.workload == "fleet":
        out = fleet_records(args)
    else:
        streams = templates(Path(args.fixture))
        out = list(fixture_records(streams, args.instances, args.records or 100_000))
    args.records = len(out)
    return out


async def produce(bootstrap: str, tag: str, records: list[Produced], compression: str) -> int:
    """Pre-produce the records, each to its topic; returns their events."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        linger_ms=20,
        max_batch_size=1024 * 1024,
        acks=1,
        compression_type=None if compression == "none" else compression,
    )
    await producer.start()
    events = 0
    try:
        pending = []
        for r in records:
            pending.append(
                await producer.send(
                    f"{tag}-pool" if r.pool else f"{tag}-events",
                    r.value,
                    key=r.key,
                    headers=r.headers,
                    timestamp_ms=None if r.ts is None else int(r.ts * 1000),
                )
            )
            events += r.events
            if len(pending) >= 5000:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await producer.stop()
    return events


async def make_topics(bootstrap: str, names: list[str], partitions: int) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(n, partitions, 1) for n in names])
    finally:
        await admin.close()


async def delete_topics(bootstrap: str, prefix: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        mine = [t for t in await admin.list_topics() if t.startswith(prefix)]
        if mine:
            await admin.delete_topics(mine)
    finally:
        await admin.close()


def _env(bootstrap: str, tag: str, args: argparse.Namespace) -> dict[str, str]:
    sets = dict(kv.split("=", 1) for kv in args.set)
    return {
        **{f"KVCONDUCTOR_KAFKA_{k.upper()}": v for k, v in sets.items()},
        "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "KVCONDUCTOR_KAFKA_ENGINE_TOPIC": f"{tag}-events",
        "KVCONDUCTOR_KAFKA_POOL_TOPIC": f"{tag}-pool",
        "KVCONDUCTOR_KAFKA_SNAPSHOT_TOPIC": f"{tag}-snapshots",
        "KVCONDUCTOR_KAFKA_DEAD_LETTER_TOPIC": f"{tag}-dead",
        "KVCONDUCTOR_KAFKA_REPARTITION_TOPIC": f"{tag}-internal",
        "KVCONDUCTOR_HTTP_REGISTRATIONS_TOPIC": f"{tag}-registrations",
        "KVCONDUCTOR_KAFKA_GROUP_ID": tag,
        "KVCONDUCTOR_KAFKA_CLIENT_ID": tag,
        "KVCONDUCTOR_HTTP_PORT": "0",
        "KVCONDUCTOR_SNAPSHOT_ENABLED": "false" if args.no_snapshots else "true",
        "KVCONDUCTOR_LOG_FORMAT": "json",
    }


class Usage(NamedTuple):
    """A process's CPU so far, and its main thread's (the event loop's)
    time waiting for a core: on a shared machine a wait for the CPU is not
    a wait for Kafka."""

    cpu_s: float
    runqueue_s: float

    @classmethod
    def of(cls, pid: int) -> Usage:
        if pid == os.getpid():  # /proc's clock ticks are 10 ms: too coarse in-process
            cpu = time.process_time()
        else:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            cpu = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        return cls(cpu, int(Path(f"/proc/{pid}/schedstat").read_text().split()[1]) / 1e9)


def _timed(seconds: float, start: Usage, end: Usage) -> dict[str, float]:
    return {
        "seconds": seconds,
        "cpu_s": end.cpu_s - start.cpu_s,
        "runqueue_s": end.runqueue_s - start.runqueue_s,
    }


def _ready(port: int) -> tuple[bool, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/ready", timeout=5) as resp:
            body = json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        body = json.loads(exc.read())
    return bool(body["ready"]), str(body["reason"])


def run_daemon(bootstrap: str, tag: str, args: argparse.Namespace) -> dict[str, float]:
    env = {**os.environ, **_env(bootstrap, tag, args)}
    exe = Path(sys.executable).parent / "kvconductor"
    logs = open(f"/tmp/{tag}.log", "w")  # noqa: SIM115 (the daemon's life)
    proc = subprocess.Popen([str(exe), "run"], env=env, stdout=logs, stderr=subprocess.STDOUT)
    try:
        port = 0
        deadline = time.monotonic() + 60
        while not port:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"the daemon did not come up: see /tmp/{tag}.log")
            for line in Path(f"/tmp/{tag}.log").read_text().splitlines():
                if '"http listening"' in line:
                    port = int(json.loads(line)["port"])
            time.sleep(0.05)
        start, used = 0.0, None
        while True:
            ok, reason = _ready(port)
            now = time.monotonic()
            if used is None and (ok or reason == "catching up"):
                start, used = now, Usage.of(proc.pid)
            if ok:
                assert used is not None
                return _timed(now - start, used, Usage.of(proc.pid))
            if now > deadline + 600 or proc.poll() is not None:
                raise RuntimeError(f"the daemon did not catch up: see /tmp/{tag}.log")
            time.sleep(0.05)
    finally:
        proc.terminate()
        proc.wait(30)
        logs.close()


class _Untouched:
    """A core that applies nothing (`--kafka-only`)."""

    def __init__(self) -> None:
        from kvconductor.index.conductor import Conductor

        self._core = Conductor()
        self.counters = self._core.counters

    def ingest_steps(self, records: Sequence[Any]) -> Steps[list[Any]]:
        yield from ()  # no kernel calls
        return []


async def run_consumer(
    bootstrap: str, tag: str, group: str, args: argparse.Namespace, profile_to: str | None
) -> dict[str, float]:
    from kvconductor.config import kafka_fetch_options, load_config
    from kvconductor.consumers.dead_letters import DeadLetterWriter
    from kvconductor.consumers.event_consumer import EventConsumer
    from kvconductor.consumers.fetcher import native_fetcher
    from kvconductor.index.conductor import Conductor
    from kvconductor.obs.metrics import Metrics

    cfg = load_config(None, _env(bootstrap, tag, args)).kafka
    conductor = _Untouched() if args.kafka_only else Conductor()
    metrics = Metrics(Conductor())
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="none",
        isolation_level="read_committed",
        **kafka_fetch_options(cfg),
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    fetcher = native_fetcher(consumer, cfg) if cfg.native_fetch else None
    await consumer.start()
    await producer.start()
    events = EventConsumer(
        consumer,
        conductor,  # type: ignore[arg-type]
        metrics,
        DeadLetterWriter(producer, cfg.dead_letter_topic, metrics),
        cfg.engine_topic,
        cfg.pool_topic,
        cfg.fetch_max_records,
        fetcher=fetcher,
    )
    if fetcher is not None:
        await fetcher.start()

    # CPU time, not wall: on a shared machine waits for a core would count.
    profile = cProfile.Profile(time.process_time) if profile_to else None
    started: list[tuple[float, Usage]] = []
    lost: list[int] = []

    async def assign(tps: set[TopicPartition]) -> dict[TopicPartition, int]:
        # The clock starts before the first fetch of the assignment.
        started.append((time.monotonic(), Usage.of(os.getpid())))
        if profile is not None:
            profile.enable()
        await consumer.seek_to_beginning(*tps)
        positions = {tp: await consumer.position(tp) for tp in tps}
        if any(positions.values()):  # fresh topics: nothing should be gone
            lost.append(sum(positions.values()))
        return positions

    events.on_assign = assign
    events.subscribe()
    try:
        # A fresh topic, one producer without transactions: offsets 0..n-1.
        while sum(events.applied_offsets.values()) < args.records:
            await events.poll(100)
        if profile is not None and profile_to is not None:
            profile.disable()
            profile.dump_stats(profile_to)
        if lost:
            raise RuntimeError(f"{lost[0]} records were deleted (retention) before they were read")
        start, used = started[0]
        return _timed(time.monotonic() - start, used, Usage.of(os.getpid()))
    finally:
        if fetcher is not None:
            await fetcher.stop()
        await consumer.stop()
        await producer.stop()


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    bootstrap = args.bootstrap
    tag = f"kafka-ingest-{uuid.uuid4().hex[:8]}"
    names = [f"{tag}-{t}" for t in ("events", "pool")]
    await make_topics(bootstrap, names, args.partitions)
    try:
        events = await produce(bootstrap, tag, workload(args), args.compression)
        if args.mode == "daemon":
            rounds = [await asyncio.to_thread(run_daemon, bootstrap, tag, args)]
        else:
            rounds = []
            for i in range(args.rounds):  # a fresh group each: from the start again
                profile = args.profile if i == 0 else None
                rounds.append(await run_consumer(bootstrap, tag, f"{tag}-{i}", args, profile))
    finally:
        await delete_topics(bootstrap, tag)
    timed = sorted(rounds, key=lambda r: r["cpu_s"])[len(rounds) // 2]
    s = timed["seconds"]
    return {
        "mode": args.mode,
        "workload": args.workload,
        "records": args.records,
        "events": events,
        "instances": args.instances if args.workload == "fixture" else None,
        "partitions": args.partitions,
        "set": args.set,
        "kafka_only": args.kafka_only,
        "compression": args.compression,
        "seconds": round(s, 3),
        "cpu_s": round(timed["cpu_s"], 3),
        # Neither computing nor waiting for a core: waiting for Kafka.
        "idle_s": round(s - timed["cpu_s"] - timed["runqueue_s"], 3),
        "runqueue_s": round(timed["runqueue_s"], 3),
        "records_per_s": round(args.records / s),
        "events_per_s": round(events / s),
        "cpu_us_per_record": round(timed["cpu_s"] / args.records * 1e6, 2),
        "rounds_cpu_us_per_record": [round(r["cpu_s"] / args.records * 1e6, 2) for r in rounds],
    }


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bootstrap", required=True, metavar="HOST:PORT")
    p.add_argument("--workload", choices=("fleet", "fixture"), default="fleet")
    p.add_argument(
        "--records", type=int, help="how many (fleet: its first N, default all; fixture: 100,000)"
    )
    p.add_argument("--entries", type=int, default=200_000, help="fleet: blocks it holds")
    p.add_argument("--seed", type=int, default=7, help="fleet: its seed")
    p.add_argument(
        "--fleet", metavar="FILE", help="fleet: `lane_profile gen`'s records, not generated"
    )
    p.add_argument("--instances", type=int, default=64, help="fixture: instances at a time")
    p.add_argument("--partitions", type=int, default=6)
    p.add_argument("--mode", choices=("daemon", "consumer"), default="daemon")
    p.add_argument(
        "--compression",
        choices=("none", "gzip", "snappy", "lz4", "zstd"),
        default="none",
        help="the pre-produced records' (lz4, snappy and zstd need cramjam)",
    )
    p.add_argument("--no-snapshots", action="store_true", help="daemon mode: snapshots off")
    p.add_argument("--kafka-only", action="store_true", help="consumer mode: apply nothing")
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="consumer mode: catch up N times on the same records; the median round's figures",
    )
    p.add_argument("--profile", metavar="FILE", help="consumer mode: cProfile stats to FILE")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a [kafka] key for the index (fetch_max_wait_ms=100), repeatable",
    )
    p.add_argument("--fixture", default=str(FIXTURE), help="the vllm-hybrid records.jsonl")
    return p


def main() -> None:
    args = parser().parse_args()
    try:  # the daemon's loop (kvconductor.tools.cli)
        import uvloop

        print(json.dumps(uvloop.run(main_async(args))))
    except ImportError:
        print(json.dumps(asyncio.run(main_async(args))))


if __name__ == "__main__":
    main()
