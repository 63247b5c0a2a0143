"""Random but reproducible engine and pool record streams for the durability tests.

`mixed_stream(seed, n)` exercises every kind of snapshot unit: owners with
several ranks and all three tiers, pool stores of several backends, pending
halves of every kind (offload intents waiting for a pool's confirmation,
token-less stores waiting for content, chains whose parent never shows up),
retired content, `kv-seq` positions, two namespaces, clears and resyncs.

Engine records are keyed by instance and pool records by backend, as the
contract says, so per-key order is what Kafka keeps and nothing else is: a
consumer interleaves partitions (and the two topics) as its fetches return.
The stream is built so that its final state does not depend on that
interleaving, so any consumer that applies every record exactly once ends in
the same state as `oracle(...)`. The one join that is not order-independent
is an offload intent that arrives after its pool confirmation *and* after the
pool removed the block again (it stays pinned); so blocks that take part in
two-phase joins (`offload` prompts, confirmed by the `mooncake-*` backends)
are never removed from a pool, and pool removals and clears happen only on
the `lmcache-*` backends, whose blocks come from prompts of their own.
"""

from __future__ import annotations

import random
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from kvconductor.index.conductor import Conductor
from kvconductor.kafka.clients import refresh_metadata
from kvconductor.wire.query import HashQuery, TokenQuery
from tests.harness import Record, engine_headers, pool_payload, removed, stored, vllm_payload

BLOCK = 4
MODELS = ("m", "m2")
MASK64 = (1 << 64) - 1


def _seq_hash(model: str, tokens: list[int]) -> int:
    # Python's hash of a tuple of ints and str is stable only for ints; mix the
    # model in as an int so the value does not depend on PYTHONHASHSEED.
    salt = sum(ord(c) * 131**i for i, c in enumerate(model))
    return hash((salt, *tokens)) & MASK64


def prompt_hashes(model: str, prompt: list[int], nblocks: int) -> list[int]:
    return [_seq_hash(model, prompt[: BLOCK * (i + 1)]) for i in range(nblocks)]


