"""Simulated engines and a pool backend that publish real-format KV events to Kafka.

The demo's traffic, also runnable on its own (`kvconductor demo --engines-only`):

- a workload of chat conversations that share system prompts and grow turn
  by turn, so prompts share prefixes the way production traffic does;
- engines (`SimEngine`): one per (instance, dp rank), each with a GPU prefix
  cache that evicts leaf-first, and either a local host/disk offload tier
  (`kv-offload: local`) or offload into a pool backend (`kv-offload: pool`);
- a pool backend (`SimPool`, Mooncake-style) that confirms the offloads it
  receives a little later (two-phase: intent on the engine topic, then a
  token-less `stored` on the pool topic) and evicts when full.

Payloads are exactly what the engines put in the third ZMQ frame: vLLM 0.33
tagged maps `[ts, [events], dp_rank]` on the engine topic (one instance
with int block hashes, one with sha256 digests as bytes, as vLLM sends them
with `prefix_caching_hash_algo=sha256`), Mooncake RFC #1527 maps on the pool
topic, with the headers of contract sections 2 and 3.

Tokenisation: none. Prompt text is mapped to token ids byte by byte (UTF-8),
the same mapping as `kvconductor query --text`, so a prompt typed there hits
what the demo engines cached.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import random
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgspec
import xxhash

from kvconductor.tools.extras import needs_extra
from kvconductor.wire.encode import (
    VllmAllBlocksCleared,
    VllmEvent,
    vllm_payload,
    vllm_removed,
    vllm_stored,
)
from kvconductor.wire.records import (
    KV_BLOCK_SIZE,
    KV_DP_RANK,
    KV_MODEL,
    KV_OFFLOAD,
    KV_SEQ,
    KV_SOURCE,
)

DEMO_MODEL = "demo/llama-3-8b"
DEMO_BLOCK_SIZE = 16
DEMO_POOL = "mooncake-0"

Headers = list[tuple[str, bytes]]
Event = dict[str, Any]  # a Mooncake pool event
BlockHash = int | bytes


def text_tokens(text: str) -> list[int]:
    """The demo's 'tokenizer': UTF-8 bytes as token ids (0..255)."""
    return list(text.encode("utf-8"))


# ---------------------------------------------------------------- workload

SYSTEM_PROMPTS: dict[str, str] = {
    "support": (
        "You are Ada, the customer support assistant of Northwind Cloud. Answer questions "
        "about billing, quotas, regions and outages. Be concise and friendly. Never invent "
        "prices: quote the price list below and link the status page for incidents. If a "
        "customer asks for a refund, collect the invoice number and the reason, then hand "
        "the case to a human agent. Price list: compute 0.041 per vCPU hour, storage 0.020 "
        "per GB month, egress 0.08 per GB after the first 100 GB. "
    ),
    "code-review": (
        "You are a senior Python reviewer. Review the diff the user pastes. Point out bugs "
        "first, then races and resource leaks, then style. Quote the exact lines you mean. "
        "Prefer small concrete suggestions over rewrites. The project targets Python 3.11, "
        "uses asyncio, msgspec and aiokafka, and runs ruff and mypy --strict in CI. "
    ),
    "sql": (
        "You translate questions into PostgreSQL 16 queries over this schema: "
        "customers(id, name, region, created_at), orders(id, customer_id, total_cents, "
        "status, created_at), items(order_id, sku, quantity, price_cents). Always qualify "
        "columns, never use SELECT *, and explain the query in one sentence afterwards. "
    ),
    "travel": (
        "You are a travel planner. Build day-by-day itineraries with realistic travel "
        "times between places, opening hours, and one rainy-day alternative per day. Ask "
        "for the budget and the travellers' ages when they are not given. Use metric "
        "units and 24-hour times. "
    ),
}

