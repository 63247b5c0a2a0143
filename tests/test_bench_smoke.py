"""The benchmark at a tiny scale: workload shape and report shape only.

No timing is asserted here, ever: the numbers belong to `kvconductor bench`.
"""

from __future__ import annotations

import json
import os
import time
from array import array
from pathlib import Path

import msgspec
import pytest
import xxhash

from kvconductor.tools.bench import report
from kvconductor.tools.bench.fixed_answer import (
    CHAIN,
    Filler,
    chains_for,
    fixed_answer_figure,
    instances_of,
)
from kvconductor.tools.bench.measure import jit_cpu_s, process_cpu_s
from kvconductor.tools.bench.peers import dynamo_available
from kvconductor.tools.bench.restore import broker_pid, local_broker
from kvconductor.tools.bench.suite import Options, run
from kvconductor.tools.bench.trace import trace_workload
from kvconductor.tools.bench.workload import WorkloadConfig, generate
from kvconductor.wire.engine import decode_engine_payload
from kvconductor.wire.hashing import BASE_SEED
from kvconductor.wire.pool import decode_pool_payload

TINY = 12_000


def _tiny_config(**kw: object) -> WorkloadConfig:
    return WorkloadConfig.for_entries(
        TINY,
        queries=20,
        system_prompts=3,
        documents=8,
        document_tokens=(256, 1024),
        max_context_tokens=4096,
        query_tokens=1024,
        **kw,
    )


def test_generator_is_deterministic_and_decodable() -> None:
    a = generate(_tiny_config())
    b = generate(_tiny_config())
    assert [r.payload for r in a.streams.records] == [r.payload for r in b.streams.records]
    assert a.stats["entries"] >= TINY
    assert a.stats["gpu_evictions"] > 0
    kinds: set[str] = set()
    for r in a.streams.records:
        if r.pool:
            for pev in decode_pool_payload(r.payload).events:
                kinds.add(f"pool-{pev.event_type}")
        else:
            raw = msgspec.msgpack.decode(r.payload)
            for ev in raw[1]:
                kinds.add(f"{ev['type']}-{ev['medium']}")
            decode_engine_payload(r.payload, "vllm")
    assert {"BlockStored-GPU", "BlockRemoved-GPU", "BlockStored-CPU", "pool-stored"} <= kinds
    assert all(len(q) == 1024 for q in a.queries)
    # Every stream is cut at the same request boundaries.
    assert len(a.streams.marks) == a.stats["requests"]


def test_mooncake_trace_reader(tmp_path: Path) -> None:
    lines = [
        {"timestamp": 0, "input_length": 1200, "output_length": 10, "hash_ids": [1, 2, 3]},
        {"timestamp": 5, "input_length": 1000, "output_length": 20, "hash_ids": [1, 2, 4]},
        {"timestamp": 9, "input_length": 300, "output_length": 5, "hash_ids": [7]},
    ]
    path = tmp_path / "trace.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    w = trace_workload(path, _tiny_config(instances=2))
    assert w.stats["requests"] == 3
    assert w.stats["block_events"] > 0


def test_filler_continues_each_instances_sequence_on_its_tiers() -> None:
    w = generate(_tiny_config())
    owners = {o.key: o for o in instances_of(w)}
    last = {k: o.seq for k, o in owners.items()}
    records = list(Filler(w).records(2 * len(owners)))
    assert {r.key for r in records} == set(owners)
    for r in records:
        fields = dict(r.headers)
        last[r.key] += 1
        assert int(fields["kv-seq"]) == last[r.key]
        # Write-through to the host tier on local-mode instances only.
        local = fields["kv-offload"] == b"local"
        assert r.blocks == (2 if local else 1) * CHAIN


def test_dynamo_gets_the_same_chains_as_kvconductor() -> None:
    w = generate(_tiny_config())
    records = list(Filler(w).records(3))
    events = list(Filler(w).dynamo(3))
    for r, (worker, payload, blocks) in zip(records, events, strict=True):
        assert r.key == f"vllm-{worker}".encode() and blocks == CHAIN
        stored = msgspec.msgpack.decode(r.payload)[1][0]
        dyn = msgspec.json.decode(payload)["data"]["stored"]["blocks"]
        assert [b["block_hash"] for b in dyn] == stored["block_hashes"]
        tokens = array("I", stored["token_ids"]).tobytes()
        step = 4 * w.config.block_size
        assert [b["tokens_hash"] for b in dyn] == [
            xxhash.xxh3_64_intdigest(tokens[i : i + step], BASE_SEED)
            for i in range(0, len(tokens), step)
        ]


