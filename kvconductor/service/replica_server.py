"""`kvconductor replica`: a read-only query server over a `Replica`.

It serves the daemon's HTTP API (and the registration routes, read-only) from a
replica of the index; the library in `kvconductor.service.replica` embeds in a
router without this server.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal

import structlog
from aiohttp import web
from aiokafka.errors import KafkaError

from kvconductor.config import Config, reveal
from kvconductor.http.api import make_app
from kvconductor.http.front import QuerySite
from kvconductor.kafka.access import KafkaAccessError
from kvconductor.registry.log import RegistrationLog
from kvconductor.service.replica import Follow, Replica, ReplicaError, SnapshotUnusable

log = structlog.get_logger("kvconductor.replica")


async def run_replica(cfg: Config, follow: Follow = "events") -> int:
    """The `kvconductor replica` entry: a read-only query server.

    Serves the daemon's HTTP API from a `Replica`: /health at once, /ready
    once the replica has restored and caught up. Retries start-up with
    backoff while Kafka or the topics are missing; SIGTERM or SIGINT stops it."""
    replica = Replica(cfg, follow=follow)
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stopping.set)
    http = cfg.http
    # The registrations, read: the same list as the daemon's and the bridges'.
    registrations = (
        RegistrationLog(
            cfg.kafka, http.registrations_topic, f"{cfg.kafka.client_id}-replica", writable=False
        )
        if http.registrations_topic
        else None
    )
    app = make_app(
        replica.conductor,
        replica.metrics,
        ready=replica.ready,
        max_body_bytes=http.max_body_bytes,
        auth_token=reveal(http.auth_token),
        client_timeout_s=http.client_timeout_s,
        registrations=registrations,
    )
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = QuerySite(runner, http.host, http.port)
        await site.start()
        port = site.port
        log.info("replica http listening", host=http.host, port=port, follow=follow)
        delay = 0.5
        started = False
        while not stopping.is_set():
            try:
                if not started:
                    await replica.start()
                    started = True
                if registrations is not None:
                    await registrations.start()
                break
            except (KafkaAccessError, SnapshotUnusable) as exc:
                log.error(str(exc))
                return 1
            except (KafkaError, OSError, ReplicaError) as exc:
                replica.status = f"waiting for kafka: {exc}"
                log.warning("replica cannot start yet; retrying", error=str(exc), retry_in_s=delay)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stopping.wait(), delay)
            delay = min(delay * 2, 10.0)
        await stopping.wait()
        log.info("signal received: stopping the replica")
    finally:
        if registrations is not None:
            await registrations.stop()
        await replica.stop()
        await runner.cleanup()
    return 1 if replica.error is not None else 0
