"""structlog set-up: JSON lines for machines, colours for a terminal."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import sys
import threading
import time
from typing import Any

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


class RateLimitedLog:
    """Logs a kind of problem at most once per interval, with the count skipped."""

    def __init__(self, name: str, interval_s: float = 60.0) -> None:
        self.interval_s = interval_s
        self._log = structlog.get_logger(name)
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def log(self, level: int, kind: str, event: str, **fields: Any) -> None:
        now = time.monotonic()
        last = self._last.get(kind)
        if last is not None and now - last < self.interval_s:
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return
        self._last[kind] = now
        suppressed = self._suppressed.pop(kind, 0)
        self._log.log(level, event, kind=kind, suppressed_since_last=suppressed, **fields)

    def warn(self, kind: str, event: str, **fields: Any) -> None:
        self.log(logging.WARNING, kind, event, **fields)


# aiokafka's messages that a cluster in motion sends by the hundred (a broker
# restarting, a leader or coordinator moving): what they mean is said once a
# while as a warning, counted every time.
_CONNECTION_NOISE = (
    "Unable connect to",  # a node, or a bootstrap server
    "Failed fetch messages",
    "Unable to request metadata",
    "Unable to update metadata",
    "Got error produce response",
    "NodeNotReady",
    "KafkaConnectionError",
    "RequestTimedOut",
    "Connection closed",
)
# What every start and every coordinator move says before it settles.
_EXPECTED = (
    "GroupCoordinatorNotAvailable",
    "CoordinatorNotAvailable",
    "NotCoordinator",
    "CoordinatorLoadInProgress",
    "coordinator dead",
    "Heartbeat session expired",
    "LeaderNotAvailable",
    "NotLeaderForPartition",
    "UnknownTopicOrPartition",
    "Heartbeat failed",
    "OffsetCommit failed",
)


class KafkaLogHandler(logging.Handler):
    """aiokafka's standard-library log, into the structured log.

    Expected start-up and fail-over noise (coordinator not available yet,
    leaders moving) goes to info; connection errors to warning, each kind
    (its message template) once a minute at most with the count of those
    skipped; other warnings and errors keep their level, rate-limited the
    same way.
    `counts` holds every warning and error seen, by level."""

    def __init__(self, interval_s: float = 60.0) -> None:
        super().__init__(logging.DEBUG)
        self.limited = RateLimitedLog("aiokafka", interval_s)
        self.counts: dict[str, int] = {}

    def emit(self, record: logging.LogRecord) -> None:
        try:
            message = record.getMessage()
        except Exception:  # a malformed call in a library must not break logging
            message = str(record.msg)
        level = _level(record.levelno, message)
        if level >= logging.WARNING:
            name = logging.getLevelName(level).lower()
            self.counts[name] = self.counts.get(name, 0) + 1
        if record.levelno < logging.WARNING:  # aiokafka's own info: as it is
            structlog.get_logger(record.name).log(level, message, logger=record.name)
            return
        fields: dict[str, Any] = {"logger": record.name}
        if record.exc_info and record.exc_info[1] is not None:
            fields["error"] = repr(record.exc_info[1])
        self.limited.log(level, f"{record.name}:{record.msg}", message, **fields)


def _level(levelno: int, message: str) -> int:
    if levelno < logging.WARNING:
        return levelno
    if any(m in message for m in _EXPECTED):
        return logging.INFO
    if any(m in message for m in _CONNECTION_NOISE):
        return logging.WARNING
    return levelno


KAFKA_LOG: KafkaLogHandler | None = None


def kafka_log_lines() -> dict[str, int]:
    """aiokafka's warnings and errors seen so far, by level (rate-limited
    in the log, counted here)."""
    return dict(KAFKA_LOG.counts) if KAFKA_LOG is not None else {}


def dropped_lines() -> int:
    return WRITER.dropped if WRITER is not None else 0


def drain(timeout_s: float) -> None:
    """At exit: let the last lines out (a while at most)."""
    if WRITER is not None:
        WRITER.drain(timeout_s)


def setup_logging(level: str = "info", fmt: str = "auto") -> None:
    global WRITER, KAFKA_LOG
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
    # aiokafka logs through the standard library: into the same log, as JSON.
    kafka = logging.getLogger("aiokafka")
    if KAFKA_LOG is not None:
        kafka.removeHandler(KAFKA_LOG)
    KAFKA_LOG = KafkaLogHandler()
    kafka.addHandler(KAFKA_LOG)
    kafka.setLevel(numeric)
    kafka.propagate = False
    # Anything else through the standard library: its warnings, on stderr.
    logging.basicConfig(
        level=logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
