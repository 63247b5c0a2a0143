"""One stream's sequence logic: in order, gaps filled by replay, or resync.

`Relay.on_live` takes each live message and puts records into the stream's
buffer so that the records on Kafka are, per stream, exactly the publisher's
messages in sequence order, each once, with a resync control record wherever
that cannot hold:

- attach (the stream starts with a replay endpoint, or without one the
  first message the bridge sees of it, or of a restarted publisher): a
  resync record first, since whatever the index holds for the instance's
  rank may be stale; then, if there is a replay endpoint, everything the
  publisher still buffers from seq 0 on (its history, as far as it goes),
  at once, so an idle engine's cache is indexed before it serves again; then
  the live messages (if the replay found nothing, the first live message
  that is not seq 0 asks for the history again, without a second resync);
- restart: the live sequence goes back (a new publisher process counts from
  0 again), or a live message comes under a number a replay already relayed
  but is not that message: resync with reason `restarted`, then as attach;
- gap: a live sequence number beyond the next expected one. The replay
  endpoint is asked for everything from the next expected on; replayed
  messages fill the gap in order, duplicates (already relayed) are dropped.
  If the gap cannot be filled (no replay endpoint, the publisher's replay
  buffer no longer has the start of it, the endpoint does not answer), a
  resync record says so and relaying goes on from the first message
  available.

While a replay runs, the live socket is not read (ZMQ queues it), so live
messages that the replay already delivered arrive after it and are dropped
as duplicates (after checking that they are the same messages).

`probe` (called when the live socket has been quiet) asks the replay
endpoint for anything after the last relayed message: the dropped tail of a
burst leaves no gap to see until the next message.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable

import structlog

from kvconductor.bridge.buffer import StreamBuffer
from kvconductor.bridge.frames import Message
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.bridge.reconcile import LiveKeys
from kvconductor.bridge.records import data_entry, reconciled_entry, resync_entry
from kvconductor.bridge.replay import ReplayError
from kvconductor.registry.publishers import PublisherConfig

log = structlog.get_logger("kvconductor.bridge.relay")

ReplayFetch = Callable[[int], AsyncIterator[Message]]
MISMATCH = "mismatch"
ATTACHED = "bridge attached to the stream: earlier state unknown"


class Relay:
    def __init__(
        self,
        pub: PublisherConfig,
        rank: int,
        buffer: StreamBuffer,
        replay: ReplayFetch | None,
        metrics: BridgeMetrics,
    ) -> None:
        self.pub = pub
        self.rank = rank
        self.buffer = buffer
        self.replay = replay
        self.metrics = metrics
        self.labels = (pub.id, str(rank))
        self.expected: int | None = None  # next sequence number to relay
        self.last_live: int | None = None
        # (seq, hash of payload) of replayed messages ahead of the live stream,
        # in order: the live copies that may still come are duplicates only
        # if they are the same messages.
        self._ahead: deque[tuple[int, int]] = deque()
        self._last: tuple[int, int] | None = None  # (seq, hash) last relayed
        # A resync was written and the history replay found nothing yet.
        self._fresh = False
        # A pool master reconciled against its key list: the keys relayed as
        # stored (`bridge.reconcile`); `lock` orders its removal records
        # against the stream's own messages.
        self.live = LiveKeys() if pub.kind == "pool" and pub.reconcile_url else None
        self.lock = asyncio.Lock()

    # ------------------------------------------------------------- input

    async def on_live(self, msg: Message) -> None:
        last = self.last_live
        self.last_live = msg.seq
        if last is not None and msg.seq <= last:
            await self._begin(
                msg,
                "restarted",
                f"publisher restarted: sequence went back from {last} to {msg.seq}",
            )
            return
        if self.expected is None:
            if self._fresh:
                await self._history(msg, "attached")
            else:
                await self._begin(msg, "attached", ATTACHED)
            return
        if msg.seq < self.expected:
            if self._replayed(msg):
                self.metrics.duplicates.labels(*self.labels).inc()
                return
            # Not the message relayed under that number: a new publisher
            # process whose first messages the bridge did not see.
            await self._begin(
                msg,
                "restarted",
                f"publisher restarted: seq {msg.seq} is not the message relayed as {msg.seq}",
            )
            return
        if msg.seq > self.expected:
            self.metrics.gaps.labels(*self.labels).inc()
            self.metrics.gap_messages.labels(*self.labels).inc(msg.seq - self.expected)
            log.info("gap", stream=str(self.buffer.key), expected=self.expected, got=msg.seq)
            if await self._fill(self.expected, msg.seq) == MISMATCH:
                await self._begin(msg, "restarted", self._mismatch_reason())
                return
            if msg.seq < self.expected:
                self.metrics.duplicates.labels(*self.labels).inc()
                return
        await self._relay(msg)

    async def attach(self) -> None:
        """The stream starts: with a replay endpoint, resync and relay the
        publisher's history now, not on its next message."""
        if self.replay is not None:
            await self._begin(None, "attached", ATTACHED)

    async def probe(self) -> None:
        """The live socket was quiet for a while: ask the replay endpoint for
        anything after the last relayed message. A PUB socket that drops the
        last messages of a burst leaves no gap to see until the next message;
        this finds them. Nothing found, or no answer, is not an error."""
        if self.replay is None or self.expected is None:
            return
        start = self.expected
        outcome = await self._replay(start, start, fresh=False, probe=True)
        if outcome == MISMATCH:
            await self._begin(None, "restarted", self._mismatch_reason())
        elif outcome not in ("empty", "failed"):
            self.metrics.gaps.labels(*self.labels).inc()
            self.metrics.gap_messages.labels(*self.labels).inc(self.expected - start)
            log.info("messages found by an idle probe", stream=str(self.buffer.key), start=start)

    def _replayed(self, msg: Message) -> bool:
        """Whether a live message below `expected` is one a replay relayed."""
        ahead = self._ahead
        while ahead and ahead[0][0] < msg.seq:
            ahead.popleft()  # dropped live: will never come
        if ahead and ahead[0][0] == msg.seq:
            return ahead.popleft()[1] == hash(msg.payload)
        return False

    def _mismatch_reason(self) -> str:
        seq = self._last[0] if self._last is not None else -1
        return (
            f"publisher restarted: its replay buffer holds another message as seq {seq} "
            "than the one relayed"
        )

    # ----------------------------------------------------------- actions

    async def resync(self, label: str, reason: str) -> None:
        """Write a resync record (the daemon clears this instance's rank)."""
        self.metrics.resyncs.labels(*self.labels, label).inc()
        # Attaching is how every stream starts; the others lose messages.
        level = log.info if label == "attached" else log.warning
        level("resync", stream=str(self.buffer.key), kind=label, reason=reason)
        await self.buffer.put(resync_entry(self.pub, self.rank, label, reason))
        if self.live is not None:
            self.live.clear()

    async def reconciled(self, payload: bytes) -> None:
        """Removals the bridge inferred from the master's key list."""
        await self.buffer.put(reconciled_entry(self.pub, self.rank, payload))

    async def _relay(self, msg: Message) -> None:
        await self.buffer.put(data_entry(self.pub, self.rank, msg.seq, msg.payload))
        if self.live is not None:
            self.live.observe(msg.payload)
        self.expected = msg.seq + 1
        self._last = (msg.seq, hash(msg.payload))

    async def _unfillable(self, label: str, reason: str, resume_at: int) -> None:
        self.metrics.unfillable.labels(*self.labels, label).inc()
        await self.resync(label, reason)
        self.expected = resume_at

    async def _begin(self, msg: Message | None, label: str, reason: str) -> None:
        """Resync, then the publisher's history from seq 0 (as far as its
        replay buffer goes), then `msg` (the live message, if any)."""
        await self.resync(label, reason)
        self.expected = None
        self._last = None
        self._ahead.clear()
        await self._history(msg, label)

    async def _history(self, msg: Message | None, label: str) -> None:
        """After a resync: the replay from seq 0, then `msg`."""
        self._fresh = False
        if self.replay is not None and (msg is None or msg.seq > 0):
            outcome = await self._replay(0, 0 if msg is None else msg.seq, fresh=True)
            log.info(
                "history replayed",
                stream=str(self.buffer.key),
                after=label,
                outcome=outcome,
                next_seq=self.expected,
            )
        if msg is None:
            self._fresh = self.expected is None
            return
        if self.expected is None or msg.seq == self.expected:
            await self._relay(msg)
        elif msg.seq < self.expected:
            self.metrics.duplicates.labels(*self.labels).inc()
        else:
            await self._unfillable(
                "replay_overrun",
                f"history replay ended at seq {self.expected - 1}, before live seq {msg.seq}",
                msg.seq,
            )
            await self._relay(msg)

    async def _fill(self, start: int, live: int) -> str:
        """Relay what the replay endpoint has from `start`; resync if `live`
        (the message after the gap) is still not reached afterwards. Returns
        the replay's outcome (MISMATCH: the publisher is another process)."""
        assert self.expected is not None
        if self.replay is None:
            await self._unfillable(
                "no_replay",
                f"messages {start}..{live - 1} lost and the publisher has no replay endpoint",
                live,
            )
            return "none"
        outcome = await self._replay(start, live, fresh=False)
        if outcome != MISMATCH and self.expected < live:
            why = {
                "failed": "the replay endpoint failed",
                "empty": "the replay endpoint no longer holds them",
            }.get(outcome, "the replay ended early")
            await self._unfillable(
                "replay_failed" if outcome == "failed" else "replay_overrun",
                f"messages {self.expected}..{live - 1} lost: {why}",
                live,
            )
        return outcome

    async def _replay(self, start: int, live: int, fresh: bool, probe: bool = False) -> str:
        """Relay replayed messages from `start` in order; returns the outcome
        (filled, partial, empty, failed, mismatch). With `fresh` (after a
        resync) the first replayed message starts the stream, whatever its
        number. Otherwise the request starts one message earlier, at the last
        one relayed: if the publisher holds another message under that
        number, it is a new process (MISMATCH) and nothing is relayed."""
        assert self.replay is not None
        verify = self._last if not fresh and self._last is not None else None
        if verify is not None and verify[0] != start - 1:
            verify = None
        outcome = "empty"
        got = 0
        try:
            async for m in self.replay(start - 1 if verify is not None else start):
                if verify is not None:
                    if m.seq == verify[0]:
                        if hash(m.payload) != verify[1]:
                            outcome = MISMATCH
                            break
                        verify = None
                        continue
                    verify = None  # no longer held: continuity cannot be checked
                if self.expected is None and fresh:
                    self.expected = m.seq
                    if m.seq > start:
                        outcome = "partial"
                assert self.expected is not None
                if m.seq < self.expected:
                    self.metrics.duplicates.labels(*self.labels).inc()
                    continue
                if m.seq > self.expected:
                    outcome = "partial"
                    await self._unfillable(
                        "replay_overrun",
                        f"messages {self.expected}..{m.seq - 1} lost: no longer in the "
                        "publisher's replay buffer",
                        m.seq,
                    )
                elif outcome == "empty":
                    outcome = "filled"
                await self._relay(m)
                got += 1
                if self.last_live is None or m.seq > self.last_live:
                    self._ahead.append((m.seq, hash(m.payload)))
        except ReplayError as exc:
            if probe and got == 0:
                log.debug("idle probe unanswered", stream=str(self.buffer.key), error=str(exc))
                return "failed"
            log.warning("replay failed", stream=str(self.buffer.key), error=str(exc))
            outcome = "failed"
        if outcome == "filled" and (self.expected is None or self.expected < live):
            outcome = "partial"
        if probe and outcome == "empty":
            return outcome
        self.metrics.replays.labels(*self.labels, outcome).inc()
        self.metrics.replayed.labels(*self.labels).inc(got)
        return outcome