_TOPICS = {
    "support": ["my invoice", "the eu-west outage", "raising my GPU quota", "a refund"],
    "code-review": ["this retry loop", "the consumer shutdown", "a lock around the cache"],
    "sql": ["top customers by revenue", "orders per region last month", "repeat buyers"],
    "travel": ["three days in Kyoto", "a week in Portugal", "a weekend in Vienna"],
}
_ASKS = [
    "Can you help me with {t}?",
    "Quick question about {t}.",
    "What should I do about {t}?",
    "Please explain {t} step by step.",
]
_REPLIES = [
    "Sure. Here is what I would do first.",
    "Good question: it depends on two things.",
    "Let me break that down for you.",
    "Here is a short answer and then the details.",
]


@dataclass
class Conversation:
    kind: str
    text: str
    turns: int = 0


class Workload:
    """Chat conversations over a few shared system prompts (seeded, reproducible)."""

    def __init__(self, rng: random.Random, max_active: int = 24, max_turns: int = 6) -> None:
        self.rng = rng
        self.max_active = max_active
        self.max_turns = max_turns
        self.active: list[Conversation] = []

    def _user_turn(self, kind: str) -> str:
        topic = self.rng.choice(_TOPICS[kind])
        return "\nUser: " + self.rng.choice(_ASKS).format(t=topic) + "\nAssistant:"

    def next_prompt(self) -> tuple[str, str]:
        """(label, prompt text) of the next request; conversations grow turn by turn."""
        rng = self.rng
        if not self.active or (len(self.active) < self.max_active and rng.random() < 0.3):
            kind = rng.choice(list(SYSTEM_PROMPTS))
            conv = Conversation(kind, SYSTEM_PROMPTS[kind])
            self.active.append(conv)
        else:
            conv = rng.choice(self.active)
        conv.text += self._user_turn(conv.kind)
        conv.turns += 1
        prompt = conv.text
        conv.text += " " + rng.choice(_REPLIES)
        if conv.turns >= self.max_turns:
            self.active.remove(conv)
        return f"{conv.kind}#{conv.turns}", prompt

    def sample_query(self) -> tuple[str, str]:
        """A prompt a router could be asked to place: an ongoing conversation's
        next turn, or a new conversation on a known system prompt."""
        rng = self.rng
        if self.active and rng.random() < 0.75:
            conv = rng.choice(self.active)
            return f"{conv.kind} turn {conv.turns + 1}", conv.text + self._user_turn(conv.kind)
        kind = rng.choice(list(SYSTEM_PROMPTS))
        return f"{kind} new", SYSTEM_PROMPTS[kind] + self._user_turn(kind)


# ------------------------------------------------------------------ events


def block_stored(
    hashes: list[BlockHash],
    parent: BlockHash | None,
    tokens: list[int],
    medium: str,
    block_size: int,
) -> VllmEvent:
    """Token-less (hash-only) offload stores carry `token_ids: []` and
    `block_size: 0`, as vLLM's offloading connector sends them without
    `self_describing_kv_events`."""
    return vllm_stored(hashes, parent, tokens, medium, block_size if tokens else 0)


def pool_event(event_id: int, event_type: str, hashes: list[int], medium: str | None) -> Event:
    """A Mooncake RFC #1527 event (as `mooncake_master` publishes it)."""
    return {
        "event_id": event_id,
        "event_type": event_type,
        "seq_hashes": hashes,
        "parent_hash": None,
        "base_block_idx": None,
        "token_ids": None,
        "medium": medium,
        "backend_id": DEMO_POOL,
        "tenant_id": None,
        "model_name": DEMO_MODEL,
        "block_size": DEMO_BLOCK_SIZE,
        "lora_name": None,
        "additional_salt": None,
    }


def pool_payload(events: list[Event], ts: float) -> bytes:
    return msgspec.msgpack.encode([int(ts * 1000), events, 0])  # Mooncake: milliseconds


# ----------------------------------------------------------------- engines


