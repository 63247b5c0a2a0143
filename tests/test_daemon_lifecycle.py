"""Start-up without a broker, readiness, and shutdown by signal, as a user runs it."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka.structs import TopicPartition

from kvconductor.index.namespace import NamespaceKey
from kvconductor.lifecycle import FatalError
from kvconductor.service.daemon import Daemon
from kvconductor.snapshots.store import SnapshotRead
from kvconductor.snapshots.units import PendingUnit, pending_key
from kvconductor.tools.kafka_local.broker import free_ports
from kvconductor.wire.packing import pack_f64, pack_u64
from tests.harness import daemon_config, http_json, running, wait_for


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_unreachable_broker_keeps_http_up_and_not_ready() -> None:
    cfg = daemon_config(f"127.0.0.1:{closed_port()}")
    async with running(cfg) as daemon:
        port = daemon.http_port
        assert port is not None
        status, body = await http_json(port, "GET", "/health")
        assert status == 200
        await wait_for(lambda: "kafka unavailable" in daemon.status, 20, "a retry")
        status, body = await http_json(port, "GET", "/ready")
        assert status == 503
        assert "kafka unavailable" in body["reason"]
        # Queries are answered (from the empty index) while Kafka is away.
        status, body = await http_json(
            port, "POST", "/query", {"model": "m", "block_size": 4, "token_ids": [1, 2, 3, 4]}
        )
        assert (status, body) == (200, {})
    # Leaving the context stopped it during its backoff without hanging.


def _start(config: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "kvconductor.tools.cli", "run", "--config", str(config)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _config(tmp_path: Path, bootstrap: str, port: int) -> Path:
    tag = tmp_path.name[-8:].replace("-", "")
    path = tmp_path / "kvconductor.toml"
    path.write_text(
        f"""
[kafka]
bootstrap_servers = "{bootstrap}"
engine_topic = "kv-events-{tag}"
pool_topic = "kv-pool-events-{tag}"
snapshot_topic = "kv-index-snapshots-{tag}"
dead_letter_topic = "kv-dead-letters-{tag}"
group_id = "kvc-{tag}"

[http]
port = {port}

[log]
format = "json"
"""
    )
    return path


async def _wait_ready(port: int, timeout: float) -> None:
    async def ready() -> bool:
        try:
            status, _ = await http_json(port, "GET", "/ready")
        except OSError:
            return False
        return status == 200

    await wait_for(ready, timeout, "daemon ready")


@pytest.mark.kafka
async def test_sigterm_finishes_cleanly_and_second_signal_exits_at_once(
    kafka_bootstrap: str, tmp_path: Path
) -> None:
    (port,) = free_ports(1)
    config = _config(tmp_path, kafka_bootstrap, port)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = _start(config, env)
    try:
        await _wait_ready(port, 60)
        proc.send_signal(signal.SIGTERM)
        out, _ = await asyncio.to_thread(proc.communicate, timeout=60)
        assert proc.returncode == 0, out.decode()
        assert b'"stopped"' in out
        assert b"Traceback" not in out
    finally:
        if proc.poll() is None:
            proc.kill()

    proc = _start(config, env)
    try:
        await _wait_ready(port, 60)
        proc.send_signal(signal.SIGTERM)
        # Two pending SIGTERMs would coalesce into one: a second signal of
        # another kind, as a user's Ctrl-C after `kill`. At once, not a
        # moment later: a clean finish can take less than any moment chosen.
        proc.send_signal(signal.SIGINT)
        started = time.monotonic()
        await asyncio.to_thread(proc.wait, timeout=30)
        assert proc.returncode == 130
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()


def test_bad_config_is_one_line_naming_the_key(tmp_path: Path) -> None:
    config = tmp_path / "bad.toml"
    config.write_text("[kafka]\npartitions = 'many'\n")
    result = subprocess.run(
        [sys.executable, "-m", "kvconductor.tools.cli", "run", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "partitions" in lines[0]


async def test_a_snapshot_the_index_cannot_take_stops_the_daemon_with_its_reason() -> None:
    """A corrupt unit (here retired arrays of different lengths) is a
    FatalError naming the topic and the reason, not a traceback."""
    daemon = Daemon(daemon_config(f"127.0.0.1:{closed_port()}"))
    unit = PendingUnit(1.0, [], [], pack_u64([1, 2]), pack_u64([3]), pack_f64([0.5, 0.5]))
    key = pending_key(NamespaceKey("default", "m", 16, None, ""))
    read = SnapshotRead({key: unit}, {key: 1}, {TopicPartition("t", 0): 1}, 1, 1, 1, 0.0, 0)

    async def corrupt() -> SnapshotRead:
        return read

    daemon.read_snapshot = corrupt  # type: ignore[method-assign]
    with pytest.raises(FatalError, match="cannot be restored: retired arrays of different"):
        await daemon.restore_snapshot()
