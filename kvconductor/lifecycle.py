"""One lifecycle for the daemon, the bridge and the replica server.

`Phase` is the state a service is in and `Lifecycle` moves it along the
transitions `Phase.can_move_to` allows, with the text that /health, /ready and
`kvconductor status` show. `with_backoff` retries a start-up step until Kafka
answers, and `serve_until_signalled` runs a service until SIGTERM/SIGINT.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import os
import signal
from collections.abc import Awaitable, Callable
from typing import TypeVar

import structlog

log = structlog.get_logger("kvconductor")

T = TypeVar("T")

FIRST_RETRY_S = 0.5
MAX_RETRY_S = 10.0


class FatalError(RuntimeError):
    """Stops a service with one clear line (fenced producer, bad topic, ...)."""


class Phase(enum.Enum):
    """Where a service is; the value is its text when no detail says more."""

    NOT_STARTED = "not started"
    STARTING = "starting"
    # A start-up step cannot reach Kafka or its topics yet: the detail says which.
    WAITING = "waiting"
    RESTORING = "restoring snapshot"
    RUNNING = "running"
    STOPPING = "stopping"
    STOPPED = "stopped"

    def can_move_to(self, target: Phase) -> bool:
        return target in _NEXT[self]


_STARTING = frozenset({Phase.STARTING, Phase.WAITING, Phase.RESTORING, Phase.RUNNING})
_NEXT: dict[Phase, frozenset[Phase]] = {
    # A replica whose start failed is not started again, and may be retried.
    Phase.NOT_STARTED: _STARTING | {Phase.NOT_STARTED, Phase.STOPPING, Phase.STOPPED},
    Phase.STARTING: _STARTING | {Phase.NOT_STARTED, Phase.STOPPING},
    Phase.WAITING: _STARTING | {Phase.NOT_STARTED, Phase.STOPPING},
    Phase.RESTORING: _STARTING | {Phase.NOT_STARTED, Phase.STOPPING},
    # Once running, an outage is the service's readiness, not its phase.
    Phase.RUNNING: frozenset({Phase.STOPPING, Phase.STOPPED}),
    Phase.STOPPING: frozenset({Phase.STOPPED}),
    # A stopped replica may be started again.
    Phase.STOPPED: _STARTING | {Phase.NOT_STARTED},
}


class InvalidTransition(RuntimeError):
    """A service tried a move its lifecycle does not allow: a bug."""


class Lifecycle:
    """A service's phase, with the detail text a probe shows."""

    def __init__(self, phase: Phase = Phase.STARTING) -> None:
        self.phase = phase
        self.detail: str | None = None
        # Where a WAITING service goes back to once the step succeeds.
        self._before_wait: tuple[Phase, str | None] | None = None

    @property
    def status(self) -> str:
        return self.detail if self.detail is not None else self.phase.value

    @property
    def running(self) -> bool:
        return self.phase is Phase.RUNNING

    def move(self, phase: Phase, detail: str | None = None) -> None:
        if phase is not self.phase and not self.phase.can_move_to(phase):
            raise InvalidTransition(f"{self.phase.name} -> {phase.name}")
        self.phase, self.detail = phase, detail
        self._before_wait = None

    def wait(self, detail: str) -> None:
        """A start-up step waits for Kafka: say why, and remember the step."""
        before = self._before_wait or (self.phase, self.detail)
        self.move(Phase.WAITING, detail)
        self._before_wait = before

    def resume(self) -> None:
        """The step that waited succeeded: back to where it was."""
        if self.phase is Phase.WAITING and self._before_wait is not None:
            self.move(*self._before_wait)


async def with_backoff(
    step: str,
    attempt: Callable[[], Awaitable[T]],
    *,
    retry_on: tuple[type[BaseException], ...],
    lifecycle: Lifecycle,
    waiting: Callable[[BaseException], str],
    stopping: asyncio.Event,
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """`attempt()`'s result, retrying on `retry_on` after a delay that doubles
    up to `MAX_RETRY_S`; until then a service still starting is WAITING with
    the text `waiting(error)`. Raises CancelledError once `stopping` is set."""
    delay = FIRST_RETRY_S
    while True:
        try:
            result = await attempt()
        except retry_on as exc:
            if on_retry is not None:
                on_retry(exc)
            if not lifecycle.running:
                lifecycle.wait(waiting(exc))
            # A timeout's text is empty: its type says it.
            error = str(exc) or repr(exc)
            log.warning("cannot start yet; retrying", step=step, error=error, retry_in_s=delay)
        else:
            lifecycle.resume()
            return result
        if stopping.is_set():
            raise asyncio.CancelledError
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stopping.wait(), delay)
        if stopping.is_set():
            raise asyncio.CancelledError
        delay = min(delay * 2, MAX_RETRY_S)


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
