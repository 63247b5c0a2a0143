"""Serving the HTTP API from an index: the daemon's and the replica server's
one way to start it (the aiohttp app behind the query front)."""

from __future__ import annotations

from collections.abc import Callable

import structlog
from aiohttp import web

from kvconductor.config import HttpConfig, reveal
from kvconductor.http.api import make_app
from kvconductor.http.front import QuerySite
from kvconductor.index.conductor import Conductor
from kvconductor.obs.metrics import Metrics
from kvconductor.registry.log import RegistrationLog

log = structlog.get_logger("kvconductor.http")

# File descriptors the process needs besides HTTP connections: Kafka's
# connections (a few per broker), the listening socket, logs, the loop's.
OTHER_FILES = 64


async def serve_api(
    conductor: Conductor,
    metrics: Metrics,
    http: HttpConfig,
    ready: Callable[[], tuple[bool, str]],
    registrations: RegistrationLog | None,
) -> tuple[web.AppRunner, int]:
    """The API listening on `http.host`/`http.port`: its runner (to clean up)
    and the port it got."""
    app = make_app(
        conductor,
        metrics,
        ready=ready,
        max_body_bytes=http.max_body_bytes,
        auth_token=reveal(http.auth_token),
        client_timeout_s=http.client_timeout_s,
        idle_timeout_s=http.idle_timeout_s,
        max_requests_per_connection=http.max_requests_per_connection,
        registrations=registrations,
    )
    _check_open_files(http.max_connections)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = QuerySite(runner, http.host, http.port, max_connections=http.max_connections)
        await site.start()
    except BaseException:
        await runner.cleanup()
        raise
    return runner, site.port


def _check_open_files(max_connections: int) -> None:
    """Warn when `max_connections` cannot be reached: accepting past the
    open-file limit fails (EMFILE) before the limit closes anything."""
    try:
        import resource
    except ImportError:  # pragma: no cover - not on Windows
        return
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and max_connections + OTHER_FILES > soft:
        log.warning(
            "http max_connections is near the open-file limit: raise ulimit -n or lower it",
            max_connections=max_connections,
            open_file_limit=soft,
        )
