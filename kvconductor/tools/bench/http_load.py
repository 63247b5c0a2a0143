"""The HTTP figure: POST /query on the daemon's real app, one client then eight.

The index is built from the workload in a forked process that serves the
same application and site as `kvconductor run` (`make_app` behind
`QuerySite`, no access log, on uvloop like the daemon) on a loopback socket;
a second process, forked before the index is built, drives it, so server
and client compete for the same two cores the way a co-located router
would.

The client is what a router's connection pool does at its cheapest: one
keep-alive HTTP/1.1 connection per concurrent client (`kvconductor.tools.bench.raw_http`).
Both processes' CPU time per query is reported, so the split is visible,
and every answer is checked byte for byte against the in-process answer to
the same query.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

import msgspec

from kvconductor.tools.bench import raw_http
from kvconductor.tools.bench.measure import forked, percentile, process_cpu_s
from kvconductor.tools.bench.peers import KvconductorPeer
from kvconductor.tools.bench.workload import Workload
from kvconductor.wire.query import TokenQuery

CLIENTS = 8
WARM_UP = 32  # requests before the clock starts: connection, caches, first-call paths

T = TypeVar("T")


def http_figure(w: Workload, requests: int, log: Callable[[str], None]) -> dict[str, Any]:
    cfg = w.config
    bodies = [
        msgspec.json.encode(
            {"model": cfg.model, "block_size": cfg.block_size, "token_ids": q.tolist()}
        )
        for q in w.queries[: max(1, min(len(w.queries), 256))]
    ]

    def server() -> dict[str, Any]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        server_pid = os.getpid()
        answers_r, answers_w = os.pipe()
        result_r, result_w = os.pipe()
        # The client is forked before the index is built: a router does not
        # share the daemon's pages, and a client forked after the build
        # would make the server copy every page it then writes (measured:
        # twice the page faults while serving).
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the client process
            os.close(answers_w)
            os.close(result_r)
            sock.close()
            try:
                with os.fdopen(answers_r, "rb") as f:
                    expected = msgspec.msgpack.decode(f.read(), type=list[bytes])
                out = msgspec.json.encode(
                    _on_fast_loop(_drive(port, server_pid, bodies, expected, requests))[0]
                )
            except BaseException as exc:
                out = msgspec.json.encode({"error": repr(exc)})
            with os.fdopen(result_w, "wb") as f:
                f.write(out)
            os._exit(0)
        os.close(answers_r)
        os.close(result_w)
        peer = KvconductorPeer(cfg.model, cfg.block_size)
        peer.apply(peer.prepare(peer.items(w)))
        expected = [
            msgspec.json.encode(peer.conductor.query(msgspec.json.decode(b, type=TokenQuery)))
            for b in bodies
        ]
        with os.fdopen(answers_w, "wb") as f:
            f.write(msgspec.msgpack.encode(expected))
        _, loop_name = _on_fast_loop(_serve(sock, peer, pid))
        with os.fdopen(result_r, "rb") as f:
            result: dict[str, Any] = msgspec.json.decode(f.read())
        result["entries"] = peer.entries()
        result["loop"] = loop_name
        return result

    log(f"figure 2 (HTTP): {requests:,} requests, one client then {CLIENTS}")
    out = forked(server)
    if "error" in out:
        return {"measured": False, "reason": f"client failed: {out['error']}"}
    out["measured"] = True
    return out


def _on_fast_loop(main: Coroutine[Any, Any, T]) -> tuple[T, str]:
    """Run `main` on uvloop when installed, as `kvconductor run` does."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(main), "asyncio"
    return uvloop.run(main), "uvloop"


async def _serve(sock: socket.socket, peer: KvconductorPeer, client: int) -> None:
    from aiohttp import web

    from kvconductor.http.api import make_app
    from kvconductor.http.front import QuerySite
    from kvconductor.obs.metrics import Metrics

    app = make_app(
        peer.conductor,
        Metrics(peer.conductor),
        ready=lambda: (True, "ready"),
        max_body_bytes=16 * 1024 * 1024,
        auth_token=None,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await QuerySite(runner, sock=sock).start()
    try:
        while os.waitpid(client, os.WNOHANG) == (0, 0):
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()


async def _drive(
    port: int, server_pid: int, bodies: list[bytes], expected: list[bytes], requests: int
) -> dict[str, Any]:
    posts = [raw_http.post(port, "/query", b) for b in bodies]
    connections = [await raw_http.connect(port) for _ in range(CLIENTS)]

    async def one(conn: raw_http.RawConnection, i: int) -> float:
        k = i % len(posts)
        started = time.perf_counter()
        status, body = await conn.exchange(posts[k])
        took = time.perf_counter() - started
        if status != 200:
            raise RuntimeError(f"/query answered {status}: {body[:200]!r}")
        if body != expected[k]:
            raise RuntimeError(f"/query answer {k} differs from the in-process one: {body!r}")
        return took

    for i in range(WARM_UP):
        await one(connections[i % CLIENTS], i)

    async def phase(clients: int, total: int) -> tuple[list[float], dict[str, float]]:
        latencies: list[float] = []
        next_request: Iterator[int] = iter(range(total))

        async def client(conn: raw_http.RawConnection) -> None:
            for i in next_request:
                latencies.append(await one(conn, i))

        before = process_cpu_s(server_pid), process_cpu_s(os.getpid())
        started = time.perf_counter()
        await asyncio.gather(*(client(c) for c in connections[:clients]))
        elapsed = time.perf_counter() - started
        after = process_cpu_s(server_pid), process_cpu_s(os.getpid())
        n = len(latencies)
        stats = {"qps": n / elapsed}
        for who, b, a in zip(("server", "client"), before, after, strict=True):
            stats[f"{who}_user_us"] = (a[0] - b[0]) / n * 1e6
            stats[f"{who}_system_us"] = (a[1] - b[1]) / n * 1e6
        return latencies, stats

    single, single_stats = await phase(1, requests)
    many, many_stats = await phase(CLIENTS, 2 * requests)
    for conn in connections:
        conn.close()

    def us(values: list[float], q: float) -> float:
        return percentile(sorted(values), q) * 1e6

    return {
        "requests": requests,
        "one_client": {"p50_us": us(single, 50), "p99_us": us(single, 99)},
        "clients": CLIENTS,
        "concurrent": {"qps": many_stats["qps"], "p50_us": us(many, 50), "p99_us": us(many, 99)},
        # Sibling keys, so that the two phases' dicts keep the report's shape.
        "p99_9_us": {"one_client": us(single, 99.9), "concurrent": us(many, 99.9)},
        "one_client_qps": single_stats["qps"],
        "cpu_us_per_query": {
            "one_client": {k: v for k, v in single_stats.items() if k != "qps"},
            "concurrent": {k: v for k, v in many_stats.items() if k != "qps"},
        },
        "cores": os.cpu_count(),
        "answers_checked": WARM_UP + len(single) + len(many),
    }
