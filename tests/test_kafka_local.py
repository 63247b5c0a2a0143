"""The local Kafka broker (kvconductor.tools.kafka_local.broker) and aiokafka 0.14 against it."""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from kvconductor.tools.kafka_local import broker as kafka_local


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


async def _create_topic(
    bootstrap: str, name: str, partitions: int = 1, configs: dict[str, str] | None = None
) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        response = await admin.create_topics(
            [NewTopic(name, partitions, 1, topic_configs=configs or {})]
        )
        errors = [(topic, code) for topic, code, *_ in response.topic_errors if code != 0]
        assert errors == [], errors
    finally:
        await admin.close()


async def _read_to_end(consumer: Any, tp: TopicPartition) -> list[bytes]:
    """Values of ``tp`` from the start to its end (its LSO under read_committed)."""
    consumer.assign([tp])
    await consumer.seek_to_beginning(tp)
    end = (await consumer.end_offsets([tp]))[tp]
    values: list[bytes] = []
    async with asyncio.timeout(30):
        while await consumer.position(tp) < end:
            batches = await consumer.getmany(tp, timeout_ms=500)
            values.extend(msg.value for msg in batches.get(tp, []))
    return values


# ------------------------------------------------------------------------------------------
# Without a broker
# ------------------------------------------------------------------------------------------


def test_cluster_id_is_16_bytes_urlsafe_base64() -> None:
    cluster_id = kafka_local.new_cluster_id()
    assert re.fullmatch(r"[A-Za-z0-9_-]{22}", cluster_id)


def test_render_properties_fills_every_placeholder(tmp_path: Path) -> None:
    text = kafka_local.render_properties(
        tmp_path, [kafka_local.Listener("PLAINTEXT", 41000)], controller_port=41001
    )
    assert "${" not in text
    props = dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:41000,CONTROLLER://127.0.0.1:41001"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:41000"
    assert props["controller.quorum.voters"] == "1@127.0.0.1:41001"
    assert props["log.dirs"] == f"{tmp_path}/kraft-logs"
    assert props["auto.create.topics.enable"] == "false"
    for key in (
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
        "transaction.state.log.min.isr",
        "share.coordinator.state.topic.replication.factor",
    ):
        assert props[key] == "1"


def test_render_properties_of_a_cluster_node(tmp_path: Path) -> None:
    quorum = kafka_local.Quorum(2, {1: 41001, 2: 41003, 3: 41005})
    props = _props(
        kafka_local.render_properties(
            tmp_path, [kafka_local.Listener("PLAINTEXT", 41002)], 41003, quorum
        )
    )
    assert props["node.id"] == "2"
    assert props["controller.quorum.voters"] == (
        "1@127.0.0.1:41001,2@127.0.0.1:41003,3@127.0.0.1:41005"
    )
    # Three replicas, two in sync: the transaction coordinator survives a node.
    for key in (
        "default.replication.factor",
        "offsets.topic.replication.factor",
        "transaction.state.log.replication.factor",
    ):
        assert props[key] == "3"
    assert props["min.insync.replicas"] == props["transaction.state.log.min.isr"] == "2"
    assert props["unclean.leader.election.enable"] == "false"


def test_cluster_cli_rejects_secured_listeners(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [
                sys.executable,
                "-m",
                "kvconductor.tools.kafka_local.broker",
                "start",
                "--dir",
                str(tmp_path),
                *args,
            ],
            capture_output=True,
            text=True,
            check=False,
        )

    got = run("--brokers", "3", "--ssl-port", "41009")
    assert got.returncode == 1
    assert "a local cluster has only PLAINTEXT listeners" in got.stderr


def test_render_properties_extra_listener_settings(tmp_path: Path) -> None:
    # The hook the TLS and SASL/SCRAM listeners use (see Security).
    sasl = kafka_local.Listener(
        "SASL_PLAINTEXT",
        41002,
        protocol="SASL_PLAINTEXT",
        settings={"sasl.enabled.mechanisms": "SCRAM-SHA-512"},
    )
    text = kafka_local.render_properties(
        tmp_path, [kafka_local.Listener("PLAINTEXT", 41000), sasl], controller_port=41001
    )
    assert "listener.name.sasl_plaintext.sasl.enabled.mechanisms=SCRAM-SHA-512" in text
    assert (
        "listener.security.protocol.map="
        "PLAINTEXT:PLAINTEXT,SASL_PLAINTEXT:SASL_PLAINTEXT,CONTROLLER:PLAINTEXT" in text
    )


