"""structlog set-up: JSON lines for machines, colours for a terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time

import structlog

_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}


class LogWriter:
    """Log lines go out from a bounded queue, written by a thread of their own,
    so that a log stream that stalls (a pipe nobody reads) or fails (disk
    full) never blocks or stops the event loop: the daemon's job is the
    index. Lines that cannot be queued or written are dropped and counted;
    the first failure is said once on stderr."""

    def __init__(self, fd: int, name: str, max_lines: int = 10_000) -> None:
        self.fd = fd
        self.name = name
        self.full_dropped = 0  # by the loggers: queue full
        self.failed_dropped = 0  # by the writer: the write failed
        self._queue: queue.Queue[str] = queue.Queue(max_lines)
        threading.Thread(target=self._run, name="log-writer", daemon=True).start()

    @property
    def dropped(self) -> int:
        return self.full_dropped + self.failed_dropped

    def msg(self, message: str) -> None:
        try:
            self._queue.put_nowait(message)
        except queue.Full:
            self.full_dropped += 1

    log = debug = info = warn = warning = err = error = critical = exception = fatal = msg

    def drain(self, timeout_s: float) -> None:
        """Wait (a while at most) for the queued lines to be written."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.01)

    def _run(self) -> None:
        while True:
            data = (self._queue.get() + "\n").encode()
            try:
                while data:
                    data = data[os.write(self.fd, data) :]
            except OSError as exc:
                self.failed_dropped += 1
                if self.failed_dropped == 1:
                    with contextlib.suppress(OSError):
                        os.write(
                            2,
                            f"kvconductor: cannot write the log to {self.name}: {exc.strerror}; "
                            "dropping log lines (kvconductor_log_lines_dropped_total)\n".encode(),
                        )
            finally:
                self._queue.task_done()


WRITER: LogWriter | None = None


def dropped_lines() -> int:
    return WRITER.dropped if WRITER is not None else 0


def drain(timeout_s: float) -> None:
    """At exit: let the last lines out (a while at most)."""
    if WRITER is not None:
        WRITER.drain(timeout_s)


def setup_logging(level: str = "info", fmt: str = "auto") -> None:
    global WRITER
    numeric = _LEVELS.get(level.lower(), logging.INFO)
    sys.stdout.flush()
    writer = WRITER = LogWriter(sys.stdout.fileno(), "stdout")
    console = fmt == "console" or (fmt == "auto" and sys.stdout.isatty())
    renderer: structlog.types.Processor = (
        structlog.dev.ConsoleRenderer() if console else structlog.processors.JSONRenderer()
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=lambda *args: writer,
        cache_logger_on_first_use=True,
    )
    # aiokafka logs through the standard library: keep its warnings, quietly.
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
