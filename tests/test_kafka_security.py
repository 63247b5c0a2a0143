"""Kafka security for real: a local broker with a TLS (SSL) and a SASL_SSL (SCRAM) listener,
certificates made here with the openssl CLI, and the daemon, the bridge and the replica run
as a user runs them (`kvconductor run | bridge | replica`), moving events through each
listener. A wrong SCRAM password or an untrusted broker certificate ends each of them with
one clear error line, in about a second instead of retrying for ever.

One secured broker serves the whole module (its PLAINTEXT listener is the inter-broker one).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import zmq.asyncio
from aiokafka.errors import KafkaConnectionError

from kvconductor.config import load_config
from kvconductor.kafka.access import KafkaAccessError, check_access
from kvconductor.tools.kafka_local import broker as kafka_local
from tests.bridge_fakes import FakePublisher
from tests.harness import (
    daemon_config,
    engine_headers,
    http_json,
    produce,
    stored,
    vllm_payload,
    wait_for,
)
from tests.test_cli import REPO, cfg_env, kvconductor

pytestmark = pytest.mark.kafka

USER = "kvc-user"
PASSWORD = "scram-secret-1"
MECHANISM = "SCRAM-SHA-512"


# ------------------------------------------------------------------ certificates


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)


def _new_key_args(key: Path) -> list[str | Path]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-keyout", key]


def make_ca(folder: Path, name: str) -> tuple[Path, Path]:
    """A self-signed CA: (certificate, key)."""
    cert, key = folder / f"{name}.pem", folder / f"{name}.key"
    _openssl(
        "req", "-x509", *_new_key_args(key), "-out", cert, "-days", "2", "-subj", f"/CN={name}"
    )
    return cert, key


def make_broker_cert(folder: Path, ca: tuple[Path, Path]) -> kafka_local.Tls:
    """A server certificate for 127.0.0.1 and localhost, signed by `ca`."""
    cert, key, csr = folder / "broker.pem", folder / "broker.key", folder / "broker.csr"
    ext = folder / "broker.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n")
    _openssl("req", *_new_key_args(key), "-out", csr, "-subj", "/CN=localhost")
    _openssl(
        "x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-out", cert, "-days", "2",
        "-set_serial", random.getrandbits(63), "-extfile", ext,
    )  # fmt: skip
    return kafka_local.Tls(certfile=cert, keyfile=key)


# ------------------------------------------------------------------------ broker


@dataclass(frozen=True)
class Secured:
    plaintext: str
    ssl: str
    sasl_ssl: str
    ca: Path  # signed the broker's certificate
    rogue_ca: Path  # did not
    folder: Path
    tls: kafka_local.Tls

    @property
    def data_dir(self) -> Path:
        return self.folder / "broker"

    def env(
        self, protocol: str, *, password: str = PASSWORD, ca: Path | None = None
    ) -> dict[str, str]:
        """`[kafka]` settings, as env vars, to reach the listener of `protocol`."""
        env = {
            "KVCONDUCTOR_KAFKA_SECURITY_PROTOCOL": protocol,
            "KVCONDUCTOR_KAFKA_SSL_CAFILE": str(ca or self.ca),
        }
        if protocol == "SSL":
            return {**env, "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": self.ssl}
        password_file = self.folder / f"password-{password}"
        password_file.write_text(password + "\n")
        return {
            **env,
            "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": self.sasl_ssl,
            "KVCONDUCTOR_KAFKA_SASL_MECHANISM": MECHANISM,
            "KVCONDUCTOR_KAFKA_SASL_USERNAME": USER,
            "KVCONDUCTOR_KAFKA_SASL_PASSWORD_FILE": str(password_file),
        }


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secured]:
    folder = tmp_path_factory.mktemp("kafka-security")
    ca = make_ca(folder, "test-ca")
    rogue_ca, _ = make_ca(folder, "rogue-ca")
    tls = make_broker_cert(folder, ca)
    port, controller, ssl_port, sasl_port = kafka_local.free_ports(4)
    data_dir = folder / "broker"
    security = kafka_local.Security(ssl_port, sasl_port, tls, {USER: PASSWORD})
    plaintext = kafka_local.start(data_dir, port, controller, security=security)
    try:
        yield Secured(
            plaintext,
            f"127.0.0.1:{ssl_port}",
            f"127.0.0.1:{sasl_port}",
            ca[0],
            rogue_ca,
            folder,
            tls,
        )
    finally:
        kafka_local.stop(data_dir)


# ---------------------------------------------------------------------- services


class Service:
    """A `kvconductor` command as a subprocess; its JSON log lines (stdout) and stderr."""

    def __init__(self, proc: asyncio.subprocess.Process, name: str) -> None:
        self.proc = proc
        self.name = name
        self.started = time.monotonic()
        self.lines: list[str] = []
        self.stderr = ""
        self._tasks = [
            asyncio.create_task(self._read_stdout()),
            asyncio.create_task(self._read_stderr()),
        ]

    @classmethod
    async def start(cls, *args: str, env: dict[str, str]) -> Service:
        proc = await asyncio.create_subprocess_exec(
            *kvconductor(), *args,
            env=env, cwd=REPO,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        return cls(proc, args[0])

    async def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        async for line in self.proc.stdout:
            self.lines.append(line.decode(errors="replace").rstrip("\n"))

    async def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        self.stderr = (await self.proc.stderr.read()).decode(errors="replace")

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.lines:
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
        return out

    def output(self) -> str:
        return "\n".join(self.lines) + "\n" + self.stderr

    async def http_port(self, event: str) -> int:
        """The HTTP port the service logged with `event` (it listens on port 0)."""

        def logged() -> bool:
            return any(e.get("event") == event for e in self.events()) or self.done

        await wait_for(logged, 60, f"{self.name}: {event}")
        ports = [e["port"] for e in self.events() if e.get("event") == event]
        assert ports, self.output()
        return int(ports[0])

    @property
    def done(self) -> bool:
        return self.proc.returncode is not None

    async def wait(self, timeout: float = 60) -> int:
        code = await asyncio.wait_for(self.proc.wait(), timeout)
        await asyncio.gather(*self._tasks)
        return code

    async def stop(self) -> int:
        if not self.done:
            self.proc.send_signal(signal.SIGTERM)
        return await self.wait()


@contextlib.asynccontextmanager
async def service(*args: str, env: dict[str, str]) -> AsyncIterator[Service]:
    svc = await Service.start(*args, env=env)
    try:
        yield svc
    finally:
        code = await svc.stop()
    assert code == 0, svc.output()[-3000:]


async def ready(port: int) -> bool:
    try:
        status, _ = await http_json(port, "GET", "/ready")
    except OSError:
        return False
    return status == 200


async def longest(port: int, tokens: list[int], instance: str) -> int:
    status, body = await http_json(
        port, "POST", "/query", {"model": "m", "block_size": 4, "token_ids": tokens}
    )
    assert status == 200, body
    return int(body.get("default", {}).get(instance, {}).get("longest_matched", 0))


def bridge_toml(path: Path, pub: FakePublisher, instance: str) -> Path:
    path.write_text(
        "[bridge]\nregistrations = false\nreplay_timeout_s = 2.0\nlinger_ms = 1\n"
        f'[[publishers]]\nid = "{instance}"\nendpoint = "{pub.endpoint}"\n'
        f'replay_endpoint = "{pub.replay_endpoint}"\nmodel = "m"\nblock_size = 4\n'
    )
    return path


# ------------------------------------------------------------------------- tests


@pytest.mark.parametrize("protocol", ["SSL", "SASL_SSL"])
async def test_bridge_daemon_and_replica_move_events_through_the_listener(
    secured: Secured, protocol: str, tmp_path: Path
) -> None:
    """engine (ZMQ) -> bridge -> Kafka -> daemon -> /query, and Kafka -> replica -> /query,
    every Kafka client on the secured listener only."""
    security = secured.env(protocol)
    cfg = daemon_config(secured.plaintext, **security)  # checks the settings, tags the topics
    env = {
        **cfg_env(cfg),
        **security,
        "KVCONDUCTOR_HTTP_PORT": "0",
        "KVCONDUCTOR_BRIDGE_PORT": "0",
        "KVCONDUCTOR_SNAPSHOT_INTERVAL_S": "0.5",
        "KVCONDUCTOR_LOG_FORMAT": "json",
    }
    instance = f"vllm-{protocol.lower()}"
    first, second = list(range(1, 9)), list(range(11, 19))
    ctx = zmq.asyncio.Context()
    pub = FakePublisher(ctx)
    try:
        async with service("run", env=env) as daemon:
            daemon_port = await daemon.http_port("http listening")
            await wait_for(lambda: ready(daemon_port), 90, "daemon ready")
            bridge_cfg = bridge_toml(tmp_path / "bridge.toml", pub, instance)
            async with service("bridge", "--config", str(bridge_cfg), env=env):
                # The bridge subscribes once its producer is up on the secured listener.
                await pub.wait_subscribed(timeout=90)
                await pub.publish(vllm_payload([stored([1, 2], first)]))

                async def daemon_has(tokens: list[int]) -> bool:
                    return await longest(daemon_port, tokens, instance) == 8

                await wait_for(lambda: daemon_has(first), 60, "daemon indexed the event")
                async with service("replica", env=env) as replica:
                    replica_port = await replica.http_port("replica http listening")
                    await wait_for(lambda: ready(replica_port), 90, "replica ready")
                    assert await longest(replica_port, first, instance) == 8
                    # Following: a later event reaches both.
                    await pub.publish(vllm_payload([stored([3, 4], second)]))
                    await wait_for(lambda: daemon_has(second), 60, "daemon, second event")

                    async def replica_has() -> bool:
                        return await longest(replica_port, second, instance) == 8

                    await wait_for(replica_has, 60, "replica followed the second event")
    finally:
        await pub.close()
        ctx.destroy(linger=0)


@pytest.mark.parametrize("protocol", ["SSL", "SASL_SSL"])
async def test_the_native_fetch_path_reads_through_the_listener(
    secured: Secured, protocol: str
) -> None:
    """`fetch_path = "native"`: its own broker connections (kvconductor.kafka.frames)
    are opened on the secured listener as aiokafka's are, TLS and SCRAM included."""
    security = {**secured.env(protocol), "KVCONDUCTOR_KAFKA_FETCH_PATH": "native"}
    cfg = daemon_config(secured.plaintext, **security)
    env = {
        **cfg_env(cfg),
        **security,
        "KVCONDUCTOR_HTTP_PORT": "0",
        "KVCONDUCTOR_LOG_FORMAT": "json",
    }
    instance = f"vllm-native-{protocol.lower()}"
    tokens = list(range(1, 9))
    async with service("run", env=env) as daemon:
        port = await daemon.http_port("http listening")
        await wait_for(lambda: ready(port), 90, "daemon ready")
        record = (instance, vllm_payload([stored([1, 2], tokens)]), engine_headers())
        await produce(secured.plaintext, cfg.kafka.engine_topic, [record])

        async def indexed() -> bool:
            return await longest(port, tokens, instance) == 8

        await wait_for(indexed, 60, "the daemon indexed the record")