def _int_hash(parent: BlockHash | None, block: bytes) -> BlockHash:
    prefix = parent.to_bytes(8, "little") if isinstance(parent, int) else b""
    return xxhash.xxh3_64_intdigest(prefix + block)


def _sha256_hash(parent: BlockHash | None, block: bytes) -> BlockHash:
    prefix = parent if isinstance(parent, bytes) else b""
    return hashlib.sha256(prefix + block).digest()


class _Lru:
    """A tier's blocks in recency order (oldest first)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[BlockHash, None] = OrderedDict()

    def __contains__(self, h: object) -> bool:
        return h in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def touch(self, h: BlockHash) -> None:
        self.blocks[h] = None
        self.blocks.move_to_end(h)

    def discard(self, h: BlockHash) -> None:
        self.blocks.pop(h, None)

    def overflow(self) -> list[BlockHash]:
        out: list[BlockHash] = []
        while len(self.blocks) > self.capacity:
            out.append(self.blocks.popitem(last=False)[0])
        return out


@dataclass
class EngineSpec:
    instance: str
    dp_rank: int
    offload: str  # "local" | "pool"
    gpu_blocks: int
    cpu_blocks: int = 0  # own host tier (local offload)
    disk_blocks: int = 0  # own disk tier (local offload)
    sha256: bool = False  # bytes block hashes (vLLM's sha256 algorithms)

    @property
    def describe(self) -> str:
        tiers = f"GPU {self.gpu_blocks}"
        if self.offload == "pool":
            tiers += f", offload to {DEMO_POOL}"
        else:
            if self.cpu_blocks:
                tiers += f", CPU {self.cpu_blocks}"
            if self.disk_blocks:
                tiers += f", DISK {self.disk_blocks}"
        hashes = "sha256 bytes" if self.sha256 else "int"
        return f"{self.instance} dp{self.dp_rank} ({tiers}; {hashes} hashes)"


def default_fleet() -> list[EngineSpec]:
    """Two instances with two dp ranks and local offload, one with a disk tier and
    sha256 hashes, one offloading into the pool backend."""
    return [
        EngineSpec("vllm-0", 0, "local", gpu_blocks=160, cpu_blocks=480),
        EngineSpec("vllm-0", 1, "local", gpu_blocks=160, cpu_blocks=480),
        EngineSpec("vllm-1", 0, "local", gpu_blocks=128, cpu_blocks=256, disk_blocks=768),
        EngineSpec(
            "vllm-1", 1, "local", gpu_blocks=128, cpu_blocks=256, disk_blocks=768, sha256=True
        ),
        EngineSpec("vllm-2", 0, "pool", gpu_blocks=128),
    ]


class SimEngine:
    """One (instance, dp rank): a prefix cache with leaf-first eviction."""

    def __init__(self, spec: EngineSpec, block_size: int) -> None:
        self.spec = spec
        self.block_size = block_size
        self.gpu = _Lru(spec.gpu_blocks)
        self.cpu = _Lru(spec.cpu_blocks)
        self.disk = _Lru(spec.disk_blocks)
        self._hash: Callable[[BlockHash | None, bytes], BlockHash] = (
            _sha256_hash if spec.sha256 else _int_hash
        )

    def hashes(self, tokens: list[int]) -> list[BlockHash]:
        bs = self.block_size
        out: list[BlockHash] = []
        parent: BlockHash | None = None
        for i in range(len(tokens) // bs):
            parent = self._hash(parent, bytes(tokens[i * bs : (i + 1) * bs]))
            out.append(parent)
        return out

    def serve(self, tokens: list[int]) -> tuple[list[VllmEvent], list[int]]:
        """Events of one request's prefill; and the blocks offloaded to the pool."""
        bs = self.block_size
        hashes = self.hashes(tokens)
        events: list[VllmEvent] = []
        first = next((i for i, h in enumerate(hashes) if h not in self.gpu), len(hashes))
        if first < len(hashes):
            parent = hashes[first - 1] if first else None
            events.append(
                block_stored(
                    hashes[first:], parent, tokens[first * bs : len(hashes) * bs], "GPU", bs
                )
            )
        # Children first, so a prefix stays more recent than what extends it
        # and eviction takes leaves before their parents (as vLLM does).
        for h in reversed(hashes):
            self.gpu.touch(h)
        offloaded: list[int] = []
        victims = self.gpu.overflow()
        if victims:
            if self.spec.offload == "pool":
                # Phase one of the two-phase offload: an intent, hash-only.
                events.append(block_stored(victims, None, [], "CPU", bs))
                offloaded = [h for h in victims if isinstance(h, int)]
            elif self.spec.cpu_blocks:
                events.append(block_stored(victims, None, [], "CPU", bs))
                for h in victims:
                    self.cpu.touch(h)
            events.append(vllm_removed(victims, "GPU"))
        spilled = self.cpu.overflow()
        if spilled:
            if self.spec.disk_blocks:
                events.append(block_stored(spilled, None, [], "DISK", bs))
                for h in spilled:
                    self.disk.touch(h)
            events.append(vllm_removed(spilled, "CPU"))
        dropped = self.disk.overflow()
        if dropped:
            events.append(vllm_removed(dropped, "DISK"))
        return events, offloaded

    def clear(self) -> list[VllmEvent]:
        self.gpu.blocks.clear()
        self.cpu.blocks.clear()
        self.disk.blocks.clear()
        return [VllmAllBlocksCleared()]


