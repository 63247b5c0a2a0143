"""The seeded workload: multi-turn sessions over shared prompts and documents.

`generate(WorkloadConfig(...))` runs sessions on a simulated cluster
(`kvconductor.tools.bench.cluster`) until the index would hold `target_entries` live
(block, owner) entries and at least `churn * target_entries` GPU blocks
were evicted, then draws query prompts from the sessions it served. The
same seed gives byte-identical records.

Sessions start from one of a few long system prompts (Zipf-popular), often
followed by a shared document (also Zipf-popular), then alternate user
turns and model outputs; every turn is one request on the session's
instance, whose prompt is the whole conversation so far.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from dataclasses import asdict, dataclass, field, replace
from typing import Any, TypeAlias

import xxhash

from kvconductor.tools.bench.cluster import Block, Cluster, Instance, Streams
from kvconductor.wire.hashing import BASE_SEED

_xxh3 = xxhash.xxh3_64_intdigest
# Seeds of the simulated engines' own sequence hashes (vLLM's NONE_HASH and
# hash function stand-ins): any fixed scheme that differs from the index's.
ENGINE_ROOT = 0x5EED_0F_E0_61_4E
ENGINE_SALT = 0x9E37_79B9_7F4A_7C15

Tokens: TypeAlias = "array[int]"  # array("I") of token ids


@dataclass(frozen=True)
class WorkloadConfig:
    seed: int = 7
    target_entries: int = 4_000_000
    instances: int = 128
    gpu_blocks: int = 16_384  # per instance
    host_blocks: int = 16_384  # per instance in kv-offload: local mode
    pool_fraction: float = 0.25  # instances in kv-offload: pool mode
    pool_backends: int = 2
    pool_blocks: int = 262_144  # per backend
    block_size: int = 16
    model: str = "bench-model"
    churn: float = 0.1
    system_prompts: int = 16
    system_tokens: tuple[int, int] = (512, 3072)
    documents: int = 512
    document_tokens: tuple[int, int] = (1024, 6144)
    document_share: float = 0.6
    user_tokens: tuple[int, int] = (32, 512)
    output_tokens: tuple[int, int] = (32, 768)
    max_context_tokens: int = 14_000
    sessions_per_instance: int = 6
    vocab: int = 65_536
    queries: int = 1000
    query_tokens: int = 8192
    max_requests: int = 2_000_000

    @classmethod
    def for_entries(cls, target: int, **overrides: Any) -> WorkloadConfig:
        """A fleet sized so that about `target` entries fill its tiers.

        Local-mode instances hold GPU plus host blocks, pool-mode ones GPU
        blocks plus their share of the pool stores; capacity is 8% above the
        target so that it is reached before every tier is full."""
        instances = int(overrides.pop("instances", min(128, max(2, round(target / 32_768)))))
        base = cls(**overrides)
        per = math.ceil(target * 1.08 / (2 * instances))
        pool_instances = replace(base, instances=instances).pool_instances
        backends = max(1, base.pool_backends)
        pool_blocks = max(per, math.ceil(per * pool_instances / backends))
        return replace(
            base,
            target_entries=target,
            instances=instances,
            gpu_blocks=per,
            host_blocks=per,
            pool_blocks=pool_blocks,
        )

    @property
    def pool_instances(self) -> int:
        """Instances in pool mode: at least one when the fraction is not 0."""
        if self.pool_fraction <= 0 or self.instances < 2:
            return 0
        return min(self.instances - 1, max(1, round(self.instances * self.pool_fraction)))

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Workload:
    config: WorkloadConfig
    streams: Streams
    queries: list[Tokens]
    stats: dict[str, Any] = field(default_factory=dict)


def random_tokens(rng: random.Random, n: int, vocab: int) -> Tokens:
    """n token ids below `vocab` (<= 65536): two random bytes each."""
    raw = array("H", rng.randbytes(2 * n))
    if vocab < 65_536:
        raw = array("H", (t % vocab for t in raw))
    return array("I", raw)


class BlockChain:
    """Tokens and the per-block hashes of a growing prompt."""

    __slots__ = ("blocks", "bs", "salt", "tokens")

    def __init__(
        self,
        bs: int,
        tokens: Tokens | None = None,
        blocks: list[Block] | None = None,
        salt: int = 0,
    ):
        self.bs = bs
        self.tokens: Tokens = array("I", tokens if tokens is not None else ())
        self.blocks: list[Block] = list(blocks) if blocks is not None else []
        # Mixed into the engine hashes: the same tokens under a LoRA adapter
        # are other blocks to the engine (its extra keys enter the hash).
        self.salt = salt

    def extend(self, more: Tokens) -> None:
        self.tokens.extend(more)
        bs = self.bs
        blocks = self.blocks
        seq, ident = (blocks[-1][0], blocks[-1][2]) if blocks else (ENGINE_ROOT, BASE_SEED)
        toks = self.tokens
        salt = ENGINE_SALT ^ self.salt
        for start in range(len(blocks) * bs, len(toks) - bs + 1, bs):
            data = toks[start : start + bs].tobytes()
            seq = _xxh3(data, seq ^ salt)
            ident = _xxh3(data, ident)
            blocks.append((seq, _xxh3(data, BASE_SEED), ident))

    def copy(self) -> BlockChain:
        return BlockChain(self.bs, self.tokens, self.blocks, self.salt)


class _Session:
    __slots__ = ("chain", "instance", "turns")

    def __init__(self, chain: BlockChain, instance: Instance) -> None:
        self.chain = chain
        self.instance = instance
        self.turns = 0


def zipf(rng: random.Random, n: int) -> int:
    """An index in [0, n) with P(i) ~ 1 / (i + 1)."""
    u = rng.random()
    return min(n - 1, int(math.exp(u * math.log(n + 1))) - 1)


class SessionSource:
    """Draws requests: a random busy session on a random instance takes a turn."""

    def __init__(self, cfg: WorkloadConfig, cluster: Cluster, rng: random.Random) -> None:
        self.cfg = cfg
        self.cluster = cluster
        self.rng = rng
        lo, hi = cfg.system_tokens
        self.systems = [
            random_tokens(rng, rng.randint(lo, hi), cfg.vocab) for _ in range(cfg.system_prompts)
        ]
        lo, hi = cfg.document_tokens
        self.documents = [
            random_tokens(rng, rng.randint(lo, hi), cfg.vocab) for _ in range(cfg.documents)
        ]
        self.prefixes: dict[tuple[int, int], BlockChain] = {}
        self.sessions = [
            [self._new_session(inst) for _ in range(cfg.sessions_per_instance)]
            for inst in cluster.instances
        ]
        self.recent: list[BlockChain] = []  # finished sessions, for queries

    def _new_session(self, inst: Instance) -> _Session:
        cfg = self.cfg
        sys_id = zipf(self.rng, cfg.system_prompts)
        doc_id = zipf(self.rng, cfg.documents) if self.rng.random() < cfg.document_share else -1
        prefix = self.prefixes.get((sys_id, doc_id))
        if prefix is None:
            prefix = BlockChain(cfg.block_size)
            prefix.extend(self.systems[sys_id])
            if doc_id >= 0:
                prefix.extend(self.documents[doc_id])
            self.prefixes[(sys_id, doc_id)] = prefix
        return _Session(prefix.copy(), inst)

    def step(self) -> None:
        cfg = self.cfg
        rng = self.rng
        i = rng.randrange(len(self.sessions))
        slots = self.sessions[i]
        k = rng.randrange(len(slots))
        s = slots[k]
        turn = random_tokens(rng, rng.randint(*cfg.user_tokens), cfg.vocab)
        turn.extend(random_tokens(rng, rng.randint(*cfg.output_tokens), cfg.vocab))
        if len(s.chain.tokens) + len(turn) > cfg.max_context_tokens:
            self.recent.append(s.chain)
            del self.recent[: -4 * cfg.queries]
            s = slots[k] = self._new_session(s.instance)
        s.chain.extend(turn)
        s.turns += 1
        self.cluster.serve(s.instance, s.chain.tokens, s.chain.blocks)

    def live_chains(self) -> list[BlockChain]:
        return [s.chain for slots in self.sessions for s in slots] + self.recent


def make_cluster(cfg: WorkloadConfig, rng: random.Random) -> Cluster:
    return Cluster(
        instances=cfg.instances,
        gpu_blocks=cfg.gpu_blocks,
        host_blocks=cfg.host_blocks,
        pool_instances=cfg.pool_instances,
        pool_backends=cfg.pool_backends,
        pool_blocks=cfg.pool_blocks,
        block_size=cfg.block_size,
        model=cfg.model,
        rng=rng,
    )


def make_queries(chains: list[BlockChain], cfg: WorkloadConfig, rng: random.Random) -> list[Tokens]:
    """`cfg.queries` prompts of exactly `cfg.query_tokens` tokens.

    Mostly the next turn of a served conversation (its context, cut or
    padded with fresh tokens), so prefixes hit at realistic depths; one in
    ten is a new conversation on a known system prompt, one in twenty is
    cold."""
    out: list[Tokens] = []
    n = cfg.query_tokens
    for _ in range(cfg.queries):
        r = rng.random()
        if r < 0.05 or not chains:
            q = random_tokens(rng, n, cfg.vocab)
        else:
            base = chains[rng.randrange(len(chains))].tokens
            if r < 0.15:
                base = base[: rng.randint(1, max(1, len(base) // 4))]
            q = array("I", base[:n])
            if len(q) < n:
                q.extend(random_tokens(rng, n - len(q), cfg.vocab))
        out.append(q)
    return out


def generate(cfg: WorkloadConfig) -> Workload:
    """Run the sessions until the target is reached; deterministic per seed."""
    started = time.perf_counter()
    rng = random.Random(cfg.seed)
    cluster = make_cluster(cfg, rng)
    source = SessionSource(cfg, cluster, rng)
    requests = 0
    churn = cfg.churn * cfg.target_entries
    while requests < cfg.max_requests:
        source.step()
        requests += 1
        if (
            requests % 64 == 0
            and cluster.evicted_gpu >= churn
            and cluster.entries() >= cfg.target_entries
        ):
            break
    queries = make_queries(source.live_chains(), cfg, rng)
    return Workload(cfg, cluster.streams, queries, workload_stats(cluster, requests, started))


def workload_stats(cluster: Cluster, requests: int, started: float) -> dict[str, Any]:
    s = cluster.streams
    return {
        "requests": requests,
        "records": len(s.records),
        "engine_records": sum(1 for r in s.records if not r.pool),
        "pool_records": sum(1 for r in s.records if r.pool),
        "block_events": sum(r.blocks for r in s.records),
        "device_block_events": sum(r.blocks for r in s.device_records),
        "payload_bytes": sum(len(r.payload) for r in s.records),
        "entries": cluster.entries(),
        "entries_by_tier": cluster.tier_entries(),
        "gpu_evictions": cluster.evicted_gpu,
        "generate_s": round(time.perf_counter() - started, 3),
    }
