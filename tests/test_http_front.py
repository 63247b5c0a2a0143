"""The query front (`kvconductor/http/front.py`) answers exactly as aiohttp.

Over real TCP: any stream of requests, split anywhere, gets the same answers
(status, headers but Date, body) from `QuerySite` as from aiohttp's own
site; plain queries are answered without aiohttp, everything else is handed
over with the connection; the timers, the 499 count, the bearer token, flow
control for a client that does not read, and shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import socket

import pytest

from kvconductor.http.front import MAX_HEAD_BYTES, MAX_HEADERS
from tests.harness import wait_for
from tests.test_http_abuse import closed_by_server, connection, read_answer, served
from tests.test_http_api import FULL_ANSWER, HASHES, TOKEN, query


def post(path: str, body: bytes, *headers: str) -> bytes:
    head = [f"POST {path} HTTP/1.1", "Host: kvconductor", f"Content-Length: {len(body)}"]
    return ("\r\n".join([*head, *headers]) + "\r\n\r\n").encode() + body


def get(path: str, *headers: str) -> bytes:
    return (
        "\r\n".join([f"GET {path} HTTP/1.1", "Host: kvconductor", *headers]) + "\r\n\r\n"
    ).encode()


def chunked(path: str, body: bytes) -> bytes:
    head = f"POST {path} HTTP/1.1\r\nHost: kvconductor\r\nTransfer-Encoding: chunked\r\n\r\n"
    return head.encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)


QUERY = json.dumps(query()).encode()
BY_HASH = json.dumps({"model": "m", "block_size": 4, "seq_hashes": HASHES}).encode()
# What routers send: the front answers these itself.
PLAIN = [
    post("/query", QUERY),
    post("/query", json.dumps(query(instance_id="vllm-1")).encode()),
    post("/query", json.dumps(query(model="other")).encode()),
    post("/query_by_hash", BY_HASH),
    post("/query", QUERY, "Content-Type: application/json", "X-Trace: abc"),
]
# And every other kind of request a router or a stranger may send.
REQUESTS = [
    *PLAIN,
    post("/query", b'{"model": "m", "block_size": 4, "token_ids": ["x"]}'),
    post("/query", b'{"model": '),
    post("/query", b""),
    post("/query?debug=1", QUERY),
    post("/nowhere", QUERY),
    post("/query", QUERY, "Connection: keep-alive"),
    chunked("/query", QUERY),
    get("/health"),
    get("/query"),
]
LAST = get("/health", "Connection: close")
# Requests after which aiohttp closes the connection: each ends a stream
# (the server's close would reset a connection still sending).
CLOSING = [
    LAST,
    post("/query", QUERY, "Proxy-Connection: close"),
    post("/query", QUERY, "Host: again"),
    post("/query", QUERY, "Content-Type: application/json", "Content-Type: text/plain"),
    post("/query", QUERY, "Sec-WebSocket-Key1: 1"),
    post("/query", QUERY).replace(b"Host: kvconductor\r\n", b""),
    post("/query", QUERY).replace(b"\r\n", b"\n"),
    post("/query", QUERY, *(f"X-{i}: {i}" for i in range(MAX_HEADERS))),
]


def answers(raw: bytes) -> list[tuple[bytes, list[bytes], bytes]]:
    """Status line, headers but Date, and body of each answer in `raw`."""
    out = []
    at = 0
    while at < len(raw):
        end = raw.index(b"\r\n\r\n", at)
        status, *lines = raw[at:end].split(b"\r\n")
        fields = dict(x.partition(b": ")[::2] for x in lines)
        at = end + 4 + int(fields[b"Content-Length"])
        if status.startswith(b"HTTP/1.0 400"):
            # aiohttp's parser refused the head: its text quotes the bytes
            # of the segment at hand, which depend on how TCP cut them.
            out.append((status, [], b""))
            continue
        out.append((status, [x for x in lines if not x.startswith(b"Date: ")], raw[end + 4 : at]))
    return out


async def exchange(port: int, stream: bytes, cuts: list[int]) -> bytes:
    """Send `stream` in pieces cut at `cuts`, then read until the server closes."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for start, end in zip([0, *cuts], [*cuts, len(stream)], strict=True):
            writer.write(stream[start:end])
            await writer.drain()
            await asyncio.sleep(0.002)  # the server reads each piece on its own
        return await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()


@pytest.mark.parametrize("seed", range(30))
async def test_any_stream_split_anywhere_is_answered_as_aiohttp_answers_it(seed: int) -> None:
    await compare_stream(seed)


def test_the_same_on_uvloop_which_the_daemon_runs() -> None:
    uvloop = pytest.importorskip("uvloop")
    for seed in range(30, 40):
        uvloop.run(compare_stream(seed))


async def compare_stream(seed: int) -> None:
    rnd = random.Random(seed)
    picked = [rnd.choice(PLAIN) for _ in range(rnd.randint(0, 6))]
    picked += [rnd.choice(REQUESTS) for _ in range(rnd.randint(1, 6))]
    last = rnd.choice(CLOSING)
    stream = b"".join([*picked, last])
    # Cut anywhere before the last request, which goes whole and on its own
    # (aiohttp drops good requests read in one segment with a refused head).
    cuts = sorted({*rnd.sample(range(1, len(stream) - len(last)), rnd.randint(0, 20))})
    cuts.append(len(stream) - len(last))
    async with served(front=False) as plain:
        expected = answers(await exchange(plain.port, stream, cuts))
    async with served() as front:
        got = answers(await exchange(front.port, stream, cuts))
    assert len(expected) == len(picked) + 1
    assert got == expected


