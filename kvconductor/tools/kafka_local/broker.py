"""A real single-node Apache Kafka broker (KRaft) for development, tests and CI, no Docker.

The broker runs straight from the Apache Kafka jars on Maven Central:

* ``fetch_jars()`` copies the runtime of ``resources/kafka/pom.xml`` (``kafka_2.13`` plus a
  log4j2 backend) into a cache folder with Maven, once; later runs find the jars there.
* ``start()`` renders ``resources/kafka/server.properties`` into a data folder, formats the
  KRaft storage, launches ``kafka.Kafka`` detached, waits until the broker answers an admin
  call and returns its bootstrap address. It is idempotent per data folder.
* ``stop()`` / ``status()`` act on the broker recorded in that data folder's pid file.

Command line (``kvconductor kafka-local``, or
``python -m kvconductor.tools.kafka_local.broker``)::

    start [--dir DIR] [--port PORT] [--controller-port PORT] [--wait SECONDS]
          [--ssl-port PORT] [--sasl-port PORT] [--tls-cert FILE --tls-key FILE]
          [--scram-user NAME=PASSWORD ...]
    start --brokers N [--dir DIR] [--port PORT] [--controller-port PORT] [--wait SECONDS]
    stop [--dir DIR]
    status [--dir DIR]
    fetch

``start`` prints only the bootstrap address on stdout (progress goes to stderr), so
``BOOTSTRAP=$(python -m kvconductor.tools.kafka_local.broker start)`` works.

``start --brokers N`` (``start_cluster()``) runs a local cluster instead: N KRaft nodes, each
broker and controller in one process, the N controllers a static quorum; node ``i`` (1..N)
lives in ``<dir>/node-<i>`` (a single node's data folder of its own) on client port
``PORT + 2(i-1)`` and controller port ``CONTROLLER_PORT + 2(i-1)``; the internal topics
(offsets, transaction state) get ``min(3, N)`` replicas and ``min(3, N) - 1`` in sync, and
each node a smaller heap (three fit a 2-core machine beside the tests). ``<dir>/cluster.json``
records the layout, so ``start`` again (a node restored after a fault) reuses its ports and
cluster id, and ``stop``/``status`` act on every node. The bootstrap printed lists every node.

Environment: ``KVCONDUCTOR_LOCAL_KAFKA_DIR`` (data folder, default
``${XDG_STATE_HOME:-~/.local/state}/kvconductor/kafka-local``),
``KVCONDUCTOR_LOCAL_KAFKA_PORT`` (client port, default 39092; the controller port defaults to the
client port + 1), ``KVCONDUCTOR_LOCAL_KAFKA_LIBS`` (jar cache, default
``~/.cache/kvconductor/kafka-<version>/libs``), ``JAVA_HOME`` (else ``java`` on PATH),
``KVCONDUCTOR_LOCAL_KAFKA_JAVA_OPTS`` (extra JVM options, after the defaults; for example
``-XX:TieredStopAtLevel=1`` starts about 1.5 s faster with ~25 MiB less RSS, at the cost of
broker throughput, so it is not the default: benchmarks run against this broker).

Files in the data folder: ``server.properties`` (rendered), ``kraft-logs/`` (topic data and
the metadata log), ``logs/server.log`` (log4j2), ``logs/kafka.out`` (the JVM's own
stdout/stderr), ``kafka.pid`` and ``broker.json`` (pid, ports, listeners, bootstrap of the
running broker), and with security ``tls/keystore.pem`` (the broker's key and certificate)
and ``scram-users.json`` (which SCRAM users the storage was formatted with).

Listeners are described by :class:`Listener` objects and rendered into the properties
template. The PLAINTEXT listener is always there (inter-broker traffic and the readiness
check use it); :class:`Security` adds a TLS listener (``SSL``) and a SASL/SCRAM listener
(``SASL_SSL``, or ``SASL_PLAINTEXT`` without a certificate), each with its
``listener.name.<name>.*`` settings. SCRAM credentials live in the KRaft metadata log, so
they are created when the storage is formatted (``kafka-storage format --add-scram``), for
both SCRAM-SHA-256 and SCRAM-SHA-512.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import concurrent.futures
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from string import Template
from typing import NamedTuple

# Package data, so a non-editable install finds the templates as a checkout does.
CONFIG_DIR = Path(__file__).resolve().parent / "resources" / "kafka"
POM_FILE = CONFIG_DIR / "pom.xml"
PROPERTIES_TEMPLATE = CONFIG_DIR / "server.properties"
LOG4J2_CONFIG = CONFIG_DIR / "log4j2.yaml"

HOST = "127.0.0.1"
DEFAULT_PORT = 39092
DEFAULT_CONTROLLER_PORT = DEFAULT_PORT + 1
DEFAULT_WAIT_S = 90.0
STOP_TIMEOUT_S = 30.0
MIN_JAVA = 17
DEPENDENCY_PLUGIN = "org.apache.maven.plugins:maven-dependency-plugin:3.8.1"
# Smaller still for each node of a local cluster: three of them, the tests and the
# daemons share 2 cores (it comes after JVM_OPTIONS, so it wins).
CLUSTER_NODE_HEAP: tuple[str, ...] = ("-Xms32m", "-Xmx320m")
# Small heap: the broker shares a 2-core machine with the tests and the daemon.
JVM_OPTIONS: tuple[str, ...] = (
    "-Xms64m",
    "-Xmx768m",
    "-XX:+UseG1GC",
    "-XX:MaxGCPauseMillis=20",
    "-XX:+ExplicitGCInvokesConcurrent",
    "-Djava.awt.headless=true",
    # Keep log4j2 alive until the JVM exits, so the shutdown is logged too.
    "-Dlog4j2.shutdownHookEnabled=false",
)

ENV_DIR = "KVCONDUCTOR_LOCAL_KAFKA_DIR"
ENV_PORT = "KVCONDUCTOR_LOCAL_KAFKA_PORT"
ENV_LIBS = "KVCONDUCTOR_LOCAL_KAFKA_LIBS"
ENV_JAVA_OPTS = "KVCONDUCTOR_LOCAL_KAFKA_JAVA_OPTS"

PID_FILE = "kafka.pid"
CLUSTER_FILE = "cluster.json"
STATE_FILE = "broker.json"
SCRAM_FILE = "scram-users.json"
KEYSTORE_FILE = Path("tls") / "keystore.pem"
LOCK_FILE = ".kafka-local.lock"
FETCHED_MARKER = ".kvconductor-fetched"

_POM_NS = {"m": "http://maven.apache.org/POM/4.0.0"}

SCRAM_MECHANISMS: tuple[str, ...] = ("SCRAM-SHA-256", "SCRAM-SHA-512")
SCRAM_LOGIN_MODULE = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
# What ``--add-scram 'MECHANISM=[name=N,password=P]'`` carries without quoting.
_SCRAM_TOKEN = re.compile(r'[^\s,\[\]="]+')


class KafkaLocalError(RuntimeError):
    """A one-line, user-facing reason why the local broker cannot be fetched or run."""


@dataclass(frozen=True)
class Listener:
    """One client listener of the broker, rendered into ``server.properties``.

    ``settings`` become ``listener.name.<name lower-case>.<key>=<value>`` lines (the place
    for ``ssl.keystore.location``, ``sasl.enabled.mechanisms`` and the like).
    """

    name: str
    port: int
    protocol: str = "PLAINTEXT"
    settings: Mapping[str, str] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"{self.name}://{HOST}:{self.port}"


@dataclass(frozen=True)
class Tls:
    """The broker's TLS identity, PEM: ``certfile`` its certificate (intermediates after it),
    ``keyfile`` its private key, unencrypted PKCS#8 (``BEGIN PRIVATE KEY``)."""

    certfile: Path
    keyfile: Path


