"""The HTTP API under abuse, and its bearer-token authentication (issue #7).

Over real TCP (raw sockets where a well-behaved client library would not
misbehave enough): oversize bodies (declared, chunked, compressed, behind
`Expect: 100-continue`), malformed JSON, a million token ids, slow clients
(headers or body dribbled, idle connections), the shared budget of buffered
bodies; the config rules that make a non-loopback listener need a token; and,
on the real broker, a daemon process under all of it at once with 16 honest
query clients while events flow, checking that answers stay exact, the
consumer catches up and memory stays bounded. Figures go to stdout
(`pytest -s`): requests per category, answers seen, RSS, lag.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import gzip
import json
import logging
import os
import random
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest
from aiohttp import web
from aiokafka import AIOKafkaProducer

from kvconductor.config import Config, ConfigError, Secret, config_keys, load_config
from kvconductor.http.api import API_KEY, make_app
from kvconductor.http.front import QuerySite
from kvconductor.obs.metrics import Metrics
from kvconductor.tools.api_client import Api, metric_sum, parse_metrics
from kvconductor.tools.kafka_local.broker import free_ports
from kvconductor.tools.termui import ToolError
from tests.harness import daemon_config, engine_headers, removed, stored, vllm_payload, wait_for
from tests.test_http_api import FULL_ANSWER, TOKEN, TOKENS, fed_conductor, query

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MIB = 1 << 20


# ------------------------------------------------------------ raw HTTP


class Answer(msgspec.Struct):
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes
    interim: list[int]  # 1xx statuses seen before the final one

    def json(self) -> Any:
        return json.loads(self.body)


async def read_answer(reader: asyncio.StreamReader) -> Answer:
    interim: list[int] = []
    while True:
        head = await reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split()[1])
        headers = {
            name.strip().lower(): value.strip()
            for name, _, value in (line.partition(":") for line in lines[1:] if line)
        }
        if 100 <= status < 200:
            interim.append(status)
            continue
        body = await reader.readexactly(int(headers.get("content-length", "0")))
        return Answer(status, headers, body, interim)


def request_head(path: str, headers: dict[str, str]) -> bytes:
    """A POST's request line and headers."""
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: kvconductor",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


@contextlib.asynccontextmanager
async def connection(port: int) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        yield reader, writer
    finally:
        writer.transport.abort()  # never wait to flush what the server will not read


async def closed_by_server(reader: asyncio.StreamReader, limit_s: float) -> bool:
    """True once the server closes the connection (EOF or reset) within `limit_s`."""
    try:
        async with asyncio.timeout(limit_s):
            while await reader.read(65536):
                pass
    except TimeoutError:
        return False
    except OSError:
        pass
    return True


async def send_declared(port: int, length: int, headers: dict[str, str] | None = None) -> Answer:
    """A POST /query that declares `length` bytes and sends only its headers."""
    async with connection(port) as (reader, writer):
        head = {
            "Content-Type": "application/json",
            "Content-Length": str(length),
            **(headers or {}),
        }
        writer.write(request_head("/query", head))
        await writer.drain()
        return await read_answer(reader)


async def send_body(
    port: int, body: bytes, chunked: bool = False, headers: dict[str, str] | None = None
) -> Answer:
    """POST /query with `body` (with Content-Length, or chunked), written 64 KiB
    at a time until the server answers (as curl does) or it is all sent."""
    framing = {"Transfer-Encoding": "chunked"} if chunked else {"Content-Length": str(len(body))}
    piece = 64 * 1024
    async with connection(port) as (reader, writer):
        writer.write(request_head("/query", {**framing, **(headers or {})}))
        answer = asyncio.create_task(read_answer(reader))
        with contextlib.suppress(OSError):
            for start in range(0, len(body), piece):
                if answer.done():
                    break
                part = body[start : start + piece]
                writer.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part)
                await writer.drain()
            if chunked and not answer.done():
                writer.write(b"0\r\n\r\n")
        return await answer


# ------------------------------------------------ an app on a real port


class Served:
    """An app served on a free port: its runner, and its metrics to read."""

    def __init__(self, port: int, app: web.Application, runner: web.AppRunner) -> None:
        self.port = port
        self.app = app
        self.runner = runner
        self.metrics = app[API_KEY].metrics

    def aiohttp_connections(self) -> int:
        assert self.runner.server is not None
        return len(self.runner.server.connections)

    def count(self, name: str, **labels: str) -> float:
        text = self.metrics.render()
        return metric_sum(
            parse_metrics(text.decode() if isinstance(text, bytes) else text), name, **labels
        )


