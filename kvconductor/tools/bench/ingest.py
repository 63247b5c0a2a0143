"""Figure 7: ingest of vLLM-shaped records, per record, per event and per block.

The records come from `kvconductor.tools.bench.vllm_engine` (one record per engine step,
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
`kvconductor run` consuming them) is `kvconductor.tools.bench.e2e.prequeued_run`, and
Dynamo's standalone indexer fed over ZMQ is `kvconductor.tools.bench.dynamo_indexer`; both
run interleaved in `real_path_figure`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.measure import forked, summary
from kvconductor.tools.bench.peers import make_peer, peer_items
from kvconductor.tools.bench.runners import (
    agreement,
    cpu_share,
    device_answers,
    per_unit,
    run_order,
    sync,
)
from kvconductor.tools.bench.workload import Workload

# Peers of this figure: on vLLM-shaped records every event is a device-tier
# one, so the device-only kvconductor peer would be the same run twice.
INGEST_PEERS = ("kvconductor", "dynamo", "naive")
CHECKED = 200  # queries whose device answers are compared across peers


def split(w: Workload) -> int:
    """Records (= marks: one a record) of the untimed first half."""
    return len(w.streams.marks) // 2


def timed_shape(w: Workload) -> dict[str, int]:
    return _shape(w.streams.records[split(w) :])


def _child(w: Workload, name: str, check: bool) -> dict[str, Any]:
    peer = make_peer(name, w)
    first = peer_items(peer, w, split(w))
    rest = peer.items(w)[len(first) :]
    peer.apply(peer.prepare(first))
    sync(peer)
    prepared = peer.prepare(rest)
    gc.collect()
    gc.freeze()
    cpu = time.process_time()
    started = time.perf_counter()
    peer.apply(prepared)
    sync(peer)
    seconds = time.perf_counter() - started
    out: dict[str, Any] = {"seconds": seconds, "cpu_seconds": time.process_time() - cpu}
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
        per_peer[name]["cpu_share"] = cpu_share(runs[name])
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


UNITS = ("records_per_s", "events_per_s", "blocks_per_s", "us_per_record", "us_per_event")


def real_path_figure(
    w: Workload,
    bootstrap: str | None,
    dynamo: str | None,
    repeats: int,
    logs: Path,
    log: Callable[[str], None] = print,
    dynamo_python: str | None = None,
    check: int = 50,
) -> dict[str, Any]:
    """kvconductor's real path (records prequeued on the broker, then the
    daemon) and Dynamo's standalone indexer (fed over ZMQ), in interleaved
    runs on the same records; the ratio of their rates run by run.
    `bootstrap` None leaves kvconductor's out, `dynamo` (why the indexer
    cannot run) Dynamo's."""
    from kvconductor.tools.bench.e2e import DaemonProcess, prequeued_run, reference_answers

    records = w.streams.records
    prompts = [q.tolist() for q in w.queries[:check]]
    full = reference_answers(w, prompts) if bootstrap is not None else []
    device = forked(lambda: _device_reference(w, check)) if dynamo is None else []
    logs.mkdir(parents=True, exist_ok=True)
    kvc: list[dict[str, Any]] = []
    dyn: list[dict[str, Any]] = []
    for r in range(repeats):
        if bootstrap is not None:
            res = prequeued_run(w, bootstrap, prompts, full, logs)
            kvc.append(res)
            log(f"  real path run {r + 1}/{repeats} kvconductor run: {_line(res)}")
        if dynamo is None:
            from kvconductor.tools.bench.dynamo_indexer import THREADS, standalone_run

            got = forked(
                lambda r=r: standalone_run(  # type: ignore[misc]
                    w, records, prompts, logs / f"dynamo-indexer-{r}.log", dynamo_python
                )
            )
            answers = got.pop("answers")
            got["identical"] = answers == device
            got["same_answers"] = sum(1 for a, b in zip(answers, device, strict=True) if a == b)
            got["shape"] = timed = _shape(records)
            got.update(per_unit(timed, got["seconds"]))
            dyn.append(got)
            log(
                f"  real path run {r + 1}/{repeats} dynamo.indexer: {_line(got)} "
                f"(sending them into its sockets beforehand took {got['send_s']:.2f} s)"
            )
    out: dict[str, Any] = {}
    if bootstrap is not None:
        out["prequeued"] = {
            "measured": True,
            "records": len(records),
            "partitions": DaemonProcess.PARTITIONS,
            "per_unit": {k: summary([x[k] for x in kvc if k in x]) for k in UNITS},
            "identical": all(x["identical"] for x in kvc),
            "bad_records": sum(x["bad_records"] for x in kvc),
            "exit_codes": [x["exit_code"] for x in kvc],
            "query": _query_summary(kvc),
            "runs": kvc,
        }
    if dynamo is None:
        out["dynamo_indexer"] = {
            "measured": True,
            "threads": THREADS,
            "per_unit": {k: summary([x[k] for x in dyn]) for k in UNITS},
            # Device answers equal to kvconductor's in-process index's (the
            # indexer keeps no copy counts, so where vLLM held two copies of
            # a block and evicted one they may differ).
            "identical": all(x["identical"] for x in dyn),
            "same_answers": [min(x["same_answers"] for x in dyn), len(device)],
            "query": _query_summary(dyn),
            "runs": dyn,
        }
    else:
        out["dynamo_indexer"] = {"measured": False, "reason": dynamo}
    if kvc and dyn:
        pairs = list(zip(kvc, dyn, strict=True))
        out["ratio_real"] = {
            "kvconductor run/dynamo.indexer": summary(
                [a["events_per_s"] / b["events_per_s"] for a, b in pairs if "events_per_s" in a]
            ),
            # Above 1: kvconductor's one-client p99 over HTTP is the lower.
            "query p99, dynamo.indexer/kvconductor run": summary(
                [b["query"]["p99_us"] / a["query"]["p99_us"] for a, b in pairs]
            ),
            # Eight keep-alive clients, as a router's connection pool.
            "queries/s with 8 clients, kvconductor run/dynamo.indexer": summary(
                [a["query"]["queries_per_s"] / b["query"]["queries_per_s"] for a, b in pairs]
            ),
        }
    return out


def _query_summary(runs: Sequence[dict[str, Any]]) -> dict[str, Any]:
    keys = ("p50_us", "p99_us", "queries_per_s")
    return {k: summary([x["query"][k] for x in runs]) for k in keys}


def _device_reference(w: Workload, check: int) -> list[list[tuple[int, int]]]:
    peer = make_peer("kvconductor", w)
    peer.apply(peer.prepare(peer.items(w)))
    return device_answers(peer, w.queries[:check])


def _shape(records: Sequence[Record]) -> dict[str, int]:
    return {
        "records": len(records),
        "events": sum(r.events for r in records),
        "blocks": sum(r.blocks for r in records),
    }


def _line(res: dict[str, Any]) -> str:
    s = res["shape"]
    if "events_per_s" not in res:
        return f"{s['records']:,} records, too fast to time at this size"
    return (
        f"{s['records']:,} records ({s['events']:,} events) in {res['seconds']:.2f} s = "
        f"{res['events_per_s']:,.0f} events/s, {res['records_per_s']:,.0f} records/s; "
        f"answers identical: {res['identical']}"
    )