class SimPool:
    """A Mooncake-style pool backend: confirms offloads after a delay, evicts LRU."""

    def __init__(self, rng: random.Random, cpu_blocks: int = 1024) -> None:
        self.rng = rng
        self.cpu = _Lru(cpu_blocks)
        self.event_id = 0
        self._inbox: list[tuple[float, list[int]]] = []

    def offer(self, hashes: list[int], now: float) -> None:
        """An engine's offload transfer; confirmed 0.5 to 2 s later."""
        if hashes:
            self._inbox.append((now + self.rng.uniform(0.5, 2.0), hashes))

    @property
    def in_flight(self) -> int:
        return sum(len(h) for _, h in self._inbox)

    def due(self, now: float) -> list[Event]:
        ready = [h for at, h in self._inbox if at <= now]
        self._inbox = [(at, h) for at, h in self._inbox if at > now]
        events: list[Event] = []
        for hashes in ready:
            self.event_id += 1
            events.append(pool_event(self.event_id, "stored", hashes, "cpu"))
            for h in hashes:
                self.cpu.touch(h)
        evicted = [h for h in self.cpu.overflow() if isinstance(h, int)]
        if evicted:
            self.event_id += 1
            events.append(pool_event(self.event_id, "removed", evicted, "cpu"))
        return events

    def clear(self) -> list[Event]:
        self.cpu.blocks.clear()
        self._inbox.clear()
        self.event_id += 1
        return [pool_event(self.event_id, "cleared", [], None)]


# --------------------------------------------------------------- publishing


@dataclass
class TrafficStats:
    engine_records: int = 0
    pool_records: int = 0
    events: int = 0
    requests: int = 0
    poison: int = 0
    started: float = field(default_factory=time.monotonic)


def engine_headers(spec: EngineSpec, seq: int) -> Headers:
    return [
        (KV_MODEL, DEMO_MODEL.encode()),
        (KV_BLOCK_SIZE, str(DEMO_BLOCK_SIZE).encode()),
        (KV_SOURCE, b"vllm"),
        (KV_SEQ, str(seq).encode()),
        (KV_DP_RANK, str(spec.dp_rank).encode()),
        (KV_OFFLOAD, spec.offload.encode()),
    ]