@contextlib.asynccontextmanager
async def served(front: bool = True, **options: Any) -> AsyncIterator[Served]:
    """make_app over a fed conductor, on 127.0.0.1 and a free port, behind the
    daemon's site (`front`) or aiohttp's own."""
    conductor = fed_conductor()
    site_options = {k: options.pop(k) for k in ("max_connections",) if k in options}
    settings: dict[str, Any] = {"max_body_bytes": MIB, "auth_token": None, **options}
    app = make_app(conductor, Metrics(conductor), ready=lambda: (True, "ok"), **settings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site: web.BaseSite = (
        QuerySite(runner, "127.0.0.1", 0, **site_options)
        if front
        else web.TCPSite(runner, "127.0.0.1", 0)
    )
    await site.start()
    try:
        yield Served(site.port, app, runner)  # type: ignore[attr-defined]
    finally:
        await runner.cleanup()


@contextlib.asynccontextmanager
async def serving(**kwargs: Any) -> AsyncIterator[tuple[int, web.Application]]:
    """`served` behind the daemon's site: every abuse reaches aiohttp through
    the query front."""
    async with served(**kwargs) as s:
        yield s.port, s.app


async def post(
    session: aiohttp.ClientSession, port: int, body: bytes, path: str = "/query", **kw: Any
) -> tuple[int, Any]:
    url = f"http://127.0.0.1:{port}{path}"
    async with session.post(url, data=body, **kw) as resp:
        raw = await resp.read()
        return resp.status, json.loads(raw)


def encode(payload: object) -> bytes:
    return msgspec.json.encode(payload)


# ----------------------------------------------------- config and startup


@pytest.mark.parametrize(
    "host", ["127.0.0.1", "127.3.2.1", "::1", "[::1]", "localhost", "LOCALHOST"]
)
def test_loopback_needs_no_token(host: str) -> None:
    cfg = load_config(None, {"KVCONDUCTOR_HTTP_HOST": host})
    assert cfg.http.auth_token is None


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "10.1.2.3", "192.168.0.7", "kvconductor"])
def test_any_other_address_needs_a_token(host: str, tmp_path: Path) -> None:
    env = {"KVCONDUCTOR_HTTP_HOST": host}
    with pytest.raises(ConfigError) as info:
        load_config(None, env)
    message = str(info.value)
    assert message.startswith("config error: [http] auth_token: required")
    assert repr(host) in message and "KVCONDUCTOR_HTTP_HOST" in message
    assert "\n" not in message
    token_file = tmp_path / "token"
    token_file.write_text("from-a-file\n")
    for extra in (
        {"KVCONDUCTOR_HTTP_AUTH_TOKEN": TOKEN},
        {"KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE": str(token_file)},
        {"KVCONDUCTOR_HTTP_ALLOW_UNAUTHENTICATED": "true"},
    ):
        cfg = load_config(None, {**env, **extra})
        assert cfg.http.host == host


@pytest.mark.parametrize(
    ("env", "needle"),
    [
        ({"KVCONDUCTOR_HTTP_AUTH_TOKEN": "two words"}, "[http] auth_token: may hold only visible"),
        ({"KVCONDUCTOR_HTTP_AUTH_TOKEN": "caf\u00e9"}, "[http] auth_token: may hold only visible"),
        (
            {"KVCONDUCTOR_HTTP_AUTH_TOKEN": TOKEN, "KVCONDUCTOR_HTTP_ALLOW_UNAUTHENTICATED": "1"},
            "[http] allow_unauthenticated: set, but auth_token is set too",
        ),
        ({"KVCONDUCTOR_HTTP_CLIENT_TIMEOUT_S": "0"}, "[http] client_timeout_s: must be positive"),
        ({"KVCONDUCTOR_HTTP_CLIENT_TIMEOUT_S": "-1"}, "[http] client_timeout_s: must be positive"),
        ({"KVCONDUCTOR_HTTP_IDLE_TIMEOUT_S": "0"}, "[http] idle_timeout_s: must be positive"),
        ({"KVCONDUCTOR_HTTP_IDLE_TIMEOUT_S": "-1"}, "[http] idle_timeout_s: must be positive"),
        ({"KVCONDUCTOR_HTTP_MAX_CONNECTIONS": "0"}, "[http] max_connections: must be at least 1"),
        ({"KVCONDUCTOR_HTTP_MAX_CONNECTIONS": "-5"}, "[http] max_connections: must be at least 1"),
        (
            {"KVCONDUCTOR_HTTP_MAX_REQUESTS_PER_CONNECTION": "0"},
            "[http] max_requests_per_connection: must be at least 1",
        ),
        (
            {"KVCONDUCTOR_HTTP_MAX_REQUESTS_PER_CONNECTION": "-1"},
            "[http] max_requests_per_connection: must be at least 1",
        ),
    ],
)
def test_token_and_timeout_rules(env: dict[str, str], needle: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, env)
    assert needle in str(info.value)
    assert "caf" not in str(info.value)  # a secret is never quoted


