"""Test doubles for the bridge: a publisher speaking vLLM's exact ZMQ layout,
and helpers to run a bridge and read what it wrote.

`FakePublisher` behaves like vLLM 0.33's `ZmqEventPublisher` on the wire
(checked byte for byte against tests/fixtures/vllm/zmq_frames_0.33.0.json
in test_bridge_frames.py): live `[topic, seq, payload]` on a PUB socket (an
XPUB here, which sends the same frames and also tells the test when the
bridge has subscribed), and a ROUTER replay socket that answers `[b"", seq]`
with every buffered message from `seq` on and the end marker, in one of the
replay generations:

- `new` (vLLM >= 0.33): `[id, b"", topic, seq, payload]`, end `[id, b"", b"", END, b""]`;
- `old` (older vLLM, SGLang): `[id, b"", seq, payload]`, end `[id, b"", END, b""]`;
- `bare` (no delimiter): `[id, seq, payload]`, end `[id, END, b""]`.

`drop=True` on `publish` keeps the message in the replay buffer but never
sends it live: a message lost between publisher and bridge.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from collections import deque
from collections.abc import AsyncIterator
from typing import Any

import zmq
import zmq.asyncio

from kvconductor.bridge.app import Bridge
from kvconductor.bridge.config import BridgeConfig, BridgeSettings
from kvconductor.config import KafkaConfig
from kvconductor.registry.publishers import PublisherConfig
from tests.harness import FIXTURES, wait_for

END = (2**64 - 1).to_bytes(8, "big")
FRAMES_FIXTURE = FIXTURES / "zmq_frames_0.33.0.json"


def fixture_frames() -> dict[str, list[list[bytes]]]:
    raw = json.loads(FRAMES_FIXTURE.read_text())
    return {name: [[bytes.fromhex(f) for f in msg] for msg in msgs] for name, msgs in raw.items()}


def fixture_payloads() -> list[bytes]:
    """The four live payloads vLLM 0.33 published (seq 0..3)."""
    return [msg[2] for msg in fixture_frames()["live"]]


def bind_pair(sock_a: zmq.Socket[Any], sock_b: zmq.Socket[Any] | None) -> int:
    """Bind two sockets on consecutive free ports; returns the first port."""
    for _ in range(50):
        port = sock_a.bind_to_random_port("tcp://127.0.0.1", min_port=20000, max_port=60000)
        if sock_b is None:
            return port
        try:
            sock_b.bind(f"tcp://127.0.0.1:{port + 1}")
        except zmq.ZMQError:
            sock_a.unbind(f"tcp://127.0.0.1:{port}")
            continue
        return port
    raise RuntimeError("no two consecutive free ports")


class FakePublisher:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        topic: bytes = b"kv-events",
        replay: bool = True,
        generation: str = "new",
        buffer_steps: int = 10_000,
        port: int | None = None,
        replay_port: int | None = None,
        sndhwm: int = 100_000,
    ) -> None:
        assert generation in ("new", "old", "bare")
        self.ctx = ctx
        self.topic = topic
        self.generation = generation
        self.seq = 0
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.setsockopt(zmq.SNDHWM, sndhwm)
        self.router: zmq.asyncio.Socket | None = None
        if replay:
            self.router = ctx.socket(zmq.ROUTER)
            self.router.setsockopt(zmq.LINGER, 0)
        if port is None:
            self.port = bind_pair(self.pub, None)
        else:
            self.port = port
            self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.replay_port: int | None = None
        if self.router is not None:
            if replay_port is None:
                self.replay_port = self.router.bind_to_random_port(
                    "tcp://127.0.0.1", min_port=20000, max_port=60000
                )
            else:
                self.replay_port = replay_port
                self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.subscribers = 0
        self.replay_requests: list[int] = []
        self._tasks = [asyncio.get_running_loop().create_task(self._watch_subscriptions())]
        if self.router is not None:
            self._tasks.append(asyncio.get_running_loop().create_task(self._serve_replay()))

    @property
    def endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.port}"

    @property
    def replay_endpoint(self) -> str | None:
        return None if self.replay_port is None else f"tcp://127.0.0.1:{self.replay_port}"

    async def _watch_subscriptions(self) -> None:
        while True:
            msg = await self.pub.recv()
            if msg[:1] == b"\x01":
                self.subscribers += 1
            elif msg[:1] == b"\x00":
                self.subscribers -= 1

    async def wait_subscribed(self, timeout: float = 10.0) -> None:
        await wait_for(lambda: self.subscribers > 0, timeout, "bridge subscription")
        await asyncio.sleep(0.05)

    async def publish(self, payload: bytes, drop: bool = False) -> int:
        seq = self.seq
        self.seq += 1
        if not drop:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.buffer.append((seq, payload))
        return seq

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 3:
                continue
            ident, _, start_bytes = frames
            start = int.from_bytes(start_bytes, "big")
            self.replay_requests.append(start)
            for seq, payload in list(self.buffer):
                if seq >= start:
                    await self.router.send_multipart(self.replay_frames(ident, seq, payload))
            await self.router.send_multipart(self.end_frames(ident))

    def replay_frames(self, ident: bytes, seq: int, payload: bytes) -> list[bytes]:
        s = seq.to_bytes(8, "big")
        if self.generation == "new":
            return [ident, b"", self.topic, s, payload]
        if self.generation == "old":
            return [ident, b"", s, payload]
        return [ident, s, payload]

    def end_frames(self, ident: bytes) -> list[bytes]:
        if self.generation == "new":
            return [ident, b"", b"", END, b""]
        if self.generation == "old":
            return [ident, b"", END, b""]
        return [ident, END, b""]

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self.pub.close(linger=0)
        if self.router is not None:
            self.router.close(linger=0)
        await asyncio.sleep(0.05)


def publisher(fake: FakePublisher, id: str = "vllm-0", **kw: Any) -> PublisherConfig:
    values: dict[str, Any] = {
        "id": id,
        "endpoint": fake.endpoint,
        "replay_endpoint": fake.replay_endpoint,
        "model": "m",
        "block_size": 4,
    }
    values.update(kw)
    return PublisherConfig(**values)


def bridge_config(
    bootstrap: str,
    publishers: tuple[PublisherConfig, ...] = (),
    *,
    engine_topic: str | None = None,
    pool_topic: str | None = None,
    registrations_topic: str | None = None,
    group_id: str | None = None,
    **settings: Any,
) -> BridgeConfig:
    tag = uuid.uuid4().hex[:8]
    kafka = KafkaConfig(
        bootstrap_servers=bootstrap,
        engine_topic=engine_topic or f"kv-events-{tag}",
        pool_topic=pool_topic or f"kv-pool-events-{tag}",
        partitions=3,
    )
    values: dict[str, Any] = {
        "port": 0,
        "registrations_topic": registrations_topic or f"kv-bridge-registrations-{tag}",
        "group_id": group_id or f"kvc-bridge-{tag}",
        "replay_timeout_s": 2.0,
        "flush_timeout_s": 5.0,
        "linger_ms": 1,
    }
    values.update(settings)
    return BridgeConfig(kafka=kafka, bridge=BridgeSettings(**values), publishers=publishers)


@contextlib.asynccontextmanager
async def running_bridge(cfg: BridgeConfig) -> AsyncIterator[Bridge]:
    bridge = Bridge(cfg)
    task = asyncio.create_task(bridge.run())
    try:
        await wait_for(lambda: bridge.status == "running" or task.done(), 60, "bridge running")
        if task.done():
            task.result()
        yield bridge
    finally:
        bridge.stop()
        await asyncio.wait_for(task, 60)


def headers_of(record: Any) -> dict[str, str]:
    return {name: bytes(value).decode() for name, value in record.headers}


def records_for(records: list[Any], key: str) -> list[Any]:
    """One key's records in log order (one key lives on one partition)."""
    mine = [r for r in records if r.key == key.encode()]
    assert len({r.partition for r in mine}) <= 1
    return sorted(mine, key=lambda r: r.offset)
