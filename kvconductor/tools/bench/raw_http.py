"""The cheapest HTTP/1.1 client: one keep-alive connection, one request at
a time, each written in one piece and its answer read by Content-Length.

The figures that query the daemon while measuring it (HTTP load, the end to
end probes) share two cores with it: a general client library (aiohttp's)
costs several times the server's own HTTP work per request, and far more
than this one, which would be measured as the server's slowness.
"""

from __future__ import annotations

import asyncio
import re
import time
from typing import cast

_CONTENT_LENGTH = re.compile(rb"\r\ncontent-length:[ \t]*(\d+)", re.IGNORECASE)
_CONNECTION_CLOSE = re.compile(rb"\r\nconnection:[ \t]*close\b", re.IGNORECASE)


def post(port: int, path: str, body: bytes) -> bytes:
    """A whole `POST path` request with a JSON body, for `RawConnection`."""
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


async def connect(port: int) -> RawConnection:
    _, conn = await asyncio.get_running_loop().create_connection(RawConnection, "127.0.0.1", port)
    conn.port = port
    return conn


class RawConnection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time; an
    answer that says `Connection: close` (the server's
    `max_requests_per_connection`) closes it, and the next request opens
    another."""

    def __init__(self) -> None:
        self.port = 0
        self._closing = False  # the answer being read says Connection: close
        self._closed_by_us = 0  # connection_lost calls of transports closed here
        self._buffer = bytearray()
        self._end = -1  # where the answer in the buffer ends, once its head is in
        self._body_at = 0
        self._status = 0
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        if self._end < 0:
            head_end = self._buffer.find(b"\r\n\r\n")
            if head_end < 0:
                return
            head = bytes(self._buffer[:head_end])
            length = _CONTENT_LENGTH.search(head)
            if length is None:
                self._fail(RuntimeError(f"answer without Content-Length: {head[:200]!r}"))
                return
            self._status = int(head[9:12])
            self._closing = _CONNECTION_CLOSE.search(head) is not None
            self._body_at = head_end + 4
            self._end = self._body_at + int(length.group(1))
        if len(self._buffer) >= self._end:
            answer = (self._status, bytes(self._buffer[self._body_at : self._end]))
            del self._buffer[: self._end]
            self._end = -1
            if self._closing and self._transport is not None:
                self._closing = False
                self._closed_by_us += 1
                self._transport.close()
                self._transport = None
                self._buffer.clear()
            if self._waiter is not None and not self._waiter.done():
                self._waiter.set_result(answer)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._closed_by_us:
            self._closed_by_us -= 1
            return
        self._fail(exc or ConnectionError("the server closed the connection"))

    def _fail(self, exc: BaseException) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(exc)

    def close(self) -> None:
        if self._transport is not None:
            self._closed_by_us += 1
            self._transport.close()
            self._transport = None

    async def exchange(self, request: bytes) -> tuple[int, bytes]:
        """Send one whole request; its status and body."""
        if self._transport is None:
            loop = asyncio.get_running_loop()
            await loop.create_connection(lambda: self, "127.0.0.1", self.port)
        assert self._transport is not None
        self._waiter = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return await self._waiter


async def rate(port: int, path: str, bodies: list[bytes], clients: int, requests: int) -> float:
    """Answers a second of `requests` POSTs of `bodies` (round robin) over
    `clients` keep-alive connections, each one request at a time: a router's
    connection pool under load. Every answer must be a 200."""
    conns = [await connect(port) for _ in range(clients)]
    wire = [post(port, path, b) for b in bodies]
    per = max(1, requests // clients)

    async def drive(conn: RawConnection, first: int, n: int) -> None:
        for i in range(n):
            status, body = await conn.exchange(wire[(first + i) % len(wire)])
            if status != 200:
                raise RuntimeError(f"{path} answered {status}: {body[:200]!r}")

    try:
        await asyncio.gather(*(drive(c, i, 4) for i, c in enumerate(conns)))  # warm-up
        started = time.perf_counter()
        await asyncio.gather(*(drive(c, i * per, per) for i, c in enumerate(conns)))
        return clients * per / (time.perf_counter() - started)
    finally:
        for c in conns:
            c.close()