FAKE_KEY = "-----BEGIN PRIVATE KEY-----\nAAAA\n-----END PRIVATE KEY-----\n"
FAKE_CERT = "-----BEGIN CERTIFICATE-----\nBBBB\n-----END CERTIFICATE-----\n"


def _tls(folder: Path, key: str = FAKE_KEY, cert: str = FAKE_CERT) -> kafka_local.Tls:
    (folder / "broker.key").write_text(key)
    (folder / "broker.pem").write_text(cert)
    return kafka_local.Tls(certfile=folder / "broker.pem", keyfile=folder / "broker.key")


def _props(text: str) -> dict[str, str]:
    return dict(
        line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#")
    )


def test_tls_and_scram_listeners_are_rendered(tmp_path: Path) -> None:
    security = kafka_local.Security(41002, 41003, _tls(tmp_path), {"alice": "secret"})
    listeners = kafka_local.listeners_for(tmp_path, 41000, security)
    props = _props(kafka_local.render_properties(tmp_path, listeners, controller_port=41001))
    assert props["listeners"] == (
        "PLAINTEXT://127.0.0.1:41000,SSL://127.0.0.1:41002,SASL_SSL://127.0.0.1:41003,"
        "CONTROLLER://127.0.0.1:41001"
    )
    assert props["advertised.listeners"] == (
        "PLAINTEXT://127.0.0.1:41000,SSL://127.0.0.1:41002,SASL_SSL://127.0.0.1:41003"
    )
    assert props["listener.security.protocol.map"] == (
        "PLAINTEXT:PLAINTEXT,SSL:SSL,SASL_SSL:SASL_SSL,CONTROLLER:PLAINTEXT"
    )
    assert props["inter.broker.listener.name"] == "PLAINTEXT"
    keystore = tmp_path / "tls" / "keystore.pem"
    for name in ("ssl", "sasl_ssl"):
        assert props[f"listener.name.{name}.ssl.keystore.type"] == "PEM"
        assert props[f"listener.name.{name}.ssl.keystore.location"] == str(keystore)
    assert props["listener.name.sasl_ssl.sasl.enabled.mechanisms"] == "SCRAM-SHA-256,SCRAM-SHA-512"
    login = "org.apache.kafka.common.security.scram.ScramLoginModule required;"
    assert props["listener.name.sasl_ssl.scram-sha-256.sasl.jaas.config"] == login
    assert props["listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config"] == login
    # The key store: key then certificate, readable by its owner only.
    assert keystore.read_text() == FAKE_KEY + FAKE_CERT
    assert keystore.stat().st_mode & 0o777 == 0o600
    assert kafka_local.scram_format_args({"alice": "secret"}) == [
        "--add-scram", "SCRAM-SHA-256=[name=alice,password=secret]",
        "--add-scram", "SCRAM-SHA-512=[name=alice,password=secret]",
    ]  # fmt: skip


def test_scram_without_a_certificate_is_sasl_plaintext(tmp_path: Path) -> None:
    security = kafka_local.Security(sasl_port=41002, scram_users={"alice": "secret"})
    listeners = kafka_local.listeners_for(tmp_path, 41000, security)
    assert [(lst.name, lst.protocol) for lst in listeners] == [
        ("PLAINTEXT", "PLAINTEXT"),
        ("SASL_PLAINTEXT", "SASL_PLAINTEXT"),
    ]
    assert "ssl.keystore.location" not in listeners[1].settings
    assert not (tmp_path / "tls").exists()


@pytest.mark.parametrize(
    ("security", "reason"),
    [
        (kafka_local.Security(ssl_port=41002), "needs --tls-cert and --tls-key"),
        (kafka_local.Security(tls=kafka_local.Tls(Path("c"), Path("k"))), "needs --ssl-port"),
        (kafka_local.Security(scram_users={"a": "b"}), "need a SASL listener"),
        (kafka_local.Security(sasl_port=41002, scram_users={"a": "b,c"}), "without spaces, commas"),
        (kafka_local.Security(sasl_port=41002, scram_users={"a b": "c"}), "without spaces, commas"),
    ],
)
def test_security_combinations_that_cannot_be_meant(
    tmp_path: Path, security: kafka_local.Security, reason: str
) -> None:
    with pytest.raises(kafka_local.KafkaLocalError, match=reason):
        kafka_local.listeners_for(tmp_path, 41000, security)


