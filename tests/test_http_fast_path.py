"""The query path's shortcuts keep every rule, and the HTTP benchmark measures
what it claims (issue #5, figure 2 over HTTP).

- A body that is already whole when the handler runs is taken without a
  timer; it must still get 413 over the limit (chunked framing has no
  declared size) and answer exactly like a body that trickles in.
- Request counts per (endpoint, status) are kept in cached metric children;
  they must land in the right series.
- The benchmarks' client (`bench/raw_http.py`) reads answers by Content-Length across any
  split of the bytes, fails loudly when the server hangs up, and the figure
  refuses to report when an answer differs from the in-process one.

No timing is asserted: the numbers belong to `kvconductor bench`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest

from kvconductor.http.api import API_KEY, QueryApi
from kvconductor.tools.api_client import metric_sum, parse_metrics
from kvconductor.tools.bench.http_load import WARM_UP, http_figure
from kvconductor.tools.bench.raw_http import connect
from kvconductor.tools.bench.workload import generate
from tests.test_bench_smoke import _tiny_config
from tests.test_http_abuse import connection, encode, read_answer, request_head, serving
from tests.test_http_api import FULL_ANSWER, TOKEN, query

BODY = encode(query())
SIDES = ("server", "client")


def chunked(body: bytes, piece: int) -> bytes:
    parts = [body[i : i + piece] for i in range(0, len(body), piece)]
    return b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"


async def whole(port: int, framing: dict[str, str], payload: bytes) -> Any:
    """Head and body in one write: the body is whole when the handler runs."""
    async with connection(port) as (reader, writer):
        writer.write(request_head("/query", framing) + payload)
        return await read_answer(reader)


async def trickled(port: int, framing: dict[str, str], payload: bytes) -> Any:
    """The head, then the body in three parts with pauses: the handler waits."""
    async with connection(port) as (reader, writer):
        writer.write(request_head("/query", framing))
        await writer.drain()
        third = len(payload) // 3 + 1
        for start in range(0, len(payload), third):
            await asyncio.sleep(0.05)
            writer.write(payload[start : start + third])
            await writer.drain()
        return await read_answer(reader)


SENDERS = [whole, trickled]


@pytest.mark.parametrize("send", SENDERS, ids=lambda f: f.__name__)
async def test_body_framings_answer_alike(send: Callable[..., Awaitable[Any]]) -> None:
    async with serving() as (port, app):
        by_length = await send(port, {"Content-Length": str(len(BODY))}, BODY)
        by_chunks = await send(port, {"Transfer-Encoding": "chunked"}, chunked(BODY, 100))
        assert app[API_KEY].buffered == 0
    for answer in (by_length, by_chunks):
        assert answer.status == 200, answer
        assert answer.json() == FULL_ANSWER


@pytest.mark.parametrize("send", SENDERS, ids=lambda f: f.__name__)
async def test_chunked_body_over_the_limit_is_413(send: Callable[..., Awaitable[Any]]) -> None:
    limit = len(BODY) - 1
    async with serving(max_body_bytes=limit) as (port, app):
        answer = await send(port, {"Transfer-Encoding": "chunked"}, chunked(BODY, 64))
        assert app[API_KEY].buffered == 0
    assert answer.status == 413, answer
    assert answer.json() == {"error": f"request body too large (limit {limit} bytes)"}
    assert answer.headers.get("connection") == "close"


async def test_requests_counted_in_their_own_series() -> None:
    """Interleaved endpoints and statuses, each counted where it belongs."""
    async with serving(auth_token=TOKEN) as (port, _), aiohttp.ClientSession() as session:
        base = f"http://127.0.0.1:{port}"
        auth = {"Authorization": f"Bearer {TOKEN}"}
        plan = [
            ("POST", "/query", BODY, auth, 200),
            ("POST", "/query", b"{", auth, 400),
            ("POST", "/query", BODY, {}, 401),
            ("POST", "/query_by_hash", encode({"model": "m", "block_size": 4}), auth, 400),
            ("POST", "/query", BODY, auth, 200),
            ("GET", "/nowhere", b"", {}, 404),
            ("GET", "/query", b"", auth, 405),
            ("POST", "/query", b"{", auth, 400),
            ("POST", "/query", BODY, auth, 200),
        ]
        for method, path, body, headers, status in plan:
            async with session.request(method, base + path, data=body, headers=headers) as r:
                assert r.status == status, (path, await r.text())
        async with session.get(base + "/metrics") as r:
            families = parse_metrics(await r.text())
    expected = {
        ("query", "200"): 3,
        ("query", "400"): 2,
        ("query", "401"): 1,
        ("query_by_hash", "400"): 1,
        ("other", "404"): 1,  # no route matched: no endpoint
        ("other", "405"): 1,
    }
    for (endpoint, code), n in expected.items():
        assert (
            metric_sum(families, "kvconductor_http_requests_total", endpoint=endpoint, code=code)
            == n
        ), (endpoint, code)
    everything = metric_sum(families, "kvconductor_http_requests_total")
    assert everything == sum(expected.values())


# ------------------------------------------------------- the bench client


async def test_client_reads_answers_split_anywhere() -> None:
    """Two answers on one connection, each written in pieces (head cut in
    the middle, body cut in three), one of them not 200."""
    bodies = [b'{"a":1}', b'{"error":"no"}']
    answers = [
        b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 7\r\n\r\n"
        + bodies[0],
        b"HTTP/1.1 400 Bad Request\r\ncontent-length:14\r\n\r\n" + bodies[1],
    ]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for answer in answers:
            await reader.readuntil(b"\r\n\r\n")
            for start in range(0, len(answer), 9):
                writer.write(answer[start : start + 9])
                await writer.drain()
                await asyncio.sleep(0.01)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await connect(port)
        request = request_head("/query", {"Content-Length": "0"})
        assert await conn.exchange(request) == (200, bodies[0])
        assert await conn.exchange(request) == (400, bodies[1])
        conn.close()
    finally:
        server.close()
        await server.wait_closed()


async def test_client_fails_when_the_server_hangs_up() -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        conn = await connect(port)
        with pytest.raises(ConnectionError):
            await asyncio.wait_for(conn.exchange(request_head("/query", {})), 60)
    finally:
        server.close()
        await server.wait_closed()


# ------------------------------------------------------------ the figure


def _tiny_workload() -> Any:
    return generate(_tiny_config())


def test_figure_checks_every_answer_and_splits_the_cpu() -> None:
    out = http_figure(_tiny_workload(), 30, log=lambda _line: None)
    assert out["measured"] is True, out
    assert out["loop"] == "uvloop"
    assert out["answers_checked"] == WARM_UP + 3 * 30
    assert out["entries"] > 0
    assert set(out["p99_9_us"]) == {"one_client", "concurrent"}
    for phase in ("one_client", "concurrent"):
        cpu = out["cpu_us_per_query"][phase]
        assert set(cpu) == {f"{who}_{kind}_us" for who in SIDES for kind in ("user", "system")}
        assert all(v >= 0 for v in cpu.values())
        assert out["p99_9_us"][phase] >= out[phase]["p99_us"] >= out[phase]["p50_us"] > 0
    assert out["concurrent"]["qps"] > 0 and out["one_client_qps"] > 0


def test_figure_refuses_a_wrong_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """A server that answers differently from the index is not measured."""

    def wrong(self: QueryApi, body: bytes) -> bytes:
        return b'{"default":{}}'

    # Both the front and aiohttp's handler answer through it; the server is
    # forked after this.
    monkeypatch.setattr(QueryApi, "token_answer", wrong)
    out = http_figure(_tiny_workload(), 5, log=lambda _line: None)
    assert out["measured"] is False
    assert "differs from the in-process one" in out["reason"], out
