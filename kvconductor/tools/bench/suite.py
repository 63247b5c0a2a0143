"""One benchmark run: every figure, in order, into one result dict."""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvconductor.tools.bench import report
from kvconductor.tools.bench.fixed_answer import fixed_answer_figure
from kvconductor.tools.bench.http_load import http_figure
from kvconductor.tools.bench.measure import forked, summary, warm_memory
from kvconductor.tools.bench.peers import ALL_PEERS, Peer, dynamo_available
from kvconductor.tools.bench.runners import apply_figure, scale_figure, strip_answers
from kvconductor.tools.bench.workload import Workload, WorkloadConfig, generate

Log = Callable[[str], None]


@dataclass
class Options:
    mode: str = "default"
    seed: int = 7
    entries: int = 4_000_000  # index size of the query, memory, restore figures
    apply_blocks: int = 1_000_000  # block events of the apply figure
    repeats: int = 5
    queries: int = 1000
    query_rounds: int = 3
    naive_queries: int = 200
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8192)
    curve: tuple[int, ...] = (100_000, 300_000, 1_000_000)
    curve_queries: int = 300
    # Sizes the smallest curve workload's index, and the full one's, are
    # grown to with filler (figure 6b: the same answers at every size);
    # empty skips it.
    fixed_curve: tuple[int, ...] = (300_000, 1_000_000, 3_000_000, 10_000_000)
    restore: bool = True
    restore_repeats: int = 3
    http_requests: int = 2000  # per client phase of the HTTP figure; 0 skips it
    e2e: bool = True  # end to end through the broker and a daemon subprocess
    e2e_repeats: int = 3
    e2e_seconds: float = 10.0  # of the half-load phase, per run
    # At most this many runs before the counted ones, reported apart, until
    # the broker's just-in-time compiler has settled (`kvconductor.tools.bench.e2e.JIT_SETTLED`):
    # the daemon meets a long-running broker, this benchmark one it started
    # (on a fresh broker the first run's half-load p99 was several times the
    # later runs': docs/bench/history.md).
    e2e_warmups: int = 3
    bootstrap: str | None = None  # a running broker for restore and e2e: none started
    warm_bytes: int = 3 << 30  # fresh memory touched once before measuring
    peers: tuple[str, ...] = ALL_PEERS
    # Figure 7: ingest of vLLM-shaped records (kvconductor.tools.bench.vllm_engine), in process
    # and, with e2e, through the broker into the daemon (records prequeued).
    vllm: bool = True
    vllm_entries: int = 1_000_000
    vllm_repeats: int = 3
    vllm_prequeued_repeats: int = 3
    # An interpreter with PyPI ai-dynamo-runtime for dynamo.indexer (None:
    # this one, which has it with the bench extra).
    dynamo_python: str | None = None
    trace: str | None = None
    trace_limit: int | None = None
    # A trace through vLLM's engine model (figures 7 and 8): the fleet it is
    # routed over, how, each instance's pool, and the replay's speed-up.
    trace_instances: int = 1000
    trace_route: str = "session"
    trace_gpu_blocks: int = 16_384
    trace_speed: float = 1.0
    out: str = "bench-results"
    notes: list[str] = field(default_factory=list)

    @classmethod
    def quick(cls) -> Options:
        return cls(
            mode="quick",
            entries=200_000,
            apply_blocks=150_000,
            repeats=3,
            queries=300,
            query_rounds=2,
            naive_queries=100,
            lengths=(1024, 8192),
            curve=(50_000, 100_000),
            curve_queries=150,
            fixed_curve=(100_000, 300_000),
            restore=False,  # the broker alone takes 15-40 s to start: --restore
            restore_repeats=2,
            http_requests=0,  # --http N measures it
            e2e=False,  # needs the broker too
            e2e_repeats=2,
            e2e_seconds=4.0,
            e2e_warmups=0,
            vllm_entries=100_000,
            vllm_prequeued_repeats=1,
            warm_bytes=512 << 20,
        )


def _workload(opts: Options, entries: int, queries: int) -> Workload:
    cfg = WorkloadConfig.for_entries(entries, seed=opts.seed, queries=queries)
    if opts.trace:
        from kvconductor.tools.bench.trace import trace_workload

        return trace_workload(Path(opts.trace), cfg, limit=opts.trace_limit, route=opts.trace_route)
    return generate(cfg)


