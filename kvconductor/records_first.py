"""Background work on the event loop that gives way to records.

A snapshot generation's work after its cut (reading identities, encoding,
sending) and its pre-copy rounds share the daemon's one event loop with
the records being applied. Taking turns with every batch gave that work
half the loop while it ran (1-3 s every generation at 4M entries), so at
half load records queued behind it and produce-to-queryable p99 was
hundreds of milliseconds. Here the background work runs its steps while no
batch is being applied, and while one is, waits at most `SHARE` times its
last step: when records never stop, it still gets a fifth of the loop and
the generation finishes.

    first = RecordsFirst()
    # the consumer, around each batch it applies:
    first.applying(); ...; first.done()
    # the background work, between its steps:
    await first.turn()
"""

from __future__ import annotations

import asyncio
import time

# While records wait, a background step of t seconds is followed by at most
# SHARE * t of records: the background keeps 1 / (1 + SHARE) of a busy loop.
SHARE = 4.0
# The least it waits for records, for steps too short to time, and the
# most (a step that awaited I/O was not all work).
MIN_WAIT_S = 0.001
MAX_WAIT_S = 0.1


class RecordsFirst:
    def __init__(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        self._resumed = time.perf_counter()

    @property
    def busy(self) -> bool:
        """Whether a batch of records is being applied."""
        return not self._idle.is_set()

    def applying(self) -> None:
        self._idle.clear()

    def done(self) -> None:
        self._idle.set()

    async def turn(self) -> None:
        """Between two steps of background work: tasks that are ready run
        (queries, the consumer taking its next batch), then, while records
        are being applied, wait for them to finish, or for the step's share."""
        step = time.perf_counter() - self._resumed
        await asyncio.sleep(0)
        if self.busy:
            try:
                async with asyncio.timeout(min(MAX_WAIT_S, max(MIN_WAIT_S, SHARE * step))):
                    while self.busy:
                        await self._idle.wait()
            except TimeoutError:
                pass
        self._resumed = time.perf_counter()