@dataclass(frozen=True)
class Security:
    """Listeners beside PLAINTEXT.

    ``ssl_port``: a TLS listener (needs ``tls``). ``sasl_port``: a SCRAM-SHA-256/512 listener,
    ``SASL_SSL`` with ``tls``, else ``SASL_PLAINTEXT``. ``scram_users`` (name -> password)
    are created when the storage is first formatted; a formatted data folder keeps its users.
    """

    ssl_port: int | None = None
    sasl_port: int | None = None
    tls: Tls | None = None
    scram_users: Mapping[str, str] = field(default_factory=dict)

    @property
    def sasl_protocol(self) -> str:
        return "SASL_SSL" if self.tls is not None else "SASL_PLAINTEXT"

    def ports(self) -> dict[str, int]:
        """Listener name (= its security protocol) -> port, for the secured listeners."""
        ports = {"SSL": self.ssl_port, self.sasl_protocol: self.sasl_port}
        return {name: port for name, port in ports.items() if port is not None}

    def check(self) -> None:
        """Raise :class:`KafkaLocalError` for a combination that cannot be meant."""
        if self.ssl_port is not None and self.tls is None:
            raise KafkaLocalError("a TLS listener (--ssl-port) needs --tls-cert and --tls-key")
        if self.tls is not None and not self.ports():
            raise KafkaLocalError("a certificate (--tls-cert) needs --ssl-port or --sasl-port")
        if self.scram_users and self.sasl_port is None:
            raise KafkaLocalError("SCRAM users (--scram-user) need a SASL listener (--sasl-port)")
        for name, password in self.scram_users.items():
            for what, token in (("user name", name), ("password", password)):
                if not _SCRAM_TOKEN.fullmatch(token):
                    raise KafkaLocalError(
                        f"SCRAM {what} of {name!r} must be non-empty, without spaces, "
                        "commas, brackets, quotes or '='"
                    )


@dataclass(frozen=True)
class Quorum:
    """A node's place in its KRaft quorum: its id, and every voter's id and controller port
    (a single node is the one voter of its own quorum)."""

    node_id: int
    voters: Mapping[int, int]

    @property
    def replication(self) -> int:
        """Replicas of the internal topics (and the default of others)."""
        return min(3, len(self.voters))

    @property
    def min_isr(self) -> int:
        return max(1, self.replication - 1)

    def render_voters(self) -> str:
        return ",".join(f"{node}@{HOST}:{port}" for node, port in sorted(self.voters.items()))


@dataclass(frozen=True)
class BrokerStatus:
    """What ``status()`` found in a data folder."""

    data_dir: Path
    running: bool
    pid: int | None = None
    bootstrap: str | None = None
    answering: bool = False


# Brokers started by this process: kept so they can be reaped (no zombies) on stop().
_CHILDREN: dict[int, subprocess.Popen[bytes]] = {}