@pytest.mark.parametrize(
    "argv", [["run"], ["replica"], ["demo", "--engines-only", "--duration", "1"]]
)
def test_servers_refuse_to_start_unauthenticated_on_a_public_address(argv: list[str]) -> None:
    env = {**os.environ, "KVCONDUCTOR_HTTP_HOST": "0.0.0.0"}
    env.pop("KVCONDUCTOR_HTTP_AUTH_TOKEN", None)
    env.pop("KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE", None)
    result = subprocess.run(
        [sys.executable, "-m", "kvconductor.tools.cli", *argv],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "config error: [http] auth_token: required" in lines[0]


# ------------------------------------------------------------------ auth


async def test_auth_is_checked_before_the_body_is_read() -> None:
    async with serving(auth_token=TOKEN) as (port, _):
        # 1 GB declared, none sent: 401, not a wait for the body
        for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": TOKEN}):
            answer = await send_declared(port, 10**9, headers)
            assert answer.status == 401, answer
            assert answer.headers["www-authenticate"].startswith("Bearer")
            assert "bearer token" in answer.json()["error"]
        # Expect: 100-continue is not invited without the token
        answer = await send_declared(port, 200, {"Expect": "100-continue"})
        assert (answer.status, answer.interim) == (401, [])
        # with it, the body is invited and answered
        body = encode(query())
        async with connection(port) as (reader, writer):
            head = {"Content-Length": str(len(body)), "Expect": "100-continue", **AUTH}
            writer.write(request_head("/query", head))
            await writer.drain()
            interim = await reader.readuntil(b"\r\n\r\n")
            assert interim.startswith(b"HTTP/1.1 100 Continue")
            writer.write(body)
            answer = await read_answer(reader)
        assert (answer.status, answer.json()) == (200, FULL_ANSWER)


async def test_token_compare_is_exact() -> None:
    async with serving(auth_token=TOKEN) as (port, _), aiohttp.ClientSession() as session:
        body = encode(query())
        for header in (
            "Bearer",
            "Bearer ",
            f"Bearer {TOKEN[:-1]}",
            f"Bearer {TOKEN}{TOKEN}",
            f"Bearer {TOKEN.upper()}",
            f"Token {TOKEN}",
            f"Bearer\t{TOKEN}",
            f"Bearer {TOKEN}\u00e9",
        ):
            status, _ = await post(session, port, body, headers={"Authorization": header})
            assert status == 401, header
        for header in (f"Bearer {TOKEN}", f"BEARER {TOKEN}", f"Bearer   {TOKEN}  "):
            status, answer = await post(session, port, body, headers={"Authorization": header})
            assert (status, answer) == (200, FULL_ANSWER), header


async def test_operator_tools_send_the_token_to_the_daemon_only() -> None:
    async with serving(auth_token=TOKEN) as (port, _):
        url = f"http://127.0.0.1:{port}"
        status, body = await asyncio.to_thread(Api(url, TOKEN).json, "GET", "/workers")
        assert status == 200 and "workers" in body
        with pytest.raises(ToolError, match=r"needs a bearer token \(401\)"):
            await asyncio.to_thread(Api(url).json, "GET", "/workers")
        with pytest.raises(ToolError, match=r"rejected the bearer token \(401\)"):
            await asyncio.to_thread(Api(url, "wrong").json, "GET", "/workers")

    # Something else at the URL that redirects: urllib would replay the header.
    forwarded: list[str | None] = []

    async def redirect(request: web.Request) -> web.Response:
        raise web.HTTPTemporaryRedirect("/elsewhere")

    async def elsewhere(request: web.Request) -> web.Response:
        forwarded.append(request.headers.get("Authorization"))
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/workers", redirect)
    app.router.add_get("/elsewhere", elsewhere)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    server: Any = site._server
    try:
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        with pytest.raises(ToolError, match=r"redirects \(307\) to /elsewhere: not following"):
            await asyncio.to_thread(Api(url, TOKEN).json, "GET", "/workers")
    finally:
        await runner.cleanup()
    assert forwarded == []


# -------------------------------------------------------- oversize bodies


async def test_oversize_bodies_get_413_without_being_buffered() -> None:
    limit = 64 * 1024
    async with serving(max_body_bytes=limit) as (port, app):
        api = app[API_KEY]
        for declared in (limit + 1, 10**9, 10**15):
            answer = await send_declared(port, declared)
            assert answer.status == 413, answer
            assert str(limit) in answer.json()["error"]
            assert answer.headers["connection"] == "close"
        answer = await send_declared(port, 10**9, {"Expect": "100-continue"})
        assert (answer.status, answer.interim) == (413, [])
        # chunked: answered once past the limit, long before the 8 MiB are sent
        answer = await send_body(port, b"[" + b"1," * (4 * MIB), chunked=True)
        assert answer.status == 413
        # a compressed body counts as what it decompresses to
        bomb = gzip.compress(b" " * (32 * MIB))
        assert len(bomb) < limit
        async with connection(port) as (reader, writer):
            head = {"Content-Encoding": "gzip", "Content-Length": str(len(bomb))}
            writer.write(request_head("/query", head) + bomb)
            answer = await read_answer(reader)
        assert answer.status == 413
        # nothing stays buffered, and honest queries are still answered
        assert api.buffered == 0
        async with aiohttp.ClientSession() as session:
            assert await post(session, port, encode(query())) == (200, FULL_ANSWER)


# ---------------------------------------------------------- malformed JSON


MALFORMED: list[tuple[str, bytes]] = [
    ("invalid UTF-8", b'{"model": "\xff\xfe", "block_size": 4, "token_ids": []}'),
    ("NaN", b'{"model": "m", "block_size": 4, "token_ids": [NaN]}'),
    ("huge float", b'{"model": "m", "block_size": 4, "token_ids": [1e999]}'),
    ("huge int", b'{"model": "m", "block_size": 4, "token_ids": [' + b"9" * 5000 + b"]}"),
    ("trailing garbage", encode(query()) + b"}"),
    ("two documents", encode(query()) + encode(query())),
    ("BOM", b"\xef\xbb\xbf" + encode(query())),
    ("deep nesting", b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("unclosed deep nesting", b"[" * 200_000),
    ("half a million escapes", b'{"model": "' + b"\\" * (MIB // 2) + b'"}'),
    ("nested token ids", b'{"model": "m", "block_size": 4, "token_ids": [[1, 2]]}'),
    ("object token ids", b'{"model": "m", "block_size": 4, "token_ids": {"0": 1}}'),
    ("null model", b'{"model": null, "block_size": 4, "token_ids": []}'),
    ("NUL bytes", b"\x00" * 1000),
]


async def test_malformed_json_gets_400_with_a_reason() -> None:
    async with serving() as (port, _), aiohttp.ClientSession() as session:
        for name, body in MALFORMED:
            status, answer = await post(session, port, body)
            assert status == 400, (name, answer)
            assert list(answer) == ["error"] and len(answer["error"]) > 10, (name, answer)
            assert len(answer["error"]) < 1000, name  # the reason, not an echo of the body
        # Well-formed oddities answer as the contract says: nothing is listed.
        # Duplicate keys: the last wins; unknown keys are ignored.
        body = encode(query())[:-1] + b', "model": "other", "junk": {"a": [1, {}]}}'
        assert await post(session, port, body) == (200, {})
        body = b'{"model": "m", "block_size": 99999999999999999999, "token_ids": [1]}'
        assert await post(session, port, body) == (200, {})


# ------------------------------------------------------ a million token ids


async def test_a_million_token_ids_are_answered_and_more_is_413() -> None:
    async with serving(max_body_bytes=16 * MIB) as (port, _), aiohttp.ClientSession() as session:
        rng = random.Random(7)
        tokens = TOKENS[:16] + [rng.randrange(150_000) for _ in range(1_000_000 - 16)]
        body = encode(query(token_ids=tokens))
        assert 5 * MIB < len(body) < 8 * MIB
        started = time.perf_counter()
        status, answer = await post(session, port, body)
        took = time.perf_counter() - started
        assert (status, answer) == (200, FULL_ANSWER)
        worst = encode(query(token_ids=[2**32 - 1] * 1_600_000))
        assert len(worst) > 16 * MIB
        for chunked in (False, True):
            assert (await send_body(port, worst, chunked)).status == 413
        print(f"\n1M token ids: {len(body)} bytes answered in {took:.2f} s")


# ----------------------------------------------------------- slow clients


async def dribble_headers(port: int, until_s: float) -> float | None:
    """Send a request's headers a byte at a time; seconds until the server
    hung up, or None if it never did within `until_s`."""
    head = request_head("/query", {"Content-Length": "2", **AUTH})
    async with connection(port) as (reader, writer):
        started = time.monotonic()
        for byte in head:
            if time.monotonic() - started > until_s:
                return None
            try:
                writer.write(bytes([byte]))
                await writer.drain()
            except OSError:
                return time.monotonic() - started
            if reader.at_eof() or await closed_by_server(reader, 0.2):
                return time.monotonic() - started
    return None


async def dribble_body(port: int, until_s: float) -> tuple[int | None, float]:
    """Headers at once, then the body a byte at a time: the status answered
    (None if none within `until_s`) and when."""
    body = encode(query())
    head = request_head("/query", {"Content-Length": str(len(body)), **AUTH})
    async with connection(port) as (reader, writer):
        writer.write(head)
        started = time.monotonic()
        answer = asyncio.create_task(read_answer(reader))
        for byte in body[:-1]:
            if answer.done() or time.monotonic() - started > until_s:
                break
            with contextlib.suppress(OSError):
                writer.write(bytes([byte]))
            await asyncio.sleep(0.2)
        if not answer.done():
            answer.cancel()
            return None, time.monotonic() - started
        try:
            return (await answer).status, time.monotonic() - started
        except (OSError, asyncio.IncompleteReadError):  # hung up without an answer
            return None, time.monotonic() - started


async def idle(port: int, until_s: float) -> float | None:
    async with connection(port) as (reader, _):
        started = time.monotonic()
        if await closed_by_server(reader, until_s):
            return time.monotonic() - started
    return None


async def slow_clients_meanwhile_honest_ones(
    port: int, timeout_s: float, until_s: float, expected: Any = FULL_ANSWER
) -> dict[str, Any]:
    """20 header dribblers, 5 body dribblers and 5 idle connections, while
    an honest client queries (and gets `expected`, unless None); what
    happened to each."""
    slow = asyncio.gather(
        asyncio.gather(*(dribble_headers(port, until_s) for _ in range(20))),
        asyncio.gather(*(dribble_body(port, until_s) for _ in range(5))),
        asyncio.gather(*(idle(port, until_s) for _ in range(5))),
    )
    honest = 0
    async with aiohttp.ClientSession(headers=AUTH) as session:
        deadline = time.monotonic() + timeout_s + 1
        while time.monotonic() < deadline or honest < 20:
            status, answer = await post(session, port, encode(query()))
            if expected is not None:
                assert (status, answer) == (200, expected)
            honest += 1
    headers, bodies, idles = await slow
    return {"honest": honest, "headers": headers, "bodies": bodies, "idle": idles}


async def test_slow_clients_are_dropped_and_do_not_block_others() -> None:
    async with serving(auth_token=TOKEN, client_timeout_s=1.0, idle_timeout_s=1.0) as (port, app):
        seen = await slow_clients_meanwhile_honest_ones(port, 1.0, until_s=30)
        assert app[API_KEY].buffered == 0
    assert all(t is not None for t in seen["headers"]), seen["headers"]
    assert all(status == 408 for status, _ in seen["bodies"]), seen["bodies"]
    assert all(t is not None for t in seen["idle"]), seen["idle"]
    print(
        f"\nslow clients (timeout 1 s), {seen['honest']} honest queries answered meanwhile: "
        f"header dribblers dropped after {max(seen['headers']):.1f} s at most, "
        f"body dribblers 408 after {max(t for _, t in seen['bodies']):.1f} s, "
        f"idle after {max(seen['idle']):.1f} s"
    )


async def test_a_client_hanging_up_mid_body_is_counted_not_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with serving() as (port, app):
        api = app[API_KEY]
        for _ in range(3):
            async with connection(port) as (_, writer):
                writer.write(request_head("/query", {"Content-Length": "1000"}) + b"[1, 2")
                await writer.drain()
                await wait_for(lambda: api.buffered > 0, 30, "the body started")
        await wait_for(lambda: api.buffered == 0, 30, "budget released")

        def hung_up() -> float:
            metrics = parse_metrics(api.metrics.render().decode())
            return metric_sum(metrics, "kvconductor_http_requests_total", code="499")

        await wait_for(lambda: hung_up() == 3, 30, "3 answers 499")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records


async def test_buffered_bodies_share_a_budget() -> None:
    limit = 64 * 1024  # budget: 4 x 64 KiB = 256 KiB; six stalled bodies hold 324 KiB
    async with serving(max_body_bytes=limit, client_timeout_s=5.0) as (port, app):
        api = app[API_KEY]
        part = b"[" + b"1," * (27 * 1024)  # 54 KiB of a declared 60 KiB, then a stall
        writers = []
        statuses: list[int] = []
        for _ in range(6):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(request_head("/query", {"Content-Length": str(60 * 1024)}) + part)
            await writer.drain()
            writers.append((reader, writer))
        await wait_for(lambda: api.buffered >= 4 * len(part), 30, "four bodies buffered")
        for reader, writer in writers:
            try:
                async with asyncio.timeout(0.5):
                    statuses.append((await read_answer(reader)).status)
            except TimeoutError:
                statuses.append(0)  # still waiting for the rest of its body
            writer.close()
        assert 503 in statuses, statuses
        assert api.buffered <= api.body_budget
        await wait_for(lambda: api.buffered == 0, 30, "budget released")
        async with aiohttp.ClientSession() as session:
            assert await post(session, port, encode(query())) == (200, FULL_ANSWER)


# ------------------------------------------------- daemon and replica processes


def config_env(cfg: Config) -> dict[str, str]:
    """`cfg` as the KVCONDUCTOR_* variables that give it to a child process."""
    env: dict[str, str] = {}
    for info in config_keys():
        value = getattr(getattr(cfg, info.section), info.key)
        if value is None:
            continue
        if isinstance(value, Secret):
            value = value.reveal()
        elif isinstance(value, bool):
            value = "true" if value else "false"
        env[info.env] = str(value)
    return env


@contextlib.asynccontextmanager
async def server_process(argv: list[str], cfg: Config, log: Path) -> AsyncIterator[int]:
    """`kvconductor <argv>` configured by `cfg` alone; yields its pid once
    /health answers, stops it after."""
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("KVCONDUCTOR_")}
    env = {**inherited, **config_env(cfg), "PYTHONUNBUFFERED": "1"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvconductor.tools.cli", *argv],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        async def up() -> bool:
            assert proc.poll() is None, log.read_text()
            try:
                async with aiohttp.ClientSession() as session:
                    url = f"http://127.0.0.1:{cfg.http.port}/health"
                    async with session.get(url) as resp:
                        return resp.status == 200
            except aiohttp.ClientError:
                return False

        await wait_for(up, 60, f"kvconductor {argv[0]} answering")
        yield proc.pid
    finally:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, 60)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait, 10)


def memory_kib(pid: int) -> dict[str, int]:
    """VmRSS (now) and VmHWM (peak) of a process, KiB."""
    out: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0])
    return out


