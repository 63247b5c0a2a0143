"""The query routes' front door: plain queries answered straight off the socket.

    runner = web.AppRunner(make_app(...), access_log=None)
    await runner.setup()
    site = QuerySite(runner, host, port)      # in place of web.TCPSite
    await site.start()

aiohttp spends about as much CPU on each request around a query as the
query itself takes (docs/benchmarks.md): with one event loop that overhead
halved the queries a daemon answers a second. The site's
connections start with `QueryFront`, which answers the one request a router
sends over and over, a whole `POST /query` or `POST /query_by_hash` with a
Content-Length, by calling the same `QueryApi` answer functions, counting
the same metrics and writing the same bytes aiohttp would.

Anything else is aiohttp's: the first request that is not that plain form
(another route or method, a msgpack body (Conductor's form), HTTP/1.0,
chunked or compressed framing, `Expect`, `Upgrade`, `Connection`, a body
over the limit, a missing or wrong
bearer token, a head httptools (llhttp, the parser aiohttp's own C parser
is built on) refuses, a body past the shared budget) or whose answer is not
200 hands the connection over: the front gives aiohttp's request handler
the transport and every unanswered byte from the start of that request,
and aiohttp serves that request and the rest of the connection with all of
http_api's rules. A query is a pure read, so a refused one answered again by
aiohttp answers the same.

The front keeps aiohttp's two timers with one lazily re-armed deadline: a
request's head must arrive within `idle_timeout_s` of connecting or of the
previous answer (else the connection is closed: the keep-alive timeout,
aiohttp's `keepalive_timeout`), and its body within `client_timeout_s` more
(else 408, closed); the clock does not run while the client leaves its
answers unread. A client that hangs up with a body half sent is counted as
499, as aiohttp's path counts it.

Limits: at most `max_connections` connections are open at once, the
front's and those handed to aiohttp together; one more is closed as soon as
it is accepted, before anything is read or written, and counted
(`kvconductor_http_connections_refused_total`). Closing costs the least
under a flood, and an answer written onto a request left unread can be lost
to the reset the close sends anyway. A connection's
`max_requests_per_connection`-th answer says `Connection: close` and the
connection closes after it, on either path (aiohttp's through the app's
`on_response_prepare`, counting on from the front's answers).

Where the two still differ, by choice: a good request that arrives in one
segment with a head aiohttp refuses is answered (aiohttp answers only the
400); the 400 text of a refused head quotes the bytes aiohttp was handed,
which can be more than one segment; a request handed over part-way (a
head past 8190 bytes, a body past the budget) gets aiohttp's timers from
the hand-over, so up to twice `client_timeout_s` in all.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from email.utils import formatdate
from typing import Any, cast

import httptools
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.tcp_helpers import tcp_keepalive

from kvconductor.config import DEFAULT_MAX_CONNECTIONS
from kvconductor.http.api import API_KEY, QueryApi, error_body
from kvconductor.obs.logs import RateLimitedLog
from kvconductor.wire.conductor import MSGPACK

# Heads past aiohttp's limits (its request handler's defaults: lines of
# 8190 bytes, 128 headers) are left to it, to be refused as it refuses them.
MAX_HEAD_BYTES = 8190
MAX_HEADERS = 128
_HEAD_END = b"\r\n\r\n"
_MSGPACK = MSGPACK.encode()


class _Head:
    """What the front needs of one request head, from httptools' callbacks."""

    __slots__ = ("auth", "heads", "host", "length", "names", "plain", "url")

    def __init__(self) -> None:
        self.url = b""
        self.length: int | None = None
        self.auth: bytes | None = None
        self.host = False
        self.plain = True
        self.heads = 0
        self.names: set[bytes] = set()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        names = self.names
        if name in names or len(names) >= MAX_HEADERS:
            # aiohttp refuses a second Host, Content-Length, Content-Type...
            # and reads the first of others (Authorization): its call.
            self.plain = False
        names.add(name)
        if name == b"content-length":
            self.length = int(value)  # llhttp has checked: digits only
        elif name == b"authorization":
            self.auth = value
        elif name == b"host":
            self.host = True
        elif name == b"content-type" and _MSGPACK in value.lower():
            # Conductor's msgpack form is aiohttp's (http_api answers it).
            self.plain = False
        elif name in _NOT_PLAIN:
            self.plain = False

    def on_headers_complete(self) -> None:
        self.heads += 1

    def on_body(self, body: bytes) -> None:
        # The head ended before the blank line the front found: llhttp read
        # it another way than a plain request, so aiohttp decides.
        self.plain = False

    def on_message_begin(self) -> None:
        if self.heads:
            self.plain = False


