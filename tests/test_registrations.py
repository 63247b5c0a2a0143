"""Registration (contract v2 section 4, last paragraph; Mooncake Conductor's
`indexer-api-design.md`): the bodies' rules here; the routes at the daemon's
address, in both forms, over a real registrations topic; and a registration
made at the daemon reaching a bridge through that topic."""

from __future__ import annotations

import hashlib
import pickle
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
import zmq
import zmq.asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from kvconductor.bridge.config import BridgeConfig
from kvconductor.bridge.records import data_entry
from kvconductor.config import Config
from kvconductor.http.api import make_app
from kvconductor.index.conductor import Conductor
from kvconductor.kafka.topics import ensure_topics_on, topic_specs
from kvconductor.obs.metrics import Metrics
from kvconductor.registry.bodies import (
    HashProfile,
    InvalidRegistration,
    RegisterBody,
    check_hash_profile,
    merge_registrations,
    root_digest,
    same_registration,
    to_publisher,
)
from kvconductor.registry.log import RegistrationLog
from kvconductor.registry.publishers import StreamKey
from tests.bridge_fakes import (
    FakePublisher,
    bridge_config,
    headers_of,
    records_for,
    running_bridge,
)
from tests.harness import daemon_config, read_all, running, stored, vllm_payload, wait_for
from tests.test_http_api import fed_conductor

MSGPACK = {"Content-Type": "application/msgpack"}
PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256_cbor",
    "python_hash_seed": "0",
    "index_projection": "low64_be",
}
# Conductor's documented root for seed "0" (indexer-api-design.md).
ROOT_0 = "4e1195df020de59e0d65a33a4279f1183e7ae4e5d980e309f8b55adff2e61c3e"


def conductor_body(**kw: Any) -> dict[str, Any]:
    """Mooncake's example proxy's registration body, field for field."""
    body: dict[str, Any] = {
        "endpoint": "tcp://127.0.0.1:5557",
        "type": "vLLM",
        "modelname": "m",
        "instance_id": "vllm-0",
        "block_size": 4,
        "dp_rank": 0,
        "tenant_id": "default",
        "lora_name": "",
        "hash_profile": dict(PROFILE),
    }
    body.update(kw)
    return {k: v for k, v in body.items() if v is not None}


# ------------------------------------------------------------------ rules


def test_root_digest_is_vllms_none_hash() -> None:
    assert root_digest(HashProfile(**PROFILE)) == ROOT_0
    pickled = HashProfile(**{**PROFILE, "algorithm": "sha256", "python_hash_seed": "random"})
    assert root_digest(pickled) == hashlib.sha256(pickle.dumps("random", protocol=5)).hexdigest()
    long_seed = HashProfile(**{**PROFILE, "python_hash_seed": "0" * 30})
    assert root_digest(long_seed) == hashlib.sha256(b"\x78\x1e" + b"0" * 30).hexdigest()


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"strategy": "vllm_v0"}, "strategy"),
        ({"algorithm": "xxhash"}, "algorithm"),
        ({"index_projection": "low64_le"}, "index_projection"),
        ({"python_hash_seed": "-1"}, "python_hash_seed"),
        ({"python_hash_seed": " 1"}, "python_hash_seed"),
        ({"python_hash_seed": "4294967296"}, "python_hash_seed"),
        ({"python_hash_seed": "\u0661"}, "python_hash_seed"),  # a non-ASCII digit
    ],
)
def test_hash_profile_rules(change: dict[str, str], field: str) -> None:
    with pytest.raises(InvalidRegistration) as info:
        check_hash_profile(HashProfile(**{**PROFILE, **change}))
    assert (info.value.reason, info.value.field) == ("invalid_value", field)


def test_seed_text_is_kept_as_given() -> None:
    for seed in ("00", "4294967295", "random"):
        check_hash_profile(HashProfile(**{**PROFILE, "python_hash_seed": seed}))
    zero = HashProfile(**PROFILE)
    assert root_digest(zero) != root_digest(HashProfile(**{**PROFILE, "python_hash_seed": "00"}))


