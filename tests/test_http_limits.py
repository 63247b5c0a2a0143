"""The HTTP front's connection limits (`[http] max_connections`,
`max_requests_per_connection`, `idle_timeout_s`), on both paths: plain
queries the query front answers, and connections handed to aiohttp.

Loopback only; every flood is a bounded number of connections, and every
wait has a deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvconductor.tools.api_client import metric_sum, parse_metrics
from kvconductor.tools.kafka_local.broker import free_ports
from tests.harness import daemon_config
from tests.test_http_abuse import (
    MIB,
    Answer,
    closed_by_server,
    connection,
    read_answer,
    send_declared,
    served,
    server_process,
)
from tests.test_http_api import FULL_ANSWER
from tests.test_http_front import QUERY, get, post

FLOOD = 150  # connections past the limit, in waves under the listen backlog
WAVE = 50
LIMIT = 20


async def exchange(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes
) -> Answer:
    writer.write(request)
    return await asyncio.wait_for(read_answer(reader), 5)


async def flood_one(port: int, held: list[asyncio.StreamWriter]) -> str:
    """One connection that sends a query: "answered" (kept open, in `held`),
    or "closed" when the server closed it without an answer."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 10)
    try:
        answer = await exchange(reader, writer, post("/query", QUERY))
    except (OSError, asyncio.IncompleteReadError):
        writer.transport.abort()
        return "closed"
    assert answer.status == 200
    held.append(writer)
    return "answered"


