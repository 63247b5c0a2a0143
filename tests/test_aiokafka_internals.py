"""aiokafka's private names that kvconductor uses are where it expects them.

The native fetch path (kvconductor/kafka/frames.py, kvconductor/consumers/
fetcher.py) takes the socket of a connection aiokafka opened and
authenticated, and builds aiokafka's Fetch requests itself;
kvconductor/kafka/clients.py reaches into the consumer's and the admin
client's own clients. None of that is aiokafka's public API, so pyproject.toml
pins the tested minor (`aiokafka~=`), and this suite, which needs no
broker, fails naming the attribute when an installed aiokafka moved one.
"""

from __future__ import annotations

import inspect
from collections.abc import Sized

import aiokafka
import pytest
from aiokafka import AIOKafkaConsumer
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.client import ConnectionGroup
from aiokafka.conn import AIOKafkaConnection, create_conn
from aiokafka.protocol.fetch import FetchRequest

# Fetch response versions the kernel reads (kernel/core/src/kafka/record_batch.rs,
# `parse_fetch_response`).
KERNEL_FETCH_VERSIONS = range(0, 12)


def moved(where: str, name: str, user: str) -> str:
    return (
        f"aiokafka {aiokafka.__version__}: {where} has no `{name}` any more; "
        f"{user} uses it (check it before moving the aiokafka pin in pyproject.toml)"
    )


def require(obj: object, name: str, where: str, user: str) -> object:
    assert hasattr(obj, name), moved(where, name, user)
    return getattr(obj, name)


async def test_a_connection_hands_its_socket_over_by_these_attributes() -> None:
    conn = AIOKafkaConnection("127.0.0.1", 9)
    user = "kvconductor/kafka/frames.py (FrameConnection.open)"
    for name in ("_reader", "_writer", "_read_task"):
        # None until connected; frames.py takes them, then sets them to None
        # so that aiokafka's close() leaves the socket to it.
        assert require(conn, name, "AIOKafkaConnection", user) is None, (
            f"aiokafka {aiokafka.__version__}: AIOKafkaConnection.{name} is no longer None "
            f"before connecting; {user} relies on what it holds"
        )
    requests = require(conn, "_requests", "AIOKafkaConnection", user)
    assert isinstance(requests, Sized), moved(
        "AIOKafkaConnection._requests (a sized queue)", "len", user
    )
    versions = require(conn, "_versions", "AIOKafkaConnection", user)
    assert isinstance(versions, dict), moved("AIOKafkaConnection._versions (a dict)", "dict", user)
    for name in ("close", "connected"):
        assert callable(require(conn, name, "AIOKafkaConnection", user))
    # The attributes are assigned in aiokafka's own code, not only read.
    source = inspect.getsource(AIOKafkaConnection)
    for name in ("_reader", "_writer", "_read_task"):
        assert f"self.{name} = " in source or f"self.{name}: " in source, moved(
            "AIOKafkaConnection's code", name, user
        )


def test_create_conn_takes_the_options_frames_passes() -> None:
    params = inspect.signature(create_conn).parameters
    for name in (
        "client_id",
        "request_timeout_ms",
        "ssl_context",
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
    ):
        assert name in params, moved(
            "aiokafka.conn.create_conn", name, "kvconductor/kafka/frames.py"
        )


def test_fetch_requests_are_built_as_the_fetcher_builds_them() -> None:
    user = "kvconductor/consumers/fetcher.py and kvconductor/kafka/frames.py"
    # read_uncommitted (0): read_committed needs v4 and up.
    request = FetchRequest(100, 1, 1 << 20, 0, [("kv-events", [(0, 0, 1 << 20)])])
    prepare = require(request, "prepare", "FetchRequest", user)
    api_key = require(FetchRequest, "API_KEY", "FetchRequest", user)
    # The highest version both sides speak; the kernel must read its answer.
    for top in range(1, KERNEL_FETCH_VERSIONS.stop):  # aiokafka builds v1 and up
        struct_ = prepare({api_key: (0, top)})  # type: ignore[operator]
        version = require(struct_, "API_VERSION", "a prepared FetchRequest", user)
        assert version in KERNEL_FETCH_VERSIONS, (
            f"aiokafka {aiokafka.__version__}: FetchRequest prepares version {version}, "
            "which the kernel's parse_fetch_response does not read"
        )
        header = require(struct_, "build_request_header", "a prepared FetchRequest", user)
        head = header(correlation_id=1, client_id="kvconductor-fetch")  # type: ignore[operator]
        assert isinstance(head.encode(), bytes)
        assert isinstance(struct_.encode(), bytes)
    newest = prepare({api_key: (0, 1000)})  # type: ignore[operator]
    assert newest.API_VERSION in KERNEL_FETCH_VERSIONS, (
        f"aiokafka {aiokafka.__version__}: FetchRequest now speaks version "
        f"{newest.API_VERSION}, past what the kernel's parse_fetch_response reads"
    )


async def test_the_clients_private_parts_that_clients_py_uses() -> None:
    user = "kvconductor/kafka/clients.py"
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:9")
    admin = AIOKafkaAdminClient(bootstrap_servers="127.0.0.1:9")
    try:
        client = require(consumer, "_client", "AIOKafkaConsumer", f"{user} (refresh_metadata)")
        assert callable(require(client, "force_metadata_update", "AIOKafkaClient", user))
        admin_client = require(admin, "_client", "AIOKafkaAdminClient", f"{user} (LiveAdminClient)")
        timeout = require(admin_client, "_request_timeout_ms", "AIOKafkaClient", user)
        assert isinstance(timeout, int), moved(
            "AIOKafkaClient._request_timeout_ms (an int)", "int", user
        )
        conns = require(admin_client, "_conns", "AIOKafkaClient", user)
        assert isinstance(conns, dict), moved("AIOKafkaClient._conns (a dict)", "dict", user)
        assert hasattr(ConnectionGroup, "DEFAULT"), moved("ConnectionGroup", "DEFAULT", user)
        send_request = require(admin, "_send_request", "AIOKafkaAdminClient", user)
        assert list(inspect.signature(send_request).parameters) == ["request", "node_id"], moved(
            "AIOKafkaAdminClient._send_request(request, node_id)", "its parameters", user
        )
    finally:
        await consumer.stop()
        await admin.close()


@pytest.mark.parametrize("name", ["_reader", "_writer", "_read_task", "_requests", "_versions"])
def test_a_missing_attribute_is_named(name: str) -> None:
    """The failure names the attribute and who uses it."""

    class Bare:
        pass

    with pytest.raises(AssertionError, match=f"`{name}`.*frames.py"):
        require(Bare(), name, "AIOKafkaConnection", "kvconductor/kafka/frames.py")