@pytest.mark.parametrize("command", ["run", "replica"])
async def test_server_processes_drop_slow_clients(command: str, tmp_path: Path) -> None:
    """As served by `kvconductor run` and `kvconductor replica`: the
    configured `client_timeout_s` and `idle_timeout_s` reach the server (no
    broker needed: the HTTP API answers while Kafka is retried)."""
    port, nothing_there = free_ports(2)
    cfg = daemon_config(
        f"127.0.0.1:{nothing_there}",
        KVCONDUCTOR_HTTP_PORT=str(port),
        KVCONDUCTOR_HTTP_AUTH_TOKEN=TOKEN,
        KVCONDUCTOR_HTTP_CLIENT_TIMEOUT_S="1",
        KVCONDUCTOR_HTTP_IDLE_TIMEOUT_S="1",
    )
    async with server_process([command], cfg, tmp_path / "server.log"):
        seen = await slow_clients_meanwhile_honest_ones(port, 1.0, until_s=20, expected={})
    assert all(t is not None for t in seen["headers"]), seen["headers"]
    assert all(status == 408 for status, _ in seen["bodies"]), seen["bodies"]
    assert all(t is not None for t in seen["idle"]), seen["idle"]


# -------------------------------------------- the daemon under load and abuse


BS = 4
STABLE = list(range(1, 65))  # 16 blocks, stored once, never touched again
STABLE_HASHES = [1000 + i for i in range(16)]
STABLE_ANSWER = {
    "default": {
        "stable": {"longest_matched": 64, "GPU": 64, "CPU": 64, "DISK": 64, "DP": {"0": 64}}
    }
}
CHURN_INSTANCES = 8
LOAD_S = 15.0
HONEST_CLIENTS = 16


