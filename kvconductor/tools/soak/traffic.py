"""What a soak sends: the demo's traffic through a producer that never gives
up, hostile records, and floods.

`AckedProducer` stands in for the `AIOKafkaProducer` of the demo's
`KafkaSink`: each `send` returns only once the broker acknowledged the
record (`acks=all`), retrying through broker restarts and freezes with a
fresh client when the old one fails, and remembers where every acknowledged
record landed and a digest of it, so the soak can prove none was lost. Sends
are serialised in call order, which keeps each engine's `kv-seq` order on
its partition when a flood or a poison burst runs next to the paced traffic.
"""

from __future__ import annotations

import asyncio
import hashlib
import random
import time
from typing import Any, NamedTuple

import msgspec
from aiokafka import AIOKafkaProducer
from aiokafka.errors import KafkaError

from kvconductor.config import KafkaConfig, kafka_client_options
from kvconductor.kafka.clients import retire, started
from kvconductor.tools.demo.engines import (
    DEMO_BLOCK_SIZE,
    DEMO_MODEL,
    DEMO_POOL,
    BlockHash,
    Headers,
    Traffic,
    _Lru,
    block_stored,
    pool_event,
    pool_payload,
)
from kvconductor.wire.encode import VllmAllBlocksCleared, vllm_payload
from kvconductor.wire.records import (
    KV_BLOCK_SIZE,
    KV_CONTROL,
    KV_DP_RANK,
    KV_MODEL,
    KV_SEQ,
    KV_SOURCE,
)

# (topic, partition, offset) of a record in the log.
Where = tuple[str, int, int]

REQUEST_TIMEOUT_MS = 30_000
MAX_BACKOFF_S = 2.0


def record_digest(key: bytes | None, value: bytes | None, headers: Headers) -> bytes:
    """What a record must still be when read back: key, value and headers."""
    return hashlib.blake2b(msgspec.msgpack.encode([key, value, headers]), digest_size=12).digest()


class AckedProducer:
    """`send` that returns once the record is acknowledged, whatever it takes."""

    def __init__(self, kafka: KafkaConfig, client_id: str) -> None:
        self.kafka = kafka
        self.client_id = client_id
        self.acked: dict[Where, bytes] = {}
        self.failed_attempts = 0
        self.clients = 0
        self._producer: Any = None
        self._lock = asyncio.Lock()

    async def _client(self) -> Any:
        if self._producer is None:
            k = self.kafka
            self._producer = await started(
                lambda: AIOKafkaProducer(
                    bootstrap_servers=k.bootstrap_servers,
                    client_id=self.client_id,
                    acks="all",
                    enable_idempotence=True,
                    request_timeout_ms=REQUEST_TIMEOUT_MS,
                    **kafka_client_options(k),
                )
            )
            self.clients += 1
        return self._producer

    async def _drop_client(self) -> None:
        # A client whose send failed may be stuck in a state it does not leave
        # (an idempotent producer after its epoch was lost): start afresh.
        producer, self._producer = self._producer, None
        if producer is not None:
            await retire(producer, 10)

    async def send(
        self, topic: str, *, key: bytes | None, value: bytes | None, headers: Headers
    ) -> Where:
        async with self._lock:
            delay = 0.1
            while True:
                try:
                    producer = await self._client()
                    future = await producer.send(topic, key=key, value=value, headers=headers)
                    meta = await future
                    break
                except (KafkaError, OSError, TimeoutError):
                    self.failed_attempts += 1
                    await self._drop_client()
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, MAX_BACKOFF_S)
            where: Where = (meta.topic, meta.partition, meta.offset)
            self.acked[where] = record_digest(key, value, headers)
            return where

    async def flush(self) -> None:
        """Nothing to flush: every send was acknowledged before it returned."""

    async def stop(self) -> None:
        async with self._lock:
            await self._drop_client()


# ---------------------------------------------------------------- poison


class Hostile(NamedTuple):
    kind: str
    pool: bool  # to the pool topic (else the engine topic)
    key: bytes | None
    value: bytes | None
    headers: Headers


def _engine_headers(**override: str | None) -> Headers:
    base: dict[str, str | None] = {
        KV_MODEL: DEMO_MODEL,
        KV_BLOCK_SIZE: str(DEMO_BLOCK_SIZE),
        **override,
    }
    return [(k, v.encode()) for k, v in base.items() if v is not None]


HOSTILE_KINDS = (
    "garbage",
    "big-garbage",
    "not-a-batch",
    "truncated",
    "nested",
    "tombstone",
    "no-model",
    "misconfigured-bridge",
    "bad-block-size",
    "zero-block-size",
    "bad-rank",
    "bad-seq",
    "bad-source",
    "bad-control",
    "no-key",
    "bad-key",
    "token-out-of-range",
    "pool-garbage",
    "pool-unknown-event",
    "pool-negative-block-size",
)


