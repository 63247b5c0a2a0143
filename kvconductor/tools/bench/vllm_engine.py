"""Engine events in vLLM's own shapes: its scheduler and `BlockPool`, simulated.

vLLM v1 publishes what its `BlockPool` did during one engine step as one
ZMQ message (`[ts, [events], dp_rank]`), across all the requests that step
scheduled, and only when something happened. The shapes that follow from
how the pool works, and that this module reproduces:

- a block is cached (hashed, announced) in the step that schedules the
  computation of its last token: one `BlockStored` per request and step
  with all its newly full blocks, so a prefill chunk stores many hashes
  and a decoding request one hash every `block_size` steps;
- a cached block whose request ended stays cached, in a free queue in
  LRU order (a request's blocks are freed tail first); when a step needs
  a block, the queue's head is reused and, if it was cached, evicted: one
  `BlockRemoved` with one hash per evicted block;
- a step that cannot give a running request its next block preempts the
  newest running request (its blocks are freed, still cached, and evicted
  later as the pool needs them) and that request starts over later, from
  its prefix hit;
- a waiting request is admitted only when its whole prompt fits
  (`full_sequence_must_fit`) and no request was preempted in the step; its
  hit is the longest cached prefix, at most its prompt less one token;
- requests with vLLM's `kv_cache_report_mode: "full"` re-announce the
  blocks they reuse (`BlockStored` from token 0, no parent) each time they
  look their prefix up.

The same engine model runs every instance of a fleet (`VllmFleet`), on
sessions whose next turn's prompt is the previous prompt, the answer and a
new user message, over shared system prompts and documents. The output is
`kvconductor.tools.bench.cluster.Streams`, one mark per record, so every figure that takes a
workload takes this one.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import msgspec
import xxhash

from kvconductor.tools.bench.cluster import (
    Block,
    NaiveOp,
    PoolBackend,
    Record,
    Streams,
    dynamo_removed,
    dynamo_stored,
    engine_record,
    lru_admit,
)
from kvconductor.tools.bench.workload import (
    BlockChain,
    Tokens,
    Workload,
    WorkloadConfig,
    make_queries,
    random_tokens,
    zipf,
)
from kvconductor.wire.encode import (
    VllmBlockRemoved,
    VllmEvent,
    digest_hash,
    sglang_payload,
    vllm_array_payload,
    vllm_bytes_hashes,
    vllm_offloaded,
    vllm_payload,
    vllm_removed,
    vllm_stored,
)
from kvconductor.wire.records import (
    KV_BLOCK_SIZE,
    KV_DP_RANK,
    KV_MODEL,
    KV_OFFLOAD,
    KV_REPORT_MODE,
    KV_SOURCE,
)

# The engines' wire forms (`FleetConfig.wire`); digest hashes are the map
# form's with the hashes replaced.
_ENCODERS: dict[str, Callable[[Sequence[VllmEvent], int | None, float], bytes]] = {
    "vllm": vllm_payload,
    "vllm-bytes": vllm_payload,
    "vllm-array": vllm_array_payload,
    "sglang": sglang_payload,
}

# One engine step, in seconds of the simulated clock (the fixture's).
STEP_S = 0.025
CLOCK_START = 1_700_000_000.0


@dataclass(frozen=True)
class EngineConfig:
    """One vLLM instance: its pool and its scheduler's limits."""

    gpu_blocks: int = 130
    max_num_seqs: int = 4
    max_batched_tokens: int = 512  # chunked prefill's token budget per step
    block_size: int = 16
    report_full_share: float = 0.0  # requests with kv_cache_report_mode "full"
    # vLLM's offloading connector (`kv-offload`): None, "local" (its own CPU
    # tier of `host_blocks`) or "pool" (offloads into the fleet's pool).
    offload: str | None = None
    host_blocks: int = 0