class Churn:
    """Engine events for `churn-*` instances (model "churn", so they never
    show in the stable prompt's answer): each record stores the next block of
    its instance's chain, every fourth also removes an older one."""

    def __init__(self) -> None:
        self.stored = collections.Counter[str]()
        self.removed = collections.Counter[str]()
        self.records = 0

    def next_record(self) -> tuple[str, bytes]:
        n = self.records
        self.records += 1
        instance = f"churn-{n % CHURN_INSTANCES}"
        k = self.stored[instance]
        base = (n % CHURN_INSTANCES) << 24
        events = [
            stored(
                [base + k],
                [base + 4 * k + j for j in range(BS)],
                parent=base + k - 1 if k else None,
                block_size=BS,
            )
        ]
        self.stored[instance] += 1
        if k % 4 == 3:
            events.append(removed([base + k - 2]))
            self.removed[instance] += 1
        return instance, vllm_payload(events)

    def expected_blocks(self) -> dict[str, int]:
        return {i: self.stored[i] - self.removed[i] for i in self.stored}


async def produce_churn(
    producer: AIOKafkaProducer, topic: str, churn: Churn, stop: asyncio.Event
) -> None:
    headers = engine_headers(model="churn", block_size=BS)
    while not stop.is_set():
        sends = []
        for _ in range(40):
            key, value = churn.next_record()
            sends.append(await producer.send(topic, key=key.encode(), value=value, headers=headers))
        await asyncio.gather(*sends)
        await asyncio.sleep(0.05)


