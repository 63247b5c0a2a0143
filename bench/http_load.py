"""The HTTP figure: POST /query on the daemon's real app, one client then eight.

The index is built from the workload in a forked process that serves the
same aiohttp application as `kvconductor run` (`make_app`) on a loopback
socket; a second process drives it with aiohttp clients, so server and
client compete for the same two cores the way a co-located router would.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import msgspec

from bench.measure import forked, percentile
from bench.peers import KvconductorPeer
from bench.workload import Workload

CLIENTS = 8


def http_figure(w: Workload, requests: int, log: Callable[[str], None]) -> dict[str, Any]:
    cfg = w.config
    bodies = [
        msgspec.json.encode(
            {"model": cfg.model, "block_size": cfg.block_size, "token_ids": q.tolist()}
        )
        for q in w.queries[: max(1, min(len(w.queries), 256))]
    ]

    def server() -> dict[str, Any]:
        peer = KvconductorPeer(cfg.model, cfg.block_size)
        peer.apply(peer.items(w))
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)
        port = sock.getsockname()[1]
        read_fd, write_fd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - the client process
            os.close(read_fd)
            sock.close()
            try:
                out = msgspec.json.encode(asyncio.run(_drive(port, bodies, requests)))
            except BaseException as exc:
                out = msgspec.json.encode({"error": repr(exc)})
            with os.fdopen(write_fd, "wb") as f:
                f.write(out)
            os._exit(0)
        os.close(write_fd)
        asyncio.run(_serve(sock, peer, pid))
        with os.fdopen(read_fd, "rb") as f:
            result: dict[str, Any] = msgspec.json.decode(f.read())
        result["entries"] = peer.entries()
        return result

    log(f"figure 2 (HTTP): {requests:,} requests, one client then {CLIENTS}")
    out = forked(server)
    if "error" in out:
        return {"measured": False, "reason": f"client failed: {out['error']}"}
    out["measured"] = True
    return out


async def _serve(sock: socket.socket, peer: KvconductorPeer, client: int) -> None:
    from aiohttp import web

    from kvconductor.http_api import make_app
    from kvconductor.metrics import Metrics

    app = make_app(
        peer.conductor,
        Metrics(peer.conductor),
        ready=lambda: (True, "ready"),
        max_body_bytes=16 * 1024 * 1024,
        auth_token=None,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.SockSite(runner, sock).start()
    try:
        while os.waitpid(client, os.WNOHANG) == (0, 0):
            await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()


async def _drive(port: int, bodies: list[bytes], requests: int) -> dict[str, Any]:
    import aiohttp

    url = f"http://127.0.0.1:{port}/query"
    connector = aiohttp.TCPConnector(limit=CLIENTS)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(body: bytes) -> float:
            started = time.perf_counter()
            async with session.post(url, data=body) as resp:
                await resp.read()
                if resp.status != 200:
                    raise RuntimeError(f"/query answered {resp.status}")
            return time.perf_counter() - started

        for body in bodies[:32]:  # warm-up: connections, caches
            await one(body)
        single = [await one(bodies[i % len(bodies)]) for i in range(requests)]

        latencies: list[float] = []
        next_request = iter(range(requests * 2))

        async def client() -> None:
            for i in next_request:
                latencies.append(await one(bodies[i % len(bodies)]))

        started = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(CLIENTS)))
        elapsed = time.perf_counter() - started

    def us(values: list[float], q: float) -> float:
        return percentile(sorted(values), q) * 1e6

    return {
        "requests": requests,
        "one_client": {"p50_us": us(single, 50), "p99_us": us(single, 99)},
        "clients": CLIENTS,
        "concurrent": {
            "qps": len(latencies) / elapsed,
            "p50_us": us(latencies, 50),
            "p99_us": us(latencies, 99),
        },
    }
