"""Helpers for tests that run the daemon against the real broker."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvconductor.config import Config, load_config
from kvconductor.index.conductor import Incoming
from kvconductor.service.daemon import Daemon
from kvconductor.wire.encode import VllmBlockRemoved, VllmBlockStored
from kvconductor.wire.encode import vllm_payload as vllm_payload  # the tests' engine payloads

# The fixtures the tests read live in the repository (tests/fixtures/README.md).
ROOT = Path(__file__).resolve().parent.parent
FIXTURE_ROOT = ROOT / "tests" / "fixtures"
FIXTURES = FIXTURE_ROOT / "vllm"

Record = tuple[str, bytes, list[tuple[str, bytes]]]  # key, value, headers


def daemon_config(bootstrap: str, **overrides: str) -> Config:
    """A config with topics and group of its own, HTTP on a free port."""
    tag = uuid.uuid4().hex[:8]
    env = {
        "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": bootstrap,
        "KVCONDUCTOR_KAFKA_ENGINE_TOPIC": f"kv-events-{tag}",
        "KVCONDUCTOR_KAFKA_POOL_TOPIC": f"kv-pool-events-{tag}",
        "KVCONDUCTOR_KAFKA_SNAPSHOT_TOPIC": f"kv-index-snapshots-{tag}",
        "KVCONDUCTOR_KAFKA_DEAD_LETTER_TOPIC": f"kv-dead-letters-{tag}",
        "KVCONDUCTOR_KAFKA_REPARTITION_TOPIC": f"kv-index-input-{tag}",
        "KVCONDUCTOR_HTTP_REGISTRATIONS_TOPIC": f"kv-bridge-registrations-{tag}",
        "KVCONDUCTOR_KAFKA_GROUP_ID": f"kvc-{tag}",
        "KVCONDUCTOR_KAFKA_PARTITIONS": "3",
        "KVCONDUCTOR_HTTP_PORT": "0",
        "KVCONDUCTOR_SNAPSHOT_INTERVAL_S": "0.5",
    }
    # The daemon suites run on either fetch path (tests/test_native_fetch.py).
    env.update({k: v for k, v in os.environ.items() if k == "KVCONDUCTOR_KAFKA_FETCH_PATH"})
    env.update(overrides)
    return load_config(None, env)


@contextlib.asynccontextmanager
async def running(cfg: Config) -> AsyncIterator[Daemon]:
    daemon = Daemon(cfg)
    task = asyncio.create_task(daemon.run())
    try:
        await wait_for(lambda: daemon.http_port is not None, 30, "http up")
        yield daemon
    finally:
        daemon.stop()
        await asyncio.wait_for(task, 60)


async def wait_for(cond: Callable[[], bool | Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if not isinstance(got, bool):
            got = await got
        if got:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.1)


async def produce(bootstrap: str, topic: str, records: Sequence[Record]) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", enable_idempotence=True)
    await producer.start()
    try:
        for key, value, headers in records:
            await producer.send(topic, key=key.encode(), value=value, headers=headers)
        await producer.flush()
    finally:
        await producer.stop()


async def read_all(bootstrap: str, topic: str, timeout: float = 10.0) -> list[Any]:
    consumer = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", group_id=None
    )
    await consumer.start()
    out: list[Any] = []
    try:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=300)
            for recs in batch.values():
                out.extend(recs)
            parts = consumer.assignment()
            ends = await consumer.end_offsets(list(parts))
            if parts and all([await consumer.position(tp) >= ends[tp] for tp in parts]):
                break
    finally:
        await consumer.stop()
    return out


async def http_json(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with aiohttp.ClientSession() as session:
        data = None if body is None else msgspec.json.encode(body)
        async with session.request(method, f"http://127.0.0.1:{port}{path}", data=data) as resp:
            raw = await resp.read()
            try:
                return resp.status, msgspec.json.decode(raw)
            except msgspec.DecodeError:
                return resp.status, raw.decode()


def engine_headers(model: str = "m", block_size: int = 4, **extra: str) -> list[tuple[str, bytes]]:
    headers = {"kv-model": model, "kv-block-size": str(block_size), **extra}
    return [(k, v.encode()) for k, v in headers.items()]


def stored(
    hashes: list[int],
    tokens: list[int] | None,
    parent: int | None = None,
    medium: str = "GPU",
    block_size: int = 4,
) -> dict[str, Any]:
    """A vLLM 0.33 `BlockStored` without a KV-cache group, as a map a test
    may change (`vllm_payload` takes maps and events alike)."""
    ev = VllmBlockStored(hashes, parent, tokens, block_size, None, medium, None)
    return msgspec.to_builtins(ev, builtin_types=(bytes,))


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return msgspec.to_builtins(VllmBlockRemoved(hashes, medium), builtin_types=(bytes,))


def pool_payload(events: list[dict[str, Any]], ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, events, 0])


def write_daemon_config(path: Path, bootstrap: str, port: int, prefix: str = "crash") -> None:
    """A daemon configuration file with topics of its own, snapshots every
    0.3 s and a JSON log (`DaemonLives` reads it)."""
    tag = uuid.uuid4().hex[:8]
    path.write_text(
        f"""
