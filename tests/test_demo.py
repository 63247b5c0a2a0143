"""`kvconductor demo` against the session's real broker: query hits within a bounded
time, then a clean shutdown on Ctrl-C or at the end of `--duration`, the broker
left running; and the README's first command (`./dev demo`) in a fresh
virtualenv."""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
import uuid
from pathlib import Path

import pytest

from tests.test_cli import REPO, clean_env, kvconductor

pytestmark = pytest.mark.kafka

HIT = re.compile(
    r"^query +\d+ .*: best (\S+) matched ([1-9]\d*) \(GPU (\d+), CPU (\d+), DISK (\d+)\)"
)
STATUS = re.compile(r"^\[ *[\d.]+s\] consumed \d+ records/s .* pending \d+ intents")
HIT_WITHIN_S = 45.0


async def _finish(proc: asyncio.subprocess.Process, timeout: float) -> tuple[bytes, bytes]:
    """Its output once it ends by itself; killed (and the test failed) if it does not."""
    try:
        return await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{proc.pid} did not end within {timeout}s; killed") from None


def demo_env(bootstrap: str) -> dict[str, str]:
    """Topics, group and HTTP port of its own, so it meets no other test."""
    tag = uuid.uuid4().hex[:8]
    return clean_env(
        KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS=bootstrap,
        KVCONDUCTOR_KAFKA_ENGINE_TOPIC=f"demo-events-{tag}",
        KVCONDUCTOR_KAFKA_POOL_TOPIC=f"demo-pool-{tag}",
        KVCONDUCTOR_KAFKA_SNAPSHOT_TOPIC=f"demo-snapshots-{tag}",
        KVCONDUCTOR_KAFKA_DEAD_LETTER_TOPIC=f"demo-dead-{tag}",
        KVCONDUCTOR_KAFKA_GROUP_ID=f"demo-{tag}",
        KVCONDUCTOR_KAFKA_PARTITIONS="2",
        KVCONDUCTOR_HTTP_PORT="0",
        KVCONDUCTOR_SNAPSHOT_INTERVAL_S="2",
    )


async def broker_answers(bootstrap: str) -> bool:
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        return bool((await admin.describe_cluster()).get("brokers"))
    finally:
        await admin.close()


def check_output(out: str, err: str) -> None:
    assert "Traceback" not in out + err, err
    lines = out.splitlines()
    assert lines[0].startswith("kvconductor demo: broker "), out[:500]
    assert "vllm-0 dp1" in lines[1] and "offload to mooncake-0" in lines[1]
    assert any(STATUS.match(line) for line in lines), out[:2000]
    hits = [m for m in map(HIT.match, lines) if m]
    assert hits, out[-2000:]
    for m in hits:
        gpu, cpu, disk = int(m[3]), int(m[4]), int(m[5])
        assert gpu <= cpu <= disk == int(m[2])
    assert re.search(
        r"^demo: stopped engines and daemon; \d+ sample queries, first hit after", out, re.M
    )


async def test_demo_shows_hits_then_stops_cleanly_on_ctrl_c(kafka_bootstrap: str) -> None:
    started = time.monotonic()
    proc = await asyncio.create_subprocess_exec(
        *kvconductor(), "demo", "--bootstrap", kafka_bootstrap, "--duration", "300",
        env=demo_env(kafka_bootstrap),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL,
        cwd=REPO,
    )  # fmt: skip
    assert proc.stdout is not None and proc.stderr is not None
    seen: list[str] = []
    try:
        async with asyncio.timeout(HIT_WITHIN_S):
            while True:
                line = (await proc.stdout.readline()).decode()
                assert line, "the demo ended before any query hit"
                seen.append(line)
                if HIT.match(line):
                    break
        hit_after = time.monotonic() - started
        proc.send_signal(signal.SIGINT)
        rest, err = await asyncio.wait_for(proc.communicate(), 60)
    except BaseException:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        raise
    out = "".join(seen) + rest.decode()
    assert proc.returncode == 0, err.decode()[-3000:]
    check_output(out, err.decode())
    assert hit_after < HIT_WITHIN_S
    # It did not start the broker, so it did not stop it either.
    assert await broker_answers(kafka_bootstrap)


def _wheelhouse() -> Path:
    """Wheels of `.[test]`'s requirements and of the build backend, fetched once per
    pyproject.toml into a cache (pip's own cache is not relied on), so fresh
    virtualenvs install from local files."""
    stamp = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    house = cache / "kvconductor" / f"wheelhouse-{stamp}"
    done = house / ".complete"
    if done.is_file():
        return house
    house.mkdir(parents=True, exist_ok=True)
    # The dependencies only: building the project here would write into the tree.
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    requirements = [*project["dependencies"], *project["optional-dependencies"]["test"]]
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    pip = [sys.executable, "-m", "pip"]
    steps = [
        [*pip, "wheel", "--quiet", "--wheel-dir", str(house), *requirements],
        [*pip, "download", "--quiet", "--dest", str(house), *build],
    ]
    for cmd in steps:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600, check=False)
        if result.returncode != 0:
            pytest.skip(f"cannot fetch the wheels for a fresh virtualenv: {result.stderr[-300:]}")
    done.write_text(stamp + "\n")
    return house