def test_empty_namespace_fields_and_spellings_are_one_registration() -> None:
    plain = RegisterBody(
        endpoint="tcp://h:1", type="vLLM", instance_id="a", modelname="m", block_size=4
    )
    spelt = RegisterBody(
        endpoint="tcp://h:1",
        type="vllm",
        instance_id="a",
        modelname="m",
        block_size=4,
        tenant_id="",
        lora_name="",
        additionalsalt="",
        replay_endpoint="",
    )
    pub = to_publisher(spelt)
    assert (pub.tenant, pub.lora_name, pub.salt, pub.replay_endpoint) == ("default", None, "", None)
    assert same_registration(plain, spelt)
    assert not same_registration(plain, msgspec.structs.replace(plain, block_size=16))


def engine_body(**kw: Any) -> dict[str, Any]:
    """An engine's own registration of the rank `conductor_body` names (the
    JSON form): its replay socket, offload mode and report mode, no profile."""
    body: dict[str, Any] = {
        "endpoint": "tcp://127.0.0.1:5557",
        "replay_endpoint": "tcp://127.0.0.1:5558",
        "type": "vllm",
        "modelname": "m",
        "instance_id": "vllm-0",
        "block_size": 4,
        "dp_rank": 0,
        "kv_offload": "pool",
        "kv_report_mode": "full",
    }
    body.update(kw)
    return {k: v for k, v in body.items() if v is not None}


def as_body(raw: dict[str, Any]) -> RegisterBody:
    return msgspec.convert(raw, RegisterBody)


def test_a_routers_and_an_engines_registration_of_one_stream_merge() -> None:
    engine, router = as_body(engine_body()), as_body(conductor_body())
    both = merge_registrations(engine, router)
    # Either order makes the same registration (each keeps its own spelling
    # of the stream's fields: `vllm` or `vLLM`).
    assert to_publisher(both) == to_publisher(merge_registrations(router, engine))
    for merged in (both, merge_registrations(router, engine)):
        pub = to_publisher(merged)
        assert (pub.replay_endpoint, pub.offload, pub.report_mode) == (
            "tcp://127.0.0.1:5558",
            "pool",
            "full",
        )
        assert merged.hash_profile == HashProfile(**PROFILE)
    # What the merge already says is a repeat: the registered body comes back.
    assert merge_registrations(both, router) == both
    assert merge_registrations(both, engine) == both


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # The stream and its namespace: their absence is the default, a value.
        ({"endpoint": "tcp://127.0.0.1:5600"}, "endpoint"),
        ({"type": "SGLang"}, "type"),
        ({"tenant_id": "t"}, "tenant_id"),
        ({"modelname": "other"}, "modelname"),
        ({"block_size": 16}, "block_size"),
        ({"lora_name": "adapter"}, "lora_name"),
        # Optional fields: set in both, differently.
        ({"replay_endpoint": "tcp://127.0.0.1:5599"}, "replay_endpoint"),
        ({"kv_offload": "local"}, "kv_offload"),
        ({"kv_report_mode": "incremental"}, "kv_report_mode"),
        ({"additionalsalt": "b"}, "additionalsalt"),
        ({"hash_profile": {**PROFILE, "python_hash_seed": "1"}}, "hash_profile"),
    ],
)
def test_a_contradiction_is_refused_naming_the_field(change: dict[str, Any], field: str) -> None:
    registered = as_body({**conductor_body(), **engine_body(), "additionalsalt": "a"})
    with pytest.raises(InvalidRegistration) as info:
        merge_registrations(registered, as_body({**conductor_body(), **change}))
    assert (info.value.reason, info.value.field) == ("invalid_registration", field)
    assert field in str(info.value) and "vllm-0|default|0" in str(info.value)


def test_absent_means_the_default_for_the_stream_and_nothing_for_the_rest() -> None:
    router = as_body(conductor_body())  # tenant "default", lora ""
    spelt = as_body(engine_body(type="VLLM", tenant_id=None, lora_name=None, kv_offload=""))
    merged = merge_registrations(router, spelt)
    assert (merged.tenant_id, merged.lora_name, merged.type) == ("default", "", "vLLM")
    assert to_publisher(merged).offload == "local" and merged.kv_report_mode == "full"
    # Set in both, spelt differently but read alike: no contradiction.
    spelt_pool = as_body(engine_body(kv_offload="POOL", type="VLLM"))
    assert merge_registrations(as_body(engine_body()), spelt_pool) == as_body(engine_body())
    # A null tenant is `default`, not silence: another tenant contradicts it.
    with pytest.raises(InvalidRegistration) as info:
        merge_registrations(as_body(engine_body()), as_body(conductor_body(tenant_id="t")))
    assert info.value.field == "tenant_id"