def hostile(kind: str, instance: bytes, rng: random.Random) -> Hostile:
    """One record the daemon must dead-letter. Most carry a valid payload that
    clears an instance's blocks, so one wrongly accepted would show in the
    index; they are keyed like real instances' records, so they land in the
    middle of real partitions."""
    cleared = vllm_payload([VllmAllBlocksCleared()], 0, time.time())
    key: bytes | None = DEMO_POOL.encode() if kind.startswith("pool-") else instance
    value: bytes | None = cleared
    headers = _engine_headers()
    pool = kind.startswith("pool-")
    match kind:
        case "garbage":
            value = rng.randbytes(rng.randrange(1, 2048))
        case "big-garbage":
            value = rng.randbytes(512 * 1024)
        case "not-a-batch":
            value = msgspec.msgpack.encode({"hello": "world"})
        case "truncated":
            value = cleared[:-3]
        case "nested":  # an event nested 100,000 arrays deep in a valid envelope
            ts = msgspec.msgpack.encode(time.time())
            value = b"\x93" + ts + b"\x91" + b"\x91" * 100_000 + b"\xc0" + b"\x00"
        case "tombstone":
            value = None
        case "no-model":
            headers = _engine_headers(**{KV_MODEL: None})
        case "misconfigured-bridge":
            headers = _engine_headers(**{KV_BLOCK_SIZE: None})
        case "bad-block-size":
            headers = _engine_headers(**{KV_BLOCK_SIZE: "16x"})
        case "zero-block-size":
            headers = _engine_headers(**{KV_BLOCK_SIZE: "0"})
        case "bad-rank":
            headers = _engine_headers(**{KV_DP_RANK: "-1"})
        case "bad-seq":
            headers = _engine_headers(**{KV_SEQ: "1e9"})
        case "bad-source":
            headers = _engine_headers(**{KV_SOURCE: "bogus"})
        case "bad-control":
            value, headers = b"", _engine_headers(**{KV_CONTROL: "explode"})
        case "no-key":
            key = None
        case "bad-key":
            key = b"\xff\xfe" + instance
        case "token-out-of-range":
            tokens = [2**33] * DEMO_BLOCK_SIZE
            event = block_stored([rng.getrandbits(63)], None, tokens, "GPU", DEMO_BLOCK_SIZE)
            value = vllm_payload([event], 0, time.time())
        case "pool-garbage":
            value = rng.randbytes(64)
        case "pool-unknown-event":
            value = pool_payload([pool_event(1, "exploded", 1)], time.time())
        case "pool-negative-block-size":
            negative = {**pool_event(1, "stored", 3), "block_size": -16}
            value = pool_payload([negative], time.time())
        case _:
            raise ValueError(f"unknown hostile record kind {kind!r}")
    return Hostile(kind, pool, key, value, headers)


def hostile_records(rng: random.Random, count: int, keys: list[str]) -> list[Hostile]:
    """`count` hostile records: every kind once per round, in a shuffled order."""
    names = list(HOSTILE_KINDS)
    out: list[Hostile] = []
    while len(out) < count:
        rng.shuffle(names)
        out.extend(hostile(n, rng.choice(keys).encode(), rng) for n in names[: count - len(out)])
    return out


# ------------------------------------------------------------ pool backend


class SlowEvictingLru(_Lru):
    """The pool backend's LRU, except that it evicts nothing confirmed in the
    last `keep_s` seconds (it may hold more than its capacity meanwhile).

    The index's one order-dependent join: an offload intent applied after its
    pool confirmation *and* the pool's removal of that block stays pinned
    until it ages out (max_pending_age_s). A daemon catching up after a
    restart applies each partition's backlog in turn, so when the pool churns
    through its capacity within that window (as it does during a flood), the
    daemon's pending intents legitimately differ from any other order's. A
    pool that keeps what it confirmed for longer than any backlog a fault
    leaves makes the final index independent of the daemon's interleaving,
    so the soak can compare it with the replay exactly."""

    def __init__(self, capacity: int, keep_s: float) -> None:
        super().__init__(capacity)
        self.keep_s = keep_s
        self._touched: dict[BlockHash, float] = {}

    def touch(self, h: BlockHash) -> None:
        super().touch(h)
        self._touched[h] = time.monotonic()

    def overflow(self) -> list[BlockHash]:
        out: list[BlockHash] = []
        young = time.monotonic() - self.keep_s
        while len(self.blocks) > self.capacity:
            oldest = next(iter(self.blocks))
            if self._touched.get(oldest, 0.0) > young:
                break
            del self.blocks[oldest]
            self._touched.pop(oldest, None)
            out.append(oldest)
        return out


def keep_pool_blocks(traffic: Traffic, keep_s: float) -> None:
    """Give the traffic's pool backend a `SlowEvictingLru` of the same capacity."""
    traffic.pool.cpu = SlowEvictingLru(traffic.pool.cpu.capacity, keep_s)


# ----------------------------------------------------------------- floods


async def flood(traffic: Traffic, seconds: float) -> int:
    """Requests back to back, next to the paced traffic, for `seconds`;
    returns how many were served."""
    served = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        await traffic.step()
        served += 1
    return served