def test_readme_demo_command_in_a_fresh_virtualenv(kafka_bootstrap: str, tmp_path: Path) -> None:
    """`./dev demo` on a machine without .venv: creates the virtualenv (no system
    site-packages), installs `-e .[test]` (from the local wheel cache), runs the demo."""
    house = _wheelhouse()
    venv = tmp_path / "venv"
    env = demo_env(kafka_bootstrap)
    env.update(KVCONDUCTOR_VENV=str(venv), PIP_NO_INDEX="1", PIP_FIND_LINKS=str(house))
    env.pop("VIRTUAL_ENV", None)
    env.pop("PYTHONPATH", None)
    result = subprocess.run(
        [str(REPO / "dev"), "demo", "--bootstrap", kafka_bootstrap, "--duration", "12"],
        env=env,
        capture_output=True,
        text=True,
        timeout=420,
        stdin=subprocess.DEVNULL,
        cwd=tmp_path,  # ./dev finds the repository by itself
    )
    assert result.returncode == 0, (result.stdout[-2000:], result.stderr[-3000:])
    assert f"dev: creating {venv}" in result.stderr
    assert (venv / "bin" / "kvconductor").is_file()
    cfg = (venv / "pyvenv.cfg").read_text()
    assert "include-system-site-packages = false" in cfg
    check_output(result.stdout, result.stderr)
    # The installed package is this repository's, editable.
    probe = subprocess.run(
        [str(venv / "bin" / "python"), "-c", "import kvconductor; print(kvconductor.__file__)"],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    )
    assert probe.stdout.strip() == str(REPO / "kvconductor" / "__init__.py")