FAULTS = {
    "wrong_password": (
        "SASL_SSL",
        {"password": "not-the-password"},
        "kafka: authentication failed for user 'kvc-user' on {sasl_ssl}",
    ),
    "untrusted_certificate": (
        "SSL",
        {"rogue": True},
        "kafka: TLS certificate verification failed for {ssl}",
    ),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
@pytest.mark.parametrize("command", ["run", "bridge", "replica"])
async def test_refused_access_ends_the_process_with_one_clear_line(
    secured: Secured, command: str, fault: str
) -> None:
    protocol, options, expected = FAULTS[fault]
    security = secured.env(
        protocol,
        password=str(options.get("password", PASSWORD)),
        ca=secured.rogue_ca if options.get("rogue") else None,
    )
    cfg = daemon_config(secured.plaintext, **security)
    env = {
        **cfg_env(cfg),
        **security,
        "KVCONDUCTOR_HTTP_PORT": "0",
        "KVCONDUCTOR_BRIDGE_PORT": "0",
        "KVCONDUCTOR_LOG_FORMAT": "json",
    }
    svc = await Service.start(command, env=env)
    try:
        code = await svc.wait(timeout=60)  # a retry loop would never end
    finally:
        if not svc.done:
            await svc.stop()
    elapsed = time.monotonic() - svc.started
    errors = [e for e in svc.events() if e.get("level") == "error"]
    print(f"\n{command} with {fault}: exit {code} after {elapsed:.1f} s: {errors}")
    assert code == 1, svc.output()
    assert len(errors) == 1, svc.output()
    line = errors[0]["event"]
    assert line.startswith(expected.format(sasl_ssl=secured.sasl_ssl, ssl=secured.ssl)), line
    assert "\n" not in line
    # Nothing else: no traceback, no warnings, no aiokafka retry lines.
    assert svc.stderr == "", svc.stderr
    assert not [e for e in svc.events() if e.get("level") == "warning"], svc.output()


async def test_check_access_names_what_is_wrong(secured: Secured) -> None:
    def kafka(**env: str) -> Any:
        return load_config(None, env).kafka

    # Accepted through both listeners.
    await check_access(kafka(**secured.env("SSL")))
    await check_access(kafka(**secured.env("SASL_SSL")))
    # A mechanism the listener does not offer.
    plain = {**secured.env("SASL_SSL"), "KVCONDUCTOR_KAFKA_SASL_MECHANISM": "PLAIN"}
    with pytest.raises(
        KafkaAccessError, match=f"{secured.sasl_ssl} does not accept SASL mechanism PLAIN"
    ):
        await check_access(kafka(**plain))
    # A plaintext client on the TLS listener is hung up on: an outage-like error with a hint.
    with pytest.raises(KafkaConnectionError, match="is it a PLAINTEXT listener"):
        await check_access(kafka(KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS=secured.ssl), timeout_s=5)
    # One refusing server and one accepting: accepted (aiokafka bootstraps from either).
    both = {
        **secured.env("SSL"),
        "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": f"{secured.plaintext},{secured.ssl}",
    }
    await check_access(kafka(**both))


@pytest.mark.parametrize(("protocol", "loop"), [("SSL", "asyncio"), ("PLAINTEXT", "uvloop")])
def test_tls_services_run_on_asyncios_loop(protocol: str, loop: str) -> None:
    """uvloop's TLS close waits 30 s for the answer to a consumer's pending fetch (it never
    reads it, MagicStack/uvloop#471): every consumer stop of a service over Kafka TLS took
    30 s more. Services over TLS run on asyncio's own loop."""
    script = (
        "import asyncio\n"
        "from kvconductor.tools.cli import _serve\n"
        "from kvconductor.config import KafkaConfig, LogConfig\n"
        "async def main() -> int:\n"
        "    print(type(asyncio.get_running_loop()).__module__)\n"
        "    return 0\n"
        f"_serve(main(), LogConfig(), KafkaConfig(security_protocol={protocol!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.strip().split(".")[0] == loop, out


def test_kafka_local_shows_the_secured_listeners(
    secured: Secured, capsys: pytest.CaptureFixture[str]
) -> None:
    assert kafka_local.status(secured.data_dir).answering
    out = capsys.readouterr().out
    assert f"bootstrap={secured.plaintext} ssl={secured.ssl} sasl_ssl={secured.sasl_ssl}" in out
    # Started again with other listeners: the running broker's address, and a note.
    (other,) = kafka_local.free_ports(1)
    again = kafka_local.Security(ssl_port=other, tls=secured.tls)
    assert kafka_local.start(secured.data_dir, security=again) == secured.plaintext
    err = capsys.readouterr().err
    assert f"already running with other secured listeners (SSL {secured.ssl}, SASL_SSL" in err
