"""`kvconductor bench`: kvconductor beside NVIDIA Dynamo's RadixTree (docs/benchmarks.md).

The benchmark is the `bench` package, installed with kvconductor; this module
only parses the command line, runs `kvconductor.tools.bench.suite` and writes the report.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvconductor.tools.termui import ToolError, fail

if TYPE_CHECKING:
    from kvconductor.tools.bench.suite import Options

PROG = "kvconductor bench"


def _import_bench() -> tuple[Any, Any]:
    """`suite` and `report` of this package, loaded only once the command line parsed."""
    return importlib.import_module(f"{__package__}.suite"), importlib.import_module(
        f"{__package__}.report"
    )


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(float(x)) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of sizes: {text!r}") from None
    if any(s <= 0 for s in sizes):
        raise argparse.ArgumentTypeError("sizes must be positive")
    return sizes


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG,
        description="Benchmark kvconductor against NVIDIA Dynamo's RadixTree and a naive index.",
    )
    p.add_argument("--quick", action="store_true", help="a small run (about a minute)")
    p.add_argument("--entries", type=int, help="index size of the query/memory/restore figures")
    p.add_argument("--apply-blocks", type=int, help="block events in the apply figure")
    p.add_argument("--repeats", type=int, help="runs per peer of the apply figure")
    p.add_argument("--queries", type=int, help="queries per round")
    p.add_argument("--curve", type=_sizes, help="cost-curve sizes, e.g. 1e5,3e5,1e6")
    fixed = p.add_mutually_exclusive_group()
    fixed.add_argument(
        "--fixed-curve",
        type=_sizes,
        help="sizes the curve's smallest and the full index grow to at a fixed answer, "
        "e.g. 1e6,1e7",
    )
    fixed.add_argument("--no-fixed-curve", action="store_true", help="skip the fixed-answer curve")
    p.add_argument("--peers", help="comma-separated subset of the peers")
    p.add_argument("--seed", type=int, help="workload seed")
    p.add_argument("--trace", help="a Mooncake trace (JSON lines) instead of the generator")
    p.add_argument("--trace-limit", type=int, help="replay only the first N trace requests")
    p.add_argument(
        "--trace-instances", type=int, help="vLLM instances a trace is routed over (default 1,000)"
    )
    p.add_argument(
        "--trace-route",
        choices=("session", "round-robin"),
        help="route trace requests by conversation (default) or in turn",
    )
    p.add_argument(
        "--trace-gpu-blocks", type=int, help="GPU blocks of each instance a trace runs on"
    )
    p.add_argument(
        "--trace-speed", type=float, help="replay a trace at this multiple of its own rate"
    )
    p.add_argument(
        "--no-vllm", action="store_true", help="skip figure 7 (ingest of vLLM-shaped records)"
    )
    p.add_argument("--vllm-entries", type=int, help="index size of the vLLM fleet of figure 7")
    p.add_argument(
        "--dynamo-python",
        metavar="PYTHON",
        help="an interpreter with ai-dynamo-runtime, for Dynamo's standalone indexer",
    )
    p.add_argument("--no-restore", action="store_true", help="skip the restore figure")
    p.add_argument("--restore", action="store_true", help="measure restore even with --quick")
    p.add_argument("--no-e2e", action="store_true", help="skip the end-to-end figure")
    p.add_argument("--e2e", action="store_true", help="measure end to end even with --quick")
    p.add_argument(
        "--bootstrap", metavar="HOST:PORT", help="use this broker instead of starting one"
    )
    p.add_argument(
        "--http", type=int, metavar="N", help="HTTP figure: N requests a phase (0: skip)"
    )
    p.add_argument("--out", default="bench-results", help="report folder (default: %(default)s)")
    return p


def options_from(args: argparse.Namespace, suite: Any) -> Options:
    """`kvconductor.tools.bench.suite.Options` for the parsed command line."""
    opts: Options = suite.Options.quick() if args.quick else suite.Options()
    for name in (
        "entries",
        "apply_blocks",
        "repeats",
        "queries",
        "curve",
        "fixed_curve",
        "seed",
        "trace_limit",
        "vllm_entries",
        "trace_instances",
        "trace_route",
        "trace_gpu_blocks",
        "trace_speed",
    ):
        value = getattr(args, name)
        if value is not None:
            setattr(opts, name, value)
    if args.no_fixed_curve:
        opts.fixed_curve = ()
    if args.peers:
        opts.peers = tuple(p.strip() for p in args.peers.split(",") if p.strip())
    if args.trace:
        opts.trace = args.trace
    if args.dynamo_python:
        opts.dynamo_python = args.dynamo_python
    if args.no_vllm:
        opts.vllm = False
    if args.no_restore:
        opts.restore = False
    elif args.restore:
        opts.restore = True
    if args.no_e2e:
        opts.e2e = False
    elif args.e2e:
        opts.e2e = True
    if args.bootstrap:
        opts.bootstrap = args.bootstrap
    if args.http is not None:
        opts.http_requests = args.http
    opts.out = args.out
    return opts


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(argv) if argv is not None else None)
    suite, report = _import_bench()
    opts = options_from(args, suite)
    from kvconductor.tools.dead_letters.tool import (
        writing_stdout,  # loads aiokafka: not at parse time
    )

    def log(line: str) -> None:
        with writing_stdout():
            print(line, flush=True)

    def cannot_write(exc: OSError) -> int:
        return fail(ToolError(f"cannot write the report to {exc.filename}: {exc.strerror}"), PROG)

    out = Path(opts.out)
    try:
        report.prepare(out)  # before a run of minutes, not after it
    except OSError as exc:
        return cannot_write(exc)
    try:
        result = suite.run(opts, log)
        log(report.markdown(result))  # first, so the figures outlive a report that fails
        try:
            paths = report.write(result, out)
        except OSError as exc:
            return cannot_write(exc)
        for kind, path in paths.items():
            log(f"wrote {kind}: {path}")
    except ToolError as exc:
        return fail(exc, PROG)
    return 0


def cli(args: argparse.Namespace) -> int:
    """`kvconductor bench ...` from the main command line (arguments in `rest`)."""
    rest: list[str] = args.rest
    if rest[:1] == ["scale"]:  # one namespace by owners and entries (scale.py)
        return int(importlib.import_module("kvconductor.tools.bench.scale").main(rest[1:]))
    if rest[:1] == ["kinds"]:  # ingest by kind of traffic (kinds.py)
        return int(importlib.import_module("kvconductor.tools.bench.kinds").main(rest[1:]))
    return main(rest)


if __name__ == "__main__":
    sys.exit(main())
