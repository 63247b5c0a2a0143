"""Mooncake traces as a workload.

The public Mooncake trace format is one JSON object per line:
`{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [ids]}`, where each hash id names one block of
`trace_block_tokens` prompt tokens (512 in the published traces) and equal
ids mean equal content. The trace carries no tokens, so each id is given a
deterministic block of random tokens; prompts are those blocks in order,
cut to `input_length`, followed by `output_length` fresh tokens. Requests go
to an instance by conversation or in turn (`Router`), and then run through
the same simulated cluster as the session generator (`trace_workload`), or
through vLLM's engine model, one record per engine step, at the trace's own
arrival times (`vllm_trace_workload`).
"""

from __future__ import annotations

import itertools
import random
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import replace
from pathlib import Path

import msgspec

from kvconductor.tools.bench.vllm_engine import (
    STEP_S,
    FleetConfig,
    Request,
    VllmFleet,
    fleet_workload_of,
)
from kvconductor.tools.bench.workload import (
    BlockChain,
    Tokens,
    Workload,
    WorkloadConfig,
    make_cluster,
    make_queries,
    random_tokens,
    workload_stats,
)


class TraceRequest(msgspec.Struct, frozen=True):
    timestamp: float
    input_length: int
    output_length: int
    hash_ids: list[int]


class TraceError(ValueError):
    pass


_decode = msgspec.json.Decoder(TraceRequest).decode


def read_trace(path: Path) -> Iterator[TraceRequest]:
    """The requests of a Mooncake trace file, in file order."""
    with path.open("rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield _decode(line)
            except msgspec.DecodeError as exc:
                raise TraceError(f"{path}:{n}: not a Mooncake trace line: {exc}") from None


def trace_workload(
    path: Path,
    cfg: WorkloadConfig,
    trace_block_tokens: int = 512,
    limit: int | None = None,
    route: str = "session",
) -> Workload:
    """Replay a trace on the simulated cluster of `cfg` (fleet and tiers)."""
    started = time.perf_counter()
    rng = random.Random(cfg.seed)
    cluster = make_cluster(cfg, rng)
    tokens = TraceTokens(cfg.seed, cfg.vocab, trace_block_tokens)
    router = Router(len(cluster.instances), route)
    recent: list[BlockChain] = []
    requests = 0
    for req in read_trace(path):
        if limit is not None and requests >= limit:
            break
        chain = BlockChain(cfg.block_size)
        prompt = tokens.prompt(req)
        prompt.extend(random_tokens(rng, req.output_length, cfg.vocab))
        chain.extend(prompt)
        inst = cluster.instances[router(req)]
        cluster.serve(inst, chain.tokens, chain.blocks)
        recent.append(chain)
        del recent[: -4 * cfg.queries]
        requests += 1
    if not requests:
        raise TraceError(f"{path}: no requests")
    queries = make_queries(recent, cfg, rng)
    stats = workload_stats(cluster, requests, started)
    stats["trace"] = str(path)
    return Workload(cfg, cluster.streams, queries, stats)


class Router:
    """Which of `instances` serves a trace request.

    Every request of the conversation trace starts with hash id 0 (a shared
    head), so routing by the first block would send the whole trace to one
    instance. By `session`: a request goes where the earlier requests with
    its second block went (the same conversation), a new conversation to
    the next instance in turn; `round-robin`: request by request."""

    ROUTES = ("session", "round-robin")

    def __init__(self, instances: int, route: str = "session") -> None:
        if route not in self.ROUTES:
            raise TraceError(f"unknown route {route!r} (one of {', '.join(self.ROUTES)})")
        self.instances = instances
        self.route = route
        self.sessions: dict[int, int] = {}
        self.turn = 0

    def __call__(self, req: TraceRequest) -> int:
        if self.route == "session" and len(req.hash_ids) > 1:
            key = req.hash_ids[1]
            inst = self.sessions.get(key)
            if inst is None:
                inst = self.sessions[key] = self.turn % self.instances
                self.turn += 1
            return inst
        inst = self.turn % self.instances
        self.turn += 1
        return inst


class TraceTokens:
    """Deterministic tokens for the trace's hash ids (a block of
    `block_tokens` random tokens each, the same id the same tokens)."""

    def __init__(self, seed: int, vocab: int, block_tokens: int = 512) -> None:
        self.seed = seed
        self.vocab = vocab
        self.block_tokens = block_tokens
        self.content: dict[int, Tokens] = {}

    def prompt(self, req: TraceRequest) -> Tokens:
        prompt: Tokens = array("I")
        for h in req.hash_ids:
            block = self.content.get(h)
            if block is None:
                rng = random.Random(self.seed * 1_000_003 + h)
                block = self.content[h] = random_tokens(rng, self.block_tokens, self.vocab)
            prompt.extend(block)
        del prompt[req.input_length :]
        return prompt


class TraceFleet(VllmFleet):
    """vLLM instances serving a trace's requests at their own arrival times
    (`timestamp` in ms, one engine step every `STEP_S`); only busy instances
    step, and the clock jumps over the idle stretches."""

    def __init__(self, cfg: FleetConfig, requests: Iterable[TraceRequest], route: str) -> None:
        super().__init__(replace(cfg, sessions_per_instance=0, system_prompts=1, documents=0))
        self.trace = iter(requests)
        self.pending = next(self.trace, None)
        self.router = Router(cfg.instances, route)
        self.tokens = TraceTokens(cfg.seed, cfg.vocab)
        self.busy: set[int] = set()

    def done(self) -> bool:
        return self.pending is None and not self.busy

    def step(self) -> None:
        due = self.pending
        if not self.busy and due is not None:
            self.steps = max(self.steps, int(due.timestamp / 1000 / STEP_S))
        now_ms = self.steps * STEP_S * 1000
        while due is not None and due.timestamp <= now_ms:
            self._arrive(due)
            due = self.pending = next(self.trace, None)
        self._step_engines(sorted(self.busy))
        self.busy = {i for i in self.busy if self.engines[i].running or self.engines[i].waiting}

    def _arrive(self, req: TraceRequest) -> None:
        cfg = self.cfg
        chain = BlockChain(cfg.engine.block_size)
        chain.extend(self.tokens.prompt(req))
        prompt = len(chain.tokens)
        output = max(1, req.output_length)
        chain.extend(random_tokens(self.rng, output, cfg.vocab))
        inst = self.router(req)
        self.requests += 1
        if self.engines[inst].add(Request(None, chain, prompt, output)):
            self.busy.add(inst)

    def _turn_done(self, instance: int, req: Request) -> None:
        self.recent.append(BlockChain(self.cfg.engine.block_size, req.tokens, req.blocks))
        del self.recent[:-4000]


def vllm_trace_workload(
    path: Path,
    cfg: FleetConfig,
    route: str = "session",
    limit: int | None = None,
    queries: int = 1000,
    query_tokens: int = 8192,
) -> Workload:
    """The trace through vLLM's engine model on the fleet of `cfg`."""
    requests = read_trace(path)
    if limit is not None:
        requests = itertools.islice(requests, limit)
    fleet = TraceFleet(cfg, requests, route)
    if fleet.pending is None:
        raise TraceError(f"{path}: no requests")
    first_ms = fleet.pending.timestamp
    last_ms = first_ms
    started = time.perf_counter()
    while not fleet.done():
        if fleet.pending is not None:
            last_ms = fleet.pending.timestamp
        fleet.step()
    w = fleet_workload_of(fleet, queries, query_tokens, started)
    w.stats["trace"] = str(path)
    w.stats["route"] = route
    w.stats["trace_span_s"] = (last_ms - first_ms) / 1000
    return w
