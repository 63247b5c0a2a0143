"""Everything kvconductor writes, made to fail (issue #7, item 2, second half).

What is written: the daemon writes no file, only its log stream (JSON lines
on stdout; aiokafka's warnings on stderr); the operator tools write their
output to stdout; `kvconductor bench` writes its report folder;
`kvconductor kafka-local` (and the demo, through it) writes the broker's
data folder: server.properties, the lock, pid and state files and the
broker's own output. The dead-letter re-drive cursor is a committed group
offset in Kafka, not a file.

Faults, as root (who ignores permission bits): a path under a regular file
(`/dev/null/x`: ENOTDIR) and a file that is `/dev/full`, or a symlink to it
(every write fails with ENOSPC). Each must give one clear line naming what
could not be written and the errno text, a non-zero exit, and never a hang:
every command runs as a subprocess under a timeout.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest

from kvconductor.config import Config
from kvconductor.consumers.dead_letters import dead_letter_headers
from kvconductor.kafka.topics import TopicSpec, ensure_topics_on
from kvconductor.tools.api_client import metric_sum, parse_metrics
from kvconductor.tools.kafka_local.broker import free_ports
from tests.harness import (
    daemon_config,
    engine_headers,
    http_json,
    produce,
    read_all,
    stored,
    vllm_payload,
    wait_for,
)
from tests.test_cli import REPO, cfg_env, clean_env, kvconductor

ENOSPC = "No space left on device"
ENOTDIR = "Not a directory"
TIMEOUT_S = 120.0


@contextlib.contextmanager
def full() -> Iterator[IO[bytes]]:
    """A stream every write to which fails with ENOSPC."""
    with open("/dev/full", "wb") as f:
        yield f


def tool(
    *args: str, env: dict[str, str] | None = None, stdout: IO[bytes] | int = subprocess.PIPE
) -> tuple[int, str, str]:
    """A `kvconductor` command with stdout where the test says: exit code,
    stdout (when piped) and stderr."""
    result = subprocess.run(
        [*kvconductor(), *args],
        env=env if env is not None else clean_env(),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        timeout=TIMEOUT_S,
        cwd=REPO,
    )
    out = result.stdout.decode() if result.stdout is not None else ""
    return result.returncode, out, result.stderr.decode()


def error_line(stderr: str) -> str:
    """The one error line of a failed command (progress lines may precede it)."""
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, f"expected one error line, got:\n{stderr}"
    return errors[0]


# -------------------------------------------------------------- the daemon


def daemon_env(cfg: Config, port: int, **extra: str) -> dict[str, str]:
    """`kvconductor run`'s environment for `cfg`'s topics and group, JSON logs."""
    return {
        **cfg_env(cfg),
        "KVCONDUCTOR_HTTP_PORT": str(port),
        "KVCONDUCTOR_LOG_FORMAT": "json",
        **extra,
    }


def spawn_daemon(env: dict[str, str], stdout: IO[bytes] | int, stderr: IO[bytes]) -> Any:
    return subprocess.Popen(
        [*kvconductor(), "run"],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=stderr,
        cwd=REPO,
    )


async def wait_ready(proc: Any, port: int, timeout: float = 90.0) -> None:
    """Until `/ready` answers 200; fails at once if the daemon exits."""

    async def ready() -> bool:
        assert proc.poll() is None, f"the daemon exited with code {proc.returncode}"
        try:
            status, _ = await asyncio.wait_for(http_json(port, "GET", "/ready"), 10)
        except (OSError, TimeoutError):
            return False
        return status == 200

    await wait_for(ready, timeout, "the daemon ready")


async def stop_daemon(proc: Any) -> int:
    """SIGTERM, then the exit code (killed after a minute: that is a hang)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        return int(await asyncio.to_thread(proc.wait, 60))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def metrics(port: int) -> Any:
    _, text = await asyncio.wait_for(http_json(port, "GET", "/metrics"), 10)
    return parse_metrics(text)


