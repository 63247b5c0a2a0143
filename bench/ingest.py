"""Figure 7: ingest of vLLM-shaped records, per record, per event and per block.

The records come from `bench.vllm_engine` (one record per engine step,
single-hash removals, decode-time single-block stores, prefill stores,
preemptions). Each peer, in a forked process of its own, builds its index
on the first half of the stream (untimed) and is timed on the second half:
ingest at steady state, on an index that is full and evicting, which is
where a fleet's indexer spends its life.

- `kvconductor`: `Conductor.ingest` in batches of the daemon's fetch size;
- `dynamo`: Dynamo's `RadixTree.apply_event`, one JSON event at a time
  (vLLM's records split into Dynamo's events ahead, untimed);
- `naive`: the obvious per-worker sets.

The real path (records pre-produced to the daemon's topics, then
`kvconductor run` consuming them) is `bench.e2e.prequeued_figure`, and
Dynamo's standalone indexer fed over ZMQ is `bench.dynamo_indexer`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from bench.measure import forked, summary
from bench.peers import make_peer, peer_items
from bench.runners import agreement, device_answers, per_unit, run_order, sync
from bench.workload import Workload

# Peers of this figure: on vLLM-shaped records every event is a device-tier
# one, so the device-only kvconductor peer would be the same run twice.
INGEST_PEERS = ("kvconductor", "dynamo", "naive")
CHECKED = 200  # queries whose device answers are compared across peers


def split(w: Workload) -> int:
    """Records (= marks: one a record) of the untimed first half."""
    return len(w.streams.marks) // 2


def timed_shape(w: Workload) -> dict[str, int]:
    records = w.streams.records[split(w) :]
    return {
        "records": len(records),
        "events": sum(r.events for r in records),
        "blocks": sum(r.blocks for r in records),
    }


def _child(w: Workload, name: str, check: bool) -> dict[str, Any]:
    peer = make_peer(name, w)
    first = peer_items(peer, w, split(w))
    rest = peer.items(w)[len(first) :]
    peer.apply(peer.prepare(first))
    sync(peer)
    prepared = peer.prepare(rest)
    gc.collect()
    gc.freeze()
    started = time.perf_counter()
    peer.apply(prepared)
    sync(peer)
    seconds = time.perf_counter() - started
    out: dict[str, Any] = {"seconds": seconds}
    if check:
        out["answers"] = device_answers(peer, w.queries[:CHECKED])
    for attr in ("errors", "notices"):
        if hasattr(peer, attr):
            out[attr] = getattr(peer, attr)
    return out


def ingest_figure(
    w: Workload, peers: Sequence[str], repeats: int, log: Callable[[str], None] = print
) -> dict[str, Any]:
    """Each peer `repeats` times, interleaved, on the stream's second half."""
    names = [p for p in peers if p in INGEST_PEERS]
    shape = timed_shape(w)
    runs: dict[str, list[dict[str, Any]]] = {p: [] for p in names}
    for r in range(repeats):
        for name in run_order(names, r):
            res = forked(lambda name=name, r=r: _child(w, name, r == 0))  # type: ignore[misc]
            runs[name].append(res)
            u = per_unit(shape, res["seconds"])
            log(
                f"  ingest run {r + 1}/{repeats} {name}: {shape['records']:,} records "
                f"({shape['events']:,} events, {shape['blocks']:,} block events) in "
                f"{res['seconds']:.2f} s = {u['records_per_s']:,.0f} records/s, "
                f"{u['events_per_s']:,.0f} events/s, {u['us_per_record']:.1f} us a record"
            )
    per_peer: dict[str, Any] = {}
    for name in names:
        each = [per_unit(shape, x["seconds"]) for x in runs[name]]
        per_peer[name] = {k: summary([e[k] for e in each]) for k in each[0]}
        for attr in ("errors", "notices"):
            if attr in runs[name][0]:
                per_peer[name][attr] = runs[name][0][attr]
    ratios: dict[str, Any] = {}
    if "kvconductor" in runs:
        for other in names:
            if other == "kvconductor":
                continue
            pairs = zip(runs["kvconductor"], runs[other], strict=True)
            ratios[f"kvconductor/{other}"] = summary(
                [b["seconds"] / a["seconds"] for a, b in pairs]
            )
    return {
        "measured": True,
        "shape": shape,
        "build_records": split(w),
        "stats": w.stats,
        "peers": per_peer,
        "ratio": ratios,
        "agreement": agreement({n: runs[n][0] for n in names}),
    }