def test_each_size_is_reached_with_every_answer_kept() -> None:
    w = generate(_tiny_config())
    base = w.stats["entries"]
    sizes = (base, 2 * base, 5 * base)
    assert chains_for(w, sizes)[0] == 0
    peers = ("kvconductor", "dynamo") if dynamo_available() is None else ("kvconductor",)
    fig = fixed_answer_figure(w, peers, sizes, queries=20, rounds=1, log=lambda _: None)
    points = fig["peers"]["kvconductor"]
    assert points[0]["entries"] == base  # sizes not above the base are left out
    for size, p in zip(sizes[1:], points[1:], strict=True):
        assert size <= p["entries"] < size + 2 * CHAIN
    for name in peers:
        got = fig["peers"][name]
        assert [p["at_entries"] for p in got] == [p["entries"] for p in points]
        assert all(p["identical"] and not p["refused"] for p in got), name
        assert [p["filler_found"] for p in got] == [None, True, True], name


def test_tiny_run_report_shape(tmp_path: Path) -> None:
    peers = ["kvconductor", "kvconductor-device", "naive"]
    if dynamo_available() is None:
        peers.append("dynamo")
    opts = Options(
        mode="test",
        entries=TINY,
        apply_blocks=2_000,
        repeats=2,
        queries=20,
        query_rounds=1,
        naive_queries=20,
        lengths=(256, 1024),
        curve=(6_000,),
        curve_queries=10,
        fixed_curve=(9_000, 24_000),
        restore=False,
        http_requests=20,
        e2e=False,
        vllm_entries=8_000,
        vllm_repeats=2,
        warm_bytes=0,
        peers=tuple(peers),
    )
    result = run(opts, log=lambda _line: None)
    # The tiny fleet has short prompts: the figures only need their shape.
    for key in ("machine", "workload", "apply", "scale", "restore", "curve", "targets"):
        assert key in result
    assert set(result["apply"]["rate"]) == set(peers)
    for s in result["apply"]["rate"].values():
        assert set(s) >= {"median", "min", "max", "spread_pct", "runs"}
        assert len(s["runs"]) == 2
    for name, r in result["scale"]["peers"].items():
        assert name in peers
        assert set(r["latency_us"]) == {"p50", "p99", "p99.9"}
        assert r["entries"] > 0
        assert "answers" not in r
    assert (
        result["scale"]["peers"]["kvconductor"]["entries_counted"]
        == (result["workload"]["stats"]["entries"])
    )
    agree = result["scale"]["agreement"]
    for name in peers[1:]:
        same, compared = agree[name]
        assert same == compared > 0, name
    assert [p["entries"] for p in result["curve"]] == sorted(p["entries"] for p in result["curve"])
    # From the smallest curve workload and from the full one, each to the
    # sizes above it.
    small, full = result["fixed_answer"]
    assert small["base_entries"] == result["curve"][0]["entries"]
    assert full["base_entries"] == result["workload"]["stats"]["entries"]
    assert len(small["peers"]["kvconductor"]) == 3 and len(full["peers"]["kvconductor"]) == 2
    for series in (small, full):
        for points in series["peers"].values():
            assert all(p["identical"] and p["filler_found"] is not False for p in points)
        assert series["peers"]["kvconductor"][-1]["entries"] >= 24_000
    assert result["targets"][-1]["figure"].startswith("cost curve")
    assert result["targets"][-1]["met"] is not None
    assert all(
        set(p["answer_size"]) == {"owners", "blocks"} for p in result["scale"]["peers"].values()
    )
    assert result["restore"]["measured"] is False
    http = result["http"]
    assert http["measured"] is True, http
    assert http["requests"] == 20 and http["clients"] == 8
    assert set(http["one_client"]) == {"p50_us", "p99_us"}
    assert set(http["concurrent"]) == {"qps", "p50_us", "p99_us"}
    paths = report.write(result, tmp_path / "out")
    md = Path(paths["md"]).read_text()
    for heading in ("## Targets", "## 1. Apply throughput", "## 6. Cost curve", "### 6b."):
        assert heading in md
    assert "## 7. Ingest of vLLM-shaped records" in md
    ingest = result["ingest"]
    assert set(ingest["peers"]) == {p for p in peers if p != "kvconductor-device"}
    assert ingest["prequeued"]["measured"] is False
    for s in result["apply"]["per_unit"].values():
        assert s["events_per_s"]["median"] > 0
    assert json.loads(Path(paths["json"]).read_text())["mode"] == "test"


def test_probes_are_split_by_the_generations_they_waited_through() -> None:
    from kvconductor.tools.bench.e2e import by_generation

    # (sent, latency) in epoch seconds; one generation from 10 to 12.
    probes = [(9.0, 0.5), (9.5, 0.6), (11.0, 0.01), (12.5, 0.02)]
    split = by_generation(probes, [(10.0, 12.0)])
    assert split["probes_during_generations"] == 2
    assert split["p99_during_generations_ms"] == pytest.approx(600)
    assert split["p99_outside_generations_ms"] == pytest.approx(500)
    none = by_generation(probes, [])
    assert none["probes_during_generations"] == 0
    assert none["p99_during_generations_ms"] is None
    assert none["p99_outside_generations_ms"] == pytest.approx(600)


