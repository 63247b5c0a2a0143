"""`kvconductor replica`: a read-only query server over a `Replica`.

It serves the daemon's HTTP API (and the registration routes, read-only) from a
replica of the index; the library in `kvconductor.service.replica` embeds in a
router without this server.
"""

from __future__ import annotations

import asyncio

import structlog
from aiokafka.errors import KafkaError

from kvconductor.config import Config
from kvconductor.http.serve import serve_api
from kvconductor.lifecycle import FatalError, serve_until_signalled, with_backoff
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
    http = cfg.http
    # The registrations, read: the same list as the daemon's and the bridges'.
    registrations = (
        RegistrationLog(
            cfg.kafka, http.registrations_topic, f"{cfg.kafka.client_id}-replica", writable=False
        )
        if http.registrations_topic
        else None
    )

    async def start() -> None:
        # The replica first: it checks the credentials, once. Registrations
        # that fail to load after it runs are retried while it answers.
        if not replica.lifecycle.running:
            try:
                await replica.start()
            except SnapshotUnusable as exc:
                raise FatalError(str(exc)) from exc
        if registrations is not None:
            await registrations.start()

    async def serve() -> None:
        runner, port = await serve_api(
            replica.conductor, replica.metrics, http, replica.ready, registrations
        )
        try:
            log.info("replica http listening", host=http.host, port=port, follow=follow)
            await with_backoff(
                "starting the replica",
                start,
                retry_on=(KafkaError, OSError, ReplicaError),
                lifecycle=replica.lifecycle,
                waiting=lambda exc: f"waiting for kafka: {exc}",
                stopping=stopping,
            )
            await stopping.wait()
        except asyncio.CancelledError:
            if not stopping.is_set():
                raise
        finally:
            if registrations is not None:
                await registrations.stop()
            await replica.stop()
            await runner.cleanup()
        if replica.error is not None:
            raise FatalError(f"the replica stopped following: {replica.error}")

    return await serve_until_signalled(serve, stopping.set, "signal received: stopping the replica")
