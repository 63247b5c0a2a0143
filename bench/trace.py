"""Mooncake traces as a workload.

The public Mooncake trace format is one JSON object per line:
`{"timestamp": ms, "input_length": tokens, "output_length": tokens,
"hash_ids": [ids]}`, where each hash id names one block of
`trace_block_tokens` prompt tokens (512 in the published traces) and equal
ids mean equal content. The trace carries no tokens, so each id is given a
deterministic block of random tokens; prompts are those blocks in order,
cut to `input_length`, followed by `output_length` fresh tokens. Requests go
to an instance chosen by their first block (prefix affinity), and then run
through the same simulated cluster as the session generator.
"""

from __future__ import annotations

import random
import time
from array import array
from collections.abc import Iterator
from pathlib import Path

import msgspec

from bench.workload import (
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
) -> Workload:
    """Replay a trace on the simulated cluster of `cfg` (fleet and tiers)."""
    started = time.perf_counter()
    rng = random.Random(cfg.seed)
    cluster = make_cluster(cfg, rng)
    content: dict[int, Tokens] = {}
    recent: list[BlockChain] = []
    requests = 0
    for req in read_trace(path):
        if limit is not None and requests >= limit:
            break
        chain = BlockChain(cfg.block_size)
        prompt: Tokens = array("I")
        for h in req.hash_ids:
            block = content.get(h)
            if block is None:
                block = content[h] = random_tokens(
                    random.Random(cfg.seed * 1_000_003 + h), trace_block_tokens, cfg.vocab
                )
            prompt.extend(block)
        del prompt[req.input_length :]
        prompt.extend(random_tokens(rng, req.output_length, cfg.vocab))
        chain.extend(prompt)
        first = req.hash_ids[0] if req.hash_ids else requests
        inst = cluster.instances[first % len(cluster.instances)]
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
