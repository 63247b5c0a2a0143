"""One stream = one publisher socket (publisher id, dp rank): read, sequence, buffer.

Data-parallel engines publish one socket per rank, rank r at the endpoint's
port + r (vLLM's `offset_endpoint_port`); a publisher with `dp_rank = a` and
`dp_size = n` is `n` streams, rank `a + i` on `endpoint` port + i and
`replay_endpoint` port + i.
"""

from __future__ import annotations

import asyncio
import contextlib

import structlog
import zmq.asyncio

from kvconductor.bridge.buffer import Budget, StreamBuffer
from kvconductor.bridge.config import BridgeSettings
from kvconductor.bridge.frames import FrameError, parse_live
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.bridge.reconcile import reconcile_forever
from kvconductor.bridge.relay import Relay
from kvconductor.bridge.replay import ReplayClient
from kvconductor.bridge.subscription import Subscription
from kvconductor.registry.publishers import PublisherConfig, StreamKey, endpoint_for_rank

log = structlog.get_logger("kvconductor.bridge.stream")


def stream_keys(pub: PublisherConfig) -> list[StreamKey]:
    return [StreamKey(pub.id, rank) for rank in pub.ranks]


class Stream:
    def __init__(
        self,
        pub: PublisherConfig,
        rank: int,
        topic: str,
        ctx: zmq.asyncio.Context,
        settings: BridgeSettings,
        budget: Budget,
        metrics: BridgeMetrics,
        origin: str,
    ) -> None:
        self.key = StreamKey(pub.id, rank)
        self.pub = pub
        self.origin = origin  # "config" or "registration"
        offset = rank - pub.dp_rank
        self.endpoint = endpoint_for_rank(pub.endpoint, offset)
        self.replay_endpoint = (
            endpoint_for_rank(pub.replay_endpoint, offset) if pub.replay_endpoint else None
        )
        self.ctx = ctx
        self.settings = settings
        self.metrics = metrics
        self.buffer = StreamBuffer(self.key, topic, budget)
        replay = (
            ReplayClient(ctx, self.replay_endpoint, settings.replay_timeout_s).fetch
            if self.replay_endpoint
            else None
        )
        self.relay = Relay(pub, rank, self.buffer, replay, metrics)
        self.task: asyncio.Task[None] | None = None
        self.reconcile_task: asyncio.Task[None] | None = None

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.task = loop.create_task(self._run(), name=f"bridge-stream-{self.key}")
        live, url = self.relay.live, self.pub.reconcile_url
        if live is not None and url is not None:
            labels = (self.key.id, str(self.key.rank))

            def counted(outcome: str, removed: int) -> None:
                self.metrics.reconciles.labels(*labels, outcome).inc()
                self.metrics.reconciled_removed.labels(*labels).inc(removed)

            self.reconcile_task = loop.create_task(
                reconcile_forever(
                    live,
                    self.relay.lock,
                    url,
                    self.pub.reconcile_interval_s,
                    self.relay.reconciled,
                    counted,
                    str(self.key),
                ),
                name=f"bridge-reconcile-{self.key}",
            )

    async def _run(self) -> None:
        sub = Subscription(self.ctx, self.endpoint, self.pub.zmq_topic, self.settings.zmq_rcvhwm)
        log.info(
            "subscribed",
            stream=str(self.key),
            endpoint=self.endpoint,
            replay_endpoint=self.replay_endpoint,
        )
        idle_ms = int(self.settings.idle_probe_s * 1000)
        lock = self.relay.lock
        try:
            async with lock:
                await self.relay.attach()
            while True:
                if idle_ms > 0 and not await sub.poll(idle_ms):
                    async with lock:
                        await self.relay.probe()
                    continue
                frames = await sub.recv()
                try:
                    msg = parse_live(frames)
                except FrameError as exc:
                    self.metrics.malformed.labels(self.key.id, str(self.key.rank), "live").inc()
                    log.warning(
                        "malformed live message dropped", stream=str(self.key), error=str(exc)
                    )
                    continue
                async with lock:
                    await self.relay.on_live(msg)
        finally:
            sub.close()

    async def stop(self, flush_timeout_s: float, resync_reason: str | None = None) -> bool:
        """Stop reading; optionally write a last resync record; wait until
        Kafka has everything buffered. False if that timed out."""
        if self.reconcile_task is not None:
            self.reconcile_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.reconcile_task
            self.reconcile_task = None
        if self.task is not None:
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.task
            self.task = None
        if resync_reason is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.relay.resync("unregistered", resync_reason), flush_timeout_s
                )
        drained = await self.buffer.drained(flush_timeout_s)
        if not drained:
            log.warning(
                "stream stopped with records not on Kafka",
                stream=str(self.key),
                records=len(self.buffer),
            )
        return drained

    def describe(self) -> dict[str, object]:
        return {
            "id": self.key.id,
            "dp_rank": self.key.rank,
            "kind": self.pub.kind,
            "source": self.pub.source,
            "origin": self.origin,
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.buffer.topic,
            "next_seq": self.relay.expected,
            "buffered": len(self.buffer),
        }