class Tally:
    """Answers seen per abuse category: {category: {status: count}}."""

    def __init__(self) -> None:
        self.seen: dict[str, collections.Counter[int]] = collections.defaultdict(
            collections.Counter
        )

    def add(self, category: str, status: int) -> None:
        self.seen[category][status] += 1

    def statuses(self, category: str) -> set[int]:
        return set(self.seen[category])


async def loop_until(stop: asyncio.Event, step: Callable[[], Awaitable[None]]) -> None:
    while not stop.is_set():
        await step()


async def metrics_of(session: aiohttp.ClientSession, port: int) -> Any:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as resp:
        return parse_metrics(await resp.text())


@pytest.mark.kafka
async def test_daemon_under_abuse_while_events_flow(kafka_bootstrap: str, tmp_path: Path) -> None:
    (port,) = free_ports(1)
    cfg = daemon_config(
        kafka_bootstrap,
        KVCONDUCTOR_HTTP_HOST="0.0.0.0",  # as deployed: a token is required
        KVCONDUCTOR_HTTP_PORT=str(port),
        KVCONDUCTOR_HTTP_AUTH_TOKEN=TOKEN,
        KVCONDUCTOR_HTTP_MAX_BODY_BYTES=str(8 * MIB),
        KVCONDUCTOR_HTTP_CLIENT_TIMEOUT_S="3",
        KVCONDUCTOR_LOG_FORMAT="json",
    )
    topic = cfg.kafka.engine_topic
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, enable_idempotence=True)
    async with server_process(["run"], cfg, tmp_path / "daemon.log") as pid:
        await producer.start()  # the daemon has created the topics by the time it answers
        try:
            figures = await _abuse_while_events_flow(port, topic, producer, pid)
        finally:
            await producer.stop()
    print("\n" + json.dumps(figures, indent=1))