def _peers(opts: Options, log: Log) -> tuple[str, ...]:
    peers = opts.peers
    if "dynamo" in peers:
        why = dynamo_available()
        if why is not None:
            note = f"Dynamo's RadixTree not measured ({why}); install the bench extra"
            log(note)
            opts.notes.append(note)
            peers = tuple(p for p in peers if p != "dynamo")
    return peers


@contextlib.contextmanager
def _maybe_broker(opts: Options, log: Log) -> Iterator[str | None]:
    if not (opts.restore or opts.e2e):
        yield None
        return
    if opts.bootstrap is not None:
        yield opts.bootstrap
        return
    from kvconductor.tools.bench.restore import local_broker

    log("starting a local Kafka broker for the restore and end-to-end figures")
    with contextlib.ExitStack() as stack:
        try:
            bootstrap: str | None = stack.enter_context(local_broker())
        except Exception as exc:  # no Java, no jars: the rest still runs
            bootstrap = None
            note = f"restore and e2e not measured: the local broker did not start ({exc})"
            log(note)
            opts.notes.append(note)
        yield bootstrap
    if bootstrap is not None:
        log("local Kafka broker stopped")


def _restore_figure(
    w: Workload, bootstrap: str, topic: str, published: dict[str, Any], opts: Options, log: Log
) -> dict[str, Any]:
    from kvconductor.tools.bench.restore import restore_from_topic
    from kvconductor.wire.query import TokenQuery

    cfg = w.config
    prompts = [q.tolist() for q in w.queries[: len(published["answers"])]]

    def child() -> dict[str, Any]:
        gc.collect()
        gc.freeze()
        index, timing = restore_from_topic(bootstrap, topic)
        answers = [index.query(TokenQuery(cfg.model, cfg.block_size, p)) for p in prompts]
        timing["identical"] = answers == published["answers"]
        return timing

    runs = []
    for r in range(opts.restore_repeats):
        res = forked(child)
        runs.append(res)
        log(
            f"  restore run {r + 1}/{opts.restore_repeats}: read {res['read_s']:.2f} s + "
            f"rebuild {res['restore_s']:.2f} s, identical answers: {res['identical']}"
        )
    return {
        "measured": True,
        "entries": w.stats["entries"],
        "bytes": runs[0]["bytes"],
        "records": runs[0]["records"],
        "units": published["units"],
        "publish_s": published["publish_s"],
        "read_s": summary([r["read_s"] for r in runs]),
        "restore_s": summary([r["restore_s"] for r in runs]),
        "total_s": summary([r["total_s"] for r in runs]),
        "identical": all(r["identical"] for r in runs),
    }


def _publish_hook(
    w: Workload, bootstrap: str, topic: str, check: int
) -> Callable[[Peer], dict[str, Any]]:
    from kvconductor.tools.bench.restore import publish_snapshot
    from kvconductor.wire.query import TokenQuery

    cfg = w.config

    def hook(peer: Peer) -> dict[str, Any]:
        conductor = peer.conductor  # type: ignore[attr-defined]
        answers = [
            conductor.query(TokenQuery(cfg.model, cfg.block_size, q.tolist()))
            for q in w.queries[:check]
        ]
        out = publish_snapshot(conductor, bootstrap, topic)
        out["answers"] = answers
        return out

    return hook


def _e2e(
    w: Workload,
    bootstrap: str | None,
    apply: dict[str, Any],
    peers: tuple[str, ...],
    opts: Options,
    log: Log,
) -> dict[str, Any]:
    """Figure 4 on the apply figure's records, next to its kvconductor rate."""
    if not opts.e2e:
        return {"measured": False, "reason": "skipped (--no-e2e or --quick)"}
    if bootstrap is None:
        return {"measured": False, "reason": "no broker"}
    if "kvconductor" not in peers:
        return {"measured": False, "reason": "kvconductor not among the peers"}
    from kvconductor.tools.bench.e2e import e2e_figure

    log(
        f"figure 4: end to end through the broker ({opts.e2e_repeats} runs after up to "
        f"{opts.e2e_warmups} warm-up runs, {opts.e2e_seconds:.0f} s at half load each)"
    )
    logs = Path(opts.out) / "e2e-logs"
    out = e2e_figure(
        w,
        bootstrap,
        apply["requests"],
        opts.e2e_repeats,
        opts.e2e_seconds,
        logs,
        log,
        warmups=opts.e2e_warmups,
    )
    apply_rate = apply["rate"]["kvconductor"]["median"]
    out["apply_rate"] = apply_rate
    out["vs_apply"] = out["rate"]["median"] / apply_rate if apply_rate else None
    return out