def test_a_process_cpu_time_is_read_from_proc() -> None:
    before = sum(process_cpu_s(os.getpid()))
    deadline = time.process_time() + 0.05
    while time.process_time() < deadline:
        pass
    # /proc counts in clock ticks (10 ms): 50 ms of work shows.
    assert sum(process_cpu_s(os.getpid())) > before


def test_only_a_jvm_has_a_compiler_to_watch() -> None:
    assert jit_cpu_s(os.getpid()) is None  # CPython: no compiler threads
    assert jit_cpu_s(2**22 + 1) is None  # above pid_max's default: no such process


@pytest.mark.kafka
def test_tiny_run_through_the_broker(kafka_bootstrap: str, tmp_path: Path) -> None:
    """Figures 4 and 5 on the session's broker: a daemon subprocess per run,
    the warm-up's reported apart from the counted one. The session's broker
    is not one the benchmark started, so its compiler cannot be watched:
    one warm-up run of the three allowed."""
    opts = Options(
        mode="test",
        entries=TINY,
        apply_blocks=2_000,
        repeats=1,
        queries=20,
        query_rounds=1,
        naive_queries=20,
        lengths=(1024,),
        curve=(),
        fixed_curve=(),
        restore_repeats=1,
        http_requests=0,
        e2e_repeats=1,
        e2e_seconds=2.0,
        e2e_warmups=3,
        vllm_entries=8_000,
        vllm_repeats=1,
        vllm_prequeued_repeats=1,
        bootstrap=kafka_bootstrap,
        warm_bytes=0,
        peers=("kvconductor",),
        out=str(tmp_path / "out"),
    )
    result = run(opts, log=lambda _line: None)
    e2e = result["e2e"]
    assert e2e["measured"] is True, e2e
    assert e2e["requests"] == result["apply"]["requests"]
    assert e2e["block_events"] == result["apply"]["block_events"]["kvconductor"]
    assert len(e2e["rate"]["runs"]) == 1 and e2e["vs_apply"] > 0
    half = e2e["half_load"]
    # Nothing lost on the way: every record applied, every probe seen, and
    # the daemon answers like an index fed the same records in process.
    assert e2e["identical"] is True
    assert e2e["bad_records"] == 0
    assert half["probes"] > 0 and half["lost"] == 0
    assert half["p50_ms"]["median"] <= half["p99_ms"]["median"] <= half["max_ms"]
    assert 0 <= half["probes_during_generations"] <= half["probes"]
    assert half["daemon_cpu"]["median"] > 0 and half["driver_cpu"]["median"] > 0
    # The test's broker is not one the benchmark started: its CPU is not measured.
    assert half["broker_cpu"]["median"] is None
    assert half["broker_jit_cpu"]["median"] is None
    assert e2e["daemon"]["exit_codes"] == [0]
    assert len(e2e["warmup_runs"]) == 1 and e2e["warmup_runs"][0]["exit_code"] == 0
    # The warm-up's, the counted run's and figure 7's prequeued run's.
    assert len(list((tmp_path / "out" / "e2e-logs").glob("daemon-*.log"))) == 3
    restore = result["restore"]
    assert restore["measured"] is True and restore["identical"] is True
    assert restore["bytes"] > 0
    rows = {t["figure"].split(":")[0]: t for t in result["targets"]}
    assert isinstance(rows["end to end"]["measured"], str)
    md = Path(report.write(result, tmp_path / "out")["md"]).read_text()
    assert "## 4. End to end through the broker" in md
    assert "after 1 warm-up run left out of the figures" in md
    assert "## 5. Restore from the snapshot topic" in md
    pre = result["ingest"]["prequeued"]
    assert pre["measured"] is True and pre["identical"] is True


@pytest.mark.parametrize("argv", [["--help"]])
def test_cli_help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    from kvconductor.tools.bench.command import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 0
    assert "--quick" in capsys.readouterr().out


@pytest.mark.kafka
def test_the_benchmarks_own_broker_is_known_by_its_bootstrap() -> None:
    """The e2e figure's broker CPU share reads the process `local_broker` runs."""
    with local_broker() as bootstrap:
        pid = broker_pid(bootstrap)
        assert pid is not None
        assert sum(process_cpu_s(pid)) > 0  # a live process: it started a JVM
        assert "java" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        # Starting the broker compiled some of its code already.
        assert (jit_cpu_s(pid) or 0.0) > 0
    assert broker_pid(bootstrap) is None
    assert broker_pid("127.0.0.1:1") is None


def test_cli_sizes_reach_the_options() -> None:
    from kvconductor.tools.bench import suite
    from kvconductor.tools.bench.command import build_parser, options_from

    def opts(*argv: str) -> Options:
        result: Options = options_from(build_parser().parse_args(list(argv)), suite)
        return result

    assert opts("--curve", "1e5,3e5", "--fixed-curve", "1e6,1e7").fixed_curve == (
        1_000_000,
        10_000_000,
    )
    assert opts("--curve", "1e5,3e5").curve == (100_000, 300_000)
    assert opts("--no-fixed-curve").fixed_curve == ()
    assert opts("--quick").fixed_curve == Options.quick().fixed_curve