@contextlib.asynccontextmanager
async def flood(port: int) -> AsyncIterator[list[str]]:
    """`FLOOD` connections, each sending a query; yields what became of each
    while those the server kept stay open; closes them after."""
    held: list[asyncio.StreamWriter] = []
    outcomes: list[str] = []
    try:
        for _ in range(FLOOD // WAVE):
            outcomes += await asyncio.gather(*(flood_one(port, held) for _ in range(WAVE)))
        yield outcomes
    finally:
        for writer in held:
            writer.transport.abort()


async def test_a_connection_flood_past_the_limit_is_closed_and_the_daemon_keeps_answering(
    tmp_path: Path,
) -> None:
    """`kvconductor run` with `KVCONDUCTOR_HTTP_MAX_CONNECTIONS` (no broker
    needed: the HTTP API answers while Kafka is retried, `{}` to a query)."""
    port, nothing_there = free_ports(2)
    cfg = daemon_config(
        f"127.0.0.1:{nothing_there}",
        KVCONDUCTOR_HTTP_PORT=str(port),
        KVCONDUCTOR_HTTP_MAX_CONNECTIONS=str(LIMIT),
    )
    async with (
        server_process(["run"], cfg, tmp_path / "daemon.log"),
        connection(port) as (reader, writer),
    ):
        # A router's connection, open before the flood.
        assert (await exchange(reader, writer, post("/query", QUERY))).status == 200
        started = time.monotonic()
        async with flood(port) as outcomes:
            flooded_s = time.monotonic() - started
            answered = outcomes.count("answered")
            # The router's connection and at most LIMIT - 1 others; the rest
            # closed on arrival, without an answer.
            assert 1 <= answered <= LIMIT - 1, outcomes
            assert outcomes.count("closed") == FLOOD - answered
            # The router's connection is answered all the while, promptly.
            for _ in range(20):
                t = time.monotonic()
                answer = await exchange(reader, writer, post("/query", QUERY))
                assert answer.status == 200 and answer.json() == {}
                assert time.monotonic() - t < 1.0
            metrics = await exchange(reader, writer, get("/metrics"))
            refused = metric_sum(
                parse_metrics(metrics.body.decode()), "kvconductor_http_connections_refused_total"
            )
            assert refused >= FLOOD - answered
        # Once the flood's connections are gone, new ones are served again.
        async with connection(port) as (r2, w2):
            for _ in range(50):
                with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                    if (await exchange(r2, w2, post("/query", QUERY))).status == 200:
                        break
                await asyncio.sleep(0.1)
                r2, w2 = await asyncio.open_connection("127.0.0.1", port)
            else:
                raise AssertionError("no new connection served after the flood")
        assert (await exchange(reader, writer, post("/query", QUERY))).status == 200
    assert flooded_s < 30, flooded_s
    print(f"\nflood: {FLOOD} connections in {flooded_s:.2f} s, {answered} served, rest closed")


async def test_the_limit_counts_the_connections_handed_to_aiohttp() -> None:
    async with served(max_connections=3) as s:
        held = []
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            held.append(writer)
            # Handed over: aiohttp serves it from now on.
            assert (await exchange(reader, writer, get("/health"))).status == 200
        try:
            async with connection(s.port) as (reader, writer):
                writer.write(post("/query", QUERY))
                assert await closed_by_server(reader, 3)
                assert reader.at_eof()
            assert s.count("kvconductor_http_connections_refused_total") == 1
        finally:
            for writer in held:
                writer.transport.abort()
        async with connection(s.port) as (reader, writer):
            for _ in range(50):  # the server sees the three go
                with contextlib.suppress(OSError, asyncio.IncompleteReadError):
                    answer = await exchange(reader, writer, post("/query", QUERY))
                    assert answer.json() == FULL_ANSWER
                    break
                await asyncio.sleep(0.05)
                reader, writer = await asyncio.open_connection("127.0.0.1", s.port)
            else:
                raise AssertionError("not served after the others closed")


async def test_connections_handed_to_aiohttp_and_gone_do_not_count() -> None:
    """aiohttp keeps a lost connection's handler until its request task
    ends, up to its keep-alive timeout: clients that went away after an
    answer aiohttp wrote must not fill the limit."""
    async with served(max_connections=3) as s:
        for _ in range(10):
            # A body past max_body_bytes, declared and not sent: aiohttp
            # answers 413 and its handler waits on after the client left.
            assert (await send_declared(s.port, 20 * MIB)).status == 413
        await asyncio.sleep(0.2)
        async with connection(s.port) as (reader, writer):
            assert (await exchange(reader, writer, post("/query", QUERY))).json() == FULL_ANSWER
        assert s.count("kvconductor_http_connections_refused_total") == 0


async def test_the_last_request_of_a_connection_is_answered_with_connection_close() -> None:
    async with served(max_requests_per_connection=3) as s:
        # Plain queries: the query front's answers.
        async with connection(s.port) as (reader, writer):
            for i in range(3):
                answer = await exchange(reader, writer, post("/query", QUERY))
                assert answer.status == 200 and answer.json() == FULL_ANSWER
                assert (answer.headers.get("connection") == "close") == (i == 2)
            assert await closed_by_server(reader, 3)
        # Pipelined: the third answer closes; the fourth request is not answered.
        async with connection(s.port) as (reader, writer):
            writer.write(post("/query", QUERY) * 4)
            got = [await asyncio.wait_for(read_answer(reader), 5) for _ in range(3)]
            assert [a.headers.get("connection") for a in got] == [None, None, "close"]
            assert await reader.read() == b""
        # aiohttp's answers.
        async with connection(s.port) as (reader, writer):
            for i in range(3):
                answer = await exchange(reader, writer, get("/health"))
                assert answer.status == 200
                assert (answer.headers.get("connection") == "close") == (i == 2)
            assert await closed_by_server(reader, 3)
        # Both: the count carries over when the front hands the connection over.
        async with connection(s.port) as (reader, writer):
            for path in ("/query", "/query"):
                answer = await exchange(reader, writer, post(path, QUERY))
                assert "connection" not in answer.headers
            answer = await exchange(reader, writer, get("/health"))
            assert answer.status == 200 and answer.headers["connection"] == "close"
            assert await closed_by_server(reader, 3)
        # Errors count as answers too (aiohttp's 404 here).
        async with connection(s.port) as (reader, writer):
            for i in range(3):
                answer = await exchange(reader, writer, get("/nowhere"))
                assert answer.status == 404
                assert (answer.headers.get("connection") == "close") == (i == 2)
            assert await closed_by_server(reader, 3)


async def test_idle_connections_are_closed_after_the_idle_timeout() -> None:
    async with served(idle_timeout_s=0.3, client_timeout_s=30) as s:
        # Never a request; after the front's answer; after aiohttp's.
        for first in (None, post("/query", QUERY), get("/health")):
            async with connection(s.port) as (reader, writer):
                if first is not None:
                    assert (await exchange(reader, writer, first)).status == 200
                started = time.monotonic()
                assert await closed_by_server(reader, 3)
                assert 0.25 <= time.monotonic() - started < 2.0
        # Requests that keep coming within it keep the connection.
        async with connection(s.port) as (reader, writer):
            for _ in range(5):
                await asyncio.sleep(0.15)
                assert (await exchange(reader, writer, post("/query", QUERY))).status == 200
            for _ in range(3):
                await asyncio.sleep(0.15)
                assert (await exchange(reader, writer, get("/health"))).status == 200


async def test_the_benchmarks_client_reconnects_after_connection_close() -> None:
    """kvconductor.tools.bench.raw_http keeps querying a daemon across its
    `max_requests_per_connection` closes."""
    from kvconductor.tools.bench import raw_http

    async with served(max_requests_per_connection=2) as s:
        conn = await raw_http.connect(s.port)
        try:
            for _ in range(7):
                status, body = await asyncio.wait_for(
                    conn.exchange(raw_http.post(s.port, "/query", QUERY)), 5
                )
                assert status == 200 and body
        finally:
            conn.close()


def test_a_limit_past_the_open_file_limit_is_warned_of(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    import structlog

    from kvconductor.http import serve

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    with structlog.testing.capture_logs() as logs:
        serve._check_open_files(512)
        assert logs == []
        serve._check_open_files(1000)
    (line,) = logs
    assert line["log_level"] == "warning"
    assert line["max_connections"] == 1000 and line["open_file_limit"] == 1024