async def _abuse_while_events_flow(
    port: int, topic: str, producer: AIOKafkaProducer, pid: int
) -> dict[str, Any]:
    stable_body = encode({"model": "m", "block_size": BS, "token_ids": STABLE})
    hash_body = encode({"model": "m", "block_size": BS, "seq_hashes": STABLE_HASHES})
    rng = random.Random(11)
    million = STABLE + [rng.randrange(150_000) for _ in range(1_000_000 - len(STABLE))]
    million_body = encode({"model": "m", "block_size": BS, "token_ids": million})
    chunked_body = b"[" + b"1," * (5 * MIB)  # 10 MiB, over the 8 MiB limit
    url = f"http://127.0.0.1:{port}"
    tally = Tally()
    wrong_answers: list[Any] = []
    churn = Churn()
    stop = asyncio.Event()
    lag_samples: list[float] = []
    rss_samples: list[int] = []

    async with aiohttp.ClientSession(
        headers=AUTH, connector=aiohttp.TCPConnector(limit=0)
    ) as session:

        async def ready() -> bool:
            async with session.get(f"{url}/ready") as resp:
                return resp.status == 200

        await wait_for(ready, 120, "the daemon ready (topics created)")
        stable = vllm_payload([stored(STABLE_HASHES, STABLE, block_size=BS)])
        await producer.send_and_wait(
            topic, key=b"stable", value=stable, headers=engine_headers(block_size=BS)
        )

        async def stable_answered() -> bool:
            return await post(session, port, stable_body) == (200, STABLE_ANSWER)

        await wait_for(stable_answered, 120, "the stable prompt indexed")
        before = memory_kib(pid)

        async def honest(i: int) -> None:
            path, body = ("/query", stable_body) if i % 2 else ("/query_by_hash", hash_body)
            status, answer = await post(session, port, body, path)
            tally.add("honest", status)
            if (status, answer) != (200, STABLE_ANSWER):
                wrong_answers.append((status, answer))

        async def malformed() -> None:
            for _, body in MALFORMED:
                tally.add("malformed", (await post(session, port, body))[0])

        async def unauthorized() -> None:
            for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
                async with aiohttp.ClientSession(headers=headers) as anonymous:
                    tally.add("unauthorized", (await post(anonymous, port, stable_body))[0])
                    async with anonymous.get(f"{url}/workers") as resp:
                        tally.add("unauthorized", resp.status)

        async def oversize_declared() -> None:
            tally.add("oversize_declared", (await send_declared(port, 20 * MIB, AUTH)).status)

        async def oversize_chunked() -> None:
            tally.add("oversize_chunked", (await send_body(port, chunked_body, True, AUTH)).status)
            await asyncio.sleep(0.5)

        async def million_ids() -> None:
            status, answer = await post(session, port, million_body)
            tally.add("million_token_ids", status)
            if (status, answer) != (200, STABLE_ANSWER):
                wrong_answers.append((status, answer))

        async def sample() -> None:
            metrics = await metrics_of(session, port)
            lag_samples.append(metric_sum(metrics, "kvconductor_consumer_lag"))
            rss_samples.append(memory_kib(pid)["VmRSS"])
            await asyncio.sleep(0.5)

        started = time.monotonic()
        slow = asyncio.create_task(
            slow_clients_meanwhile_honest_ones(port, LOAD_S, until_s=LOAD_S, expected=None)
        )
        tasks = [
            asyncio.create_task(produce_churn(producer, topic, churn, stop)),
            *(
                asyncio.create_task(loop_until(stop, lambda i=i: honest(i)))
                for i in range(HONEST_CLIENTS)
            ),
            *(
                asyncio.create_task(loop_until(stop, step))
                for step in (
                    malformed,
                    unauthorized,
                    oversize_declared,
                    oversize_chunked,
                    million_ids,
                    sample,
                )
            ),
        ]
        await asyncio.sleep(LOAD_S)
        stop.set()
        await asyncio.gather(*tasks)
        slow_seen = await slow
        load_s = time.monotonic() - started
        await producer.flush()

        consumed_records = 1 + churn.records  # the stable record, then the churn

        async def caught_up() -> bool:
            metrics = await metrics_of(session, port)
            consumed = metric_sum(metrics, "kvconductor_records_consumed_total", topic=topic)
            lag = metric_sum(metrics, "kvconductor_consumer_lag")
            return consumed >= consumed_records and lag == 0

        drain_started = time.monotonic()
        await wait_for(caught_up, 120, "the consumer caught up")
        drain_s = time.monotonic() - drain_started
        after = memory_kib(pid)
        metrics = await metrics_of(session, port)
        async with session.get(f"{url}/workers") as resp:
            workers = (await resp.json())["workers"]

    (churn_ns,) = [ns for ns in workers if ns["model"] == "churn"]
    blocks = {name: ranks["0"]["GPU"] for name, ranks in churn_ns["instances"].items()}
    assert blocks == churn.expected_blocks()
    assert (
        metric_sum(metrics, "kvconductor_records_consumed_total", topic=topic) == consumed_records
    )
    assert metric_sum(metrics, "kvconductor_bad_records_total") == 0
    assert wrong_answers == []
    expected = {
        "honest": {200},
        "malformed": {400},
        "unauthorized": {401},
        "oversize_declared": {413},
        "oversize_chunked": {413},
        "million_token_ids": {200},
    }
    for category, statuses in expected.items():
        assert tally.statuses(category) == statuses, (category, tally.seen[category])
    server_errors = [
        (labels, value)
        for labels, value in metrics["kvconductor_http_requests_total"]
        if labels["code"].startswith("5") and labels["endpoint"] != "ready"  # 503: not yet
    ]
    assert server_errors == []
    growth_mib = (after["VmRSS"] - before["VmRSS"]) / 1024
    assert growth_mib < 512, (before, after)  # generous: reported, not tuned
    return {
        "load_s": round(load_s, 1),
        "records_produced": consumed_records,
        "records_per_s": round(churn.records / load_s),
        "drain_after_load_s": round(drain_s, 1),
        "lag_max": max(lag_samples, default=0),
        "lag_samples": len(lag_samples),
        "answers": {c: dict(s) for c, s in tally.seen.items()},
        "slow_clients": {
            "honest_queries_meanwhile": slow_seen["honest"],
            "header_dribblers_dropped": sum(t is not None for t in slow_seen["headers"]),
            "body_dribblers": dict(collections.Counter(s for s, _ in slow_seen["bodies"])),
            "idle_dropped": sum(t is not None for t in slow_seen["idle"]),
        },
        "rss_mib": {
            "before": round(before["VmRSS"] / 1024, 1),
            "max_sampled": round(max(rss_samples, default=0) / 1024, 1),
            "after": round(after["VmRSS"] / 1024, 1),
            "peak_hwm": round(after["VmHWM"] / 1024, 1),
        },
    }