[kafka]
bootstrap_servers = "{bootstrap}"
engine_topic = "{prefix}-events-{tag}"
pool_topic = "{prefix}-pool-{tag}"
snapshot_topic = "{prefix}-snapshots-{tag}"
dead_letter_topic = "{prefix}-dead-{tag}"
group_id = "{prefix}-{tag}"
client_id = "{prefix}-{tag}"
partitions = 3

[http]
port = {port}

[snapshot]
interval_s = 0.3

[log]
level = "info"
format = "json"
"""
    )


class DaemonLives:
    """Daemon subprocesses, one after another, with their logs."""

    def __init__(self, config: Path, logs: Path) -> None:
        self.config = config
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.n = 0

    def start(self, group_id: str, client_id: str) -> None:
        self.n += 1
        log = (self.logs / f"life-{self.n:02d}.log").open("wb")
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "KVCONDUCTOR_KAFKA_GROUP_ID": group_id,
            "KVCONDUCTOR_KAFKA_CLIENT_ID": client_id,
        }
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvconductor.tools.cli", "run", "--config", str(self.config)],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        log.close()

    def kill(self, sig: int = signal.SIGKILL, timeout: float = 30) -> int:
        proc = self.proc
        assert proc is not None
        proc.send_signal(sig)
        code = proc.wait(timeout)
        self.proc = None
        return code

    def phases(self) -> dict[str, int]:
        """How far each life got before it was killed."""
        out = {"before restore": 0, "restored": 0, "published": 0}
        for events in self.events():
            if "snapshot published" in events:
                out["published"] += 1
            elif "snapshot restored" in events:
                out["restored"] += 1
            else:
                out["before restore"] += 1
        return out

    def events(self) -> list[list[str]]:
        out = []
        for path in sorted(self.logs.glob("life-*.log")):
            events = []
            for line in path.read_text(errors="replace").splitlines():
                try:
                    events.append(json.loads(line).get("event", ""))
                except ValueError:
                    continue
            out.append(events)
        return out

    def published(self) -> int:
        """Generations published so far, by every life."""
        return sum(events.count("snapshot published") for events in self.events())

    def summary(self) -> str:
        """One line a life: generations published, the first events logged."""
        lines = []
        for n, events in enumerate(self.events(), 1):
            published = events.count("snapshot published")
            firsts = [e for e in events if e != "snapshot published"][:4]
            lines.append(f"  life {n:2d}: {published:3d} generations; {firsts}")
        return "\n".join(lines)


async def create_event_topics(bootstrap: str, cfg: Config) -> None:
    """The event topics exist before the first daemon, so the producer can
    start at once (the daemon keeps existing topics)."""
    k = cfg.kafka
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [
                NewTopic(k.engine_topic, 3, 1),
                NewTopic(k.pool_topic, 3, 1),
                NewTopic(k.snapshot_topic, 1, 1, topic_configs={"cleanup.policy": "compact"}),
            ]
        )
    finally:
        await admin.close()


def fixture_records(name: str) -> list[Incoming]:
    """A recorded fixture's records (`tests/fixtures/<name>/records.jsonl`),
    stamped a second apart from 1000.0."""
    path = Path(__file__).parent / "fixtures" / name / "records.jsonl"
    out = []
    for i, line in enumerate(path.read_text().splitlines()):
        row = json.loads(line)
        headers = [(k, v.encode()) for k, v in row["headers"].items()]
        value = base64.b64decode(row["value_b64"])
        out.append(Incoming(False, row["key"].encode(), headers, value, 1000.0 + i))
    return out
