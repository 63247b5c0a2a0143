"""Running a long-lived command until a signal: shared by daemon and bridge."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Awaitable, Callable

import structlog

log = structlog.get_logger("kvconductor")


class FatalError(RuntimeError):
    """Stops a service with one clear line (fenced producer, bad topic, ...)."""


async def serve_until_signalled(
    run: Callable[[], Awaitable[None]], stop: Callable[[], None], on_signal: str
) -> int:
    """Run until the first SIGTERM/SIGINT asks `stop()` for a clean finish; a
    second signal exits at once. Returns the process exit code."""
    loop = asyncio.get_running_loop()
    signals = 0

    def handle() -> None:
        nonlocal signals
        signals += 1
        if signals > 1:
            log.warning("second signal: exiting at once")
            os._exit(130)
        log.info(on_signal)
        stop()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, handle)
    try:
        await run()
    except FatalError as exc:
        log.error(str(exc))
        return 1
    return 0
