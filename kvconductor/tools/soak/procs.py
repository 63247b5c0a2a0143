"""The processes a soak disturbs: its private Kafka broker and the daemon.

Both are real processes the soak signals by pid. The broker is the one of
`kvconductor kafka-local`, in a data folder of its own on free ports, so a
restart finds its data again and nothing else uses it. The daemon is
`python -m kvconductor.tools.cli run --config FILE`, one life after another, each
with its own log file. Everything here blocks; the soak calls it from a
worker thread (`asyncio.to_thread`) so that traffic keeps flowing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvconductor.tools.kafka_local import broker as kafka_local

GONE_TIMEOUT_S = 30.0
START_ATTEMPTS = 3


def process_state(pid: int) -> str | None:
    """The state letter of /proc/<pid>/stat (R, S, T, Z, ...); None once reaped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name in parentheses may itself hold spaces and parentheses.
    return stat.rsplit(")", 1)[1].split()[0]


def wait_gone(pid: int, timeout_s: float = GONE_TIMEOUT_S) -> None:
    """Until `pid` has exited (a zombie counts: it holds no ports and no files)."""
    deadline = time.monotonic() + timeout_s
    while process_state(pid) not in (None, "Z", "X"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"process {pid} still runs {timeout_s:.0f} s after SIGKILL")
        time.sleep(0.05)


def memory_kib(pid: int) -> tuple[int, int]:
    """(VmRSS, VmHWM) of a live process in KiB: now, and the peak of its life."""
    fields: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            name, _, rest = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                fields[name] = int(rest.split()[0])
    except (OSError, ValueError, IndexError):
        return 0, 0
    return fields.get("VmRSS", 0), fields.get("VmHWM", 0)


class Broker:
    """A private single-node broker in `data_dir`, on ports chosen once, so
    that every restart comes back at the same address with the same data."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        self.port, self.controller_port = kafka_local.free_ports(2)
        self.failed_starts = 0  # starts that failed and were tried again

    @property
    def bootstrap(self) -> str:
        return f"{kafka_local.HOST}:{self.port}"

    @property
    def pid(self) -> int:
        try:
            return int((self.data_dir / kafka_local.PID_FILE).read_text().strip())
        except (OSError, ValueError):
            raise RuntimeError(f"no broker pid in {self.data_dir}") from None

    def start(self) -> None:
        """Start the broker; again if the start failed (a loaded machine has
        seen one-off failures of the storage format step). Counted."""
        for attempt in range(START_ATTEMPTS):
            try:
                kafka_local.start(self.data_dir, self.port, self.controller_port)
                return
            except kafka_local.KafkaLocalError:
                if attempt + 1 == START_ATTEMPTS:
                    raise
                with contextlib.suppress(Exception):
                    kafka_local.stop(self.data_dir)
                self.failed_starts += 1

    def stop(self) -> None:
        """SIGTERM: the broker's controlled shutdown."""
        kafka_local.stop(self.data_dir)

    def kill(self) -> None:
        pid = self.pid
        os.kill(pid, signal.SIGKILL)
        wait_gone(pid)

    def freeze(self) -> None:
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


def daemon_env() -> dict[str, str]:
    """This environment without KVCONDUCTOR_* settings: the daemon reads its
    configuration file only, the same file the soak's replay reads."""
    return {k: v for k, v in os.environ.items() if not k.startswith("KVCONDUCTOR_")}


class DaemonLives:
    """The daemon as a subprocess, restarted after every kill; its peak
    memory over all lives, and exits nobody asked for."""

    def __init__(self, config: Path, logs: Path) -> None:
        self.config = config
        self.logs = logs
        self.proc: subprocess.Popen[bytes] | None = None
        self.lives = 0
        self.max_rss_kib = 0
        self.unexpected_exits: list[str] = []

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def start(self) -> None:
        self.lives += 1
        with (self.logs / f"daemon-{self.lives:03d}.log").open("wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "kvconductor.tools.cli",
                    "run",
                    "--config",
                    str(self.config),
                ],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=daemon_env(),
            )

    def sample(self) -> int:
        """The current life's RSS in KiB (0 if none runs); records its peak."""
        if self.proc is None:
            return 0
        rss, hwm = memory_kib(self.proc.pid)
        self.max_rss_kib = max(self.max_rss_kib, hwm, rss)
        return rss

    def check_alive(self) -> bool:
        """False, noted, and a new life started, if the daemon exited by itself."""
        proc = self.proc
        if proc is None or proc.poll() is None:
            return True
        self.unexpected_exits.append(f"life {self.lives} exited with code {proc.returncode}")
        self.start()
        return False

    def signal(self, sig: int, timeout_s: float = 60.0) -> int:
        """Send `sig` to the current life and wait for it to end; its exit code."""
        proc = self.proc
        if proc is None:
            raise RuntimeError("no daemon runs")
        self.sample()
        proc.send_signal(sig)
        try:
            code = proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            name = signal.Signals(sig).name
            raise RuntimeError(
                f"the daemon did not end within {timeout_s:.0f} s of {name}"
            ) from None
        self.proc = None
        return code
