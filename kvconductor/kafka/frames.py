"""A broker connection whose every response lands whole in one buffer.

aiokafka's connection reads responses through asyncio's `StreamReader`:
each chunk from the socket is appended to the reader's buffer, each
response copied out of it, and its decoder copies a Fetch response's
records out once more: three copies of every fetched byte, over half the
native fetch path's CPU (kvconductor/tools/bench/kafka_ingest.py --kafka-only). Here the
socket is read (an `asyncio.BufferedProtocol`) straight into a buffer the
size of the response frame, which the kernel then reads in place
(`_kernel.fetch_response`, `RecordReader.read`).

aiokafka still opens the connection: its ApiVersions lookup and its SASL
handshake, over TLS when configured, so every security setting it
supports holds here unchanged. Once it is open, with no request of its
own outstanding, its transport is handed to this protocol and aiokafka's
connection object lets go of it.
"""

from __future__ import annotations

import asyncio
import collections
import struct
from typing import Any

from aiokafka import errors as kafka_errors
from aiokafka.conn import create_conn

_SIZE = struct.Struct(">i")

# The largest answer whose buffer a connection keeps for the next (see
# `FrameConnection.request`): a fresh buffer's every page is faulted in
# as the socket fills it, on a VM as costly as reading its records. A
# catch-up's answers are a few MiB each; past this they are not kept.
KEEP_BYTES = 16 * 1024 * 1024


class _Frames(asyncio.BufferedProtocol):
    """Size-prefixed frames, each read straight into the buffer its owner
    gives for its size."""

    def __init__(self, owner: FrameConnection) -> None:
        self._owner = owner
        self._head = bytearray(4)
        self._frame: memoryview | None = None  # None: reading a size
        self._view = memoryview(self._head)
        self._filled = 0

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._view[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self._filled += nbytes
        if self._filled < len(self._view):
            return
        if self._frame is None:
            (size,) = _SIZE.unpack(self._head)
            if size < 0:
                self._owner.close(kafka_errors.KafkaConnectionError("negative response size"))
                return
            self._frame = self._view = self._owner._buffer_for(size)
            self._filled = 0
            if size:
                return
        frame, self._frame = self._frame, None
        self._view = memoryview(self._head)
        self._filled = 0
        self._owner._on_frame(frame)

    def eof_received(self) -> bool:
        return False  # the transport closes: connection_lost follows

    def connection_lost(self, exc: Exception | None) -> None:
        self._owner._on_lost(exc)


class FrameConnection:
    """Requests to one broker; each answer is (the request's API version,
    its response frame: the correlation id, then the response)."""

    def __init__(
        self,
        writer: asyncio.StreamWriter,
        versions: dict[int, tuple[int, int]],
        client_id: str,
        timeout_s: float,
        where: str,
    ) -> None:
        # Held: a StreamWriter let go of closes its transport.
        self._writer = writer
        self._transport = transport = writer.transport
        self._versions = versions
        self._client_id = client_id
        self._timeout_s = timeout_s
        self._where = where
        # Per request outstanding: its correlation id, its answer to be, and
        # whether that may be read into the kept buffer.
        self._pending: collections.deque[tuple[int, asyncio.Future[memoryview], bool]] = (
            collections.deque()
        )
        self._correlation = 0
        self._store = bytearray()  # the kept answer buffer (`request`'s `reuse`)
        self._closed: kafka_errors.KafkaError | None = None
        transport.set_protocol(_Frames(self))

    @classmethod
    async def open(
        cls,
        host: str,
        port: int,
        *,
        client_id: str,
        request_timeout_ms: int = 40_000,
        **options: Any,
    ) -> FrameConnection:
        """A connection to `host:port`, opened and authenticated by aiokafka
        with `options` (`create_conn`'s: security_protocol, ssl_context,
        sasl_*)."""
        conn = await create_conn(
            host, port, client_id=client_id, request_timeout_ms=request_timeout_ms, **options
        )
        # aiokafka's connection has no way to hand its socket over: its
        # attributes, as aiokafka 0.14 names them (pinned in pyproject).
        writer, task = conn._writer, conn._read_task
        if writer is None or conn._requests:
            conn.close()
            raise kafka_errors.KafkaConnectionError(f"{host}:{port}: not open after its handshake")
        conn._reader = conn._writer = conn._read_task = None  # its close() leaves the socket be
        task.cancel()
        return cls(writer, conn._versions, client_id, request_timeout_ms / 1000, f"{host}:{port}")

    @property
    def connected(self) -> bool:
        return self._closed is None

    async def request(self, request: Any, *, reuse: bool = False) -> tuple[int, memoryview]:
        """Sends aiokafka's `request` (a `Request`, e.g. `FetchRequest`) at
        the highest version both sides speak; its answer's frame.

        `reuse`: the caller is done with the answer of its last `reuse`
        request, whose buffer this answer may then be read into (one such
        answer outstanding at a time; others get buffers of their own)."""
        if self._closed is not None:
            raise self._closed
        struct_ = request.prepare(self._versions)
        self._correlation = (self._correlation + 1) % 2**31
        header = struct_.build_request_header(
            correlation_id=self._correlation, client_id=self._client_id
        )
        message = header.encode() + struct_.encode()
        future: asyncio.Future[memoryview] = asyncio.get_running_loop().create_future()
        reuse = reuse and not any(r for _, _, r in self._pending)
        self._pending.append((self._correlation, future, reuse))
        self._transport.write(_SIZE.pack(len(message)) + message)
        try:
            async with asyncio.timeout(self._timeout_s):
                return struct_.API_VERSION, await future
        except TimeoutError:
            # Its answer may yet come: the connection is out of step.
            error = kafka_errors.KafkaTimeoutError(f"{self._where}: no answer in time")
            self.close(error)
            raise error from None

    def close(self, why: kafka_errors.KafkaError | None = None) -> None:
        if self._closed is None:
            self._closed = why or kafka_errors.KafkaConnectionError(f"{self._where}: closed")
            self._transport.close()
        self._fail_pending()

    def _buffer_for(self, size: int) -> memoryview:
        """Where the next answer, of `size` bytes, is read."""
        if size <= KEEP_BYTES and self._pending and self._pending[0][2]:
            if len(self._store) < size:
                self._store = bytearray(size)
            return memoryview(self._store)[:size]
        return memoryview(bytearray(size))

    def _on_frame(self, frame: memoryview) -> None:
        if not self._pending:
            self.close(kafka_errors.CorrelationIdError(f"{self._where}: an answer unasked for"))
            return
        correlation, future, _ = self._pending.popleft()
        if len(frame) < 4 or _SIZE.unpack_from(frame)[0] != correlation:
            self.close(kafka_errors.CorrelationIdError(f"{self._where}: answers out of order"))
            if not future.done():
                future.set_exception(self._closed or kafka_errors.CorrelationIdError())
            return
        if not future.done():  # not given up on
            future.set_result(frame)

    def _on_lost(self, exc: Exception | None) -> None:
        if self._closed is None:
            self._closed = kafka_errors.KafkaConnectionError(f"{self._where}: connection lost")
            if exc is not None:
                self._closed.__cause__ = exc
        self._fail_pending()

    def _fail_pending(self) -> None:
        pending, self._pending = self._pending, collections.deque()
        for _, future, _ in pending:
            if not future.done():
                assert self._closed is not None
                future.set_exception(self._closed)