@pytest.mark.parametrize(
    ("key", "cert", "reason"),
    [
        ("-----BEGIN RSA PRIVATE KEY-----\n", FAKE_CERT, "not an unencrypted PKCS#8 PEM key"),
        ("-----BEGIN ENCRYPTED PRIVATE KEY-----\n", FAKE_CERT, "openssl pkcs8 -topk8 -nocrypt"),
        (FAKE_KEY, "no certificate here", "holds no PEM certificate"),
    ],
)
def test_keystore_takes_an_unencrypted_pkcs8_key_and_a_certificate(
    tmp_path: Path, key: str, cert: str, reason: str
) -> None:
    with pytest.raises(kafka_local.KafkaLocalError, match=reason):
        kafka_local.write_keystore(tmp_path, _tls(tmp_path, key, cert))


def test_scram_users_are_fixed_when_the_storage_is_formatted(tmp_path: Path) -> None:
    # Refused before any JVM runs: the folder's storage was formatted without users.
    (tmp_path / "kraft-logs").mkdir()
    (tmp_path / "kraft-logs" / "meta.properties").write_text("cluster.id=AAAAAAAAAAAAAAAAAAAAAA\n")
    security = kafka_local.Security(sasl_port=41002, scram_users={"bob": "pw"})
    with pytest.raises(kafka_local.KafkaLocalError, match=r"fixed when its storage was formatted"):
        kafka_local.start(tmp_path, port=41000, controller_port=41001, security=security)
    with pytest.raises(kafka_local.KafkaLocalError, match="needs at least one SCRAM user"):
        kafka_local.start(
            tmp_path,
            port=41000,
            controller_port=41001,
            security=kafka_local.Security(sasl_port=41002),
        )