# Framing, protocol switches and connection handling stay with aiohttp
# (llhttp reads Proxy-Connection as Connection; aiohttp refuses the hixie-76
# WebSocket key).
_NOT_PLAIN = frozenset(
    {
        b"transfer-encoding",
        b"content-encoding",
        b"expect",
        b"upgrade",
        b"connection",
        b"proxy-connection",
        b"sec-websocket-key1",
    }
)


class _Route:
    __slots__ = ("answer", "endpoint", "latency")

    def __init__(self, endpoint: str, answer: Callable[[bytes], bytes], latency: Any) -> None:
        self.endpoint = endpoint
        self.answer = answer
        self.latency = latency


class _Date:
    """The Date header's value, formatted once a second as aiohttp does."""

    __slots__ = ("second", "text")

    def __init__(self) -> None:
        self.second = -1
        self.text = b""

    def now(self) -> bytes:
        second = int(time.time())
        if second != self.second:
            self.second = second
            self.text = formatdate(second, usegmt=True).encode("ascii")
        return self.text


_SERVER = SERVER_SOFTWARE.encode("ascii")


def _answer_bytes(status_line: bytes, body: bytes, date: bytes, closing: bool) -> bytes:
    # aiohttp's header order, so that both paths' answers look alike.
    return b"".join(
        (
            status_line,
            b"\r\nContent-Type: application/json\r\nContent-Length: ",
            str(len(body)).encode("ascii"),
            b"\r\nDate: ",
            date,
            b"\r\nServer: ",
            _SERVER,
            b"\r\nConnection: close\r\n\r\n" if closing else b"\r\n\r\n",
            body,
        )
    )


