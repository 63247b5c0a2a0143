"""HTTP API against a real Conductor fed through `conductor.snapshot_state().apply_engine`."""

from __future__ import annotations

import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

import aiohttp.test_utils
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from prometheus_client.parser import text_string_to_metric_families

from kvconductor.http.api import make_app
from kvconductor.http.front import QuerySite
from kvconductor.index.conductor import Conductor
from kvconductor.obs.metrics import Metrics
from kvconductor.wire.events import BlockStored, EngineBatch
from kvconductor.wire.records import EngineMeta

BS = 4
# Four full blocks and a partial one (never indexed, never matched).
TOKENS = [100 + i for i in range(4 * BS)] + [7, 8]
HASHES = [0xA000 + i for i in range(4)]  # the engine's sequence hashes of those blocks
TOKEN = "s3cret-token"

# vllm-0 rank 0: GPU blocks 0-1, own CPU block 2, own DISK block 3;
# vllm-0 rank 1: GPU block 0; vllm-1 rank 0: GPU blocks 0-3.
VLLM0 = {"longest_matched": 16, "GPU": 8, "CPU": 12, "DISK": 16, "DP": {"0": 16, "1": 4}}
VLLM1 = {"longest_matched": 16, "GPU": 16, "CPU": 16, "DISK": 16, "DP": {"0": 16}}
FULL_ANSWER = {"default": {"vllm-0": VLLM0, "vllm-1": VLLM1}}


def meta(rank: int = 0) -> EngineMeta:
    return EngineMeta(
        model="m",
        block_size=BS,
        source="vllm",
        seq=None,
        tenant="default",
        salt="",
        dp_rank=rank,
        offload_pool=False,
    )


def store(
    conductor: Conductor, instance: str, first: int, last: int, medium: str | None, rank: int = 0
) -> None:
    """Store blocks first..last (inclusive) of TOKENS in one medium of one rank."""
    event = BlockStored(
        block_hashes=HASHES[first : last + 1],
        parent_block_hash=HASHES[first - 1] if first else None,
        token_ids=TOKENS[first * BS : (last + 1) * BS],
        block_size=BS,
        medium=medium,
    )
    batch = EngineBatch(ts=1.0, events=[event], dp_rank=rank)
    conductor.snapshot_state().apply_engine(instance, meta(rank), batch, 1.0)


def fed_conductor() -> Conductor:
    conductor = Conductor()
    store(conductor, "vllm-0", 0, 1, None)
    store(conductor, "vllm-0", 2, 2, "CPU")
    store(conductor, "vllm-0", 3, 3, "DISK")
    store(conductor, "vllm-0", 0, 0, "GPU", rank=1)
    store(conductor, "vllm-1", 0, 3, "GPU")
    return conductor


def query(**extra: Any) -> dict[str, Any]:
    return {"model": "m", "block_size": BS, "token_ids": TOKENS, **extra}


class Ready:
    def __init__(self) -> None:
        self.state = (False, "catching up on kv-events")

    def __call__(self) -> tuple[bool, str]:
        return self.state


if TYPE_CHECKING:
    Client = TestClient[web.Request, web.Application]
    MakeClient = Callable[..., Awaitable[Client]]


def _query_site(
    runner: web.BaseRunner, sock: socket.socket, ssl_context: object = None
) -> QuerySite:
    return QuerySite(runner, sock=sock)