def test_cli_security_errors_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    start = ["start", "--dir", str(tmp_path), "--port", "41000"]
    assert kafka_local.main([*start, "--ssl-port", "41002"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == ("kafka-local: error: a TLS listener (--ssl-port) needs --tls-cert and --tls-key")
    assert kafka_local.main([*start, "--sasl-port", "41002", "--tls-key", "k"]) == 1
    assert capsys.readouterr().err.strip().endswith("--tls-cert and --tls-key go together")
    users = ["--scram-user", "a=1", "--scram-user", "a=2"]
    assert kafka_local.main([*start, "--sasl-port", "41002", *users]) == 1
    assert capsys.readouterr().err.strip().endswith("SCRAM user 'a' is given twice")
    with pytest.raises(SystemExit):
        kafka_local.main([*start, "--scram-user", "no-password"])
    assert "expected NAME=PASSWORD" in capsys.readouterr().err


def test_stop_ignores_a_pid_that_is_not_its_broker(tmp_path: Path) -> None:
    # A stale pid file naming some other live process (here: a sleep) must not kill it.
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / kafka_local.PID_FILE).write_text(f"{other.pid}\n")
        assert kafka_local.stop(tmp_path) is False
        assert other.poll() is None
        assert not (tmp_path / kafka_local.PID_FILE).exists()
        assert kafka_local.status(tmp_path).running is False
    finally:
        other.kill()
        other.wait()


def test_the_broker_templates_are_package_data() -> None:
    # Inside the package, so a non-editable install has them too (pyproject's package-data).
    package = Path(kafka_local.__file__).resolve().parent
    for path in (kafka_local.POM_FILE, kafka_local.PROPERTIES_TEMPLATE, kafka_local.LOG4J2_CONFIG):
        assert path.is_file() and path.is_relative_to(package), path
    assert re.fullmatch(r"\d+\.\d+\.\d+", kafka_local.kafka_version())


def test_the_default_data_folder_is_the_users_state_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(kafka_local.ENV_DIR, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    assert kafka_local.default_data_dir() == tmp_path / "state" / "kvconductor" / "kafka-local"
    monkeypatch.delenv("XDG_STATE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    want = tmp_path / "home" / ".local" / "state" / "kvconductor" / "kafka-local"
    assert kafka_local.default_data_dir() == want
    monkeypatch.setenv(kafka_local.ENV_DIR, str(tmp_path / "mine"))
    assert kafka_local.default_data_dir() == tmp_path / "mine"


# ------------------------------------------------------------------------------------------
# Against the session broker
# ------------------------------------------------------------------------------------------


@pytest.mark.kafka
async def test_produce_consume_and_commit(kafka_bootstrap: str) -> None:
    topic, group = _name("kl-plain"), _name("kl-group")
    await _create_topic(kafka_bootstrap, topic)

    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        meta = await producer.send_and_wait(topic, b"hello", key=b"k1")
    finally:
        await producer.stop()
    assert meta.offset == 0

    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=kafka_bootstrap,
        group_id=group,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
    )
    await consumer.start()
    try:
        msg = await asyncio.wait_for(consumer.getone(), 30)
        assert (msg.key, msg.value, msg.offset) == (b"k1", b"hello", 0)
        await consumer.commit()
        assert await consumer.committed(TopicPartition(topic, 0)) == 1
    finally:
        await consumer.stop()

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        assert offsets[TopicPartition(topic, 0)].offset == 1
        # auto.create.topics.enable=false: a metadata request does not create a topic.
        missing = _name("kl-missing")
        await admin.describe_topics([missing])
        assert missing not in await admin.list_topics()
    finally:
        await admin.close()


@pytest.mark.kafka
async def test_transactions(kafka_bootstrap: str) -> None:
    topic, group = _name("kl-txn"), _name("kl-txn-group")
    await _create_topic(kafka_bootstrap, topic)
    tp = TopicPartition(topic, 0)

    producer = AIOKafkaProducer(
        bootstrap_servers=kafka_bootstrap, transactional_id=_name("kl-txn-id")
    )
    await producer.start()
    try:
        async with producer.transaction():
            await producer.send_and_wait(topic, b"committed")
        await producer.begin_transaction()
        await producer.send_and_wait(topic, b"aborted")
        await producer.abort_transaction()
        # consume-transform-produce: output and input offsets commit atomically.
        async with producer.transaction():
            await producer.send_and_wait(topic, b"with-offsets")
            await producer.send_offsets_to_transaction({tp: 7}, group)
    finally:
        await producer.stop()

    consumer = AIOKafkaConsumer(
        bootstrap_servers=kafka_bootstrap,
        isolation_level="read_committed",
        enable_auto_commit=False,
        fetch_max_wait_ms=100,
    )
    await consumer.start()
    try:
        assert await _read_to_end(consumer, tp) == [b"committed", b"with-offsets"]
    finally:
        await consumer.stop()

    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(group)
        assert offsets[tp].offset == 7
    finally:
        await admin.close()


# ------------------------------------------------------------------------------------------
# start / stop of a broker of its own (never the session broker)
# ------------------------------------------------------------------------------------------


@pytest.mark.kafka
def test_start_is_idempotent_stop_works_and_restart_keeps_the_cluster(tmp_path: Path) -> None:
    port, controller_port = kafka_local.free_ports(2)
    bootstrap = kafka_local.start(tmp_path, port=port, controller_port=controller_port)
    pid = int((tmp_path / kafka_local.PID_FILE).read_text())
    try:
        assert bootstrap == f"127.0.0.1:{port}"
        again = kafka_local.start(tmp_path, port=port, controller_port=controller_port)
        assert again == bootstrap
        assert int((tmp_path / kafka_local.PID_FILE).read_text()) == pid
        status = kafka_local.status(tmp_path)
        assert (status.running, status.pid, status.bootstrap, status.answering) == (
            True,
            pid,
            bootstrap,
            True,
        )
        cluster_id = (tmp_path / "kraft-logs" / "meta.properties").read_text()
    finally:
        assert kafka_local.stop(tmp_path) is True

    assert not (tmp_path / kafka_local.PID_FILE).exists()
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    assert kafka_local.stop(tmp_path) is False
    assert kafka_local.status(tmp_path).running is False

    # A restart on the same folder reuses its formatted storage (same cluster id).
    try:
        assert kafka_local.start(tmp_path, port=port, controller_port=controller_port) == bootstrap
        assert (tmp_path / "kraft-logs" / "meta.properties").read_text() == cluster_id
    finally:
        assert kafka_local.stop(tmp_path) is True