def _say(message: str) -> None:
    print(f"kafka-local: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Locations and settings
# --------------------------------------------------------------------------------------


def _config_file(path: Path) -> Path:
    if not path.is_file():
        raise KafkaLocalError(f"{path} is missing: this kvconductor installation is incomplete")
    return path


def kafka_version() -> str:
    """The Kafka version pinned in ``resources/kafka/pom.xml`` (property ``kafka.version``)."""
    root = ET.parse(_config_file(POM_FILE)).getroot()
    node = root.find("m:properties/m:kafka.version", _POM_NS)
    if node is None or not (node.text or "").strip():
        raise KafkaLocalError(f"{POM_FILE} has no <kafka.version> property")
    return (node.text or "").strip()


def default_data_dir() -> Path:
    """``$KVCONDUCTOR_LOCAL_KAFKA_DIR``, else ``kafka-local`` in the user's XDG state folder:
    broker data outlives a run but is no cache, and never belongs beside the code."""
    env = os.environ.get(ENV_DIR)
    if env:
        return Path(env).expanduser()
    state = Path(os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
    return state / "kvconductor" / "kafka-local"


def default_port() -> int:
    env = os.environ.get(ENV_PORT)
    if not env:
        return DEFAULT_PORT
    try:
        return int(env)
    except ValueError:
        raise KafkaLocalError(f"{ENV_PORT}={env!r} is not a port number") from None


def default_libs_dir() -> Path:
    env = os.environ.get(ENV_LIBS)
    if env:
        return Path(env).expanduser()
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvconductor" / f"kafka-{kafka_version()}" / "libs"


def _resolve_dir(data_dir: Path | None) -> Path:
    return (data_dir if data_dir is not None else default_data_dir()).expanduser().resolve()


# --------------------------------------------------------------------------------------
# Tools: Java and Maven
# --------------------------------------------------------------------------------------


def _java_version(java: str) -> int:
    try:
        out = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except OSError as exc:
        raise KafkaLocalError(f"cannot run {java}: {exc}") from None
    match = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    if match is None:
        raise KafkaLocalError(f"cannot tell the Java version of {java}")
    major = int(match.group(1))
    return int(match.group(2) or 0) if major == 1 else major


def find_java() -> str:
    """Path of a Java 17+ ``java`` (``$JAVA_HOME/bin/java``, else ``java`` on PATH)."""
    java_home = os.environ.get("JAVA_HOME")
    candidate = Path(java_home) / "bin" / "java" if java_home else None
    java = str(candidate) if candidate and candidate.is_file() else shutil.which("java")
    if java is None:
        raise KafkaLocalError(
            f"Java {MIN_JAVA}+ is required to run Kafka and none was found "
            "(install openjdk-17-jre-headless or set JAVA_HOME)"
        )
    version = _java_version(java)
    if version < MIN_JAVA:
        raise KafkaLocalError(
            f"Kafka 4.x needs Java {MIN_JAVA}+, but {java} is Java {version} "
            "(install openjdk-17-jre-headless or set JAVA_HOME)"
        )
    return java


@contextlib.contextmanager
def _locked(lock_path: Path) -> Iterator[None]:
    """An exclusive advisory lock (flock) held for the ``with`` block."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with lock_path.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _pom_stamp() -> str:
    return hashlib.sha256(_config_file(POM_FILE).read_bytes()).hexdigest()


def _jars_present(libs: Path, version: str, stamp: str) -> bool:
    marker = libs / FETCHED_MARKER
    return (
        marker.is_file()
        and marker.read_text().strip() == stamp
        and (libs / f"kafka_2.13-{version}.jar").is_file()
    )


def fetch_jars(libs: Path | None = None) -> Path:
    """Copy the broker's runtime jars into ``libs`` with Maven, unless already there.

    Returns the libs folder. The folder is complete once it holds a marker written after
    Maven succeeded (it records a hash of the pom, so editing the pom fetches again).
    """
    version = kafka_version()
    libs = (libs if libs is not None else default_libs_dir()).expanduser().resolve()
    stamp = _pom_stamp()
    if _jars_present(libs, version, stamp):
        return libs
    with _locked(libs.parent / f"{libs.name}.lock"):
        if _jars_present(libs, version, stamp):  # another process fetched meanwhile
            return libs
        mvn = shutil.which("mvn")
        if mvn is None:
            raise KafkaLocalError(
                "Maven (mvn) is required to fetch the Kafka jars once and was not found "
                "(install the maven package)"
            )
        _say(f"fetching Apache Kafka {version} jars from Maven Central into {libs} (once)")
        started = time.monotonic()
        libs.mkdir(parents=True, exist_ok=True)
        for stale in [*libs.glob("*.jar"), libs / FETCHED_MARKER]:
            stale.unlink(missing_ok=True)
        # Maven's project folder is the pom's: a copy in the cache keeps anything Maven
        # writes out of the installed package, which may be read-only.
        pom = libs.parent / "pom.xml"
        shutil.copyfile(POM_FILE, pom)
        cmd = [
            mvn, "-q", "-B", "-f", str(pom),
            f"{DEPENDENCY_PLUGIN}:copy-dependencies",
            f"-DoutputDirectory={libs}", "-DincludeScope=runtime",
        ]  # fmt: skip
        result = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            tail = "\n".join((result.stdout + result.stderr).strip().splitlines()[-15:])
            print(tail, file=sys.stderr)
            raise KafkaLocalError(f"mvn could not fetch the Kafka jars (exit {result.returncode})")
        if not (libs / f"kafka_2.13-{version}.jar").is_file():
            raise KafkaLocalError(f"mvn ran but kafka_2.13-{version}.jar is not in {libs}")
        _write(libs / FETCHED_MARKER, stamp + "\n")
        jars = list(libs.glob("*.jar"))
        size_mib = sum(j.stat().st_size for j in jars) / 2**20
        elapsed = time.monotonic() - started
        _say(f"fetched {len(jars)} jars ({size_mib:.0f} MiB) in {elapsed:.1f} s")
    return libs


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


def render_properties(
    data_dir: Path,
    listeners: Sequence[Listener],
    controller_port: int,
    quorum: Quorum | None = None,
) -> str:
    """``server.properties`` for ``data_dir`` from the template in ``resources/kafka``.

    The first listener must be ``PLAINTEXT`` (the inter-broker listener of the template).
    ``quorum`` defaults to a single node (id 1, the only voter).
    """
    quorum = quorum if quorum is not None else Quorum(1, {1: controller_port})
    if not listeners or listeners[0].name != "PLAINTEXT":
        raise KafkaLocalError("the first listener must be the PLAINTEXT listener")
    controller = Listener("CONTROLLER", controller_port)
    ports = [lst.port for lst in (*listeners, controller)]
    if len(set(ports)) != len(ports):
        raise KafkaLocalError(f"listener ports must differ, got {ports}")
    protocol_map = {lst.name: lst.protocol for lst in (*listeners, controller)}
    settings = [
        f"listener.name.{lst.name.lower()}.{key}={value}"
        for lst in listeners
        for key, value in lst.settings.items()
    ]
    template = Template(_config_file(PROPERTIES_TEMPLATE).read_text())
    return template.substitute(
        controller_port=controller_port,
        node_id=quorum.node_id,
        quorum_voters=quorum.render_voters(),
        replication=quorum.replication,
        min_isr=quorum.min_isr,
        data_dir=str(data_dir),
        listeners=",".join(lst.url for lst in (*listeners, controller)),
        advertised_listeners=",".join(lst.url for lst in listeners),
        protocol_map=",".join(f"{name}:{proto}" for name, proto in protocol_map.items()),
        listener_settings="\n".join(settings),
    )


def new_cluster_id() -> str:
    """16 random bytes, URL-safe base64 without padding (what ``kafka-storage random-uuid``
    prints), never starting with "-": the storage tool would read such an id (1 in 64) as an
    option and fail to format."""
    while True:
        cid = base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode("ascii")
        if not cid.startswith("-"):
            return cid


def _existing_cluster_id(data_dir: Path) -> str | None:
    meta = data_dir / "kraft-logs" / "meta.properties"
    if not meta.is_file():
        return None
    for line in meta.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "cluster.id" and value.strip():
            return value.strip()
    return None


def _write(path: Path, text: str) -> None:
    """Write ``text`` to ``path``; a failure (disk full, read-only) names the file."""
    try:
        path.write_text(text)
    except OSError as exc:
        raise KafkaLocalError(f"cannot write {path}: {exc.strerror or exc}") from exc


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path``, readable by its owner only (it holds a private key)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(text)


def write_keystore(data_dir: Path, tls: Tls) -> Path:
    """The broker's PEM key store (``ssl.keystore.type=PEM``): the private key, then the
    certificate chain, in one file of the data folder. Written at every start, so a renewed
    certificate is picked up by the next start."""
    try:
        key = tls.keyfile.read_text()
        cert = tls.certfile.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise KafkaLocalError(f"cannot read the broker's TLS certificate or key: {exc}") from None
    if "-----BEGIN PRIVATE KEY-----" not in key:
        # Kafka's PEM key store reads PKCS#8 only, and an unencrypted key needs no password.
        raise KafkaLocalError(
            f"{tls.keyfile} is not an unencrypted PKCS#8 PEM key (BEGIN PRIVATE KEY); convert "
            f"it with: openssl pkcs8 -topk8 -nocrypt -in {tls.keyfile} -out broker-pkcs8.key"
        )
    if "-----BEGIN CERTIFICATE-----" not in cert:
        raise KafkaLocalError(f"{tls.certfile} holds no PEM certificate (BEGIN CERTIFICATE)")
    path = data_dir / KEYSTORE_FILE
    _write_private(path, f"{key.strip()}\n{cert.strip()}\n")
    return path


def listeners_for(data_dir: Path, port: int, security: Security) -> list[Listener]:
    """PLAINTEXT on ``port``, then the listeners ``security`` asks for (writing the key store
    they share into ``data_dir``)."""
    security.check()
    listeners = [Listener("PLAINTEXT", port)]
    tls: dict[str, str] = {}
    if security.tls is not None:
        keystore = write_keystore(data_dir, security.tls)
        tls = {"ssl.keystore.type": "PEM", "ssl.keystore.location": str(keystore)}
    if security.ssl_port is not None:
        listeners.append(Listener("SSL", security.ssl_port, "SSL", tls))
    if security.sasl_port is not None:
        scram = {
            "sasl.enabled.mechanisms": ",".join(SCRAM_MECHANISMS),
            **{f"{m.lower()}.sasl.jaas.config": SCRAM_LOGIN_MODULE for m in SCRAM_MECHANISMS},
        }
        protocol = security.sasl_protocol
        listeners.append(Listener(protocol, security.sasl_port, protocol, {**tls, **scram}))
    return listeners


def scram_format_args(users: Mapping[str, str]) -> list[str]:
    """``kafka-storage format`` arguments creating each user for every SCRAM mechanism."""
    return [
        arg
        for name, password in users.items()
        for mechanism in SCRAM_MECHANISMS
        for arg in ("--add-scram", f"{mechanism}=[name={name},password={password}]")
    ]


def _scram_digests(cluster_id: str, users: Mapping[str, str]) -> dict[str, str]:
    """Per user, a digest of its password salted with the cluster id: enough to tell whether
    a later start asks for the users the storage was formatted with, without storing them."""
    return {
        name: hashlib.sha256(f"{cluster_id}\0{name}\0{password}".encode()).hexdigest()
        for name, password in users.items()
    }


def _check_scram_users(data_dir: Path, cluster_id: str | None, security: Security) -> None:
    """SCRAM users are fixed when the storage is formatted: refuse a start that asks for
    others, and a SASL listener nobody could log in to."""
    recorded: dict[str, object] = {}
    if cluster_id is not None:
        users = _read_json(data_dir / SCRAM_FILE).get("users")
        recorded = users if isinstance(users, dict) else {}
        if security.scram_users and _scram_digests(cluster_id, security.scram_users) != recorded:
            names = ", ".join(sorted(recorded)) or "none"
            raise KafkaLocalError(
                f"the SCRAM users of {data_dir} were fixed when its storage was formatted "
                f"(users: {names}); to change them, stop the broker and remove "
                f"{data_dir / 'kraft-logs'} (its topics go with it), or use another --dir"
            )
    if security.sasl_port is not None and not (security.scram_users or recorded):
        raise KafkaLocalError(
            "a SASL listener needs at least one SCRAM user (--scram-user NAME=PASSWORD)"
        )


def _java_cmd(
    java: str, libs: Path, data_dir: Path, main_class: str, heap: Sequence[str] = ()
) -> list[str]:
    return [
        java,
        *JVM_OPTIONS,
        *heap,
        *shlex.split(os.environ.get(ENV_JAVA_OPTS, "")),
        "-cp",
        f"{libs}/*",
        f"-Dlog4j2.configurationFile={_config_file(LOG4J2_CONFIG)}",
        f"-Dkafka.logs.dir={data_dir / 'logs'}",
        main_class,
    ]


# --------------------------------------------------------------------------------------
# Processes
# --------------------------------------------------------------------------------------


def _cmdline(pid: int) -> list[str] | None:
    """Arguments of a live, non-zombie process, or None."""
    proc = Path(f"/proc/{pid}")
    if proc.is_dir():
        try:
            stat = (proc / "stat").read_text()
            if stat.rpartition(")")[2].split()[0] == "Z":
                return None
            raw = (proc / "cmdline").read_bytes()
        except (OSError, IndexError):
            return None
        return [arg.decode(errors="replace") for arg in raw.split(b"\0") if arg] or None
    try:  # no /proc (macOS): ask ps
        out = subprocess.run(
            ["ps", "-ww", "-o", "stat=,args=", "-p", str(pid)],
            capture_output=True, text=True, check=False,
        )  # fmt: skip
    except OSError:
        return None
    fields = out.stdout.strip().split()
    if out.returncode != 0 or len(fields) < 2 or fields[0].startswith("Z"):
        return None
    return fields[1:]


def _is_our_broker(pid: int, data_dir: Path) -> bool:
    """Is ``pid`` the ``kafka.Kafka`` process started on this data folder's properties?"""
    args = _cmdline(pid)
    return (
        args is not None and "kafka.Kafka" in args and str(data_dir / "server.properties") in args
    )


def _reap(pid: int, wait_s: float = 0.0) -> None:
    """Collect the exit status of a broker this process started (else it lingers as a
    zombie), waiting up to ``wait_s`` for it. Brokers started by other processes are
    reaped by their parent or init."""
    child = _CHILDREN.get(pid)
    if child is None:
        return
    if wait_s > 0:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=wait_s)
    else:
        child.poll()
    if child.returncode is not None:
        del _CHILDREN[pid]


def _read_pid(data_dir: Path) -> int | None:
    try:
        return int((data_dir / PID_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def _read_json(path: Path) -> dict[str, object]:
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _read_state(data_dir: Path) -> dict[str, object]:
    return _read_json(data_dir / STATE_FILE)


def _listeners_of(state: Mapping[str, object]) -> dict[str, str]:
    """Listener name -> address of a running broker, from its ``broker.json``."""
    listeners = state.get("listeners")
    if not isinstance(listeners, dict):
        return {}
    return {str(name): str(address) for name, address in listeners.items()}


def _forget(data_dir: Path) -> None:
    (data_dir / PID_FILE).unlink(missing_ok=True)
    (data_dir / STATE_FILE).unlink(missing_ok=True)


def running_pid(data_dir: Path) -> int | None:
    """The pid of the broker running from ``data_dir``, if one is."""
    pid = _read_pid(data_dir)
    if pid is None:
        return None
    _reap(pid)
    return pid if _is_our_broker(pid, data_dir) else None


def _port_busy(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((HOST, port))
        except OSError:
            return True
    return False


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports on 127.0.0.1 (for test brokers), never the defaults of
    the developer's own broker (39092/39093)."""
    avoid = {DEFAULT_PORT, DEFAULT_CONTROLLER_PORT}
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            sock = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            sock.bind((HOST, 0))
            port = int(sock.getsockname()[1])
            if port not in avoid:
                ports.append(port)
        return ports


def _log_tail(data_dir: Path, lines: int = 30) -> str:
    parts = []
    for name in ("kafka.out", "server.log"):
        path = data_dir / "logs" / name
        with contextlib.suppress(OSError):
            text = path.read_text(errors="replace").strip()
            if text:
                parts.append(f"--- {path} (last lines) ---")
                parts.extend(text.splitlines()[-lines:])
    return "\n".join(parts)


# --------------------------------------------------------------------------------------
# Readiness
# --------------------------------------------------------------------------------------


async def _answers(bootstrap: str, timeout_s: float, brokers: int = 1) -> bool:
    """One admin call: does the broker answer a metadata request listing itself (and, in a
    cluster, at least ``brokers`` brokers)?"""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(
        bootstrap_servers=bootstrap,
        client_id="kvconductor-kafka-local",
        request_timeout_ms=max(1000, int(timeout_s * 1000)),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            cluster = await admin.describe_cluster()
        return len(cluster.get("brokers") or []) >= brokers
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection((HOST, port), timeout=1.0):
            return True
    except OSError:
        return False


async def _wait_ready_async(
    bootstrap: str, port: int, alive: Callable[[], bool], wait_s: float, brokers: int
) -> str:
    deadline = time.monotonic() + wait_s
    while True:
        if not alive():
            return "died"
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return "timeout"
        if _port_open(port) and await _answers(bootstrap, min(5.0, max(remaining, 0.5)), brokers):
            return "ready"
        await asyncio.sleep(0.25)


def _wait_ready(
    bootstrap: str, port: int, alive: Callable[[], bool], wait_s: float, brokers: int = 1
) -> str:
    """Poll until the broker answers ("ready"), its process ends ("died") or time is up.

    Runs its own event loop in a worker thread: safe to call from synchronous code, from a
    running event loop, and without touching the caller's current event loop (pytest-asyncio).
    aiokafka's connection errors are silenced while polling.
    """
    aiokafka_log = logging.getLogger("aiokafka")
    level = aiokafka_log.level
    aiokafka_log.setLevel(logging.CRITICAL)
    try:
        with concurrent.futures.ThreadPoolExecutor(1, "kafka-local-wait") as pool:
            coro = _wait_ready_async(bootstrap, port, alive, wait_s, brokers)
            return pool.submit(asyncio.run, coro).result()
    finally:
        aiokafka_log.setLevel(level)


# --------------------------------------------------------------------------------------
# start / stop / status
# --------------------------------------------------------------------------------------


def _ready_or_raise(
    data_dir: Path,
    bootstrap: str,
    port: int,
    pid: int,
    wait_s: float,
    started: float,
    *,
    fresh: bool,
    brokers: int = 1,
) -> str:
    """Wait for the broker; on failure print its log tail and raise. A ``fresh`` broker (just
    launched) that does not answer in time is stopped; an older one is left alone."""

    def alive() -> bool:
        child = _CHILDREN.get(pid)
        if child is not None:
            # Our own child: its exit status is the truth. Its command line
            # is not, until it has exec'd java (late on a loaded machine).
            return child.poll() is None
        return _is_our_broker(pid, data_dir)

    outcome = _wait_ready(bootstrap, port, alive, wait_s, brokers)
    if outcome == "ready":
        _say(f"broker ready on {bootstrap} (pid {pid}, {time.monotonic() - started:.1f} s)")
        return bootstrap
    tail = _log_tail(data_dir)
    if tail:
        print(tail, file=sys.stderr)
    if outcome == "died":
        _reap(pid)
        _forget(data_dir)
        raise KafkaLocalError(
            f"the Kafka broker (pid {pid}) exited during start; see {data_dir / 'logs'}"
        )
    if not fresh:
        raise KafkaLocalError(
            f"the Kafka broker (pid {pid}) runs but did not answer on {bootstrap} within "
            f"{wait_s:.0f} s; see {data_dir / 'logs'}, or stop it and start again"
        )
    _kill(pid, data_dir, STOP_TIMEOUT_S)
    _forget(data_dir)
    raise KafkaLocalError(
        f"the Kafka broker (pid {pid}) did not answer on {bootstrap} within {wait_s:.0f} s "
        f"and was stopped; see {data_dir / 'logs'}"
    )


def start(
    data_dir: Path | None = None,
    port: int | None = None,
    controller_port: int | None = None,
    wait_s: float = DEFAULT_WAIT_S,
    security: Security | None = None,
) -> str:
    """Start (or find running) the local broker of ``data_dir``; return its bootstrap address.

    ``data_dir`` defaults to :func:`default_data_dir`; ``port``
    to ``$KVCONDUCTOR_LOCAL_KAFKA_PORT`` or 39092; ``controller_port`` to ``port + 1``.
    ``security`` adds TLS and SASL/SCRAM listeners on ports of their own; the address returned
    is always the PLAINTEXT one. If a broker started by this tool already runs in ``data_dir``
    (whatever its ports and listeners), its address is returned once it answers. Raises
    :class:`KafkaLocalError` with a one-line reason.
    """
    security = security if security is not None else Security()
    started = time.monotonic()
    data_dir = _resolve_dir(data_dir)
    explicit_port = port is not None or bool(os.environ.get(ENV_PORT))
    port = default_port() if port is None else port
    controller_port = port + 1 if controller_port is None else controller_port
    data_dir.mkdir(parents=True, exist_ok=True)
    with _locked(data_dir / LOCK_FILE):
        launch = _launch(data_dir, port, controller_port, security, explicit_port=explicit_port)
        return _ready_or_raise(
            data_dir, launch.bootstrap, launch.port, launch.pid, wait_s, started, fresh=launch.fresh
        )


class _Launch(NamedTuple):
    bootstrap: str
    port: int
    pid: int
    fresh: bool  # launched now (else found running)


def _launch(
    data_dir: Path,
    port: int,
    controller_port: int,
    security: Security,
    *,
    explicit_port: bool = True,
    quorum: Quorum | None = None,
    cluster_id: str | None = None,
    heap: Sequence[str] = (),
) -> _Launch:
    """Find the broker of ``data_dir`` running, or format its storage (once, with
    ``cluster_id`` if given) and launch it; call with the folder's lock held. Does not wait
    for it to answer."""
    pid = running_pid(data_dir)
    if pid is not None:
        state = _read_state(data_dir)
        running_port = state.get("port")
        if not isinstance(running_port, int):
            raise KafkaLocalError(f"{data_dir / STATE_FILE} is unreadable; run stop first")
        bootstrap = f"{HOST}:{running_port}"
        if running_port != port and explicit_port:
            _say(f"already running in {data_dir} on port {running_port}, not {port}")
        secured = {name: f"{HOST}:{p}" for name, p in security.ports().items()}
        running_secured = {k: v for k, v in _listeners_of(state).items() if k != "PLAINTEXT"}
        if secured and secured != running_secured:
            shown = ", ".join(f"{k} {v}" for k, v in running_secured.items()) or "none"
            _say(f"already running with other secured listeners ({shown}); stop it first")
        _say(f"already running (pid {pid}) in {data_dir}")
        return _Launch(bootstrap, running_port, pid, fresh=False)
    _forget(data_dir)  # a stale pid file, if any
    formatted_id = _existing_cluster_id(data_dir)
    listeners = listeners_for(data_dir, port, security)
    _check_scram_users(data_dir, formatted_id, security)

    java = find_java()
    libs = fetch_jars()
    busy = [p for p in (*(lst.port for lst in listeners), controller_port) if _port_busy(p)]
    if busy:
        raise KafkaLocalError(
            f"port {busy[0]} on {HOST} is already in use (another broker?); "
            f"choose others with --port/--controller-port or {ENV_PORT}"
        )
    props = data_dir / "server.properties"
    _write(props, render_properties(data_dir, listeners, controller_port, quorum))
    logs = data_dir / "logs"
    logs.mkdir(exist_ok=True)

    cluster_id = formatted_id or cluster_id or new_cluster_id()
    fmt = subprocess.run(
        [
            *_java_cmd(java, libs, data_dir, "kafka.tools.StorageTool", heap),
            "format", "-t", cluster_id, "-c", str(props), "--ignore-formatted",
            *(scram_format_args(security.scram_users) if formatted_id is None else ()),
        ],
        capture_output=True, text=True, timeout=180, check=False,
    )  # fmt: skip
    if fmt.returncode != 0:
        # The output would echo SCRAM passwords given on the command line.
        output = (fmt.stdout + fmt.stderr).strip()
        for password in security.scram_users.values():
            output = output.replace(password, "*****")
        print(output, file=sys.stderr)
        # Kept: a caller that captures stderr (the soak, tests) loses it.
        _write(logs / "format.out", output + "\n")
        raise KafkaLocalError(
            f"formatting the KRaft storage in {data_dir} failed; see {logs / 'format.out'}"
        )
    if formatted_id is None:
        users = _scram_digests(cluster_id, security.scram_users)
        _write_private(data_dir / SCRAM_FILE, json.dumps({"users": users}, indent=2) + "\n")

    shown = ", ".join(f"{lst.name} {HOST}:{lst.port}" for lst in listeners)
    _say(f"starting Kafka {kafka_version()} in {data_dir} ({shown})")
    with (logs / "kafka.out").open("ab") as out:
        child = subprocess.Popen(
            [*_java_cmd(java, libs, data_dir, "kafka.Kafka", heap), str(props)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=data_dir,
            start_new_session=True,
        )
    _CHILDREN[child.pid] = child
    bootstrap = f"{HOST}:{port}"
    try:
        _write(data_dir / PID_FILE, f"{child.pid}\n")
    except KafkaLocalError:
        # Untracked, it would outlive every `stop`.
        child.kill()
        child.wait()
        raise
    state = {
        "pid": child.pid,
        "bootstrap": bootstrap,
        "port": port,
        "controller_port": controller_port,
        "listeners": {lst.name: f"{HOST}:{lst.port}" for lst in listeners},
        "cluster_id": cluster_id,
        "kafka_version": kafka_version(),
        "libs": str(libs),
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    _write(data_dir / STATE_FILE, json.dumps(state, indent=2) + "\n")
    return _Launch(bootstrap, port, child.pid, fresh=True)


def node_dir(data_dir: Path, node_id: int) -> Path:
    """The data folder of node ``node_id`` (1..N) of the local cluster in ``data_dir``."""
    return data_dir / f"node-{node_id}"


def _read_cluster(data_dir: Path) -> dict[str, object]:
    """The layout ``cluster.json`` records, or {} (not a cluster folder)."""
    return _read_json(data_dir / CLUSTER_FILE)


def _cluster_nodes(data_dir: Path) -> list[tuple[int, int, int]]:
    """(node id, client port, controller port) of every node of the cluster in ``data_dir``."""
    layout = _read_cluster(data_dir)
    ports, controllers = layout.get("ports"), layout.get("controller_ports")
    if not isinstance(ports, list) or not isinstance(controllers, list):
        return []
    return [
        (i + 1, int(p), int(c)) for i, (p, c) in enumerate(zip(ports, controllers, strict=True))
    ]


def start_cluster(
    data_dir: Path | None = None,
    brokers: int = 3,
    port: int | None = None,
    controller_port: int | None = None,
    wait_s: float = DEFAULT_WAIT_S,
    ports: Sequence[int] | None = None,
    controller_ports: Sequence[int] | None = None,
) -> str:
    """Start (or find running) every node of the local cluster of ``data_dir``; return the
    bootstrap address listing them all.

    Node ``i`` gets client port ``port + 2(i-1)`` and controller port ``controller_port +
    2(i-1)`` (``port`` as for ``start``, ``controller_port`` defaulting to ``port + 1``), or
    the ``ports`` and ``controller_ports`` given. A folder that already holds a cluster keeps
    its layout (node count, ports, cluster id): starting it again restarts the nodes that are
    not running, which is how a test restores a node it killed. All nodes are launched before
    any is waited for: a node answers only once a majority of the quorum runs."""
    started = time.monotonic()
    data_dir = _resolve_dir(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    with _locked(data_dir / LOCK_FILE):
        nodes = _cluster_nodes(data_dir)
        if nodes:
            if brokers > 1 and len(nodes) != brokers:
                _say(f"{data_dir} holds a cluster of {len(nodes)} nodes, not {brokers}")
            layout = _read_cluster(data_dir)
            cluster_id = str(layout.get("cluster_id"))
        else:
            if brokers < 2:
                raise KafkaLocalError("a cluster needs at least 2 brokers (--brokers)")
            first = default_port() if port is None else port
            ctrl = first + 1 if controller_port is None else controller_port
            client = list(ports) if ports else [first + 2 * i for i in range(brokers)]
            controllers = (
                list(controller_ports)
                if controller_ports
                else [ctrl + 2 * i for i in range(brokers)]
            )
            if len(client) != brokers or len(controllers) != brokers:
                raise KafkaLocalError(
                    f"{brokers} brokers need {brokers} ports and controller ports"
                )
            cluster_id = new_cluster_id()
            nodes = [
                (i + 1, p, c) for i, (p, c) in enumerate(zip(client, controllers, strict=True))
            ]
            layout = {
                "brokers": brokers,
                "ports": client,
                "controller_ports": controllers,
                "bootstrap": ",".join(f"{HOST}:{p}" for p in client),
                "cluster_id": cluster_id,
            }
            _write(data_dir / CLUSTER_FILE, json.dumps(layout, indent=2) + "\n")
        voters = {node: ctrl for node, _, ctrl in nodes}
        launched = []
        for node, client_port, ctrl in nodes:
            folder = node_dir(data_dir, node)
            folder.mkdir(exist_ok=True)
            with _locked(folder / LOCK_FILE):
                launch = _launch(
                    folder,
                    client_port,
                    ctrl,
                    Security(),
                    quorum=Quorum(node, voters),
                    cluster_id=cluster_id,
                    heap=CLUSTER_NODE_HEAP,
                )
            launched.append((folder, launch))
        for folder, launch in launched:
            _ready_or_raise(
                folder,
                launch.bootstrap,
                launch.port,
                launch.pid,
                wait_s,
                started,
                fresh=launch.fresh,
                brokers=len(nodes),
            )
        return str(layout["bootstrap"])


def _kill(pid: int, data_dir: Path, timeout_s: float) -> None:
    """SIGTERM, wait up to ``timeout_s``, then SIGKILL; returns once the broker is gone."""

    def gone(wait: float) -> bool:
        deadline = time.monotonic() + wait
        while True:
            _reap(pid)
            if not _is_our_broker(pid, data_dir):
                # It may have exited just after the reap above: a zombie no
                # longer looks like our broker but still holds its pid.
                _reap(pid, wait_s=5.0)
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)

    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    if gone(timeout_s):
        return
    _say(f"broker pid {pid} ignored SIGTERM for {timeout_s:.0f} s; sending SIGKILL")
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    if not gone(10.0):
        raise KafkaLocalError(f"broker pid {pid} survived SIGKILL")


def stop(data_dir: Path | None = None, timeout_s: float = STOP_TIMEOUT_S) -> bool:
    """Stop the broker started in ``data_dir``; True if one was running. Idempotent.

    Only signals the pid from the pid file, and only if that process really is the
    ``kafka.Kafka`` broker of this data folder.
    """
    data_dir = _resolve_dir(data_dir)
    if not data_dir.is_dir():
        _say(f"not running ({data_dir} does not exist)")
        return False
    nodes = _cluster_nodes(data_dir)
    if nodes:
        return _stop_cluster(data_dir, [node_dir(data_dir, n) for n, _, _ in nodes], timeout_s)
    with _locked(data_dir / LOCK_FILE):
        pid = running_pid(data_dir)
        if pid is None:
            if (data_dir / PID_FILE).exists():
                _say("removing a stale pid file")
            _forget(data_dir)
            _say(f"not running in {data_dir}")
            return False
        started = time.monotonic()
        _kill(pid, data_dir, timeout_s)
        _forget(data_dir)
        _say(f"stopped broker pid {pid} in {time.monotonic() - started:.1f} s")
        return True


def _stop_cluster(data_dir: Path, folders: Sequence[Path], timeout_s: float) -> bool:
    """Every node at once: stopped one after another, the last ones would wait for a quorum
    that is gone."""
    with _locked(data_dir / LOCK_FILE):
        pids = [(folder, running_pid(folder)) for folder in folders]
        for _, pid in pids:
            if pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        started = time.monotonic()
        for folder, pid in pids:
            if pid is not None:
                _kill(pid, folder, max(1.0, timeout_s - (time.monotonic() - started)))
            _forget(folder)
        stopped = [pid for _, pid in pids if pid is not None]
        if stopped:
            _say(f"stopped {len(stopped)} nodes in {time.monotonic() - started:.1f} s")
        else:
            _say(f"not running in {data_dir}")
        return bool(stopped)


def status(data_dir: Path | None = None) -> BrokerStatus:
    """Print and return whether the broker of ``data_dir`` runs, its pid and bootstrap; for a
    cluster, a line per node, and running and answering only if every node is."""
    data_dir = _resolve_dir(data_dir)
    nodes = _cluster_nodes(data_dir) if data_dir.is_dir() else []
    if nodes:
        each = [status(node_dir(data_dir, n)) for n, _, _ in nodes]
        return BrokerStatus(
            data_dir,
            all(s.running for s in each),
            None,
            ",".join(s.bootstrap for s in each if s.bootstrap),
            all(s.answering for s in each),
        )
    pid = running_pid(data_dir) if data_dir.is_dir() else None
    if pid is None:
        print(f"stopped (dir {data_dir})")
        return BrokerStatus(data_dir=data_dir, running=False)
    port = _read_state(data_dir).get("port")
    bootstrap = f"{HOST}:{port}" if isinstance(port, int) else None
    answering = (
        bootstrap is not None
        and isinstance(port, int)
        and (_wait_ready(bootstrap, port, lambda: True, 5.0) == "ready")
    )
    health = "answering" if answering else "NOT answering"
    secured = "".join(
        f" {name.lower()}={address}"
        for name, address in _listeners_of(_read_state(data_dir)).items()
        if name != "PLAINTEXT"
    )
    print(f"running pid={pid} bootstrap={bootstrap}{secured} ({health}) dir={data_dir}")
    return BrokerStatus(data_dir, True, pid, bootstrap, answering)


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------


def _scram_user(text: str) -> tuple[str, str]:
    name, sep, password = text.partition("=")
    if not (sep and name and password):
        raise argparse.ArgumentTypeError("expected NAME=PASSWORD")
    return name, password


def _security(args: argparse.Namespace) -> Security:
    if (args.tls_cert is None) != (args.tls_key is None):
        raise KafkaLocalError("--tls-cert and --tls-key go together")
    users: dict[str, str] = {}
    for name, password in args.scram_user:
        if name in users:
            raise KafkaLocalError(f"SCRAM user {name!r} is given twice")
        users[name] = password
    tls = None if args.tls_cert is None else Tls(args.tls_cert, args.tls_key)
    return Security(args.ssl_port, args.sasl_port, tls, users)


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--dir",
        type=Path,
        default=None,
        help=f"data folder (default ${ENV_DIR} or $XDG_STATE_HOME/kvconductor/kafka-local)",
    )
    parser = argparse.ArgumentParser(
        prog="kvconductor kafka-local",
        description="Run a local single-node Apache Kafka broker (KRaft) from Maven jars.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    start_p = sub.add_parser(
        "start", parents=[common], help="start the broker (idempotent), print its bootstrap"
    )
    start_p.add_argument(
        "--port", type=int, default=None, help=f"client port (default ${ENV_PORT} or 39092)"
    )
    start_p.add_argument(
        "--controller-port", type=int, default=None, help="controller port (default port + 1)"
    )
    start_p.add_argument(
        "--wait", type=float, default=DEFAULT_WAIT_S, help="seconds to wait for readiness"
    )
    start_p.add_argument(
        "--brokers",
        type=int,
        default=1,
        help="a local cluster of this many KRaft nodes (ports PORT, PORT+2, ...; default 1)",
    )
    secured = start_p.add_argument_group(
        "security", "TLS and SASL/SCRAM listeners beside PLAINTEXT (see docs/operations.md)"
    )
    secured.add_argument("--ssl-port", type=int, metavar="PORT", help="add a TLS listener")
    secured.add_argument(
        "--sasl-port",
        type=int,
        metavar="PORT",
        help="add a SCRAM-SHA-256/512 listener (SASL_SSL with --tls-cert, else SASL_PLAINTEXT)",
    )
    secured.add_argument(
        "--tls-cert", type=Path, metavar="FILE", help="broker certificate (PEM, chain after it)"
    )
    secured.add_argument(
        "--tls-key", type=Path, metavar="FILE", help="its private key (PEM, unencrypted PKCS#8)"
    )
    secured.add_argument(
        "--scram-user",
        type=_scram_user,
        action="append",
        default=[],
        metavar="NAME=PASSWORD",
        help="a SCRAM user, created when the storage is first formatted (repeatable)",
    )
    sub.add_parser("stop", parents=[common], help="stop the broker (idempotent)")
    sub.add_parser("status", parents=[common], help="running/stopped, pid, bootstrap")
    sub.add_parser("fetch", help="only fetch the broker jars into the cache")
    return parser


def _is_cluster(data_dir: Path | None) -> bool:
    return bool(_cluster_nodes(_resolve_dir(data_dir)))


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry point. Exit codes: 0 ok; 1 error; 3 ``status`` found it stopped."""
    args = _parser().parse_args(argv)
    try:
        if args.command == "start" and (args.brokers > 1 or _is_cluster(args.dir)):
            if _security(args) != Security():
                raise KafkaLocalError("a local cluster has only PLAINTEXT listeners")
            bootstrap = start_cluster(
                args.dir, args.brokers, args.port, args.controller_port, args.wait
            )
            print(bootstrap, flush=True)
        elif args.command == "start":
            bootstrap = start(args.dir, args.port, args.controller_port, args.wait, _security(args))
            print(bootstrap, flush=True)
        elif args.command == "stop":
            stop(args.dir)
        elif args.command == "status":
            return 0 if status(args.dir).running else 3
        elif args.command == "fetch":
            print(fetch_jars())
    except KafkaLocalError as exc:
        print(f"kafka-local: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:  # a folder that is not one, a read-only disk, stdout full
        where = exc.filename or "stdout"
        print(f"kafka-local: error: cannot write {where}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