@pytest.mark.kafka
async def test_daemon_keeps_serving_when_its_log_stream_is_full(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    cfg = daemon_config(kafka_bootstrap)
    (port,) = free_ports(1)
    err_path = tmp_path / "stderr"
    with full() as out, err_path.open("wb") as err:
        proc = spawn_daemon(daemon_env(cfg, port), out, err)
        try:
            await wait_ready(proc, port)
            record = ("a", vllm_payload([stored([1, 2], list(range(8)))]), engine_headers())
            await produce(kafka_bootstrap, cfg.kafka.engine_topic, [record])

            async def applied() -> bool:
                m = await metrics(port)
                return metric_sum(m, "kvconductor_records_consumed_total") >= 1

            await wait_for(applied, 60, "the record applied")
            m = await metrics(port)
            assert metric_sum(m, "kvconductor_log_lines_dropped_total") > 0
        finally:
            code = await stop_daemon(proc)
    assert code == 0
    stderr = err_path.read_text()
    assert "Traceback" not in stderr, stderr
    lines = [line for line in stderr.splitlines() if ENOSPC in line]
    assert len(lines) == 1 and "stdout" in lines[0], stderr


@pytest.mark.kafka
async def test_daemon_keeps_serving_when_nobody_reads_its_log_stream(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    cfg = daemon_config(kafka_bootstrap)
    (port,) = free_ports(1)
    # A resync control record is logged as a warning each: 500 of them are far
    # more than a pipe's 64 KiB.
    resyncs = [
        (f"inst-{i}", b"", [("kv-control", b"resync"), ("kv-control-reason", b"test " * 40)])
        for i in range(500)
    ]
    with (tmp_path / "stderr").open("wb") as err:
        proc = spawn_daemon(daemon_env(cfg, port), subprocess.PIPE, err)
        try:
            await wait_ready(proc, port)
            await produce(kafka_bootstrap, cfg.kafka.engine_topic, resyncs)
            for _ in range(10):
                try:
                    status, _ = await asyncio.wait_for(http_json(port, "GET", "/health"), 10)
                except TimeoutError:
                    pytest.fail("/health stopped answering: the daemon hangs on its log stream")
                assert status == 200
                await asyncio.sleep(1.0)

            async def consumed() -> bool:
                m = await metrics(port)
                return metric_sum(m, "kvconductor_records_consumed_total") == len(resyncs)

            await wait_for(consumed, 60, "every record applied")
        finally:
            proc.kill()
            await asyncio.to_thread(proc.wait, 60)
            assert proc.stdout is not None
            proc.stdout.close()


# ----------------------------------------------------- kvconductor dead-letters


@pytest.mark.kafka
async def test_dead_letters_output_on_a_full_disk(kafka_bootstrap: str) -> None:
    """`list` and `redrive` with stdout on a full disk: one line, exit 1; the
    re-drive that happened says so, and is neither lost nor repeated."""
    cfg = daemon_config(kafka_bootstrap)
    k = cfg.kafka
    env = cfg_env(cfg)
    await ensure_topics_on(
        k.bootstrap_servers,
        "test-write-errors",
        {},
        [TopicSpec(t, 1, 1, {}, {}) for t in (k.dead_letter_topic, k.engine_topic)],
    )
    value = vllm_payload([stored([1, 2], list(range(8)))])
    headers = dead_letter_headers(engine_headers(), "rejected", "test", k.engine_topic, 0, 3, 1)
    await produce(kafka_bootstrap, k.dead_letter_topic, [("dl-0", value, headers)])

    with full() as out:
        code, _, err = await asyncio.to_thread(tool, "dead-letters", "list", env=env, stdout=out)
    assert code == 1
    assert error_line(err) == f"kvconductor dead-letters: error: cannot write to stdout: {ENOSPC}"

    with full() as out:
        code, _, err = await asyncio.to_thread(tool, "dead-letters", "redrive", env=env, stdout=out)
    assert code == 1
    assert error_line(err) == (
        f"kvconductor dead-letters: error: re-drove 1 record, but cannot write to stdout: {ENOSPC}"
    )
    code, out_text, err = await asyncio.to_thread(tool, "dead-letters", "redrive", env=env)
    assert code == 0, err
    assert "re-driven already" in out_text
    redriven = [r for r in await read_all(kafka_bootstrap, k.engine_topic) if r.key == b"dl-0"]
    assert len(redriven) == 1 and redriven[0].value == value


# --------------------------------------------------------- kvconductor demo


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def demo_broker_error(broker_dir: Path) -> str:
    # The demo's broker takes the port and the next (its controller): both
    # must be free, or the port check answers before the write is tried.
    port = next(p for p in iter(lambda: free_ports(1)[0], 0) if _bindable(p + 1))
    code, _, err = tool(
        "demo", "--broker-dir", str(broker_dir), "--broker-port", str(port), "--duration", "1"
    )
    assert code == 1
    return error_line(err)


def test_demo_broker_folder_that_is_not_a_folder() -> None:
    assert demo_broker_error(Path("/dev/null/x")) == (
        f"kvconductor demo: error: cannot start the local Kafka broker in /dev/null/x: {ENOTDIR}"
    )


@pytest.mark.kafka  # the broker's jars must be fetched (the session broker does that)
def test_demo_broker_folder_on_a_full_disk(kafka_bootstrap: str, tmp_path: Path) -> None:
    (tmp_path / "server.properties").symlink_to("/dev/full")
    line = demo_broker_error(tmp_path)
    assert line == (
        "kvconductor demo: error: cannot start the local Kafka broker: "
        f"cannot write {tmp_path / 'server.properties'}: {ENOSPC}"
    )
    assert not (tmp_path / "kafka.pid").exists()  # it failed before starting anything


@pytest.mark.kafka
async def test_demo_output_on_a_full_disk(kafka_bootstrap: str) -> None:
    env = {**cfg_env(daemon_config(kafka_bootstrap)), "KVCONDUCTOR_HTTP_PORT": "0"}
    with full() as out:
        code, _, err = await asyncio.to_thread(
            tool, "demo", "--bootstrap", kafka_bootstrap, "--duration", "60", "--plain",
            env=env, stdout=out,
        )  # fmt: skip
    assert code == 1
    assert error_line(err) == f"kvconductor demo: error: cannot write to stdout: {ENOSPC}"


# -------------------------------------------------------- kvconductor bench

TINY_BENCH = (
    "bench", "--quick", "--entries", "12000", "--apply-blocks", "2000", "--repeats", "1",
    "--queries", "20", "--curve", "6000", "--peers", "kvconductor", "--no-restore",
    "--http", "0",
)  # fmt: skip


def test_bench_report_folder_that_is_not_a_folder_fails_before_the_run() -> None:
    code, out, err = tool("bench", "--quick", "--out", "/dev/null/x")
    assert code == 1
    assert error_line(err) == (
        f"kvconductor bench: error: cannot write the report to /dev/null/x: {ENOTDIR}"
    )
    assert out == ""  # nothing was run


def test_bench_report_on_a_full_disk(tmp_path: Path) -> None:
    (tmp_path / "report.json").symlink_to("/dev/full")
    code, out, err = tool(*TINY_BENCH, "--out", str(tmp_path))
    assert code == 1
    assert error_line(err) == (
        f"kvconductor bench: error: cannot write the report to {tmp_path / 'report.json'}: {ENOSPC}"
    )
    assert "# kvconductor benchmark report" in out  # the figures are not lost


def test_bench_output_on_a_full_disk(tmp_path: Path) -> None:
    with full() as out:
        code, _, err = tool("bench", "--quick", "--out", str(tmp_path), stdout=out)
    assert code == 1
    assert error_line(err) == f"kvconductor bench: error: cannot write to stdout: {ENOSPC}"


# --------------------------------------------------- kvconductor kafka-local


def test_kafka_local_folder_that_is_not_a_folder() -> None:
    code, _, err = tool("kafka-local", "start", "--dir", "/dev/null/x")
    assert code == 1
    line = error_line(err)
    assert "/dev/null/x" in line and ENOTDIR in line


def test_kafka_local_output_on_a_full_disk(tmp_path: Path) -> None:
    with full() as out:
        code, _, err = tool("kafka-local", "status", "--dir", str(tmp_path), stdout=out)
    assert code == 1
    line = error_line(err)
    assert "stdout" in line and ENOSPC in line


@pytest.mark.kafka  # the broker's jars must be fetched (the session broker does that)
def test_kafka_local_folder_on_a_full_disk(kafka_bootstrap: str, tmp_path: Path) -> None:
    (tmp_path / "server.properties").symlink_to("/dev/full")
    port, controller = free_ports(2)
    code, _, err = tool(
        "kafka-local", "start", "--dir", str(tmp_path),
        "--port", str(port), "--controller-port", str(controller),
    )  # fmt: skip
    assert not (tmp_path / "kafka.pid").exists()
    assert code == 1
    line = error_line(err)
    assert "server.properties" in line and ENOSPC in line
