"""Ingest by kind of traffic: `Conductor.ingest` on each kind of a varied fleet.

Each kind of `kvconductor.tools.bench.field_fleet` is replayed alone, ten
copies of its records under new instance ids (interleaved), into a fresh
`Conductor` in batches of 500 records: process time, best of two, with the
engine lane (`Conductor()`) and without (`Conductor(lane=False)`); then the
whole fleet, every kind's replay interleaved, the same way. An untimed pass
with the lane counts the records that took the Python path and the lane's
`run` calls: a record the lane cannot apply costs a call into the kernel
(and a context it tries to build) before the Python path applies it.

    python -m kvconductor.tools.bench.kinds [--quick] [--out kinds.json]
    kvconductor bench kinds ...
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec

from kvconductor.index.conductor import Conductor, Notice
from kvconductor.index.engine_lane import Steps, Stop
from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.field_fleet import KINDS, FieldConfig, copies, events_of, field_fleet
from kvconductor.wire.records import Incoming

BATCH = 500
COPIES = 10
REPEATS = 2
MIXED = "mixed fleet"


def incoming(records: Sequence[Record]) -> list[list[Incoming]]:
    items = [Incoming(r.pool, r.key, r.headers, r.payload, r.ts) for r in records]
    return [items[i : i + BATCH] for i in range(0, len(items), BATCH)]


def timed(batches: list[list[Incoming]], lane: bool, repeats: int) -> tuple[float, int]:
    """Best process time of `repeats` fresh replays; the records skipped."""
    best = float("inf")
    errors = 0
    for _ in range(repeats):
        conductor = Conductor(lane=lane)
        gc.collect()
        notices: list[Notice] = []
        started = time.process_time()
        for batch in batches:
            notices += conductor.ingest(batch)
        best = min(best, time.process_time() - started)
        errors = sum(1 for n in notices if n.error is not None)
        del conductor
    return best, errors


def lane_traffic(batches: list[list[Incoming]]) -> dict[str, int]:
    """With the lane, untimed: the records that took the Python path, the
    stretches of them, the lane's `run` calls (each a hand-over to the
    kernel, one per Python record and batch) and the contexts it built."""
    conductor = Conductor()
    lane = conductor.lane
    count = {"python": 0, "stretches": 0, "lane_runs": 0, "contexts": 0}
    if lane is None:  # no kernel built
        return count
    taken: list[int] = []
    one = conductor._ingest_one  # the Python path's per-record entry
    run, context = lane.run, lane._context

    def counting_one(i: int, rec: Incoming) -> Notice | None:
        taken.append(i)
        return one(i, rec)

    def counting_run(records: list[Incoming], start: int) -> Steps[Stop]:
        count["lane_runs"] += 1
        return (yield from run(records, start))

    def counting_context(rec: Incoming, payload_rank: int | None) -> bool:
        count["contexts"] += 1
        return context(rec, payload_rank)

    # Instance attributes over the methods, on this throw-away conductor.
    conductor._ingest_one = counting_one  # type: ignore[method-assign]
    lane.run = counting_run  # type: ignore[method-assign]
    lane._context = counting_context  # type: ignore[method-assign]
    for batch in batches:
        taken.clear()
        conductor.ingest(batch)
        count["python"] += len(taken)
        count["stretches"] += sum(1 for k, i in enumerate(taken) if k == 0 or taken[k - 1] != i - 1)
    return count


def interleave(streams: Sequence[Sequence[Record]]) -> list[Record]:
    """One stream of several, each in its own order, spread evenly."""
    keyed = [((k + 0.5) / len(s), j, r) for j, s in enumerate(streams) for k, r in enumerate(s)]
    keyed.sort(key=lambda x: (x[0], x[1]))
    return [r for _, _, r in keyed]


def measure(records: Sequence[Record], repeats: int) -> dict[str, Any]:
    batches = incoming(records)
    events = sum(events_of(r.payload) for r in records)
    lane_s, lane_errors = timed(batches, True, repeats)
    python_s, python_errors = timed(batches, False, repeats)
    traffic = lane_traffic(batches)
    n = len(records)
    return {
        "records": n,
        "events": events,
        "events_per_record": events / n,
        "lane": {
            "cpu_s": lane_s,
            "us_per_event": lane_s * 1e6 / events,
            "us_per_record": lane_s * 1e6 / n,
        },
        "python": {
            "cpu_s": python_s,
            "us_per_event": python_s * 1e6 / events,
            "us_per_record": python_s * 1e6 / n,
        },
        "lane_over_python": lane_s / python_s,
        "python_path_share": traffic["python"] / n,
        "lane_runs_per_record": traffic["lane_runs"] / n,
        "lane_traffic": traffic,
        "errors": lane_errors + python_errors,
    }


def run(
    cfg: FieldConfig, kinds: Sequence[str], n_copies: int, repeats: int, log: Any = print
) -> dict[str, Any]:
    started = time.perf_counter()
    fleet = field_fleet(cfg, tuple(kinds))
    generate_s = time.perf_counter() - started
    replays = {k: copies(recs, n_copies, "r") for k, recs in fleet.items()}
    rows: dict[str, dict[str, Any]] = {}
    for kind, records in replays.items():
        rows[kind] = measure(records, repeats)
        log(f"  {kind}: {_line(rows[kind])}")
    # Every kind's replay interleaved, instance ids kept (`rN/kind/...`).
    rows[MIXED] = measure(interleave(list(replays.values())), repeats)
    log(f"  {MIXED}: {_line(rows[MIXED])}")
    dense = rows.get("dense")
    for row in rows.values():
        row["vs_dense"] = (
            row["lane"]["us_per_event"] / dense["lane"]["us_per_event"] if dense else None
        )
    return {
        "commit": _commit(),
        "config": {
            "records_per_kind": cfg.records,
            "copies": n_copies,
            "batch": BATCH,
            "repeats": repeats,
            "seed": cfg.seed,
            "engine": dataclasses.asdict(cfg.engine),
        },
        "generate_s": round(generate_s, 2),
        "kinds": rows,
    }


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "-C", str(Path(__file__).parent), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return None
    return out.stdout.strip() or None


def _line(row: dict[str, Any]) -> str:
    return (
        f"{row['records']:,} records, {row['events_per_record']:.1f} events a record; "
        f"lane {row['lane']['us_per_event']:.2f} us an event, "
        f"python {row['python']['us_per_event']:.2f}; "
        f"{row['python_path_share']:.0%} on the Python path"
    )


def markdown(result: dict[str, Any]) -> str:
    head = (
        "| kind | events a record | µs an event | µs a record | x dense | "
        "µs a record, lane=False | lane / no lane | Python path | lane runs a record |\n"
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|\n"
    )
    lines = []
    for kind, r in result["kinds"].items():
        vs = f"{r['vs_dense']:.1f}" if r["vs_dense"] is not None else "-"
        lines.append(
            f"| {kind} | {r['events_per_record']:.1f} | {r['lane']['us_per_event']:.2f} | "
            f"{r['lane']['us_per_record']:.1f} | {vs} | {r['python']['us_per_record']:.1f} | "
            f"{r['lane_over_python']:.2f} | {r['python_path_share']:.0%} | "
            f"{r['lane_runs_per_record']:.2f} |"
        )
    return head + "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvconductor bench kinds", description=__doc__.split("\n", 1)[0]
    )
    p.add_argument("--quick", action="store_true", help="a small run, for tests")
    p.add_argument("--records", type=int, help="records of each kind before copies (1000)")
    p.add_argument("--copies", type=int, help=f"copies of each kind replayed ({COPIES})")
    p.add_argument("--repeats", type=int, help=f"timed replays, the best kept ({REPEATS})")
    p.add_argument("--kinds", help="comma-separated subset of " + ", ".join(KINDS))
    p.add_argument("--out", type=Path, help="write the result as JSON here")
    p.add_argument(
        "--fixtures", type=Path, help="the repository's tests/fixtures (for the hybrid kinds)"
    )
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    kinds = tuple(k.strip() for k in a.kinds.split(",")) if a.kinds else KINDS
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        sys.stderr.write(f"unknown kinds: {', '.join(unknown)}\n")
        return 2
    cfg = FieldConfig(fixtures=a.fixtures) if a.fixtures else FieldConfig()
    if not cfg.fixtures.is_dir():
        # An install without the repository's tests: the fixture kinds cannot run.
        dropped = [k for k in kinds if k.startswith("hybrid-")]
        kinds = tuple(k for k in kinds if k not in dropped)
        if dropped:
            sys.stderr.write(f"no fixtures at {cfg.fixtures}: {', '.join(dropped)} left out\n")
    n_copies, repeats = COPIES, REPEATS
    if a.quick:
        cfg = replace(cfg, records=40)
        n_copies, repeats = 2, 1
    if a.records:
        cfg = replace(cfg, records=a.records)
    n_copies = a.copies or n_copies
    repeats = a.repeats or repeats
    result = run(cfg, kinds, n_copies, repeats, log=lambda s: print(s, file=sys.stderr))
    sys.stdout.write(markdown(result))
    if a.out:
        a.out.write_bytes(msgspec.json.format(msgspec.json.encode(result)) + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
