"""NVIDIA Dynamo's standalone KV indexer (`python -m dynamo.indexer`) as a peer.

Fed the way it is fed in production: every instance publishes its records
on a ZMQ PUB socket of its own with vLLM's framing (topic, 8-byte
big-endian sequence number, payload: the same bytes kvconductor's daemon
gets from Kafka), and the indexer, told of each instance through its HTTP
`/register`, subscribes to them. Queried through its HTTP `/query`
(`{"token_ids", "model_name"}`; scores are matched tokens per instance and
rank).

One run: start the indexer, register and connect every instance (a probe
block per instance, resent until the indexer shows it: ZMQ drops what a
PUB sends before its subscriber has joined), stop the indexer (SIGSTOP),
publish every record into the sockets' queues (no send high-water mark, so
nothing is dropped), then let it go (SIGCONT) and time from there until
its `dynamo_kvrouter_kv_cache_events_applied` counters have grown by the
records' event count: a prequeued backlog, as the daemon's on the broker.

The indexer ships with PyPI `ai-dynamo-runtime` (the bench extra); another
interpreter that has it can be named instead (`kvconductor bench
--dynamo-python`).
"""

from __future__ import annotations

import asyncio
import http.client
import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

from kvconductor.tools.bench import raw_http
from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.measure import percentile, process_cpu_s
from kvconductor.tools.bench.workload import Workload
from kvconductor.tools.extras import needs_extra
from kvconductor.tools.kafka_local import broker as kafka_local
from kvconductor.wire.encode import vllm_payload, vllm_stored

if TYPE_CHECKING:
    import zmq

THREADS = 4  # the indexer's default (a ThreadPoolIndexer)
SCRAPE_S = 0.01
TIMEOUT_S = 300.0
# The HTTP load figure's shape: eight clients, as figure 2's.
RATE_CLIENTS = 8
RATE_REQUESTS = 4000
# One client's latency figure: the prompts asked this many times over, so a
# p99 is read from 1,000 and more answers, not from the slowest of 50.
LATENCY_ROUNDS = 20
PROBE_TOKEN = 1 << 20  # above any vocabulary: probe prompts share no block with the workload's


def available(python: str | None) -> str | None:
    """None when `python` (default: this interpreter) can run the standalone
    indexer, else why not."""
    if python is None:
        if importlib.util.find_spec("dynamo") is None:
            return "ai-dynamo-runtime is not installed (the bench extra)"
        if importlib.util.find_spec("dynamo.indexer") is None:
            return "this ai-dynamo-runtime has no dynamo.indexer"
        return None
    if not Path(python).exists():
        return f"{python} does not exist"
    probe = subprocess.run(
        [python, "-c", "import dynamo.indexer"], capture_output=True, timeout=60, check=False
    )
    if probe.returncode:
        return f"{python} cannot import dynamo.indexer: {probe.stderr.decode()[-200:]}"
    return None


class Http:
    """A keep-alive connection to an HTTP API (the indexer's, the daemon's)."""

    def __init__(self, port: int) -> None:
        self.conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)

    def call(self, method: str, path: str, body: Any = None) -> tuple[int, bytes]:
        data = None if body is None else json.dumps(body).encode()
        headers = {"content-type": "application/json"} if data is not None else {}
        self.conn.request(method, path, data, headers)
        resp = self.conn.getresponse()
        return resp.status, resp.read()

    def json(self, method: str, path: str, body: Any = None) -> Any:
        status, data = self.call(method, path, body)
        if status not in (200, 201):
            raise RuntimeError(f"dynamo.indexer {path} answered {status}: {data[:300]!r}")
        return json.loads(data)

    def latencies(self, path: str, bodies: Sequence[bytes]) -> list[float]:
        """Seconds per request of `bodies` posted one after the other, each
        answer read whole (one client, keep-alive: a router's cheapest)."""
        out = []
        headers = {"content-type": "application/json"}
        for body in bodies:
            t = time.perf_counter()
            self.conn.request("POST", path, body, headers)
            resp = self.conn.getresponse()
            resp.read()
            out.append(time.perf_counter() - t)
            if resp.status != 200:
                raise RuntimeError(f"{path} answered {resp.status}")
        return out

    def one_client(self, path: str, bodies: Sequence[bytes]) -> dict[str, float]:
        """p50 / p99 of one keep-alive client asking `bodies`
        `LATENCY_ROUNDS` times over, after a warm-up."""
        self.latencies(path, bodies[:20])
        return query_percentiles(self.latencies(path, list(bodies) * LATENCY_ROUNDS))

    def applied(self) -> int:
        """KV events the indexer has applied (any outcome), from /metrics."""
        _, text = self.call("GET", "/metrics")
        total = 0.0
        for family in text_string_to_metric_families(text.decode()):
            if family.name == "dynamo_kvrouter_kv_cache_events_applied":
                total += sum(s.value for s in family.samples if not s.name.endswith("_created"))
        return int(total)

    def close(self) -> None:
        self.conn.close()


def _worker(key: bytes) -> int:
    return int(key.rsplit(b"-", 1)[1])