@pytest.mark.parametrize("mode", ["incremental", "full"])
def test_the_report_mode_is_relayed_as_a_header(mode: str) -> None:
    pub = to_publisher(as_body(engine_body(kv_report_mode=mode)))
    assert pub.report_mode == mode
    assert dict(data_entry(pub, 0, 1, b"x").headers)["kv-report-mode"] == mode.encode()
    silent = to_publisher(as_body(engine_body(kv_report_mode=None)))
    assert "kv-report-mode" not in dict(data_entry(silent, 0, 1, b"x").headers)


@pytest.mark.parametrize("mode", ["", "Full", "delta"])
def test_an_unknown_report_mode_is_refused(mode: str) -> None:
    with pytest.raises(InvalidRegistration) as info:
        to_publisher(as_body(engine_body(kv_report_mode=mode)))
    assert (info.value.reason, info.value.field) == ("invalid_value", "kv_report_mode")


def test_a_pool_backend_has_no_report_mode() -> None:
    pool = engine_body(type="Mooncake", kv_offload=None, kv_report_mode="full")
    with pytest.raises(InvalidRegistration) as info:
        to_publisher(as_body(pool))
    assert info.value.field == "kv_report_mode"


def test_bind_form_endpoint_is_refused_with_the_fix() -> None:
    body = RegisterBody(
        endpoint="tcp://*:5557", type="vLLM", instance_id="a", modelname="m", block_size=4
    )
    with pytest.raises(InvalidRegistration) as info:
        to_publisher(body)
    text = str(info.value)
    assert text.startswith("endpoint:") and "tcp://<engine host>:5557" in text, text


# ------------------------------------------------- the daemon's routes


@pytest.fixture
async def registry(kafka_bootstrap: str) -> AsyncIterator[RegistrationLog]:
    topic = f"kv-bridge-registrations-{uuid.uuid4().hex[:8]}"
    cfg = daemon_config(kafka_bootstrap, KVCONDUCTOR_HTTP_REGISTRATIONS_TOPIC=topic)
    specs = [s for s in topic_specs(cfg) if s.name == topic]
    await ensure_topics_on(kafka_bootstrap, "kvc-test", {}, specs)
    log = RegistrationLog(cfg.kafka, topic, "kvc-test")
    await log.start()
    yield log
    await log.stop()


Client = TestClient[Any, Any]


def app_of(conductor: Conductor, registrations: RegistrationLog | None) -> web.Application:
    return make_app(
        conductor,
        Metrics(conductor),
        ready=lambda: (True, "ok"),
        max_body_bytes=1 << 20,
        auth_token=None,
        registrations=registrations,
    )


@pytest.fixture
async def client(registry: RegistrationLog) -> AsyncIterator[Client]:
    async with TestClient(TestServer(app_of(fed_conductor(), registry))) as c:
        yield c


async def call(
    client: Client, method: str, path: str, body: Any = None, headers: dict[str, str] = MSGPACK
) -> tuple[int, Any, str]:
    data = None if body is None else msgspec.msgpack.encode(body)
    async with client.request(method, path, data=data, headers=headers) as resp:
        raw = await resp.read()
        if resp.content_type == "application/msgpack":
            return resp.status, msgspec.msgpack.decode(raw), resp.content_type
        return resp.status, msgspec.json.decode(raw), resp.content_type


async def registered(registry: RegistrationLog, count: int) -> None:
    await wait_for(lambda: len(registry.catalog) == count, 20, f"{count} registrations read back")


