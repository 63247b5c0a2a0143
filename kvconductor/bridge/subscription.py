"""The live side of one stream: a ZMQ SUB socket on a publisher's PUB socket.

ZMQ connects and reconnects by itself (a publisher that is not up yet, or
restarts, is simply waited for). The socket's receive high-water mark is the
first queue behind the bridge's own buffer: while the bridge does not read
(its buffer is full), up to `rcvhwm` messages wait here, then in the
publisher's send queue, and after that the publisher drops them.
"""

from __future__ import annotations

import zmq
import zmq.asyncio


class Subscription:
    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, topic: str, rcvhwm: int) -> None:
        self.endpoint = endpoint
        self.socket = ctx.socket(zmq.SUB)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.RCVHWM, rcvhwm)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.socket.connect(endpoint)

    async def poll(self, timeout_ms: int) -> bool:
        """True when a message is waiting (within `timeout_ms`)."""
        return bool(await self.socket.poll(timeout_ms))

    async def recv(self) -> list[bytes]:
        return await self.socket.recv_multipart()

    def close(self) -> None:
        self.socket.close(linger=0)