class _Publishers:
    """One PUB socket per instance, sequence numbers per socket."""

    def __init__(self, keys: Sequence[bytes]) -> None:
        # pyzmq: the bench extra (the daemon's install has none).
        with needs_extra("bench", "the benchmark's Dynamo indexer peer"):
            import zmq
        self.ctx = zmq.Context()
        self.ports = dict(zip(keys, kafka_local.free_ports(len(keys)), strict=True))
        self.socks: dict[bytes, zmq.Socket[bytes]] = {}
        self.seq = dict.fromkeys(keys, 0)
        for key, port in self.ports.items():
            sock = self.ctx.socket(zmq.PUB)
            sock.setsockopt(zmq.SNDHWM, 0)  # queue, never drop
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(f"tcp://127.0.0.1:{port}")
            self.socks[key] = sock

    def send(self, key: bytes, payload: bytes) -> None:
        seq = self.seq[key]
        self.seq[key] = seq + 1
        self.socks[key].send_multipart((b"", seq.to_bytes(8, "big"), payload))

    def close(self) -> None:
        for sock in self.socks.values():
            sock.close()
        self.ctx.term()


def _probe(key: bytes, block_size: int) -> tuple[list[int], bytes]:
    """A one-block store of tokens no workload prompt has: its prompt and payload."""
    tokens = [PROBE_TOKEN + _worker(key)] * block_size
    event = vllm_stored([(1 << 62) + _worker(key)], None, tokens, "GPU", block_size)
    return tokens, vllm_payload([event], 0, 0.0)


def _connect(http_: Http, pubs: _Publishers, model: str, block_size: int) -> None:
    for key, port in pubs.ports.items():
        http_.json(
            "POST",
            "/register",
            {
                "instance_id": _worker(key),
                "endpoint": f"tcp://127.0.0.1:{port}",
                "model_name": model,
                "block_size": block_size,
            },
        )
    waiting = set(pubs.ports)
    deadline = time.monotonic() + 60
    while waiting:
        if time.monotonic() > deadline:
            raise RuntimeError(f"dynamo.indexer never saw {len(waiting)} of the instances")
        for key in waiting:
            pubs.send(key, _probe(key, block_size)[1])
        time.sleep(0.05)
        for key in list(waiting):
            answer = http_.json(
                "POST", "/query", {"token_ids": _probe(key, block_size)[0], "model_name": model}
            )
            if answer.get("scores", {}).get(str(_worker(key))):
                waiting.discard(key)


def gpu_blocks(answer: dict[str, Any], block_size: int) -> list[tuple[int, int]]:
    """The /query answer as sorted (worker, device blocks matched)."""
    out = []
    for worker, ranks in answer.get("scores", {}).items():
        tokens = max(ranks.values(), default=0)
        if tokens:
            out.append((int(worker), tokens // block_size))
    return sorted(out)


def standalone_run(
    w: Workload,
    records: Sequence[Record],
    prompts: Sequence[list[int]],
    log_path: Path,
    python: str | None = None,
    threads: int = THREADS,
) -> dict[str, Any]:
    """One run of the indexer on `records` (engine records, in order)."""
    cfg = w.config
    (port,) = kafka_local.free_ports(1)
    env = {**os.environ, "DYN_LOG": "warn"}
    cmd = [python or sys.executable, "-m", "dynamo.indexer", "--port", str(port)]
    cmd += ["--threads", str(threads)]
    events = sum(r.events for r in records)
    with log_path.open("wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    pubs = _Publishers(sorted({r.key for r in records}))
    http_ = Http(port)
    try:
        _wait_http(http_, proc, log_path)
        _connect(http_, pubs, cfg.model, cfg.block_size)
        base = http_.applied()
        # Prequeued, like the daemon's backlog on the broker: the indexer is
        # stopped while every record goes into its sockets' queues, and the
        # clock starts when it is let go.
        os.kill(proc.pid, signal.SIGSTOP)
        sending = time.perf_counter()
        for r in records:
            pubs.send(r.key, r.payload)
        sent = time.perf_counter() - sending
        cpu0 = sum(process_cpu_s(proc.pid))
        started = time.perf_counter()
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + TIMEOUT_S
        while (applied := http_.applied() - base) < events:
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(
                    f"dynamo.indexer applied {applied:,} of {events:,} events (its log: {log_path})"
                )
            time.sleep(SCRAPE_S)
        seconds = time.perf_counter() - started
        cpu = sum(process_cpu_s(proc.pid)) - cpu0
        queries = [{"token_ids": p, "model_name": cfg.model} for p in prompts]
        answers = [gpu_blocks(http_.json("POST", "/query", q), cfg.block_size) for q in queries]
        bodies = [json.dumps(q).encode() for q in queries]
        query = http_.one_client("/query", bodies)
        query["queries_per_s"] = asyncio.run(
            raw_http.rate(port, "/query", bodies, RATE_CLIENTS, RATE_REQUESTS)
        )
    finally:
        http_.close()
        pubs.close()
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(30)
    return {
        "seconds": seconds,
        "send_s": sent,
        "events_applied": applied,
        "indexer_cpu_s": cpu,
        "answers": answers,
        "query": query,
    }


def query_percentiles(seconds: Sequence[float]) -> dict[str, float]:
    """p50 / p99 in microseconds of one client's queries."""
    us = sorted(x * 1e6 for x in seconds)
    return {"p50_us": percentile(us, 50), "p99_us": percentile(us, 99), "queries": len(us)}


def _wait_http(http_: Http, proc: subprocess.Popen[bytes], log_path: Path) -> None:
    deadline = time.monotonic() + 60
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"dynamo.indexer exited:\n{log_path.read_text()[-1000:]}")
        try:
            http_.json("GET", "/workers")
            return
        except (OSError, http.client.HTTPException):
            http_.close()
            if time.monotonic() > deadline:
                raise RuntimeError("dynamo.indexer's HTTP API never came up") from None
            time.sleep(0.1)