@pytest.mark.kafka
async def test_register_services_global_view_query_unregister(
    client: Client, registry: RegistrationLog
) -> None:
    ok = {"status": "registered successfully", "instance_id": "vllm-0"}
    assert await call(client, "POST", "/register", conductor_body()) == (
        200,
        ok,
        "application/msgpack",
    )
    # A rank with no blocks yet (vllm-2) is listed at zeros in the msgpack answer.
    idle = conductor_body(instance_id="vllm-2", endpoint="tcp://127.0.0.1:5560", dp_rank=3)
    assert (await call(client, "POST", "/register", idle))[0] == 200
    await registered(registry, 2)
    # Identical repeat: the same answer, nothing written.
    end = await registry.consumer.end_offsets(list(registry.consumer.assignment()))
    assert (await call(client, "POST", "/register", conductor_body(tenant_id="")))[:2] == (200, ok)
    assert await registry.consumer.end_offsets(list(registry.consumer.assignment())) == end

    status, services, _ = await call(client, "GET", "/services", headers={})
    assert status == 200 and services["count"] == 2
    assert services["services"][0] == {
        "Endpoint": "tcp://127.0.0.1:5557",
        "ReplayEndpoint": "",
        "Type": "vLLM",
        "ModelName": "m",
        "LoraName": "",
        "TenantID": "default",
        "InstanceID": "vllm-0",
        "BlockSize": 4,
        "DPRank": 0,
        "CacheGroup": None,
        "HashProfile": {**PROFILE, "root_digest": ROOT_0},
    }
    status, view, _ = await call(client, "GET", "/global_view", headers={})
    assert status == 200 and view["context_count"] == 1
    (ctx,) = view["contexts"]
    assert ctx["instances"] == {"vllm-0": [0], "vllm-2": [3]}
    assert ctx["prefix_count"] == 4 and ctx["hash_profile"]["root_digest"] == ROOT_0
    assert (ctx["model_name"], ctx["lora_name"], ctx["block_size"], ctx["tenant_id"]) == (
        "m",
        "",
        4,
        "default",
    )

    query = {"model": "m", "block_size": 4, "token_ids": list(range(100, 116))}
    status, answer, _ = await call(client, "POST", "/query", query)
    assert status == 200
    zeros = {"gpu": 0, "cpu": 0, "disk": 0}
    assert answer["instances"]["vllm-2"] == {
        "longest_matched": 0,
        "gpu": 0,
        "cpu": 0,
        "disk": 0,
        "dp": {"3": 0},
        "rank_matches": {"3": zeros},
    }
    assert set(answer["instances"]) == {"vllm-0", "vllm-1", "vllm-2"}
    alone = await call(client, "POST", "/query", {**query, "instance_id": "vllm-2"})
    assert list(alone[1]["instances"]) == ["vllm-2"]

    gone = {"status": "unregistered successfully", "removed_instances": ["vllm-2|default|3"]}
    unregister = {"instance_id": "vllm-2", "dp_rank": 3, "tenant_id": ""}
    assert (await call(client, "POST", "/unregister", unregister))[:2] == (200, gone)
    await registered(registry, 1)
    status, error, content_type = await call(client, "POST", "/unregister", unregister)
    assert (status, error, content_type) == (
        404,
        {"error": "service not found: vllm-2|default|3"},
        "application/msgpack",
    )
    # The tenant is part of the service key.
    other = {"instance_id": "vllm-0", "dp_rank": 0, "tenant_id": "t"}
    assert (await call(client, "POST", "/unregister", other))[0] == 404


@pytest.mark.kafka
async def test_conflicts_are_invalid_registration(
    client: Client, registry: RegistrationLog
) -> None:
    assert (await call(client, "POST", "/register", conductor_body()))[0] == 200
    await registered(registry, 1)
    for body, field in (
        (conductor_body(block_size=16), "block_size"),  # same service key, another stream
        (conductor_body(hash_profile={**PROFILE, "python_hash_seed": "1"}), "hash_profile"),
        (conductor_body(tenant_id="t"), "tenant_id"),  # the same instance rank, another tenant
        (conductor_body(instance_id="vllm-9"), "endpoint"),  # another key on the same endpoint
    ):
        status, error, _ = await call(client, "POST", "/register", body)
        assert (status, error["reason"], error["field"]) == (
            400,
            "invalid_registration",
            field,
        ), error
        assert set(error) == {"error", "reason", "field"}