class QueryFront(asyncio.Protocol):
    """One connection, until it is closed or handed over to aiohttp."""

    __slots__ = (
        "answered",
        "buf",
        "deadline",
        "end",
        "fed",
        "head",
        "held",
        "parser",
        "paused",
        "route",
        "scan",
        "site",
        "start",
        "timer",
        "transport",
    )

    def __init__(self, site: QuerySite) -> None:
        self.site = site
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None
        # The head being read: its fields and parser, fed buf[:fed] so far.
        self.head: _Head | None = None
        self.parser: httptools.HttpRequestParser | None = None
        self.fed = 0
        self.scan = 0  # where the search for the head's end resumes
        self.route: _Route | None = None  # set while a head waits for its body
        self.start = 0  # where that body starts in buf
        self.end = 0  # and where it ends
        self.held = 0  # body bytes counted in the API's shared budget
        self.paused = False  # writing: the client is not reading its answers
        self.deadline = 0.0
        self.timer: asyncio.TimerHandle | None = None
        self.answered = 0  # answers written on this connection

    # ------------------------------------------------------ transport

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses.
        tcp = cast(asyncio.Transport, transport)
        site = self.site
        if site.open_connections() >= site.max_connections:
            # Refused before anything is read: connection_lost finds nothing to settle.
            site.refuse()
            tcp.abort()
            return
        self.transport = tcp
        tcp_keepalive(tcp)
        site.fronts.add(self)
        self._restart_deadline(idle=True)
        self.timer = site.loop.call_at(self.deadline, self._on_timer)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        self._serve()

    def eof_received(self) -> bool:
        return False  # the transport closes; connection_lost settles the rest

    def connection_lost(self, exc: Exception | None) -> None:
        if self.route is not None:
            # Hung up with a body half sent: aiohttp's path counts this 499.
            self.site.api.count(self.route.endpoint, 499)
        self._leave()

    def pause_writing(self) -> None:
        # Pipelined requests whose answers are not read: stop reading more.
        # Like aiohttp waiting in drain(), the connection is not idle then.
        self.paused = True
        assert self.transport is not None
        self.transport.pause_reading()

    def resume_writing(self) -> None:
        self.paused = False
        self._restart_deadline(idle=True)
        assert self.transport is not None
        self.transport.resume_reading()

    # ------------------------------------------------------- requests

    def _serve(self) -> None:
        buf = self.buf
        api = self.site.api
        while True:
            route = self.route
            if route is None:
                end = buf.find(_HEAD_END, self.scan)
                read = len(buf) if end < 0 else end + 4
                # Fed as it comes, so that llhttp refuses what it will not
                # take (TLS on this port, bare LF) at once, through aiohttp.
                if read > MAX_HEAD_BYTES or not self._feed(read):
                    self._hand_over()
                    return
                if end < 0:
                    # A head dribbled in byte by byte is searched once.
                    self.scan = max(0, len(buf) - 3)
                    return
                route = self._plain_route()
                if route is None:
                    self._hand_over()
                    return
                self.route = route
                self._restart_deadline(idle=False)
            if len(buf) < self.end:
                # The body is still coming: it counts against the budget of
                # bodies buffered at once, which aiohttp answers with 503.
                api.buffered += len(buf) - self.start - self.held
                self.held = len(buf) - self.start
                if api.buffered > api.body_budget:
                    self._hand_over()
                return
            body = bytes(buf[self.start : self.end])
            started = time.perf_counter()
            try:
                answer = route.answer(body)
            except Exception:  # ApiError, or a bug aiohttp will log and answer 500
                self._hand_over()  # aiohttp answers it again, with the error
                return
            route.latency.observe(time.perf_counter() - started)
            del buf[: self.end]
            self._next_request()
            self._restart_deadline(idle=True)
            api.count(route.endpoint, 200)
            self.answered += 1
            last = self.answered >= api.max_requests_per_connection
            transport = self.transport
            assert transport is not None
            transport.write(_answer_bytes(b"HTTP/1.1 200 OK", answer, self.site.date.now(), last))
            if last:
                # Written out first, then closed; pipelined requests after
                # it are dropped unread, as `Connection: close` announced.
                buf.clear()
                transport.close()
                return
            if not buf:
                return

    def _feed(self, upto: int) -> bool:
        """Give llhttp the head's bytes up to `upto`; False if it refuses them."""
        if self.parser is None:
            self.head = _Head()
            self.parser = httptools.HttpRequestParser(self.head)
        try:
            # A copy, not a view: a view held on would pin buf's size.
            self.parser.feed_data(bytes(self.buf[self.fed : upto]))
        except httptools.HttpParserError:
            return False
        self.fed = upto
        return True

    def _plain_route(self) -> _Route | None:
        """The route of a whole plain query head, with its body's place; else None."""
        head, parser = self.head, self.parser
        assert head is not None and parser is not None
        site = self.site
        route = site.routes.get(head.url)
        if (
            route is None
            or head.length is None
            or not head.plain
            or not head.host  # aiohttp refuses HTTP/1.1 without it
            or head.heads != 1
            or parser.get_method() != b"POST"
            or parser.get_http_version() != "1.1"
            or not parser.should_keep_alive()
            or head.length > site.api.max_body_bytes
            or not site.api.token_ok(head.auth)
        ):
            return None
        self.start = self.fed
        self.end = self.fed + head.length
        return route

    def _next_request(self) -> None:
        self._release()
        self.route = None
        self.head = None
        self.parser = None
        self.fed = 0
        self.scan = 0

    def _restart_deadline(self, idle: bool) -> None:
        """The next request's head in `idle_timeout_s`, or (not `idle`)
        the body of the one whose head is in, within `client_timeout_s`."""
        api = self.site.api
        timeout = api.idle_timeout_s if idle else api.client_timeout_s
        self.deadline = self.site.loop.time() + timeout

    def _on_timer(self) -> None:
        transport = self.transport
        if transport is None:
            return
        loop = self.site.loop
        if loop.time() < self.deadline or self.paused:
            if self.paused:
                self._restart_deadline(idle=True)
            self.timer = loop.call_at(self.deadline, self._on_timer)
            return
        self.timer = None
        route = self.route
        if route is not None:
            api = self.site.api
            error = api.body_timeout()
            transport.write(
                _answer_bytes(
                    b"HTTP/1.1 408 Request Timeout",
                    error_body(error.message),
                    self.site.date.now(),
                    True,
                )
            )
            api.count(route.endpoint, error.status)
            self.route = None
        transport.close()

    # ------------------------------------------------------- leaving

    def _release(self) -> None:
        self.site.api.buffered -= self.held
        self.held = 0

    def _leave(self) -> None:
        self._next_request()
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.site.fronts.discard(self)
        self.transport = None

    def _hand_over(self) -> None:
        """aiohttp serves the connection from the unanswered request on."""
        transport = self.transport
        assert transport is not None
        rest = bytes(self.buf)
        if self.answered:
            # aiohttp's side counts on from here (`max_requests_per_connection`).
            self.site.api.answered[transport] = self.answered
        self._leave()
        handler = self.site.aiohttp_server()
        transport.set_protocol(handler)
        handler.connection_made(transport)
        if self.paused:
            # The front stopped reading for its own unread answers; aiohttp
            # waits on writing instead and resumes reading itself.
            handler.pause_writing()
            transport.resume_reading()
        if rest:
            handler.data_received(rest)

    def close(self) -> None:
        """Shutdown: as aiohttp cancels a handler at shutdown, a body half
        received is not counted as the client's hang-up."""
        if self.transport is not None:
            self.route = None
            self.transport.close()