class Request:
    __slots__ = (
        "blocks",
        "cached",
        "computed",
        "held",
        "hit",
        "lora",
        "output",
        "prompt",
        "report_full",
        "sampled",
        "session",
        "tokens",
    )

    def __init__(
        self,
        session: _Session | None,
        chain: BlockChain,
        prompt: int,
        output: int,
        report_full: bool = False,
        lora: tuple[int, str] | None = None,
    ) -> None:
        self.session = session
        self.lora = lora  # (adapter id, name)
        self.tokens: Tokens = chain.tokens  # the prompt and the whole answer
        self.blocks: list[Block] = chain.blocks
        self.prompt = prompt
        self.output = output
        self.report_full = report_full
        self.sampled = 0  # answer tokens sampled so far
        self.computed = 0  # tokens whose KV is computed (or scheduled this step)
        self.held: list[int] = []  # block ids, in order
        self.cached = 0  # of which the first `cached` are hashed and announced
        self.hit = 0  # tokens of the last prefix hit

    @property
    def known(self) -> int:
        """Tokens the engine knows: the prompt and the tokens sampled so far."""
        return self.prompt + self.sampled


class _Session:
    __slots__ = ("chain", "lora", "turns")

    def __init__(self, chain: BlockChain, turns: int, lora: tuple[int, str] | None = None) -> None:
        self.chain = chain
        self.turns = turns  # left, this one included
        self.lora = lora


class BlockPool:
    """vLLM's `BlockPool` for one full-attention group: ref counts, cached
    blocks by hash (copies allowed), and the LRU free queue.

    vLLM's free queue starts as every block in id order, and freed blocks
    join its tail, so the never-used blocks are handed out first: they are
    a counter here (`fresh`), not queue entries, which keeps thousands of
    large idle pools cheap."""

    def __init__(self, blocks: int) -> None:
        self.size = blocks
        self.fresh = 0  # blocks below this id were handed out at least once
        self.ref: dict[int, int] = {}  # of the blocks in use
        self.hash_of: dict[int, int] = {}  # of the cached blocks
        self.free: OrderedDict[int, None] = OrderedDict()  # freed blocks, LRU first
        self.cached: dict[int, list[int]] = {}  # engine hash -> block ids holding it

    def num_free(self) -> int:
        return self.size - self.fresh + len(self.free)

    def lookup(self, blocks: list[Block], limit: int) -> list[int]:
        """Block ids of the longest cached prefix among `blocks[:limit]`."""
        out: list[int] = []
        cached = self.cached
        for b in blocks[:limit]:
            ids = cached.get(b[0])
            if not ids:
                break
            out.append(ids[0])
        return out

    def touch(self, ids: Iterable[int]) -> None:
        free = self.free
        ref = self.ref
        for i in ids:
            n = ref.get(i, 0)
            if n == 0:
                del free[i]
            ref[i] = n + 1

    def allocate(self, n: int, removed: Callable[[int], None]) -> list[int]:
        """`n` blocks off the free queue's head; each cached one is evicted."""
        pop = self.free.popitem
        out: list[int] = []
        for _ in range(n):
            if self.fresh < self.size:
                i = self.fresh
                self.fresh += 1
            else:
                i = pop(last=False)[0]
                h = self.hash_of.pop(i, None)
                if h is not None:
                    ids = self.cached[h]
                    ids.remove(i)
                    if not ids:
                        del self.cached[h]
                    removed(h)
            self.ref[i] = 1
            out.append(i)
        return out

    def release(self, ids: list[int]) -> None:
        """A request's blocks, tail first: its tail is evicted first."""
        free = self.free
        ref = self.ref
        for i in reversed(ids):
            n = ref[i] - 1
            if n:
                ref[i] = n
            else:
                del ref[i]
                free[i] = None

    def cache(self, i: int, h: int) -> None:
        self.hash_of[i] = h
        self.cached.setdefault(h, []).append(i)

    def held(self, i: int) -> bool:
        """Whether a request holds block `i` (it is not in the free queue)."""
        return i in self.ref


