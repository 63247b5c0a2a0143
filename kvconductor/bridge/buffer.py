"""Ordered, bounded buffers between the ZMQ side and the Kafka producer.

Every stream (publisher id, dp rank) has a `StreamBuffer`: its records in
sequence order, from the moment they are read off ZMQ until Kafka
acknowledges them. All buffers draw on one `Budget` (records and bytes).
When the budget is spent, `StreamBuffer.put` waits: the stream stops reading
its sockets, ZMQ's own queues (the subscriber's receive high-water mark, the
publisher's send high-water mark) hold what comes next, and beyond those
the publisher drops messages. The bridge then sees a sequence gap once Kafka
drains the buffer, and fills it from the publisher's replay buffer, or says
so with a resync record when it cannot. So memory stays bounded and nothing
is lost silently.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from kvconductor.bridge.records import Entry
from kvconductor.registry.publishers import StreamKey


class Budget:
    """Records and bytes held by all buffers together, with waiting."""

    def __init__(self, max_messages: int, max_bytes: int) -> None:
        self.max_messages = max_messages
        self.max_bytes = max_bytes
        self.messages = 0
        self.bytes = 0
        self.on_full: Callable[[], None] | None = None
        self.waited_s = 0.0
        self._freed = asyncio.Event()

    def fits(self, size: int) -> bool:
        if self.messages == 0:
            return True  # one record larger than the byte bound still passes alone
        return self.messages < self.max_messages and self.bytes + size <= self.max_bytes

    async def acquire(self, size: int) -> None:
        if not self.fits(size):
            if self.on_full is not None:
                self.on_full()
            start = time.monotonic()
            while not self.fits(size):
                self._freed.clear()
                await self._freed.wait()
            self.waited_s += time.monotonic() - start
        self.messages += 1
        self.bytes += size

    def release(self, size: int) -> None:
        self.messages -= 1
        self.bytes -= size
        self._freed.set()


class StreamBuffer:
    """One stream's records in order: `entries[:sent]` are with the producer
    (not yet acknowledged), `entries[sent:]` wait to be sent."""

    def __init__(self, key: StreamKey, topic: str, budget: Budget) -> None:
        self.key = key
        self.topic = topic
        self.budget = budget
        self.entries: deque[Entry] = deque()
        self.sent = 0
        self.changed = asyncio.Event()
        self.closed = False
        self._empty = asyncio.Event()
        self._empty.set()

    def __len__(self) -> int:
        return len(self.entries)

    async def put(self, entry: Entry) -> None:
        """Append in order; waits while the budget is spent (backpressure)."""
        await self.budget.acquire(entry.size)
        self.entries.append(entry)
        self._empty.clear()
        self.changed.set()

    def pop_acked(self, entry: Entry) -> bool:
        """Remove an acknowledged record (always the oldest one sent)."""
        if not self.entries or self.entries[0] is not entry:
            try:
                self.entries.remove(entry)
            except ValueError:
                return False
        else:
            self.entries.popleft()
        self.sent -= 1
        self.budget.release(entry.size)
        if not self.entries:
            self._empty.set()
        return True

    def replace_unsent(self, index: int, entry: Entry) -> None:
        old = self.entries[index]
        self.entries[index] = entry
        self.budget.bytes += entry.size - old.size

    def drop_all(self) -> int:
        n = len(self.entries)
        for entry in self.entries:
            self.budget.release(entry.size)
        self.entries.clear()
        self.sent = 0
        self._empty.set()
        return n

    async def drained(self, timeout: float) -> bool:
        """Wait until every record is acknowledged; False on timeout."""
        try:
            await asyncio.wait_for(self._empty.wait(), timeout)
        except TimeoutError:
            return False
        return True