def _replay(w: Workload, bootstrap: str | None, opts: Options, log: Log) -> dict[str, Any]:
    """Figure 8: the trace at its own rate (times `trace_speed`) into the daemon."""
    if not opts.trace:
        return {"measured": False, "reason": "no --trace"}
    if bootstrap is None:
        return {"measured": False, "reason": "no broker (or --no-e2e / --quick)"}
    from kvconductor.tools.bench.replay import replay_figure

    log(f"figure 8: {opts.trace} replayed into the daemon at {opts.trace_speed:g}x its rate")
    return replay_figure(w, bootstrap, opts.trace_speed, Path(opts.out) / "e2e-logs", log)


def _dynamo_indexer(peers: tuple[str, ...], opts: Options, log: Log) -> str | None:
    """None when Dynamo's standalone indexer is measured, else why not (said once)."""
    if "dynamo" not in opts.peers:
        return "not among the peers"
    from kvconductor.tools.bench.dynamo_indexer import available

    why = available(opts.dynamo_python)
    if why is not None:
        note = f"Dynamo's standalone indexer not measured ({why}); install the bench extra"
        log(note)
        opts.notes.append(note)
    return why


def _ingest(
    bootstrap: str | None, peers: tuple[str, ...], opts: Options, log: Log
) -> dict[str, Any]:
    """Figure 7 on a vLLM fleet of its own (`kvconductor.tools.bench.vllm_engine`)."""
    if not opts.vllm:
        return {"measured": False, "reason": "skipped (--no-vllm)"}
    from kvconductor.tools.bench.ingest import ingest_figure
    from kvconductor.tools.bench.vllm_engine import FleetConfig, fleet_workload

    if opts.trace:
        from kvconductor.tools.bench.trace import vllm_trace_workload

        log(
            f"figure 7: ingest of {opts.trace} through vLLM's engine model on "
            f"{opts.trace_instances:,} instances (routed by {opts.trace_route})"
        )
        engine = replace(FleetConfig.engine_default(), gpu_blocks=opts.trace_gpu_blocks)
        fleet = FleetConfig(seed=opts.seed, instances=opts.trace_instances, engine=engine)
        w = vllm_trace_workload(
            Path(opts.trace), fleet, opts.trace_route, opts.trace_limit, opts.curve_queries
        )
    else:
        log(f"figure 7: ingest of vLLM-shaped records ({opts.vllm_entries:,} entries)")
        fleet = FleetConfig.for_entries(opts.vllm_entries, seed=opts.seed)
        w = fleet_workload(fleet, opts.vllm_entries, churn=0.5, queries=opts.curve_queries)
    log(f"  {w.stats}")
    out = ingest_figure(w, peers, opts.vllm_repeats, log)
    kvc = bootstrap if opts.e2e and "kvconductor" in peers else None
    dynamo = _dynamo_indexer(peers, opts, log)
    if kvc is None and dynamo is not None:
        why = "no broker" if opts.e2e and bootstrap is None else "skipped (--no-e2e or --quick)"
        out["prequeued"] = {"measured": False, "reason": why}
        out["dynamo_indexer"] = {"measured": False, "reason": dynamo}
    else:
        from kvconductor.tools.bench.ingest import real_path_figure

        runs = opts.vllm_prequeued_repeats
        log(
            f"  the real paths: records prequeued then the daemon, and dynamo.indexer ({runs} runs)"
        )
        out.update(
            real_path_figure(
                w,
                kvc,
                dynamo,
                runs,
                Path(opts.out) / "e2e-logs",
                log,
                dynamo_python=opts.dynamo_python,
            )
        )
        if kvc is None:
            why = "no broker" if opts.e2e else "skipped (--no-e2e or --quick)"
            out["prequeued"] = {"measured": False, "reason": why}
        out["real_ratio"] = out.pop("ratio_real", {})
    for name, ratio in out["ratio"].items():
        log(f"  ingest {name}: {ratio['median']:.2f}x (time ratio, pair by pair)")
    out["replay"] = _replay(w, kvc, opts, log)
    del w
    gc.collect()
    return out