REFUSED = [
    ({**conductor_body(), "root_digest": ROOT_0}, "unknown_field", "root_digest"),
    ({k: v for k, v in conductor_body().items() if k != "hash_profile"}, "missing", "hash_profile"),
    ({k: v for k, v in conductor_body().items() if k != "dp_rank"}, "missing", "dp_rank"),
    (conductor_body(endpoint=""), "invalid_value", "endpoint"),
    (conductor_body(type="Ollama"), "invalid_value", "type"),
    (conductor_body(block_size=0), "out_of_range", "block_size"),
    (conductor_body(dp_rank=-1), "out_of_range", "dp_rank"),
    (conductor_body(dp_rank="0"), "invalid_type", "dp_rank"),
    (conductor_body(cache_group=1), "unsupported", "cache_group"),
    (conductor_body(cache_group=[0]), "invalid_type", "cache_group"),
    (conductor_body(hash_profile="vllm_v1"), "invalid_type", "hash_profile"),
    (conductor_body(hash_profile={**PROFILE, "extra": 1}), "unknown_field", "extra"),
    (
        conductor_body(hash_profile={**PROFILE, "python_hash_seed": 0}),
        "invalid_type",
        "python_hash_seed",
    ),
    (
        conductor_body(hash_profile={**PROFILE, "python_hash_seed": ""}),
        "invalid_value",
        "python_hash_seed",
    ),
    (conductor_body(hash_profile={**PROFILE, "algorithm": "md5"}), "invalid_value", "algorithm"),
    (conductor_body(endpoint="tcp://*:5557"), "invalid_registration", "endpoint"),
]


@pytest.mark.kafka
@pytest.mark.parametrize(("body", "reason", "field"), REFUSED)
async def test_conductors_register_validation(
    client: Client, body: dict[str, Any], reason: str, field: str | None
) -> None:
    status, error, content_type = await call(client, "POST", "/register", body)
    assert (status, content_type, error["reason"], error.get("field")) == (
        400,
        "application/msgpack",
        reason,
        field,
    ), error


@pytest.mark.kafka
async def test_content_types_methods_and_the_json_form(
    client: Client, registry: RegistrationLog
) -> None:
    for path in ("/register", "/unregister"):
        status, error, _ = await call(client, "POST", path, headers={"Content-Type": "text/plain"})
        assert (status, error["reason"]) == (400, "unsupported_content_type")
        status, error, _ = await call(client, "POST", path, body=None)
        assert (status, error["reason"]) == (400, "invalid_msgpack")
        raw = await client.post(path, data=b"\x91\x01", headers=MSGPACK)
        assert msgspec.msgpack.decode(await raw.read())["reason"] == "invalid_msgpack"
    for method, path in (
        ("GET", "/register"),
        ("GET", "/unregister"),
        ("POST", "/services"),
        ("POST", "/global_view"),
    ):
        status, error, content_type = await call(client, method, path, headers={})
        assert (status, content_type, list(error)) == (405, "application/msgpack", ["error"])
    # GET /query is the JSON contract's route: its 405 stays JSON.
    assert (await call(client, "GET", "/query", headers={}))[::2] == (405, "application/json")
    status, error, _ = await call(client, "POST", "/unregister", {"instance_id": "x"})
    assert (status, error["reason"], error["field"]) == (400, "missing", "dp_rank")
    status, error, _ = await call(
        client, "POST", "/unregister", {"instance_id": "x", "dp_rank": 0, "type": "vLLM"}
    )
    assert (status, error["reason"], error["field"]) == (400, "unknown_field", "type")

    # The bridge's JSON form: RFC #1403's body, JSON answers.
    json_body = {
        "endpoint": "tcp://127.0.0.1:5600",
        "type": "SGLang",
        "modelname": "m",
        "instance_id": "sgl-0",
        "block_size": 4,
        "tenant_id": "",
        "lora_name": "",
        "additionalsalt": "",
        "priority": "ignored",
    }
    async with client.post("/register", json=json_body) as resp:
        assert resp.content_type == "application/json"
        assert (resp.status, await resp.json()) == (
            200,
            {"status": "registered successfully", "instance_id": "sgl-0"},
        )
    async with client.post("/register", json={**json_body, "type": "Ollama"}) as resp:
        assert resp.status == 400
        assert list(await resp.json()) == ["error"]
    await registered(registry, 1)
    async with client.get("/services", headers={"Accept": "application/json"}) as resp:
        listing = await resp.json()
        assert listing["services"][0]["Type"] == "SGLang"
        assert listing["services"][0]["HashProfile"] is None
    async with client.post("/unregister", json={"instance_id": "sgl-0", "dp_rank": 0}) as resp:
        assert (await resp.json())["removed_instances"] == ["sgl-0|default|0"]


