"""Helpers for tests that run the daemon against the real broker."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from kvconductor.config import Config, load_config
from kvconductor.daemon import Daemon

# The fixtures the tests read live in the repository (tests/fixtures/README.md).
FIXTURE_ROOT = Path(__file__).resolve().parent / "fixtures"
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


def vllm_payload(events: list[dict[str, Any]], rank: int | None = 0, ts: float = 1.0) -> bytes:
    """A vLLM 0.33 (tagged map) payload."""
    return msgspec.msgpack.encode([ts, events, rank])


def stored(
    hashes: list[int],
    tokens: list[int] | None,
    parent: int | None = None,
    medium: str = "GPU",
    block_size: int = 4,
) -> dict[str, Any]:
    return {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": block_size,
        "lora_id": None,
        "medium": medium,
        "lora_name": None,
    }


def removed(hashes: list[int], medium: str = "GPU") -> dict[str, Any]:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def pool_payload(events: list[dict[str, Any]], ts: float = 1.0) -> bytes:
    return msgspec.msgpack.encode([ts, events, 0])