def run(opts: Options, log: Log = print) -> dict[str, Any]:
    started = time.time()
    t0 = time.perf_counter()
    peers = _peers(opts, log)
    result: dict[str, Any] = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "mode": opts.mode,
        "options": asdict(opts),
        "machine": report.machine(),
        "peers": list(peers),
    }
    if opts.warm_bytes:
        log(f"touching {opts.warm_bytes / 2**30:.1f} GiB of fresh memory once")
        result["machine"]["first_touch"] = warm_memory(opts.warm_bytes)
        log(f"  {result['machine']['first_touch']}")
    log(f"generating the workload ({opts.entries:,} entries)")
    w = _workload(opts, opts.entries, opts.queries)
    result["workload"] = {"config": w.config.to_json(), "stats": w.stats}
    log(f"  {w.stats}")

    log(f"figure 1: apply throughput ({opts.apply_blocks:,} block events, {opts.repeats} runs)")
    result["apply"] = apply_figure(w, peers, opts.apply_blocks, opts.repeats, log)

    with _maybe_broker(opts, log) as bootstrap:
        after: dict[str, Callable[[Peer], dict[str, Any]]] = {}
        topic = ""
        if opts.restore and bootstrap is not None and "kvconductor" in peers:
            from kvconductor.tools.bench.restore import new_topic

            topic = new_topic()
            after["kvconductor"] = _publish_hook(w, bootstrap, topic, 50)
        log(f"figures 2-3: build, memory, query latency at {opts.entries:,} entries")
        scale = scale_figure(
            w,
            peers,
            opts.queries,
            opts.query_rounds,
            opts.naive_queries,
            lengths=opts.lengths,
            after=after,
            log=log,
        )
        strip_answers(scale)
        result["scale"] = scale
        published = scale["peers"].get("kvconductor", {}).pop("after", None)
        if bootstrap is not None and published is not None:
            log("figure 5: restore from the snapshot topic")
            result["restore"] = _restore_figure(w, bootstrap, topic, published, opts, log)
        else:
            reason = "skipped (--no-restore or --quick)" if not opts.restore else "no broker"
            result["restore"] = {"measured": False, "reason": reason}
        result["e2e"] = _e2e(w, bootstrap, result["apply"], peers, opts, log)
        result["ingest"] = _ingest(bootstrap, peers, opts, log)

    if opts.http_requests > 0 and "kvconductor" in peers:
        result["http"] = http_figure(w, opts.http_requests, log)
    else:
        why = "skipped (--http 0, or --quick without --http N)"
        result["http"] = {"measured": False, "reason": why}

    main_point = {"entries": w.stats["entries"], "peers": _curve_view(scale["peers"])}
    fixed = [_fixed_answer(w, peers, opts, log)]
    del w
    gc.collect()
    curve = []
    for i, size in enumerate(sorted(opts.curve)):
        log(f"figure 6: cost curve at {size:,} entries")
        wc = _workload(opts, size, opts.curve_queries)
        sc = scale_figure(wc, peers, opts.curve_queries, 1, opts.naive_queries, log=log)
        curve.append({"entries": wc.stats["entries"], "peers": _curve_view(sc["peers"])})
        if i == 0:
            fixed.insert(0, _fixed_answer(wc, peers, opts, log))
        del wc
        gc.collect()
    curve.append(main_point)
    result["curve"] = sorted(curve, key=lambda p: p["entries"])
    result["fixed_answer"] = [f for f in fixed if f is not None]
    if max((*opts.curve, opts.entries)) < 10_000_000:
        note = (
            "The workload's 10^7 point is not in the default run: generating it and "
            "building every peer's index takes about 2.5x the 4M run; `kvconductor bench "
            "--entries 10000000` runs it."
        )
        if max(opts.fixed_curve, default=0) >= 10_000_000:
            note += " The fixed-answer curve (6b) reaches 10^7 with filler."
        result["curve_note"] = note
    result["elapsed_s"] = time.perf_counter() - t0
    result["machine"]["loadavg_end"] = report.loadavg()
    result["machine"]["cpu_probe_ms_end"] = report.cpu_probe_ms()
    result["targets"] = report.targets(result)
    result["notes"] = opts.notes
    return result


def _fixed_answer(
    w: Workload, peers: tuple[str, ...], opts: Options, log: Log
) -> dict[str, Any] | None:
    """Figure 6b from `w`, up to the sizes of `opts.fixed_curve` above it."""
    base = w.stats["entries"]
    if "kvconductor" not in peers or not any(s > base for s in opts.fixed_curve):
        return None
    log(f"figure 6b: cost curve at a fixed answer, from {base:,} entries")
    return fixed_answer_figure(
        w, peers, opts.fixed_curve, opts.curve_queries, opts.query_rounds, log=log
    )


def _curve_view(peers: dict[str, Any]) -> dict[str, Any]:
    keep = ("entries", "build_rate", "bytes_per_entry", "latency_us", "answer_size")
    return {name: {k: r[k] for k in keep} for name, r in peers.items()}