def pool_headers(seq: int) -> Headers:
    return [
        (KV_MODEL, DEMO_MODEL.encode()),
        (KV_BLOCK_SIZE, str(DEMO_BLOCK_SIZE).encode()),
        (KV_SEQ, str(seq).encode()),
    ]


class KafkaSink:
    """Publishes straight to the engine and pool topics, as a bridge would: key,
    payload as is, and the contract's headers. `producer` is a started
    `AIOKafkaProducer` (or anything with its `send` and `flush` coroutines)."""

    poison = True  # can send a record with broken headers

    def __init__(self, producer: Any, engine_topic: str, pool_topic: str) -> None:
        self.producer = producer
        self.engine_topic = engine_topic
        self.pool_topic = pool_topic

    async def engine(self, spec: EngineSpec, payload: bytes, seq: int) -> None:
        await self.producer.send(
            self.engine_topic,
            key=spec.instance.encode(),
            value=payload,
            headers=engine_headers(spec, seq),
        )

    async def pool(self, payload: bytes, seq: int) -> None:
        await self.producer.send(
            self.pool_topic, key=DEMO_POOL.encode(), value=payload, headers=pool_headers(seq)
        )

    async def raw(self, key: bytes, payload: bytes, headers: Headers) -> None:
        await self.producer.send(self.engine_topic, key=key, value=payload, headers=headers)

    async def flush(self) -> None:
        await self.producer.flush()

    def close(self) -> None:
        pass


class ZmqSink:
    """Each engine rank, and the pool backend, publishes on a ZMQ PUB socket of
    its own, as vLLM (`--kv-events-config '{"endpoint": "tcp://*:5557"}'`) and
    `mooncake_master` do: frames `[topic, seq as 8 bytes big-endian, payload]`,
    topic empty. A bridge subscribes to them once they are registered with it
    (`registrations()`). No replay socket: a message sent before the bridge
    subscribed is lost to it, and the bridge says so with a resync record."""

    poison = False

    def __init__(self, fleet: list[EngineSpec], bind_host: str, first_port: int) -> None:
        # pyzmq comes with the demo and bridge extras; imported by name so
        # type checks pass without it.
        with needs_extra("demo", "--via-bridge"):
            zmq = importlib.import_module("zmq")
            self._ctx = importlib.import_module("zmq.asyncio").Context()
        self.ports: dict[tuple[str, int], int] = {}
        self._sockets: dict[tuple[str, int], Any] = {}
        keys = [(s.instance, s.dp_rank) for s in fleet] + [(DEMO_POOL, 0)]
        for i, key in enumerate(keys):
            sock = self._ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 100_000)
            try:
                sock.bind(f"tcp://{bind_host}:{first_port + i}")
            except zmq.ZMQError as exc:
                sock.close(linger=0)
                self.close()
                raise OSError(f"cannot bind tcp://{bind_host}:{first_port + i}: {exc}") from None
            self.ports[key] = first_port + i
            self._sockets[key] = sock
        self.fleet = fleet

    async def engine(self, spec: EngineSpec, payload: bytes, seq: int) -> None:
        sock = self._sockets[(spec.instance, spec.dp_rank)]
        await sock.send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def pool(self, payload: bytes, seq: int) -> None:
        await self._sockets[(DEMO_POOL, 0)].send_multipart([b"", seq.to_bytes(8, "big"), payload])

    async def raw(self, key: bytes, payload: bytes, headers: Headers) -> None:
        raise NotImplementedError("a ZMQ publisher sends no Kafka headers")

    async def flush(self) -> None:
        pass

    def close(self) -> None:
        self._sockets.clear()
        self._ctx.destroy(linger=0)  # closes every socket of the context, then terminates

    def registrations(self, host: str) -> list[dict[str, Any]]:
        """Mooncake RFC #1403 registration bodies for `POST <bridge>/register`."""
        out: list[dict[str, Any]] = []
        for spec in self.fleet:
            out.append(
                {
                    "endpoint": f"tcp://{host}:{self.ports[(spec.instance, spec.dp_rank)]}",
                    "replay_endpoint": None,
                    "type": "vLLM",
                    "modelname": DEMO_MODEL,
                    "lora_name": None,
                    "tenant_id": "default",
                    "instance_id": spec.instance,
                    "block_size": DEMO_BLOCK_SIZE,
                    "dp_rank": spec.dp_rank,
                    "additionalsalt": "",
                    "kv_offload": spec.offload,
                }
            )
        out.append(
            {
                "endpoint": f"tcp://{host}:{self.ports[(DEMO_POOL, 0)]}",
                "replay_endpoint": None,
                "type": "Mooncake",
                "modelname": DEMO_MODEL,
                "tenant_id": "default",
                "instance_id": DEMO_POOL,
                "block_size": DEMO_BLOCK_SIZE,
                "dp_rank": 0,
                "additionalsalt": "",
            }
        )
        return out