class Engine:
    """One instance: a scheduler step at a time, its events per step."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.pool = BlockPool(cfg.gpu_blocks)
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.finished: list[Request] = []
        self.preemptions = 0
        self.evicted = 0
        self.rejected = 0
        # The step's events, and the same as (parent, blocks) stores and
        # removed hashes for the peers that take another format.
        self.events: list[VllmEvent] = []
        self.ops: list[tuple[int | None, list[Block]] | int] = []
        # The hashes the step cached, for an offloading connector to save,
        # and that connector's own CPU tier (`offload: local`).
        self.saved: list[int] = []
        self.host: OrderedDict[int, None] = OrderedDict()

    def add(self, req: Request) -> bool:
        """Queue a request; False when it could never fit in the pool (vLLM
        refuses a request longer than its cache can hold)."""
        if -(-(req.prompt + req.output) // self.cfg.block_size) > self.cfg.gpu_blocks:
            self.rejected += 1
            return False
        self.waiting.append(req)
        return True

    # ----------------------------------------------------------- events

    def _removed(self, h: int) -> None:
        self.evicted += 1
        self.events.append(vllm_removed([h], "GPU"))
        self.ops.append(h)

    def _stored(self, req: Request, start: int, end: int) -> None:
        """`BlockStored` of the request's blocks [start, end)."""
        run = req.blocks[start:end]
        bs = self.cfg.block_size
        parent = req.blocks[start - 1][0] if start else None
        toks = req.tokens[start * bs : end * bs].tolist()
        hashes = [b[0] for b in run]
        self.events.append(vllm_stored(hashes, parent, toks, "GPU", bs, req.lora))
        self.ops.append((parent, run))
        self.saved += hashes

    # ---------------------------------------------------------- the step

    def _grow(self, req: Request, todo: int) -> None:
        """Blocks for `todo` more tokens, then the blocks they fill cached."""
        bs = self.cfg.block_size
        pool = self.pool
        req.computed += todo
        need = -(-req.computed // bs) - len(req.held)
        if need > 0:
            req.held += pool.allocate(need, self._removed)
        full = req.computed // bs
        if full > req.cached:
            held = req.held
            blocks = req.blocks
            for k in range(req.cached, full):
                pool.cache(held[k], blocks[k][0])
            self._stored(req, req.cached, full)
            req.cached = full

    def _needs(self, req: Request, todo: int) -> int:
        return max(0, -(-(req.computed + todo) // self.cfg.block_size) - len(req.held))

    def _preempt(self) -> Request:
        victim = self.running.pop()
        self.pool.release(victim.held)
        victim.held = []
        victim.computed = victim.cached = 0
        self.waiting.appendleft(victim)
        self.preemptions += 1
        return victim

    def step(self) -> list[VllmEvent]:
        """One scheduler step; its events (maybe none)."""
        self.events = []
        self.ops = []
        self.saved = []
        cfg = self.cfg
        pool = self.pool
        budget = cfg.max_batched_tokens
        preempted = False
        scheduled: list[Request] = []
        for req in list(self.running):
            if budget <= 0:
                break
            if preempted and req not in self.running:  # preempted for an earlier one
                continue
            todo = min(req.known - req.computed, budget)
            while self._needs(req, todo) > pool.num_free():
                preempted = True
                if self._preempt() is req:
                    break
            if preempted and req not in self.running:
                continue
            self._grow(req, todo)
            budget -= todo
            scheduled.append(req)
        while (
            not preempted and self.waiting and budget > 0 and len(self.running) < cfg.max_num_seqs
        ):
            req = self.waiting[0]
            todo = self._admit(req, budget)
            if not todo:
                break
            self.waiting.popleft()
            self.running.append(req)
            budget -= todo
            scheduled.append(req)
        self._sample(scheduled)
        if cfg.offload == "local" and self.saved:
            self._offload_locally()
        return self.events

    def _offload_locally(self) -> None:
        """vLLM's offloading connector saves what the step cached into its
        CPU tier (LRU) and says so by hash only; what that evicts, it
        removes."""
        added, evicted = lru_admit(self.host, self.saved, self.cfg.host_blocks)
        if evicted:
            self.events.append(VllmBlockRemoved(evicted, "CPU"))
        if added:
            self.events.append(vllm_offloaded(added))

    def _admit(self, req: Request, budget: int) -> int:
        """Prefix lookup and allocation of a waiting request: the tokens
        scheduled for it, 0 when it has to wait."""
        pool = self.pool
        bs = self.cfg.block_size
        known = req.known
        hit = pool.lookup(req.blocks, (known - 1) // bs)  # the last token is recomputed
        if req.report_full and hit:
            self._stored(req, 0, len(hit))
        reusable = sum(1 for i in hit if not pool.held(i))
        if -(-known // bs) - len(hit) > pool.num_free() - reusable:
            return 0
        pool.touch(hit)
        req.held = hit
        req.cached = len(hit)
        req.hit = req.computed = len(hit) * bs
        todo = min(known - req.computed, budget)
        self._grow(req, todo)
        return todo

    def _sample(self, scheduled: list[Request]) -> None:
        """A request with every known token computed samples the next one;
        one that has its whole answer ends and frees its blocks."""
        for req in scheduled:
            if req.computed < req.known:
                continue  # a prefill chunk: more to compute
            req.sampled += 1
            if req.sampled >= req.output:
                self.running.remove(req)
                self.pool.release(req.held)
                req.held = []
                self.finished.append(req)


@dataclass(frozen=True)
class FleetConfig:
    """A fleet of identical vLLM instances and the sessions they serve."""

    seed: int = 7
    instances: int = 8
    engine: EngineConfig = EngineConfig()
    model: str = "bench-model"
    sessions_per_instance: int = 6  # at most one request in flight each
    turns: tuple[int, int] = (1, 8)
    think_steps: tuple[int, int] = (0, 40)
    system_prompts: int = 16
    system_tokens: tuple[int, int] = (512, 3072)
    documents: int = 512
    document_tokens: tuple[int, int] = (1024, 6144)
    document_share: float = 0.6
    user_tokens: tuple[int, int] = (32, 512)
    output_tokens: tuple[int, int] = (32, 768)
    max_context_tokens: int = 14_000
    vocab: int = 65_536
    # Data-parallel ranks of each instance (one engine each, under the
    # instance's key), the rank in the payload (vLLM >= 0.10) or, with
    # `rank_in_header`, in `kv-dp-rank` and the payload's rank nil.
    dp_ranks: int = 1
    rank_in_header: bool = False
    # Sessions on a LoRA adapter (one of `loras`), their blocks hashed apart.
    lora_share: float = 0.0
    loras: int = 4
    # The engines' wire form: "vllm" (0.33, int hashes), "vllm-bytes"
    # (digest hashes), "vllm-array" (<= 0.23 tagged arrays), "sglang".
    wire: str = "vllm"
    # `offload: pool`: one backend of `pool_blocks` per `pool_share`
    # instances; a `confirm_first` share of its confirmations come before
    # the engine's intent.
    pool_blocks: int = 65_536
    pool_share: int = 4
    confirm_first: float = 0.1

    @classmethod
    def for_entries(cls, target: int, **overrides: Any) -> FleetConfig:
        """A fleet whose GPU pools hold about `target` cached blocks in all:
        one instance per 32,768 (at most 128, like the session workload),
        pools 8% above their share so that the target is reached before
        they are full, and enough sessions to keep every instance's running
        batch full."""
        instances = int(overrides.pop("instances", min(128, max(2, round(target / 32_768)))))
        engine: EngineConfig = overrides.pop("engine", cls.engine_default())
        engine = replace(engine, gpu_blocks=math.ceil(target * 1.08 / instances))
        sessions = overrides.pop("sessions_per_instance", engine.max_num_seqs * 5 // 4)
        return cls(instances=instances, engine=engine, sessions_per_instance=sessions, **overrides)

    @staticmethod
    def engine_default() -> EngineConfig:
        """A production-like engine: 64 running requests, 2,048 tokens a step."""
        return EngineConfig(max_num_seqs=64, max_batched_tokens=2048)


FIXTURE_FLEET = FleetConfig(
    seed=11,
    instances=2,
    engine=EngineConfig(gpu_blocks=130, max_num_seqs=4, max_batched_tokens=512),
    sessions_per_instance=3,
    turns=(1, 4),
    think_steps=(0, 60),
    system_prompts=3,
    system_tokens=(200, 300),
    documents=0,
    document_share=0.0,
    user_tokens=(60, 240),
    output_tokens=(8, 64),
)
"""The workload of the vLLM fixture's dense instances (`hyb-d0`, `hyb-d1`:
tests/fixtures/vllm-hybrid/README.md): 4 running requests, 512 tokens a
step, a 130-block pool, chat sessions of 1-4 turns over 3 system prompts,
answers of 8-64 tokens; the arrival spread and the lengths of the system
prompts and user turns, which the README does not give, were chosen so
that the shape of the records matches (tests/test_bench_vllm_shape.py)."""


class VllmFleet:
    """Instances stepping in lockstep; sessions stay on their instance."""

    def __init__(self, cfg: FleetConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        rng = self.rng
        engines = cfg.instances * cfg.dp_ranks
        self.engines = [Engine(cfg.engine) for _ in range(engines)]
        lo, hi = cfg.system_tokens
        self.systems = [
            random_tokens(rng, rng.randint(lo, hi), cfg.vocab) for _ in range(cfg.system_prompts)
        ]
        lo, hi = cfg.document_tokens
        self.documents = [
            random_tokens(rng, rng.randint(lo, hi), cfg.vocab) for _ in range(cfg.documents)
        ]
        self.prefixes: dict[tuple[int, int, int], BlockChain] = {}
        ranks = cfg.dp_ranks
        self.keys = [f"vllm-{i // ranks}".encode() for i in range(engines)]
        self.headers = [
            (KV_MODEL, cfg.model.encode()),
            (KV_BLOCK_SIZE, str(cfg.engine.block_size).encode()),
            (KV_SOURCE, b"sglang" if cfg.wire == "sglang" else b"vllm"),
        ]
        if cfg.engine.report_full_share:
            # Its requests re-announce what they reuse: declared, as the
            # bridge declares it from the registration.
            self.headers.append((KV_REPORT_MODE, b"full"))
        if cfg.engine.offload:
            self.headers.append((KV_OFFLOAD, cfg.engine.offload.encode()))
        self.engine_headers = [
            [*self.headers, (KV_DP_RANK, str(i % ranks).encode())]
            if cfg.rank_in_header
            else self.headers
            for i in range(engines)
        ]
        self.ranks: list[int | None] = [
            None if cfg.rank_in_header else i % ranks for i in range(engines)
        ]
        self.encode = _ENCODERS[cfg.wire]
        self.digests: dict[int, bytes] = {}  # of `wire: vllm-bytes`, cached
        self.backends = [
            PoolBackend(f"mooncake-{b}", cfg.model, cfg.engine.block_size, cfg.pool_blocks)
            for b in range(-(-engines // cfg.pool_share))
        ]
        self.seqs = [0] * engines
        self.streams = Streams()
        self.steps = 0
        self.requests = 0
        self.dynamo_event_id = 0
        self.recent: list[BlockChain] = []  # sessions that ended, for queries
        # (step due, order, instance, session) of the turns to come.
        self.due: list[tuple[int, int, int, _Session]] = []
        self._order = 0
        for i in range(engines):
            for _ in range(cfg.sessions_per_instance):
                self._schedule(i, self._new_session(), rng.randint(*cfg.think_steps))

    # --------------------------------------------------------- sessions

    def _new_session(self) -> _Session:
        cfg, rng = self.cfg, self.rng
        sys_id = zipf(rng, cfg.system_prompts)
        doc_id = -1
        if self.documents and rng.random() < cfg.document_share:
            doc_id = zipf(rng, cfg.documents)
        adapter = -1
        lora = None
        if cfg.lora_share and rng.random() < cfg.lora_share:
            adapter = rng.randrange(cfg.loras)
            lora = (adapter + 1, f"adapter-{adapter}")
        prefix = self.prefixes.get((sys_id, doc_id, adapter))
        if prefix is None:
            salt = xxhash.xxh3_64_intdigest(lora[1].encode()) if lora else 0
            prefix = BlockChain(cfg.engine.block_size, salt=salt)
            prefix.extend(self.systems[sys_id])
            if doc_id >= 0:
                prefix.extend(self.documents[doc_id])
            self.prefixes[(sys_id, doc_id, adapter)] = prefix
        return _Session(prefix.copy(), rng.randint(*cfg.turns), lora)

    def _schedule(self, instance: int, session: _Session, delay: int) -> None:
        self._order += 1
        heapq.heappush(self.due, (self.steps + delay, self._order, instance, session))

    def _start_turn(self, instance: int, session: _Session) -> None:
        cfg, rng = self.cfg, self.rng
        session.chain.extend(random_tokens(rng, rng.randint(*cfg.user_tokens), cfg.vocab))
        prompt = len(session.chain.tokens)
        output = rng.randint(*cfg.output_tokens)
        chain = session.chain.copy()
        chain.extend(random_tokens(rng, output, cfg.vocab))
        report_full = rng.random() < cfg.engine.report_full_share
        self.requests += 1
        req = Request(session, chain, prompt, output, report_full, session.lora)
        if not self.engines[instance].add(req):
            self._schedule(instance, self._new_session(), rng.randint(*cfg.think_steps))

    def _turn_done(self, instance: int, req: Request) -> None:
        cfg = self.cfg
        session = req.session
        assert session is not None
        # The next prompt holds the answer: the request's chain goes on.
        session.chain = BlockChain(
            cfg.engine.block_size, req.tokens, req.blocks, session.chain.salt
        )
        session.turns -= 1
        if session.turns <= 0 or len(req.tokens) > cfg.max_context_tokens:
            self.recent.append(session.chain)
            del self.recent[:-4000]
            session = self._new_session()
        self._schedule(instance, session, self.rng.randint(*cfg.think_steps))

    def live_chains(self) -> list[BlockChain]:
        bs = self.cfg.engine.block_size
        running = [BlockChain(bs, r.tokens, r.blocks) for e in self.engines for r in e.running]
        return self.recent + running

    # ------------------------------------------------------------ steps

    def step(self) -> None:
        """One engine step on every instance, a record for each that had events."""
        while self.due and self.due[0][0] <= self.steps:
            _, _, instance, session = heapq.heappop(self.due)
            self._start_turn(instance, session)
        self._step_engines(range(len(self.engines)))

    def _step_engines(self, which: Iterable[int]) -> None:
        ts = CLOCK_START + self.steps * STEP_S
        for i in which:
            engine = self.engines[i]
            events = engine.step()
            if events:
                self._emit(i, engine, events, ts + i * 1e-6)
            for req in engine.finished:
                self._turn_done(i, req)
            engine.finished.clear()
        self.steps += 1

    def _emit(self, i: int, engine: Engine, events: list[VllmEvent], ts: float) -> None:
        self.seqs[i] += 1
        blocks = 0
        removed: list[int] = []
        stored_seqs: list[int] = []
        stored_idents: list[int] = []
        dyn = self.streams.dynamo
        for op in engine.ops:
            self.dynamo_event_id += 1
            if isinstance(op, int):
                removed.append(op)
                dyn.append((i, dynamo_removed(self.dynamo_event_id, [op]), 1))
                blocks += 1
            else:
                parent, run = op
                stored_seqs += [b[0] for b in run]
                stored_idents += [b[2] for b in run]
                pairs = [(b[0], b[1]) for b in run]
                dyn.append((i, dynamo_stored(self.dynamo_event_id, parent, pairs), len(run)))
                blocks += len(run)
        device_events = len(events)
        pool_record = None
        if self.cfg.engine.offload == "pool" and engine.saved:
            offloaded = self._to_pool(i, engine.saved)
            if offloaded:
                events = [*events, vllm_offloaded(offloaded)]
                blocks += len(offloaded)
                pool_record = self.backends[i // self.cfg.pool_share].confirm(offloaded, ts)
        if self.cfg.wire == "vllm-bytes":
            events = [vllm_bytes_hashes(e, self._digest) for e in events]
        rec = engine_record(
            self.keys[i],
            self.engine_headers[i],
            self.seqs[i],
            events,
            ts,
            blocks,
            self.ranks[i],
            self.encode,
        )
        streams = self.streams
        if pool_record is not None and self.rng.random() < self.cfg.confirm_first:
            streams.records.append(pool_record)
            pool_record = None
        streams.records.append(rec)
        if pool_record is not None:
            streams.records.append(pool_record)
        if len(events) == device_events:  # the device tier alone
            streams.device_records.append(rec)
        streams.naive.append(
            NaiveOp(i, array("Q", removed), array("Q", stored_seqs), array("Q", stored_idents))
        )
        streams.mark()

    def _to_pool(self, i: int, saved: list[int]) -> list[int]:
        """What the connector offloads of what the step cached: the blocks
        its backend does not hold (the engine says so, hash only, and the
        backend confirms them on the pool topic)."""
        held = self.backends[i // self.cfg.pool_share].blocks
        return [h for h in saved if h not in held]

    def _digest(self, h: int) -> bytes:
        d = self.digests.get(h)
        if d is None:
            d = self.digests[h] = digest_hash(h)
        return d

    def entries(self) -> int:
        """Live (block, owner) entries: cached blocks, copies counted once."""
        return sum(len(e.pool.cached) for e in self.engines)


def record_shape(records: Iterable[Record]) -> dict[str, float]:
    """Events per record and hashes per store and removal, on average."""
    n = events = stores = removals = store_hashes = removal_hashes = 0
    for r in records:
        _, evs, _ = msgspec.msgpack.decode(r.payload)
        n += 1
        events += len(evs)
        for e in evs:
            if e["type"] == "BlockStored":
                stores += 1
                store_hashes += len(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                removals += 1
                removal_hashes += len(e["block_hashes"])
    return {
        "records": n,
        "events": events,
        "events_per_record": events / n if n else 0.0,
        "hashes_per_store": store_hashes / stores if stores else 0.0,
        "hashes_per_removal": removal_hashes / removals if removals else 0.0,
        "removals": removals,
        "stores": stores,
    }


def run_fleet(cfg: FleetConfig, steps: int) -> VllmFleet:
    """A fleet after `steps` engine steps."""
    fleet = VllmFleet(cfg)
    for _ in range(steps):
        fleet.step()
    return fleet


def fleet_workload(
    cfg: FleetConfig,
    target_entries: int,
    churn: float = 0.1,
    queries: int = 1000,
    query_tokens: int = 8192,
    max_steps: int = 10_000_000,
) -> Workload:
    """Step the fleet until it holds `target_entries` cached blocks and
    evicted `churn` times that many; queries drawn from its sessions."""
    started = time.perf_counter()
    fleet = VllmFleet(cfg)
    evictions = churn * target_entries
    while fleet.steps < max_steps:
        fleet.step()
        if fleet.steps % 16 == 0 and (
            sum(e.evicted for e in fleet.engines) >= evictions and fleet.entries() >= target_entries
        ):
            break
    return fleet_workload_of(fleet, queries, query_tokens, started, churn)


def fleet_workload_of(
    fleet: VllmFleet, queries: int, query_tokens: int, started: float, churn: float = 0.0
) -> Workload:
    """The fleet's records as a workload, queries drawn from its sessions."""
    cfg = fleet.cfg
    wcfg = WorkloadConfig(
        seed=cfg.seed,
        target_entries=fleet.entries(),
        instances=cfg.instances,
        gpu_blocks=cfg.engine.gpu_blocks,
        host_blocks=0,
        pool_fraction=0.0,
        block_size=cfg.engine.block_size,
        model=cfg.model,
        churn=churn,
        vocab=cfg.vocab,
        queries=queries,
        query_tokens=query_tokens,
    )
    chains = fleet.live_chains()
    w = Workload(wcfg, fleet.streams, make_queries(chains, wcfg, fleet.rng))
    s = fleet.streams
    entries = fleet.entries()
    w.stats = {
        "shape": "vllm",
        "instances": cfg.instances,
        "engine": dataclasses.asdict(cfg.engine),
        "steps": fleet.steps,
        "requests": fleet.requests,
        "records": len(s.records),
        "engine_records": len(s.records),
        "pool_records": 0,
        "events": sum(r.events for r in s.records),
        "block_events": sum(r.blocks for r in s.records),
        "device_block_events": sum(r.blocks for r in s.records),
        "payload_bytes": sum(len(r.payload) for r in s.records),
        "entries": entries,
        "entries_by_tier": {"GPU": entries, "CPU": 0, "pool": 0},
        "gpu_evictions": sum(e.evicted for e in fleet.engines),
        "preemptions": sum(e.preemptions for e in fleet.engines),
        "rejected": sum(e.rejected for e in fleet.engines),
        "shape_of_records": record_shape(s.records[:20_000]),
        "generate_s": round(time.perf_counter() - started, 3),
    }
    return w