class QuerySite(web.BaseSite):
    """`web.TCPSite`, with each connection starting at `QueryFront`."""

    __slots__ = (
        "_host",
        "_port",
        "_sock",
        "aiohttp_server",
        "api",
        "date",
        "fronts",
        "loop",
        "max_connections",
        "refusals",
        "routes",
    )

    def __init__(
        self,
        runner: web.BaseRunner,
        host: str | None = None,
        port: int = 0,
        *,
        sock: socket.socket | None = None,
        backlog: int = 128,
        max_connections: int = DEFAULT_MAX_CONNECTIONS,
    ) -> None:
        super().__init__(runner, backlog=backlog)
        if max_connections < 1:
            raise ValueError(f"max_connections must be at least 1, got {max_connections}")
        self.max_connections = max_connections
        self.refusals = RateLimitedLog("kvconductor.http")
        self._host = host
        self._port = port
        self._sock = sock  # listening already (tests, the benchmark): host and port unused
        app = runner.app if isinstance(runner, web.AppRunner) else None
        if app is None:
            raise TypeError("QuerySite serves an AppRunner over make_app's application")
        self.api: QueryApi = app[API_KEY]
        self.fronts: set[QueryFront] = set()
        self.date = _Date()
        self.routes = {
            b"/query": _Route("query", self.api.token_answer, self.api.latency_query),
            b"/query_by_hash": _Route("query_by_hash", self.api.hash_answer, self.api.latency_hash),
        }

    @property
    def name(self) -> str:
        return f"http://{self._host or '0.0.0.0'}:{self._port}"

    def open_connections(self) -> int:
        """Connections open now: the front's, and those handed to aiohttp.
        aiohttp keeps a lost connection's handler until its request task
        ends (up to its keep-alive timeout): one whose transport is gone is
        not open."""
        handed = sum(1 for h in self.aiohttp_server.connections if h.transport is not None)
        return len(self.fronts) + handed

    def refuse(self) -> None:
        """Count (and, at most once a minute, log) a connection over the limit."""
        self.api.metrics.http_connections_refused.inc()
        self.refusals.warn(
            "max_connections",
            "http connection refused: at max_connections",
            max_connections=self.max_connections,
        )

    async def start(self) -> None:
        await super().start()
        server = self._runner.server
        assert server is not None
        self.aiohttp_server = server
        self.loop = asyncio.get_running_loop()
        where: dict[str, Any] = (
            {"sock": self._sock}
            if self._sock is not None
            else {"host": self._host, "port": self._port}
        )
        self._server = await self.loop.create_server(
            lambda: QueryFront(self), backlog=self._backlog, **where
        )

    async def stop(self) -> None:
        await super().stop()
        for front in list(self.fronts):
            front.close()

    @property
    def port(self) -> int:
        """The bound port (the one asked for until started)."""
        server: Any = self._server
        if server is None or not server.sockets:
            return self._port
        return int(server.sockets[0].getsockname()[1])