class _Gen:
    def __init__(self, seed: int, instances: int, backends: int) -> None:
        self.rng = random.Random(seed)
        rng = self.rng

        def prompts(n: int) -> dict[str, list[list[int]]]:
            return {
                m: [[rng.randrange(60) for _ in range(BLOCK * 8)] for _ in range(n)] for m in MODELS
            }

        # Engines cache every kind; offload intents and confirmations use the
        # `offload` ones; pools that store (and remove) their own blocks the
        # `pool` ones. Ghost prompts' blocks are never stored: chains hanging
        # off them stay unresolved, confirmations of them wait for good.
        self.offload = prompts(6)
        self.pooled = prompts(4)
        self.ghosts = prompts(1)
        self.engine_prompts = {m: self.offload[m] + self.pooled[m] for m in MODELS}
        self.instances = [f"vllm-{i}" for i in range(instances)]
        self.model_of = {inst: MODELS[i % len(MODELS)] for i, inst in enumerate(self.instances)}
        self.confirmers = [f"mooncake-{i}" for i in range(backends)]
        self.stores = [f"lmcache-{i}" for i in range(max(1, backends - 1))]
        self.seq: dict[tuple[str, int], int] = {}
        # (instance, rank, medium) -> hashes held, for removals
        self.held: dict[tuple[str, int, str], list[int]] = {}
        self.pool_held: dict[str, list[tuple[str, int]]] = {}
        self.intents: dict[str, list[int]] = {m: [] for m in MODELS}
        self.engine: list[Record] = []
        self.pool: list[Record] = []

    def _engine(self, inst: str, rank: int, events: list[dict[str, Any]], **extra: str) -> None:
        n = self.seq.get((inst, rank), 0) + 1
        self.seq[(inst, rank)] = n
        headers = engine_headers(
            self.model_of.get(inst, "m"), BLOCK, **{"kv-dp-rank": str(rank), "kv-seq": str(n)}
        )
        headers += [(k, v.encode()) for k, v in extra.items()]
        self.engine.append((inst, vllm_payload(events, rank=None), headers))

    def _pool(self, backend: str, model: str, events: list[dict[str, Any]]) -> None:
        self.pool.append((backend, pool_payload(events), engine_headers(model, BLOCK)))

    def step(self) -> None:
        rng = self.rng
        r = rng.random()
        inst = rng.choice(self.instances)
        model = self.model_of[inst]
        rank = rng.randrange(2)
        if r < 0.30:  # a store with tokens, from the root
            p = rng.choice(self.engine_prompts[model])
            n = rng.randrange(1, 8)
            medium = rng.choice(["GPU", "GPU", "CPU", "DISK"])
            hashes = prompt_hashes(model, p, n)
            self._engine(inst, rank, [stored(hashes, p[: BLOCK * n], medium=medium)])
            self.held.setdefault((inst, rank, medium), []).extend(hashes)
        elif r < 0.38:  # a continuation named by its parent's hash
            ghost = rng.random() < 0.3
            p = rng.choice(self.ghosts[model] if ghost else self.engine_prompts[model])
            k = rng.randrange(1, 6)
            m = rng.randrange(1, 3)
            hashes = prompt_hashes(model, p, k + m)
            ev = stored(hashes[k:], p[BLOCK * k : BLOCK * (k + m)], parent=hashes[k - 1])
            self._engine(inst, rank, [ev])
            if not ghost:
                self.held.setdefault((inst, rank, "GPU"), []).extend(hashes[k:])
        elif r < 0.45:  # a token-less store: content from the catalog, or wait
            p = rng.choice(self.engine_prompts[model] + self.ghosts[model])
            hashes = prompt_hashes(model, p, rng.randrange(1, 8))
            self._engine(inst, rank, [stored(hashes, None, medium="CPU")])
            self.held.setdefault((inst, rank, "CPU"), []).extend(hashes)
        elif r < 0.60:  # removals
            options = [k for k, v in self.held.items() if k[0] == inst and v]
            if not options:
                return
            key = rng.choice(options)
            gone = rng.sample(self.held[key], min(rng.randrange(1, 4), len(self.held[key])))
            for h in gone:
                self.held[key].remove(h)
            self._engine(key[0], key[1], [removed(gone, medium=key[2])])
        elif r < 0.62:  # everything of one rank cleared
            self._engine(inst, rank, [{"type": "AllBlocksCleared"}])
            for key in [k for k in self.held if k[0] == inst and k[1] == rank]:
                self.held[key] = []
        elif r < 0.63:  # a bridge's resync control record
            hdrs = [("kv-control", b"resync"), ("kv-dp-rank", str(rank).encode())]
            self.engine.append((inst, b"", hdrs))
            self.seq.pop((inst, rank), None)
            for key in [k for k in self.held if k[0] == inst and k[1] == rank]:
                self.held[key] = []
        elif r < 0.75:  # offload intents (phase one)
            model = rng.choice(MODELS)
            p = rng.choice(self.offload[model])
            n = rng.randrange(1, 8)
            hashes = prompt_hashes(model, p, n)
            ev = stored(hashes, p[: BLOCK * n], medium="CPU")
            hdrs = engine_headers(model, BLOCK, **{"kv-offload": "pool"})
            self.engine.append((f"offloader-{model}", vllm_payload([ev]), hdrs))
            if rng.random() < 0.7:  # the rest are only confirmed by chance
                self.intents[model].extend(hashes)
        elif r < 0.88:  # pool confirmations (phase two), sometimes of unknown content
            model = rng.choice(MODELS)
            backend = rng.choice(self.confirmers)
            if self.intents[model] and rng.random() < 0.8:
                hashes = rng.sample(self.intents[model], min(3, len(self.intents[model])))
            else:
                p = rng.choice(self.offload[model] + self.ghosts[model])
                hashes = prompt_hashes(model, p, rng.randrange(1, 8))
            medium = rng.choice(["cpu", "cpu", "disk"])
            ev = {"event_type": "stored", "seq_hashes": hashes, "medium": medium}
            self._pool(backend, model, [ev])
        elif r < 0.93:  # pool stores carrying their own tokens
            model = rng.choice(MODELS)
            backend = rng.choice(self.stores)
            p = rng.choice(self.pooled[model])
            n = rng.randrange(1, 8)
            hashes = prompt_hashes(model, p, n)
            ev = {
                "event_type": "stored",
                "seq_hashes": hashes,
                "token_ids": p[: BLOCK * n],
                "medium": "cpu",
            }
            self._pool(backend, model, [ev])
            self.pool_held.setdefault(backend, []).extend((model, h) for h in hashes)
        elif r < 0.995:  # pool removals
            backend = rng.choice(self.stores)
            held = self.pool_held.get(backend)
            if not held:
                return
            model, _ = rng.choice(held)
            gone = [x for m, x in held if m == model][:3]
            self.pool_held[backend] = [(m, x) for m, x in held if not (m == model and x in gone)]
            self._pool(backend, model, [{"event_type": "removed", "seq_hashes": gone}])
        else:  # a pool backend cleared
            backend = rng.choice(self.stores)
            self._pool(backend, rng.choice(MODELS), [{"event_type": "cleared"}])
            self.pool_held[backend] = []


