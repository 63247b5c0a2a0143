"""Replay client: asks a publisher's ROUTER socket for the messages it buffered.

A fresh DEALER socket per request (a REQ socket would receive only the first
replayed message, and a timed-out request's late replies must not mix with
the next one's). The request is `[b"", seq]`; the reply is every buffered
message with a sequence number from `seq` on, in order, then the end marker
(see `frames`). `replay_timeout_s` bounds the wait for each next frame, not
the whole reply: the caller may pause between messages (a full buffer).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from kvconductor.bridge.frames import FrameError, Message, parse_replay, replay_request


class ReplayError(Exception):
    """The replay endpoint did not answer in time, or answered nonsense."""


class ReplayClient:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, timeout_s: float) -> None:
        self.ctx = ctx
        self.endpoint = endpoint
        self.timeout_ms = max(1, int(timeout_s * 1000))

    async def fetch(self, start_seq: int) -> AsyncIterator[Message]:
        """Every message the publisher still holds from `start_seq` on, in order."""
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(self.endpoint)
            try:
                await asyncio.wait_for(
                    sock.send_multipart(replay_request(start_seq)), self.timeout_ms / 1000
                )
            except TimeoutError:
                raise ReplayError(f"cannot send the replay request to {self.endpoint}") from None
            while True:
                if not await sock.poll(self.timeout_ms):
                    raise ReplayError(f"no reply from {self.endpoint} within {self.timeout_ms} ms")
                frames = await sock.recv_multipart()
                try:
                    msg = parse_replay(frames)
                except FrameError as exc:
                    raise ReplayError(f"bad replay reply from {self.endpoint}: {exc}") from None
                if msg is None:
                    return
                yield msg
        finally:
            sock.close(linger=0)