Sink = KafkaSink | ZmqSink


class Traffic:
    """Drives the workload through the engines and the pool into a sink."""

    def __init__(
        self,
        sink: Sink,
        *,
        rate: float = 20.0,
        seed: int = 0,
        fleet: list[EngineSpec] | None = None,
        poison: bool = True,
    ) -> None:
        self.sink = sink
        self.rate = rate
        self.rng = random.Random(seed)
        self.workload = Workload(random.Random(seed + 1))
        self.engines = [SimEngine(s, DEMO_BLOCK_SIZE) for s in fleet or default_fleet()]
        self.pool = SimPool(random.Random(seed + 2))
        self.stats = TrafficStats()
        self.poison = poison and sink.poison
        self._seq: dict[tuple[str, int], int] = {}
        self._pool_seq = 0

    async def _send_engine(self, engine: SimEngine, events: list[VllmEvent]) -> None:
        spec = engine.spec
        key = (spec.instance, spec.dp_rank)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        await self.sink.engine(spec, vllm_payload(events, spec.dp_rank, time.time()), seq)
        self.stats.engine_records += 1
        self.stats.events += len(events)

    async def _send_pool(self, events: list[Event]) -> None:
        seq = self._pool_seq
        self._pool_seq += 1
        await self.sink.pool(pool_payload(events, time.time()), seq)
        self.stats.pool_records += 1
        self.stats.events += len(events)

    async def start(self) -> None:
        """Engines and pool (re)start empty, as after a restart: they say so first."""
        for engine in self.engines:
            await self._send_engine(engine, engine.clear())
        await self._send_pool(self.pool.clear())
        if self.poison:
            # A misconfigured bridge: no kv-block-size header. The daemon
            # dead-letters it; see `kvconductor dead-letters list`.
            await self.sink.raw(
                b"misconfigured-bridge",
                vllm_payload([VllmAllBlocksCleared()], 0, time.time()),
                [(KV_MODEL, DEMO_MODEL.encode())],
            )
            self.stats.poison += 1

    async def step(self) -> None:
        """One request on a random engine, then whatever the pool has due."""
        _, text = self.workload.next_prompt()
        engine = self.rng.choice(self.engines)
        events, offloaded = engine.serve(text_tokens(text))
        now = time.monotonic()
        self.stats.requests += 1
        if events:
            await self._send_engine(engine, events)
        self.pool.offer(offloaded, now)
        pool_events = self.pool.due(now)
        if pool_events:
            await self._send_pool(pool_events)

    async def run(self, stop: asyncio.Event) -> None:
        await self.start()
        interval = 1.0 / self.rate
        next_at = time.monotonic()
        while not stop.is_set():
            await self.step()
            next_at += interval
            delay = next_at - time.monotonic()
            if delay < -1.0:  # fell behind (slow broker): do not burst to catch up
                next_at = time.monotonic()
            if delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), delay)
            else:
                await asyncio.sleep(0)
        await self.sink.flush()