def mixed_stream(
    seed: int, n: int, instances: int = 8, backends: int = 3
) -> tuple[list[Record], list[Record]]:
    """`n` steps of engine and pool activity: (engine records, pool records)."""
    gen = _Gen(seed, instances, backends)
    for _ in range(n):
        gen.step()
    return gen.engine, gen.pool


def oracle(engine: list[Record], pool: list[Record], now: float = 1.0) -> Conductor:
    """An uninterrupted in-memory run over the records."""
    conductor = Conductor()
    for key, value, headers in engine:
        conductor.ingest_engine_record(key, headers, value, now)
    for key, value, headers in pool:
        conductor.ingest_pool_record(key, headers, value, now)
    return conductor


def oracle_from_kafka(records: list[Any], pool_topic: str) -> Conductor:
    """An uninterrupted run over records read back from Kafka (their timestamps)."""
    conductor = Conductor()
    for r in records:
        ingest = (
            conductor.ingest_pool_record
            if r.topic == pool_topic
            else conductor.ingest_engine_record
        )
        ingest(r.key, r.headers, r.value, r.timestamp / 1000.0)
    return conductor


async def end_offsets(bootstrap: str, topics: list[str]) -> dict[TopicPartition, int]:
    """Each partition's end offset (its next offset), for partitions with records."""
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    try:
        tps = [
            TopicPartition(t, p)
            for t in topics
            for p in sorted(consumer.partitions_for_topic(t) or await _partitions(consumer, t))
        ]
        ends: dict[TopicPartition, int] = await consumer.end_offsets(tps)
        return {tp: o for tp, o in ends.items() if o > 0}
    finally:
        await consumer.stop()


async def _partitions(consumer: AIOKafkaConsumer, topic: str) -> set[int]:
    await refresh_metadata(consumer)
    return consumer.partitions_for_topic(topic) or set()


async def read_topics(bootstrap: str, topics: list[str]) -> list[Any]:
    """Every record of the topics, per partition in offset order."""
    ends = await end_offsets(bootstrap, topics)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, group_id=None)
    await consumer.start()
    out: list[Any] = []
    try:
        consumer.assign(list(ends))
        await consumer.seek_to_beginning(*ends)
        left = set(ends)
        while left:
            batch = await consumer.getmany(*left, timeout_ms=500)
            for recs in batch.values():
                out.extend(r for r in recs if r.offset < ends[TopicPartition(r.topic, r.partition)])
            for tp in list(left):
                if await consumer.position(tp) >= ends[tp]:
                    left.discard(tp)
    finally:
        await consumer.stop()
    return out


def fingerprint_diff(got: dict[Any, bytes], want: dict[Any, bytes]) -> list[Any]:
    """Unit keys whose state differs (or exists on one side only)."""
    return sorted((k for k in got.keys() | want.keys() if got.get(k) != want.get(k)), key=repr)


def sample_queries(seed: int, instances: int = 8, backends: int = 3) -> list[Any]:
    """Token and hash queries for every prompt of `mixed_stream(seed, ...)`,
    each whole and cut short."""
    gen = _Gen(seed, instances, backends)
    out: list[Any] = []
    for model in MODELS:
        for p in gen.engine_prompts[model] + gen.ghosts[model]:
            for n in (8, 3):
                out.append(TokenQuery(model=model, block_size=BLOCK, token_ids=p[: BLOCK * n]))
                hashes: list[int | str] = list(prompt_hashes(model, p, n))
                out.append(HashQuery(model=model, block_size=BLOCK, seq_hashes=hashes))
    return out