async def test_registration_off_is_404() -> None:
    async with TestClient(TestServer(app_of(Conductor(), None))) as c:
        status, error, _ = await call(c, "POST", "/register", conductor_body())
        assert status == 404 and "registration" in error["error"]


# -------------------------------------- from the daemon to the bridge


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def daemon_and_bridge(bootstrap: str) -> tuple[Config, BridgeConfig]:
    """A daemon's and a bridge's configs on the same topics of their own."""
    topic = f"kv-bridge-registrations-{uuid.uuid4().hex[:8]}"
    cfg = daemon_config(bootstrap, KVCONDUCTOR_HTTP_REGISTRATIONS_TOPIC=topic)
    bcfg = bridge_config(
        bootstrap,
        engine_topic=cfg.kafka.engine_topic,
        pool_topic=cfg.kafka.pool_topic,
        registrations_topic=topic,
    )
    return cfg, bcfg


async def post_msgpack(port: int, path: str, body: object) -> tuple[int, Any]:
    data = msgspec.msgpack.encode(body)
    url = f"http://127.0.0.1:{port}{path}"
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=MSGPACK) as r,
    ):
        return r.status, msgspec.msgpack.decode(await r.read())


@pytest.mark.kafka
async def test_registration_at_the_daemon_reaches_the_bridge(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    pub = FakePublisher(ctx)
    cfg, bcfg = daemon_and_bridge(kafka_bootstrap)
    body = conductor_body(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)
    key = StreamKey("vllm-0", 0)
    try:
        async with running(cfg) as daemon, running_bridge(bcfg) as bridge:
            log = daemon.registrations
            assert log is not None and bridge.registry is not None and daemon.http_port
            await wait_for(log.loaded.is_set, 30, "the daemon's registrations")
            assert (await post_msgpack(daemon.http_port, "/register", body))[0] == 200
            await wait_for(lambda: key in bridge.streams, 30, "the bridge relays it")
            await pub.wait_subscribed()
            stream = bridge.streams[key]
            # A repeat, at the daemon or at the bridge, restarts nothing.
            await wait_for(lambda: key in log.catalog, 10, "read back at the daemon")
            assert (await post_msgpack(daemon.http_port, "/register", body))[0] == 200
            assert bridge.http_port is not None
            status, answer = await post_msgpack(bridge.http_port, "/register", body)
            assert (status, answer["instance_id"]) == (200, "vllm-0")
            assert bridge.streams[key] is stream
            # Both list it; unregistered at the bridge, it is gone at the daemon.
            status, services = await post_msgpack(
                daemon.http_port, "/unregister", {"instance_id": "vllm-0", "dp_rank": 0}
            )
            assert status == 200, services
            await wait_for(lambda: key not in bridge.streams, 30, "the bridge stops it")
            await wait_for(lambda: key not in log.catalog, 10, "gone at the daemon")
    finally:
        await pub.close()


@pytest.mark.kafka
async def test_a_replica_reads_the_list_and_writes_nothing(
    client: Client, registry: RegistrationLog
) -> None:
    assert (await call(client, "POST", "/register", conductor_body()))[0] == 200
    await registered(registry, 1)
    replica_log = RegistrationLog(registry.kafka, registry.topic, "kvc-replica", writable=False)
    await replica_log.start()
    try:
        async with TestClient(TestServer(app_of(Conductor(), replica_log))) as replica:
            status, services, _ = await call(replica, "GET", "/services", headers={})
            assert (status, services["count"]) == (200, 1)
            # An identical repeat needs no write: Mooncake's router restarting
            # against a replica still starts.
            assert (await call(replica, "POST", "/register", conductor_body()))[0] == 200
            other = conductor_body(instance_id="vllm-5", endpoint="tcp://127.0.0.1:5599")
            status, error, _ = await call(replica, "POST", "/register", other)
            assert status == 403 and "replica" in error["error"]
            gone = {"instance_id": "vllm-0", "dp_rank": 0}
            assert (await call(replica, "POST", "/unregister", gone))[0] == 403
    finally:
        await replica_log.stop()


@pytest.mark.kafka
async def test_a_registration_that_adds_fields_merges(
    client: Client, registry: RegistrationLog
) -> None:
    """The engine's own registration (JSON) first, then Mooncake's router's
    (msgpack): both 200, one merged registration listed and stored."""
    async with client.post("/register", json=engine_body()) as resp:
        assert (resp.status, await resp.json()) == (
            200,
            {"status": "registered successfully", "instance_id": "vllm-0"},
        )
    await registered(registry, 1)
    ok = {"status": "registered successfully", "instance_id": "vllm-0"}
    assert (await call(client, "POST", "/register", conductor_body()))[:2] == (200, ok)
    key = StreamKey("vllm-0", 0)
    await wait_for(
        lambda: registry.catalog[key].body.hash_profile is not None, 20, "the merge read back"
    )
    status, services, _ = await call(client, "GET", "/services", headers={})
    assert status == 200 and services["count"] == 1
    (view,) = services["services"]
    assert view["ReplayEndpoint"] == "tcp://127.0.0.1:5558"  # the engine's
    assert view["HashProfile"] == {**PROFILE, "root_digest": ROOT_0}  # the router's
    pub = registry.catalog[key].publisher
    assert (pub.offload, pub.report_mode) == ("pool", "full")
    # Either again adds nothing: nothing is written.
    end = await registry.consumer.end_offsets(list(registry.consumer.assignment()))
    assert (await call(client, "POST", "/register", conductor_body()))[:2] == (200, ok)
    async with client.post("/register", json=engine_body()) as resp:
        assert resp.status == 200
    assert await registry.consumer.end_offsets(list(registry.consumer.assignment())) == end
    # A contradiction is still one, in either form, naming the field.
    async with client.post("/register", json=engine_body(kv_offload="local")) as resp:
        assert resp.status == 400
        assert "kv_offload" in (await resp.json())["error"]


@pytest.mark.kafka
async def test_a_merge_at_the_daemon_restarts_the_bridges_stream_with_its_headers(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    """The router's registration at the daemon first; the engine's own at the
    bridge merges into it, and the records carry the engine's headers."""
    pub = FakePublisher(ctx)
    cfg, bcfg = daemon_and_bridge(kafka_bootstrap)
    key = StreamKey("vllm-0", 0)
    router = conductor_body(endpoint=pub.endpoint)
    engine = engine_body(endpoint=pub.endpoint, replay_endpoint=pub.replay_endpoint)
    try:
        async with running(cfg) as daemon, running_bridge(bcfg) as bridge:
            log = daemon.registrations
            assert log is not None and daemon.http_port and bridge.http_port
            await wait_for(log.loaded.is_set, 30, "the daemon's registrations")
            assert (await post_msgpack(daemon.http_port, "/register", router))[0] == 200
            await wait_for(lambda: key in bridge.streams, 30, "the bridge relays it")
            async with (
                aiohttp.ClientSession() as session,
                session.post(f"http://127.0.0.1:{bridge.http_port}/register", json=engine) as r,
            ):
                assert r.status == 200, await r.text()
            await wait_for(
                lambda: key in bridge.streams and bridge.streams[key].pub.report_mode == "full",
                30,
                "the stream restarted with the merged registration",
            )
            await wait_for(
                lambda: key in log.catalog and log.catalog[key].body.kv_offload == "pool",
                10,
                "the merge read back at the daemon",
            )
            assert log.catalog[key].body.hash_profile == HashProfile(**PROFILE)
            await pub.wait_subscribed()
            await pub.publish(vllm_payload([stored([1], list(range(4)), block_size=4)], 0))

            data: list[Any] = []

            async def relayed() -> bool:
                records = await read_all(kafka_bootstrap, cfg.kafka.engine_topic)
                data[:] = [r for r in records_for(records, "vllm-0") if r.value]
                return bool(data)

            await wait_for(relayed, 30, "a record relayed")
            headers = headers_of(data[-1])
            assert (headers["kv-offload"], headers["kv-report-mode"]) == ("pool", "full")
    finally:
        await pub.close()