# Every test runs on aiohttp's own site and on the daemon's (`QuerySite`,
# whose front answers plain queries and hands the rest to aiohttp): both
# must answer alike.
@pytest.fixture(params=["aiohttp", "front"])
async def make_client(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[MakeClient]:
    if request.param == "front":
        monkeypatch.setattr(aiohttp.test_utils, "SockSite", _query_site)
    clients: list[Client] = []

    async def make(
        conductor: Conductor | None = None,
        *,
        auth_token: str | None = None,
        max_body_bytes: int = 1 << 20,
        ready: Callable[[], tuple[bool, str]] | None = None,
        metrics: Metrics | None = None,
    ) -> Client:
        conductor = conductor if conductor is not None else fed_conductor()
        metrics = metrics if metrics is not None else Metrics(conductor)
        app = make_app(
            conductor,
            metrics,
            ready=ready if ready is not None else (lambda: (True, "ok")),
            max_body_bytes=max_body_bytes,
            auth_token=auth_token,
        )
        client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


async def post_json(client: Client, path: str, payload: object, **kw: Any) -> tuple[int, Any, str]:
    resp = await client.post(path, data=json.dumps(payload), **kw)
    text = await resp.text()
    return resp.status, json.loads(text), text


def assert_error(status: int, body: Any, expected: int) -> None:
    assert status == expected, body
    assert isinstance(body, dict) and list(body) == ["error"], body
    assert isinstance(body["error"], str) and body["error"]


# ------------------------------------------------------------- answers


async def test_query_contract_shape(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/query", data=json.dumps(query()))
    assert resp.status == 200
    assert resp.content_type == "application/json"
    raw = await resp.read()
    assert json.loads(raw) == FULL_ANSWER
    # exactly the contract's fields, in its order, compact
    assert raw == (
        b'{"default":{"vllm-0":{"longest_matched":16,"GPU":8,"CPU":12,"DISK":16,'
        b'"DP":{"0":16,"1":4}},"vllm-1":{"longest_matched":16,"GPU":16,"CPU":16,'
        b'"DISK":16,"DP":{"0":16}}}}'
    )


async def test_query_by_hash_matches_query(make_client: MakeClient) -> None:
    client = await make_client()
    body = {"model": "m", "block_size": BS, "seq_hashes": HASHES}
    status, answer, _ = await post_json(client, "/query_by_hash", body)
    assert status == 200
    assert answer == FULL_ANSWER
    # a prefix of the hashes matches a prefix; hex digests are accepted
    body = {"model": "m", "block_size": BS, "seq_hashes": [f"{HASHES[0]:016x}", HASHES[1]]}
    status, answer, _ = await post_json(client, "/query_by_hash", body)
    assert status == 200
    assert answer["default"]["vllm-1"]["longest_matched"] == 8


async def test_query_filters_and_partial_prompts(make_client: MakeClient) -> None:
    client = await make_client()
    status, answer, _ = await post_json(client, "/query", query(instance_id="vllm-1"))
    assert (status, answer) == (200, {"default": {"vllm-1": VLLM1}})
    # a prompt that diverges after block 0: every listed rank is still listed
    tokens = TOKENS[:BS] + [1] * BS
    status, answer, _ = await post_json(client, "/query", query(token_ids=tokens))
    assert status == 200
    v0 = answer["default"]["vllm-0"]
    assert v0 == {"longest_matched": 4, "GPU": 4, "CPU": 4, "DISK": 4, "DP": {"0": 4, "1": 4}}
    # nothing matches: listed ranks with zeros
    status, answer, _ = await post_json(client, "/query", query(token_ids=[]))
    assert status == 200
    assert answer["default"]["vllm-1"] == {
        "longest_matched": 0,
        "GPU": 0,
        "CPU": 0,
        "DISK": 0,
        "DP": {"0": 0},
    }


@pytest.mark.parametrize(
    "extra",
    [
        {"model": "other"},
        {"block_size": BS * 2},
        {"tenant_id": "acme"},
        {"lora_name": "adapter"},
        {"cache_salt": "pepper"},
        {"instance_id": "vllm-9"},
    ],
)
async def test_nothing_listed_is_empty_object(
    make_client: MakeClient, extra: dict[str, Any]
) -> None:
    client = await make_client()
    status, answer, text = await post_json(client, "/query", query(**extra))
    assert (status, answer, text) == (200, {}, "{}")
    body = {"model": "m", "block_size": BS, "seq_hashes": HASHES, **extra}
    status, answer, text = await post_json(client, "/query_by_hash", body)
    assert (status, answer, text) == (200, {}, "{}")


async def test_explicit_defaults_and_unknown_fields(make_client: MakeClient) -> None:
    client = await make_client()
    body = query(tenant_id="default", lora_name=None, cache_salt="", priority="high")
    status, answer, _ = await post_json(client, "/query", body)
    assert (status, answer) == (200, FULL_ANSWER)


async def test_empty_namespace_fields_are_the_defaults(make_client: MakeClient) -> None:
    # Contract v2 section 1, on aiohttp's path and on the front's (whose JSON
    # reader is the kernel's when it is built).
    client = await make_client()
    for body in (
        query(tenant_id="", lora_name="", cache_salt=""),
        query(tenant_id=None, lora_name=None, cache_salt=None),
    ):
        status, answer, _ = await post_json(client, "/query", body)
        assert (status, answer) == (200, FULL_ANSWER)
    by_hash = {"model": "m", "block_size": BS, "seq_hashes": HASHES, "tenant_id": ""}
    status, answer, _ = await post_json(client, "/query_by_hash", {**by_hash, "lora_name": ""})
    assert (status, answer) == (200, FULL_ANSWER)


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/query", b"{"),
        ("/query", b""),
        ("/query", b"not json"),
        ("/query", b"[]"),
        ("/query", b"null"),
        ("/query", json.dumps({"model": "m", "block_size": BS}).encode()),  # no token_ids
        ("/query", json.dumps({"block_size": BS, "token_ids": [1]}).encode()),  # no model
        ("/query", json.dumps(query(block_size="4")).encode()),
        ("/query", json.dumps(query(block_size=True)).encode()),
        ("/query", json.dumps(query(block_size=4.5)).encode()),
        ("/query", json.dumps(query(block_size=0)).encode()),
        ("/query", json.dumps(query(block_size=-4)).encode()),
        ("/query", json.dumps(query(model=5)).encode()),
        ("/query", json.dumps(query(token_ids="1,2,3")).encode()),
        ("/query", json.dumps(query(token_ids=["a"])).encode()),
        ("/query", json.dumps(query(token_ids=[1.5])).encode()),
        ("/query", json.dumps(query(token_ids=[-1, 2, 3, 4])).encode()),
        ("/query", json.dumps(query(token_ids=[2**32, 2, 3, 4])).encode()),
        ("/query", json.dumps(query(token_ids=[2**70, 2, 3, 4])).encode()),
        ("/query", json.dumps(query(lora_name=3)).encode()),
        ("/query", json.dumps(query(instance_id=["x"])).encode()),
        ("/query_by_hash", json.dumps({"model": "m", "block_size": BS}).encode()),
        ("/query_by_hash", json.dumps(query()).encode()),  # token_ids instead of seq_hashes
        ("/query_by_hash", json.dumps({"model": "m", "block_size": BS, "seq_hashes": [2**64]})),
        ("/query_by_hash", json.dumps({"model": "m", "block_size": BS, "seq_hashes": ["zz"]})),
        ("/query_by_hash", json.dumps({"model": "m", "block_size": BS, "seq_hashes": [None]})),
        ("/query_by_hash", json.dumps({"model": "m", "block_size": 0, "seq_hashes": [1]})),
    ],
)
async def test_bad_requests_are_400_json(
    make_client: MakeClient, path: str, body: bytes | str
) -> None:
    client = await make_client()
    resp = await client.post(path, data=body, headers={"Content-Type": "application/json"})
    assert resp.content_type == "application/json"
    assert_error(resp.status, await resp.json(), 400)


async def test_400_names_the_problem(make_client: MakeClient) -> None:
    client = await make_client()
    _, body, _ = await post_json(client, "/query", {"model": "m", "block_size": BS})
    assert "token_ids" in body["error"]
    _, body, _ = await post_json(client, "/query", query(block_size="4"))
    assert "block_size" in body["error"]
    resp = await client.post("/query", data=b"{")
    assert "malformed JSON" in (await resp.json())["error"]
    _, body, _ = await post_json(client, "/query", query(token_ids=[2**32] * BS))
    assert "token_ids" in body["error"]


async def test_413_for_large_bodies(make_client: MakeClient) -> None:
    client = await make_client(max_body_bytes=4096)
    big = json.dumps(query(token_ids=[1] * 4000))
    assert len(big) > 4096
    resp = await client.post("/query", data=big)
    assert resp.content_type == "application/json"
    assert_error(resp.status, await resp.json(), 413)
    assert "4096" in (await resp.json())["error"]

    async def chunks() -> AsyncIterator[bytes]:  # chunked: no Content-Length
        for i in range(0, len(big), 1000):
            yield big[i : i + 1000].encode()

    resp = await client.post("/query", data=chunks())
    assert_error(resp.status, await resp.json(), 413)
    # just under the limit is fine
    ok = json.dumps(query(token_ids=[1] * 600))
    assert len(ok) < 4096
    status, _, _ = await post_json(client, "/query", json.loads(ok))
    assert status == 200


async def test_404_and_405_are_json(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/nope")
    assert resp.content_type == "application/json"
    assert_error(resp.status, await resp.json(), 404)
    resp = await client.get("/query")
    assert resp.content_type == "application/json"
    assert_error(resp.status, await resp.json(), 405)
    assert "POST" in resp.headers["Allow"]
    resp = await client.post("/workers", data=b"{}")
    assert_error(resp.status, await resp.json(), 405)


# ------------------------------------------------------------------ auth


async def test_bearer_auth(make_client: MakeClient) -> None:
    client = await make_client(auth_token=TOKEN)
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": f"Basic {TOKEN}"},
        {"Authorization": TOKEN},
        {"Authorization": f"Bearer {TOKEN}x"},
    ):
        for method, path in (("POST", "/query"), ("POST", "/query_by_hash"), ("GET", "/workers")):
            resp = await client.request(method, path, data=json.dumps(query()), headers=headers)
            assert_error(resp.status, await resp.json(), 401)
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    good = {"Authorization": f"Bearer {TOKEN}"}
    status, answer, _ = await post_json(client, "/query", query(), headers=good)
    assert (status, answer) == (200, FULL_ANSWER)
    status, _, _ = await post_json(
        client,
        "/query_by_hash",
        {"model": "m", "block_size": BS, "seq_hashes": HASHES},
        headers={"Authorization": f"bearer {TOKEN}"},
    )
    assert status == 200
    resp = await client.get("/workers", headers=good)
    assert resp.status == 200
    # operations endpoints stay open
    for path in ("/health", "/ready", "/metrics"):
        resp = await client.get(path)
        assert resp.status == 200, path


async def test_no_auth_when_no_token(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/workers", headers={"Authorization": "Bearer anything"})
    assert resp.status == 200


# ------------------------------------------------------------ operations


async def test_health(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/health")
    assert resp.status == 200
    assert await resp.json() == {"status": "ok"}


async def test_ready(make_client: MakeClient) -> None:
    ready = Ready()
    client = await make_client(ready=ready)
    resp = await client.get("/ready")
    assert resp.status == 503
    assert await resp.json() == {"ready": False, "reason": "catching up on kv-events"}
    ready.state = (True, "caught up")
    resp = await client.get("/ready")
    assert resp.status == 200
    assert await resp.json() == {"ready": True, "reason": "caught up"}


async def test_ready_check_that_raises_is_503(make_client: MakeClient) -> None:
    def broken() -> tuple[bool, str]:
        raise RuntimeError("boom")

    client = await make_client(ready=broken)
    resp = await client.get("/ready")
    assert resp.status == 503
    assert (await resp.json())["ready"] is False


async def test_workers(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/workers")
    assert resp.status == 200
    body = await resp.json()
    assert set(body) == {"workers", "pending"}
    assert body["pending"] == {"waiting": 0, "unresolved": 0, "intents": 0, "retired": 0}
    (ns,) = body["workers"]
    assert (ns["tenant"], ns["model"], ns["block_size"]) == ("default", "m", BS)
    assert ns["instances"]["vllm-0"]["0"] == {"GPU": 2, "CPU": 1, "DISK": 1}
    assert ns["instances"]["vllm-0"]["1"] == {"GPU": 1, "CPU": 0, "DISK": 0}
    assert ns["instances"]["vllm-1"]["0"] == {"GPU": 4, "CPU": 0, "DISK": 0}


async def test_internal_errors_are_500_json(make_client: MakeClient) -> None:
    class Broken(Conductor):
        def workers(self) -> list[dict[str, object]]:
            raise RuntimeError("bug")

    client = await make_client(Broken())
    resp = await client.get("/workers")
    assert_error(resp.status, await resp.json(), 500)
    assert (await client.get("/health")).status == 200


# --------------------------------------------------------------- metrics


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_metrics_endpoint(make_client: MakeClient) -> None:
    conductor = fed_conductor()
    conductor.snapshot_state().counters["unknown_medium"] += 3
    client = await make_client(conductor)
    for _ in range(3):
        assert (await post_json(client, "/query", query()))[0] == 200
    await post_json(client, "/query", {"model": "m"})  # a 400
    body = {"model": "m", "block_size": BS, "seq_hashes": HASHES}
    assert (await post_json(client, "/query_by_hash", body))[0] == 200

    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=0.0.4")
    samples = scrape(await resp.text())

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted(labels.items())))]

    assert value("kvconductor_blocks_applied_total", source="vllm", tier="GPU") == 7
    assert value("kvconductor_blocks_applied_total", source="vllm", tier="CPU") == 1
    assert value("kvconductor_blocks_applied_total", source="vllm", tier="DISK") == 1
    assert value("kvconductor_index_events_total", kind="unknown_medium") == 3
    assert value("kvconductor_pending", kind="waiting") == 0
    assert value("kvconductor_namespaces") == 1
    assert value("kvconductor_instances") == 2
    assert value("kvconductor_query_latency_seconds_count", endpoint="query") == 4
    assert value("kvconductor_query_latency_seconds_count", endpoint="query_by_hash") == 1
    assert value("kvconductor_query_latency_seconds_bucket", endpoint="query", le="0.1") >= 3
    assert value("kvconductor_http_requests_total", endpoint="query", code="200") == 3
    assert value("kvconductor_http_requests_total", endpoint="query", code="400") == 1


async def test_daemon_metrics_and_separate_registries(make_client: MakeClient) -> None:
    first, second = Metrics(fed_conductor()), Metrics()  # no clash: own registries
    first.records_consumed.labels("kv-events").inc(5)
    first.bad_records.labels("kv-events", "undecodable").inc()
    first.dead_letters.labels("undecodable").inc()
    first.observe_seq(0)
    first.observe_seq(3)
    first.set_lag("kv-events", 2, 42)
    first.set_lag("kv-events", 3, 1)
    first.forget_partition("kv-events", 3)
    first.forget_partition("kv-events", 9)  # never seen: no error
    samples = scrape(first.render().decode())
    assert samples[("kvconductor_records_consumed_total", (("topic", "kv-events"),))] == 5
    key = ("kvconductor_bad_records_total", (("kind", "undecodable"), ("topic", "kv-events")))
    assert samples[key] == 1
    assert samples[("kvconductor_dead_letters_total", (("kind", "undecodable"),))] == 1
    assert samples[("kvconductor_seq_gaps_total", ())] == 1
    assert samples[("kvconductor_seq_missing_total", ())] == 3
    lag = (("partition", "2"), ("topic", "kv-events"))
    assert samples[("kvconductor_consumer_lag", lag)] == 42
    assert ("kvconductor_consumer_lag", (("partition", "3"), ("topic", "kv-events"))) not in samples
    # an unbound Metrics renders without index families' samples
    assert ("kvconductor_namespaces", ()) not in scrape(second.render().decode())
    second.bind(fed_conductor())
    assert scrape(second.render().decode())[("kvconductor_namespaces", ())] == 1
    # served from the app as well
    client = await make_client(metrics=first)
    resp = await client.get("/metrics")
    text = await resp.text()
    assert scrape(text)[("kvconductor_seq_missing_total", ())] == 3
