"""A repeatable measure of in-process ingest (figure 7's workload, reduced).

`gen` steps a vLLM-shaped fleet (`kvconductor.tools.bench.vllm_engine`, churn 0.5 as figure 7)
and pickles its records; `run` builds a `Conductor` on the first half
(untimed) and ingests the second half in the bench's batches. On a loaded
machine the wall clock is noise, so the figure to compare is instructions,
under callgrind:

    python -m kvconductor.tools.bench.lane_profile gen --entries 200000 --out /tmp/fleet.pkl
    valgrind --tool=callgrind --zero-before=os_getppid --dump-before=os_getpgrp \\
        python -m kvconductor.tools.bench.lane_profile run /tmp/fleet.pkl

`run` calls `os.getppid()` just before the timed half and `os.getpgrp()`
just after it, so the first dump holds the timed half's instructions only.
It also prints the half's process time, a record (noisy).

The installed kernel has no symbols, so callgrind puts its cost on the
interpreter. For a profile, build the `profiling` cargo profile (release
with line tables) and put it in place of the installed module; reinstall
(`pip install -e .`) to go back to the release build:

    (cd kernel && PYO3_PYTHON=$PWD/../.venv/bin/python \
        cargo build -p kvconductor-kernel --profile profiling --features extension-module)
    cp kernel/target/profiling/lib_kernel.so kvconductor/_kernel$(python -c \
        'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
    callgrind_annotate --inclusive=no callgrind.out.<pid>.1
"""

from __future__ import annotations

import argparse
import gc
import os
import pickle
import time
from pathlib import Path

from kvconductor.index.conductor import Conductor
from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.peers import INGEST_BATCH
from kvconductor.tools.bench.vllm_engine import FleetConfig, fleet_workload
from kvconductor.wire.records import Incoming


def fleet_records(entries: int, seed: int) -> list[Record]:
    """The records of a fleet stepped to `entries` cached blocks, churn 0.5."""
    w = fleet_workload(FleetConfig.for_entries(entries, seed=seed), entries, churn=0.5, queries=0)
    return list(w.streams.records)


def generate(entries: int, seed: int, out: Path) -> None:
    records = fleet_records(entries, seed)
    out.write_bytes(pickle.dumps(records))
    print(f"{len(records):,} records -> {out}")


def batches(records: list[Record]) -> list[list[Incoming]]:
    incoming = [Incoming(r.pool, r.key, r.headers, r.payload, r.ts) for r in records]
    return [incoming[i : i + INGEST_BATCH] for i in range(0, len(incoming), INGEST_BATCH)]


def run(path: Path, lane: bool) -> None:
    records: list[Record] = pickle.loads(path.read_bytes())
    half = len(records) // 2
    first, rest = batches(records[:half]), batches(records[half:])
    conductor = Conductor(lane=lane)
    for batch in first:
        conductor.ingest(batch)
    gc.collect()
    gc.freeze()
    os.getppid()  # callgrind: --zero-before=os_getppid
    cpu = time.process_time()
    for batch in rest:
        conductor.ingest(batch)
    cpu = time.process_time() - cpu
    os.getpgrp()  # callgrind: --dump-before=os_getpgrp
    timed = records[half:]
    events = sum(r.events for r in timed)
    print(
        f"{len(timed):,} records, {events:,} events: {cpu * 1e6 / len(timed):.2f} us a record "
        f"(process time)"
    )
    os._exit(0)  # the index's teardown is not part of the figure


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("gen")
    g.add_argument("--entries", type=int, default=200_000)
    g.add_argument("--seed", type=int, default=7)
    g.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("records", type=Path)
    r.add_argument("--python", action="store_true", help="the Python path (lane=False)")
    a = p.parse_args()
    if a.cmd == "gen":
        generate(a.entries, a.seed, a.out)
    else:
        run(a.records, not a.python)


if __name__ == "__main__":
    main()
