"""`kvconductor bench scale`: memory, apply and query cost of one namespace
as its owners and its (block, owner) entries grow (docs/benchmarks.md,
"Scale").

Each point runs in a fresh interpreter (`--point`), so that its resident
memory is that of one index and nothing a previous point freed: the
figure is the growth of the process's peak RSS while the index is built,
per (block, owner) entry.

The workload: chains of `chain` blocks (distinct tokens per chain, the
engine's sequence hash per block), each held by `sharing` owners, spread
round robin over `owners` (instance x dp rank) owners of one namespace.
Built by `NamespaceIndex.store_owner`, the path engine stores take, so the
build is the apply figure (block entries a second). Then, at that size:

- churn: a store of a new 16-block chain, then its removal one hash an
  event (vLLM's shapes), on owners spread over the namespace;
- walk: `BlockStore.match_tokens` of a held chain, every owner listed
  (a prefix all of them share for `sharing` owners, a miss for the rest);
- one instance: `run_query_json` of that chain for the instance holding
  it (`instance_id`), the request a router's per-instance check makes;
- every instance: `run_query_json` for all of them (an answer with a row
  per instance: its size grows with the owners, as the contract's does);
- join + query: a new owner's first store, then a query (the answer's
  shape is laid out again after a change of owners).
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import time
from array import array
from collections import Counter

import msgspec

from kvconductor.index.fleet import IndexLimits
from kvconductor.index.namespace import Dirty, NamespaceIndex, namespace_key
from kvconductor.index.query import run_query_json
from kvconductor.wire.media import DEVICE
from kvconductor.wire.query import TokenQuery

BLOCK = 16
MODEL = "scale"


class Point(msgspec.Struct, frozen=True):
    owners: int
    entries: int
    sharing: int
    chain: int
    bytes_per_entry: float
    build_s: float
    apply_entries_per_s: float
    store_event_us: float  # a 16-block store at this size
    remove_event_us: float  # a one-hash removal at this size
    walk_all_us: float  # p50, every owner listed
    query_one_us: float  # p50, run_query_json with instance_id
    query_all_us: float  # p50, run_query_json, every instance
    answer_all_bytes: int
    join_query_us: float  # p50, a new owner's first store, then a query of one instance
    kernel: bool


def _rss_peak_kib() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _rss_now_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return _rss_peak_kib()


def _tokens(chain: int, length: int) -> bytes:
    start = chain * length * BLOCK
    return array("I", range(start, start + length * BLOCK)).tobytes()


def _token_list(packed: bytes) -> list[int]:
    out = array("I")
    out.frombytes(packed)
    return out.tolist()


def _seqs(chain: int, length: int) -> list[int]:
    # Distinct per (chain, block), never 0; the same content keeps its hash
    # across owners, as an engine fleet's does.
    return [(chain << 20 | i) + 1 for i in range(length)]


def _owner_of(o: int, ranks: int) -> tuple[str, int]:
    return f"i{o // ranks:05d}", o % ranks


def _p50_us(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def measure(owners: int, entries: int, sharing: int, chain: int, ranks: int, queries: int) -> Point:
    """One point, built in this process (run it in a fresh one for memory)."""
    limits = IndexLimits(max_owners_per_namespace=owners + 64)  # room for the joins
    ns = NamespaceIndex(
        namespace_key(None, MODEL, BLOCK, None, None),
        limits.max_pending,
        limits.max_pending_age_s,
        limits.max_blocks_per_owner,
        limits.max_retired_content,
        Counter(),
        Dirty(),
        limits.max_owners_per_namespace,
    )
    holdings = max(entries // chain, 1)
    gc.collect()
    gc.disable()
    base = _rss_now_kib()
    t0 = time.perf_counter()
    for h in range(holdings):
        c = h // sharing
        inst, rank = _owner_of(h % owners, ranks)
        ns.store_owner(inst, rank, DEVICE, _seqs(c, chain), None, _tokens(c, chain), None)
    build = time.perf_counter() - t0
    gc.enable()
    held = holdings * chain
    grown = max(_rss_peak_kib(), _rss_now_kib()) - base
    ns.dirty.clear()

    # Churn at this size: new chains beyond the built ones.
    fresh = holdings // sharing + 1
    stores: list[float] = []
    removes: list[float] = []
    for k in range(max(queries // 4, 8)):
        inst, rank = _owner_of((k * 7919) % owners, ranks)
        seqs = _seqs(fresh + k, 16)
        packed = _tokens(fresh + k, 16)
        t = time.perf_counter()
        ns.store_owner(inst, rank, DEVICE, seqs, None, packed, None)
        stores.append(time.perf_counter() - t)
        for seq in reversed(seqs):
            t = time.perf_counter()
            ns.remove_owner(inst, rank, DEVICE, [seq])
            removes.append(time.perf_counter() - t)
    ns.dirty.clear()

    # One loop a kind of query: each walk over every owner would leave the
    # next one-instance query a cold cache.
    picks = [(q * 104_729) % holdings for q in range(queries)]
    prompts = [_tokens(h // sharing, chain) for h in picks]
    walks: list[float] = []
    for prompt in prompts:
        t = time.perf_counter()
        ns.store.match_tokens(prompt, BLOCK, ns.seed, ns.all_bits)
        walks.append(time.perf_counter() - t)
    one: list[float] = []
    for h, prompt in zip(picks, prompts, strict=True):
        inst, _ = _owner_of(h % owners, ranks)
        req = TokenQuery(
            model=MODEL, block_size=BLOCK, token_ids=_token_list(prompt), instance_id=inst
        )
        t = time.perf_counter()
        run_query_json(ns, req, None, prompt)
        one.append(time.perf_counter() - t)
    every: list[float] = []
    answer = b""
    for prompt in prompts:
        req = TokenQuery(model=MODEL, block_size=BLOCK, token_ids=_token_list(prompt))
        t = time.perf_counter()
        answer = run_query_json(ns, req, None, prompt)
        every.append(time.perf_counter() - t)
    # A change of owners re-lays the answer's shape before the next answer.
    joins: list[float] = []
    prompt = _tokens(0, chain)
    req = TokenQuery(model=MODEL, block_size=BLOCK, token_ids=_token_list(prompt), instance_id="j")
    for k in range(max(queries // 10, 4)):
        seqs = _seqs(fresh + queries + k, 1)
        packed = _tokens(fresh + queries + k, 1)
        t = time.perf_counter()
        ns.store_owner("j", k, DEVICE, seqs, None, packed, None)
        run_query_json(ns, req, None, prompt)
        joins.append(time.perf_counter() - t)
    from kvconductor.kernel import KERNEL

    return Point(
        owners=owners,
        entries=held,
        sharing=sharing,
        chain=chain,
        bytes_per_entry=grown * 1024 / held,
        build_s=build,
        apply_entries_per_s=held / build,
        store_event_us=_p50_us(stores),
        remove_event_us=_p50_us(removes),
        walk_all_us=_p50_us(walks),
        query_one_us=_p50_us(one),
        query_all_us=_p50_us(every),
        answer_all_bytes=len(answer),
        join_query_us=_p50_us(joins),
        kernel=KERNEL is not None,
    )


def _sizes(text: str) -> list[int]:
    return [int(float(x)) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvconductor bench scale",
        description="Memory, apply and query cost of one namespace by owners and entries.",
    )
    p.add_argument(
        "--owners", type=_sizes, default=[64, 1_000, 4_096, 10_000], help="owners, e.g. 64,1e4"
    )
    p.add_argument(
        "--entries",
        type=_sizes,
        default=[1_000_000, 10_000_000],
        help="(block, owner) entries, e.g. 1e6,1e7",
    )
    p.add_argument("--sharing", type=_sizes, default=[1, 8], help="owners holding each chain")
    p.add_argument("--chain", type=int, default=64, help="blocks a stored chain")
    p.add_argument("--ranks", type=int, default=1, help="dp ranks an instance")
    p.add_argument("--queries", type=int, default=200, help="queries of each kind a point")
    p.add_argument("--out", help="write the points as JSON lines here too")
    p.add_argument("--point", action="store_true", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.point:
        point = measure(
            args.owners[0], args.entries[0], args.sharing[0], args.chain, args.ranks, args.queries
        )
        sys.stdout.write(msgspec.json.encode(point).decode() + "\n")
        return 0
    rows = []
    for entries in args.entries:
        for owners in args.owners:
            for sharing in args.sharing:
                if sharing > owners:
                    continue
                cmd = [
                    sys.executable, "-m", "kvconductor.tools.bench.scale", "--point",
                    "--owners", str(owners), "--entries", str(entries),
                    "--sharing", str(sharing), "--chain", str(args.chain),
                    "--ranks", str(args.ranks), "--queries", str(args.queries),
                ]  # fmt: skip
                done = subprocess.run(cmd, check=True, capture_output=True, text=True)
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(_line(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return 0


def _line(r: dict[str, float]) -> str:
    return (
        f"owners {r['owners']:>6} entries {r['entries']:>11,} sharing {r['sharing']:>2}: "
        f"{r['bytes_per_entry']:6.1f} B/entry, apply {r['apply_entries_per_s'] / 1e6:5.2f} M/s, "
        f"store {r['store_event_us']:6.1f} us, remove {r['remove_event_us']:5.1f} us, "
        f"walk {r['walk_all_us']:7.1f} us, one {r['query_one_us']:7.1f} us, "
        f"all {r['query_all_us']:8.1f} us ({r['answer_all_bytes']:,} B), "
        f"join+query {r['join_query_us']:7.1f} us"
    )


if __name__ == "__main__":
    sys.exit(main())