async def test_plain_queries_never_reach_aiohttp_and_are_counted() -> None:
    async with served() as s, connection(s.port) as (reader, writer):
        for _ in range(3):
            writer.write(post("/query", QUERY))
            answer = await read_answer(reader)
            assert answer.status == 200 and answer.json() == FULL_ANSWER
            assert answer.headers["content-type"] == "application/json"
        assert s.aiohttp_connections() == 0
        assert s.count("kvconductor_http_requests_total", endpoint="query", code="200") == 3
        assert s.count("kvconductor_query_latency_seconds_count", endpoint="query") == 3
        # A request of another kind: the connection is aiohttp's from then on.
        writer.write(get("/health") + post("/query", QUERY))
        assert (await read_answer(reader)).json() == {"status": "ok"}
        assert (await read_answer(reader)).json() == FULL_ANSWER
        assert s.aiohttp_connections() == 1
        assert s.count("kvconductor_http_requests_total", endpoint="query", code="200") == 4


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ((f"Authorization: Bearer {TOKEN}",), 200),
        ((f"authorization: bearer   {TOKEN} ",), 200),
        ((), 401),
        (("Authorization: Bearer wrong",), 401),
        # aiohttp reads the first of two: the front leaves the choice to it.
        (("Authorization: Bearer wrong", f"Authorization: Bearer {TOKEN}"), 401),
        ((f"Authorization: Bearer {TOKEN}", "Authorization: Bearer wrong"), 200),
    ],
)
async def test_bearer_token_as_aiohttp_checks_it(headers: tuple[str, ...], status: int) -> None:
    async with served(auth_token=TOKEN) as s, connection(s.port) as (reader, writer):
        writer.write(post("/query", QUERY, *headers))
        answer = await read_answer(reader)
        assert answer.status == status
        if status == 200:
            assert answer.json() == FULL_ANSWER


async def test_head_and_body_deadlines() -> None:
    async with served(client_timeout_s=0.3, idle_timeout_s=0.3) as s:
        # No head: closed. Queries that keep coming keep the connection.
        async with connection(s.port) as (reader, _):
            assert await closed_by_server(reader, 3)
        async with connection(s.port) as (reader, writer):
            for _ in range(6):
                await asyncio.sleep(0.1)
                writer.write(post("/query", QUERY))
                assert (await read_answer(reader)).status == 200
            assert await closed_by_server(reader, 3)
        # A body that stops coming: 408, as aiohttp words it, and closed.
        async with connection(s.port) as (reader, writer):
            writer.write(post("/query", QUERY)[:-5])
            answer = await read_answer(reader)
            assert answer.status == 408
            assert answer.json() == {"error": "request body not received within 0.3 s"}
            assert answer.headers["connection"] == "close"
            assert await closed_by_server(reader, 3)
        assert s.count("kvconductor_http_requests_total", endpoint="query", code="408") == 1


async def test_hanging_up_mid_body_counts_499() -> None:
    async with served() as s:
        for _ in range(2):
            async with connection(s.port) as (_, writer):
                writer.write(post("/query", QUERY)[:-5])
                await writer.drain()
                await asyncio.sleep(0.05)
        await wait_for(
            lambda: s.count("kvconductor_http_requests_total", endpoint="query", code="499") == 2,
            5,
            "two answers 499",
        )


async def test_a_client_that_does_not_read_stops_the_reading_not_the_memory() -> None:
    n = 30_000
    # Not reading answers for longer than the timeout is not idling.
    async with served(
        client_timeout_s=0.3, idle_timeout_s=0.3, max_requests_per_connection=n + 1
    ) as s:
        sock = socket.socket()
        # A small receive window, so that the answers back up into the server.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", s.port))
        reader, writer = await asyncio.open_connection(sock=sock)
        writer.write(post("/query", QUERY) * n + LAST)
        await asyncio.sleep(1.5)  # the server fills its send buffer and pauses
        got = answers(await asyncio.wait_for(reader.read(-1), 30))
        writer.close()
    assert len(got) == n + 1
    assert all(json.loads(body) == FULL_ANSWER for _, _, body in got[:n])
    assert json.loads(got[-1][2]) == {"status": "ok"}


async def test_cleanup_closes_idle_front_connections() -> None:
    async with contextlib.AsyncExitStack() as stack:
        s = await stack.enter_async_context(served())
        reader, writer = await stack.enter_async_context(connection(s.port))
        writer.write(post("/query", QUERY))
        assert (await read_answer(reader)).status == 200
        await s.runner.cleanup()
        assert await closed_by_server(reader, 3)


async def test_a_head_longer_than_the_front_reads_is_aiohttps() -> None:
    # aiohttp limits a line, not the head: this one it answers.
    request = post("/query", QUERY, "X-Long: " + "x" * MAX_HEAD_BYTES)
    async with served() as s, connection(s.port) as (reader, writer):
        writer.write(request + request)
        for _ in range(2):
            assert (await read_answer(reader)).json() == FULL_ANSWER
        assert s.aiohttp_connections() == 1


@pytest.mark.parametrize(
    "garbage",
    [
        b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03",
        b"HELLO\r\n",
        b"POST /query HTTP/1.1\nHost: x\n",
    ],
)
async def test_what_llhttp_refuses_is_refused_at_once_as_aiohttp_does(garbage: bytes) -> None:
    got = []
    for front in (False, True):
        async with served(front=front, client_timeout_s=30) as s, connection(s.port) as (r, w):
            w.write(garbage)
            got.append(await asyncio.wait_for(r.read(-1), 5))  # not the 30 s timeout
    assert got[0].startswith(b"HTTP/1.0 400 Bad Request")
    assert answers(got[1]) == answers(got[0])