def _free_port_run(n: int) -> int:
    """The first of `n` consecutive free ports."""
    import socket

    from kvconductor.tools.kafka_local.broker import free_ports

    for _ in range(50):
        (first,) = free_ports(1)
        ok = True
        for port in range(first + 1, first + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return first
    raise AssertionError(f"no {n} consecutive free ports")


def _adjacent_free_ports() -> int:
    """A free port whose successor (the controller port) is free too."""
    return _free_port_run(2)


def test_demo_stops_the_broker_it_started_and_only_that(tmp_path: Path) -> None:
    """Without --bootstrap the demo runs the local broker: started by the demo, it
    is stopped at the end; already running, it is left running."""
    from kvconductor.tools.kafka_local import broker as kafka_local

    broker_dir = tmp_path / "broker"
    port = _adjacent_free_ports()
    env = demo_env(f"127.0.0.1:{port}")
    args = ["demo", "--broker-dir", str(broker_dir), "--broker-port", str(port), "--duration", "6"]
    try:
        first = subprocess.run(
            [*kvconductor(), *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
        )
        assert first.returncode == 0, first.stderr[-3000:]
        check_output(first.stdout, first.stderr)
        assert "(local broker started by the demo)" in first.stdout
        assert "stopping the local Kafka broker the demo started" in first.stderr
        assert not kafka_local.status(broker_dir).running

        kafka_local.start(broker_dir, port=port)
        second = subprocess.run(
            [*kvconductor(), *args], env=env, capture_output=True, text=True, timeout=300, cwd=REPO
        )
        assert second.returncode == 0, second.stderr[-3000:]
        assert "(local broker already running, left running)" in second.stdout
        assert "stopping the local Kafka broker" not in second.stderr
        assert kafka_local.status(broker_dir).running
    finally:
        kafka_local.stop(broker_dir)


async def test_engines_only_feed_a_daemon(kafka_bootstrap: str) -> None:
    """docker-compose's `engines` service: only the traffic, read by a separate daemon."""
    from kvconductor.config import load_config
    from kvconductor.tools.demo.engines import (
        DEMO_BLOCK_SIZE,
        DEMO_MODEL,
        SYSTEM_PROMPTS,
        text_tokens,
    )
    from tests.harness import http_json, running, wait_for

    env = demo_env(kafka_bootstrap)
    cfg = load_config(None, env)
    async with running(cfg) as daemon:
        port = daemon.http_port
        assert port is not None
        proc = await asyncio.create_subprocess_exec(
            *kvconductor(), "demo", "--engines-only", "--bootstrap", kafka_bootstrap,
            "--duration", "8",
            env=env,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            stdin=asyncio.subprocess.DEVNULL,
            cwd=REPO,
        )  # fmt: skip
        query = {
            "model": DEMO_MODEL,
            "block_size": DEMO_BLOCK_SIZE,
            "token_ids": text_tokens(SYSTEM_PROMPTS["sql"]),
        }

        async def cached() -> bool:
            _, answer = await http_json(port, "POST", "/query", query)
            hits = answer.get("default", {}).values()
            return any(h["longest_matched"] > 0 for h in hits)

        try:
            await wait_for(cached, 60, "a system prompt cached by the demo engines")
        finally:
            out, err = await _finish(proc, 90)
        assert proc.returncode == 0, err.decode()[-3000:]
        assert out.decode().startswith(f"demo engines -> {kafka_bootstrap} topics ")
        assert re.search(r"^engines: \d+ requests", out.decode(), re.M)


async def test_engines_via_the_bridge_feed_a_daemon(kafka_bootstrap: str) -> None:
    """docker-compose's data path: demo engines on ZMQ PUB sockets, registered with
    a `kvconductor bridge`, which relays them to Kafka, read by the daemon."""
    from kvconductor.config import load_config
    from kvconductor.tools.cli import build_parser
    from kvconductor.tools.demo.engines import (
        DEMO_BLOCK_SIZE,
        DEMO_MODEL,
        SYSTEM_PROMPTS,
        text_tokens,
    )
    from kvconductor.tools.kafka_local.broker import free_ports
    from tests.harness import http_json, running, wait_for

    subcommands = next(
        a.choices for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)
    )
    if "bridge" not in subcommands:
        pytest.skip("`kvconductor bridge` is not in kvconductor.tools.cli yet")
    env = demo_env(kafka_bootstrap)
    cfg = load_config(None, env)
    tag = uuid.uuid4().hex[:8]
    (bridge_port,) = free_ports(1)
    zmq_port = _free_port_run(6)  # one PUB socket per engine rank and the pool
    bridge_env = {
        **env,
        "KVCONDUCTOR_BRIDGE_PORT": str(bridge_port),
        "KVCONDUCTOR_BRIDGE_REGISTRATIONS_TOPIC": f"demo-registrations-{tag}",
        "KVCONDUCTOR_BRIDGE_GROUP_ID": f"demo-bridge-{tag}",
        "KVCONDUCTOR_BRIDGE_CLIENT_ID": f"demo-bridge-{tag}",
    }
    bridge = await asyncio.create_subprocess_exec(
        *kvconductor(), "bridge", "--config", str(REPO / "config" / "bridge.toml"),
        env=bridge_env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
        stdin=asyncio.subprocess.DEVNULL, cwd=REPO,
    )  # fmt: skip
    try:
        async with running(cfg) as daemon:
            port = daemon.http_port
            assert port is not None
            engines = await asyncio.create_subprocess_exec(
                *kvconductor(), "demo", "--engines-only",
                "--via-bridge", f"http://127.0.0.1:{bridge_port}",
                "--zmq-port", str(zmq_port), "--duration", "15", "--wait", "60",
                env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
                stdin=asyncio.subprocess.DEVNULL, cwd=REPO,
            )  # fmt: skip
            query = {
                "model": DEMO_MODEL,
                "block_size": DEMO_BLOCK_SIZE,
                "token_ids": text_tokens(SYSTEM_PROMPTS["travel"]),
            }

            async def cached() -> bool:
                _, answer = await http_json(port, "POST", "/query", query)
                hits = answer.get("default", {}).values()
                return any(h["longest_matched"] > 0 for h in hits)

            try:
                await wait_for(cached, 90, "a system prompt cached via the bridge")
            except AssertionError as exc:
                # Say where the relay stopped: the engines' and the bridge's
                # own accounts.
                _, err = await _finish(engines, 120)
                _, bridge_err = await _stop(bridge)
                raise AssertionError(
                    f"{exc}\nengines: {err.decode()[-2000:]}\nbridge: {bridge_err.decode()[-3000:]}"
                ) from None
            out, err = await _finish(engines, 120)
            assert engines.returncode == 0, err.decode()[-3000:]
            assert "via bridge http://127.0.0.1:" in out.decode()
    finally:
        if bridge.returncode is None:
            await _stop(bridge)


async def _stop(proc: asyncio.subprocess.Process) -> tuple[bytes, bytes]:
    """SIGTERM, then its output; killed if it does not end within 30 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.communicate(), 30)
    except TimeoutError:
        proc.kill()
        return await proc.communicate()


def test_demo_with_its_http_port_taken_is_one_line(kafka_bootstrap: str) -> None:
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        env = {**demo_env(kafka_bootstrap), "KVCONDUCTOR_HTTP_PORT": str(port)}
        result = subprocess.run(
            [*kvconductor(), "demo", "--bootstrap", kafka_bootstrap, "--duration", "5"],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            cwd=REPO,
        )
    assert result.returncode == 1
    lines = result.stderr.strip().splitlines()
    assert lines == [
        f"kvconductor demo: error: the daemon cannot listen on 127.0.0.1:{port}: address "
        "already in use (another kvconductor running? set KVCONDUCTOR_HTTP_PORT)"
    ], result.stderr
