"""The bridge: publishers' ZMQ streams in, contract records on Kafka out.

Start-up: serve HTTP (health says "starting"), create the engine, pool and
registrations topics if missing (the same specs as the daemon's), start the
producer, subscribe to the config file's publishers, load the registrations
and join the bridges' group. Each stream then runs on its own (see
`stream`, `relay`), its records drained to Kafka by the sink.

Stop (SIGTERM/SIGINT, or `stop()`): stop reading ZMQ, give Kafka up to
`bridge.flush_timeout_s` to take what is buffered, leave the group (so
another bridge takes the registrations over), close.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
import zmq.asyncio
from aiohttp import web

from kvconductor.bridge.buffer import Budget, StreamBuffer
from kvconductor.bridge.config import BridgeConfig
from kvconductor.bridge.http import make_app
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.bridge.records import Entry, resync_entry
from kvconductor.bridge.registry import Registry
from kvconductor.bridge.sink import Sink
from kvconductor.bridge.stream import Stream, stream_keys
from kvconductor.config import kafka_client_options, reveal
from kvconductor.kafka.clients import until_kafka_answers
from kvconductor.kafka.topics import (
    TopicSpec,
    compacted_spec,
    ensure_service_topics,
    event_topic_specs,
)
from kvconductor.lifecycle import (
    Lifecycle,
    Phase,
    serve_until_signalled,
)
from kvconductor.registry.publishers import PublisherConfig, StreamKey
from kvconductor.wire.records import KV_CONTROL

log = structlog.get_logger("kvconductor.bridge")


def bridge_topic_specs(cfg: BridgeConfig) -> list[TopicSpec]:
    """The engine and pool topics, as the daemon creates them, plus the
    compacted registrations topic."""
    k = cfg.kafka
    registrations = compacted_spec(
        cfg.bridge.registrations_topic, k.partitions, k.replication_factor
    )
    return [*event_topic_specs(k), registrations]


class Bridge:
    def __init__(self, cfg: BridgeConfig) -> None:
        self.cfg = cfg
        b = cfg.bridge
        self.metrics = BridgeMetrics()
        self.metrics.buffer_max_messages.set(b.buffer_max_messages)
        self.metrics.buffer_max_bytes.set(b.buffer_max_bytes)
        self.budget = Budget(b.buffer_max_messages, b.buffer_max_bytes)
        self.budget.on_full = self.metrics.buffer_full.inc
        self.sink = Sink(cfg, self.metrics, self.budget)
        self.sink.on_too_large = self._too_large
        self.static: dict[StreamKey, PublisherConfig] = {
            key: pub for pub in cfg.publishers for key in stream_keys(pub)
        }
        self.registry: Registry | None = (
            Registry(cfg, self.metrics, self.reconcile, self.static.keys())
            if b.registrations
            else None
        )
        self.streams: dict[StreamKey, Stream] = {}
        self.ctx: zmq.asyncio.Context | None = None
        self.lifecycle = Lifecycle()
        self.http_port: int | None = None
        self.stopping = asyncio.Event()
        self._lock = asyncio.Lock()
        self._runner: web.AppRunner | None = None

    # ------------------------------------------------------------- HTTP

    async def _start_http(self) -> None:
        b = self.cfg.bridge
        app = make_app(self, auth_token=reveal(b.auth_token))
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, b.host, b.port)
        await site.start()
        server: Any = site._server
        self.http_port = server.sockets[0].getsockname()[1]
        log.info("http listening", host=b.host, port=self.http_port)

    @property
    def status(self) -> str:
        return self.lifecycle.status

    def health(self) -> tuple[bool, dict[str, object]]:
        kafka_ok = self.sink.delivering
        running = self.lifecycle.running
        ok = running and kafka_ok
        detail: dict[str, object] = {
            "status": "ok" if ok else "degraded" if running else self.status,
            "kafka": "up" if kafka_ok else "unavailable",
            "oldest_unacked_s": round(self.sink.waiting_s(), 3),
            "streams": len(self.streams),
            "buffer": {
                "messages": self.budget.messages,
                "bytes": self.budget.bytes,
                "max_messages": self.budget.max_messages,
                "max_bytes": self.budget.max_bytes,
            },
        }
        if self.registry is not None:
            detail["registrations"] = len(self.registry.log.catalog)
            detail["registration_partitions"] = sorted(self.registry.owned)
        return ok, detail

    def update_gauges(self) -> None:
        self.sink.update_gauges()

    def describe(self) -> dict[str, object]:
        return {
            "streams": [self.streams[k].describe() for k in sorted(self.streams)],
            "registrations": self.registry.describe() if self.registry is not None else [],
        }

    # ----------------------------------------------------------- streams

    async def reconcile(self) -> None:
        """Relay exactly the config's publishers plus the owned registrations."""
        if self.ctx is None or self.lifecycle.phase is Phase.STOPPING:
            return
        async with self._lock:
            desired = dict(self.static)
            catalog: set[StreamKey] = set()
            if self.registry is not None:
                catalog = set(self.registry.log.catalog)
                for key, pub in self.registry.desired().items():
                    desired.setdefault(key, pub)
            stops: list[Awaitable[None]] = []
            for key, stream in list(self.streams.items()):
                if desired.get(key) == stream.pub:
                    continue
                reason = None
                if stream.origin == "registration" and key not in catalog:
                    reason = "publisher unregistered: the bridge no longer follows it"
                stops.append(self._stop_stream(key, reason))
            await asyncio.gather(*stops)
            for key, pub in desired.items():
                if key not in self.streams:
                    origin = "config" if key in self.static else "registration"
                    self._start_stream(key, pub, origin)
            self.metrics.streams.set(len(self.streams))

    def _start_stream(self, key: StreamKey, pub: PublisherConfig, origin: str) -> None:
        assert self.ctx is not None
        stream = Stream(
            pub,
            key.rank,
            self.cfg.topic_for(pub),
            self.ctx,
            self.cfg.bridge,
            self.budget,
            self.metrics,
            origin,
        )
        self.streams[key] = stream
        self.sink.add(stream.buffer)
        stream.start()

    async def _stop_stream(self, key: StreamKey, resync_reason: str | None) -> None:
        stream = self.streams.pop(key)
        await stream.stop(self.cfg.bridge.flush_timeout_s, resync_reason)
        await self.sink.remove(key)
        log.info("stream stopped", stream=str(key), resync=resync_reason is not None)

    def _too_large(self, buffer: StreamBuffer, entry: Entry) -> Entry:
        stream = self.streams.get(buffer.key)
        pub = stream.pub if stream is not None else None
        self.metrics.resyncs.labels(buffer.key.id, str(buffer.key.rank), "too_large").inc()
        reason = (
            f"message seq {entry.seq} of {len(entry.value)} bytes is larger than "
            f"max_request_size {self.cfg.bridge.max_request_size}: not relayed"
        )
        if pub is None:  # pragma: no cover - the stream owns its buffer
            return Entry(entry.key, b"", [(KV_CONTROL, b"resync")], None, 64)
        return resync_entry(pub, buffer.key.rank, "too_large", reason)

    # --------------------------------------------------------------- run

    async def _with_backoff(self, what: str, attempt: Callable[[], Awaitable[None]]) -> None:
        self.lifecycle.move(Phase.STARTING, what)
        await until_kafka_answers(what, attempt, self.lifecycle, self.stopping)

    async def _ensure_topics(self) -> None:
        k = self.cfg.kafka
        admin = f"{self.cfg.bridge.client_id}-admin"
        await ensure_service_topics(k, admin, kafka_client_options(k), bridge_topic_specs(self.cfg))

    async def run(self) -> None:
        """Run until `stop()`; raises FatalError for what needs a human."""
        await self._start_http()
        try:
            await self._with_backoff("creating topics", self._ensure_topics)
            await self._with_backoff("starting producer", self.sink.start)
            self.ctx = zmq.asyncio.Context()
            await self.reconcile()
            if self.registry is not None:
                await self._with_backoff("loading registrations", self.registry.start)
                await self.reconcile()
            self.lifecycle.move(Phase.RUNNING)
            log.info("bridge running", streams=len(self.streams))
            while not self.stopping.is_set():
                self.sink.update_gauges()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stopping.wait(), 1.0)
        except asyncio.CancelledError:
            if not self.stopping.is_set():
                raise
        finally:
            await self._shutdown()

    async def _shutdown(self) -> None:
        self.lifecycle.move(Phase.STOPPING)
        async with self._lock:
            await asyncio.gather(*(self._stop_stream(k, None) for k in list(self.streams)))
        if self.registry is not None:
            await self.registry.stop()
        await self.sink.stop()
        if self.ctx is not None:
            self.ctx.destroy(linger=0)
            self.ctx = None
        if self._runner is not None:
            await self._runner.cleanup()
        self.lifecycle.move(Phase.STOPPED)
        log.info("stopped")

    def stop(self) -> None:
        self.stopping.set()


async def run_bridge(cfg: BridgeConfig) -> int:
    """The `kvconductor bridge` entry: signals, then the bridge until stopped."""
    bridge = Bridge(cfg)
    return await serve_until_signalled(
        bridge.run, bridge.stop, "signal received: flushing buffered records, then stopping"
    )
