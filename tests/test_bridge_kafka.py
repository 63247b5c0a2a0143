"""The bridge between real ZMQ sockets and the real broker: every record on
Kafka checked for order, key, headers and untouched payload bytes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import zmq
import zmq.asyncio

from tests.bridge_fakes import (
    FakePublisher,
    bridge_config,
    fixture_payloads,
    headers_of,
    publisher,
    records_for,
    running_bridge,
)
from tests.harness import http_json, read_all, wait_for

pytestmark = pytest.mark.kafka


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


def payload(i: int) -> bytes:
    """Fixture payloads first (real vLLM 0.33 bytes), then distinct fillers."""
    fixtures = fixture_payloads()
    return fixtures[i] if i < len(fixtures) else b"\x93\xcb" + i.to_bytes(8, "big") + b"\x90\x00"


ENGINE_HEADERS = {
    "kv-model": "m",
    "kv-block-size": "4",
    "kv-source": "vllm",
    "kv-tenant": "default",
    "kv-salt": "",
    "kv-dp-rank": "0",
    "kv-offload": "local",
}


def check_stream(
    records: list[Any],
    expected: list[tuple[str, Any]],
    key: str = "vllm-0",
    base: dict[str, str] | None = None,
    payload_of: Callable[[int], bytes] = payload,
) -> None:
    """`expected`: ("data", seq) or ("resync", reason prefix), in log order."""
    base = ENGINE_HEADERS if base is None else base
    mine = records_for(records, key)
    got: list[tuple[str, Any]] = []
    for r in mine:
        h = headers_of(r)
        if h.get("kv-control") == "resync":
            assert r.value == b""
            assert "kv-seq" not in h
            assert {k: h[k] for k in base} == base
            got.append(("resync", h["kv-control-reason"]))
        else:
            assert h == {**base, "kv-seq": h["kv-seq"]}, h
            seq = int(h["kv-seq"])
            assert r.value == payload_of(seq), f"payload of seq {seq} changed"
            got.append(("data", seq))
    assert len(got) == len(expected), got
    for (kind, value), (want_kind, want) in zip(got, expected, strict=True):
        assert kind == want_kind, got
        if kind == "resync":
            assert value.startswith(want), (value, want)
        else:
            assert value == want, got


ATTACHED = ("resync", "bridge attached")


def relayed(bridge: Any) -> float:
    """Data records Kafka has acknowledged so far."""
    return metric(bridge.metrics.render().decode(), "kvconductor_bridge_messages_relayed_total")


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of `name` whose labels include `labels`."""
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        series, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


async def records_until(bootstrap: str, topic: str, count: int, timeout: float = 20) -> list[Any]:
    out: list[Any] = []

    async def enough() -> bool:
        nonlocal out
        out = await read_all(bootstrap, topic, timeout=5)
        return len(out) >= count

    await wait_for(enough, timeout, f"{count} records on {topic}")
    return out


@pytest.mark.parametrize("generation", ["new", "old"])
async def test_dropped_messages_filled_by_replay(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context, generation: str
) -> None:
    pub = FakePublisher(ctx, generation=generation)
    cfg = bridge_config(kafka_bootstrap, (publisher(pub),), registrations=False)
    try:
        async with running_bridge(cfg) as bridge:
            await pub.wait_subscribed()
            dropped = {2, 3, 7, 11, 12, 13}
            for i in range(20):
                await pub.publish(payload(i), drop=i in dropped)
            records = await records_until(kafka_bootstrap, cfg.kafka.engine_topic, 21)
            check_stream(records, [ATTACHED, *(("data", i) for i in range(20))])
            m = bridge.metrics.render().decode()
            assert metric(m, "kvconductor_bridge_gaps_total", publisher="vllm-0") >= 1
            assert metric(m, "kvconductor_bridge_replays_total", outcome="filled") >= 1
            assert metric(m, "kvconductor_bridge_messages_relayed_total") == 20
            assert metric(m, "kvconductor_bridge_unfillable_gaps_total") == 0
    finally:
        await pub.close()


async def test_restarted_publisher_gives_a_resync(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    pub = FakePublisher(ctx)
    cfg = bridge_config(kafka_bootstrap, (publisher(pub),), registrations=False)
    try:
        async with running_bridge(cfg) as bridge:
            await pub.wait_subscribed()
            for i in range(5):
                await pub.publish(payload(i))
            await records_until(kafka_bootstrap, cfg.kafka.engine_topic, 6)
            port, replay_port = pub.port, pub.replay_port
            await pub.close()
            pub = FakePublisher(ctx, port=port, replay_port=replay_port)  # a new process
            await pub.wait_subscribed()
            for i in range(3):
                await pub.publish(payload(i))
            records = await records_until(kafka_bootstrap, cfg.kafka.engine_topic, 10)
            check_stream(
                records,
                [
                    ATTACHED,
                    *(("data", i) for i in range(5)),
                    ("resync", "publisher restarted: sequence went back from 4 to 0"),
                    *(("data", i) for i in range(3)),
                ],
            )
            m = bridge.metrics.render().decode()
            assert metric(m, "kvconductor_bridge_resyncs_total", reason="restarted") == 1
    finally:
        await pub.close()


async def test_gap_without_replay_endpoint_gives_a_resync(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    pub = FakePublisher(ctx, replay=False)
    cfg = bridge_config(kafka_bootstrap, (publisher(pub),), registrations=False)
    try:
        async with running_bridge(cfg) as bridge:
            await pub.wait_subscribed()
            for i in range(7):
                await pub.publish(payload(i), drop=i in (3, 4))
            records = await records_until(kafka_bootstrap, cfg.kafka.engine_topic, 7)
            check_stream(
                records,
                [
                    ATTACHED,
                    *(("data", i) for i in range(3)),
                    ("resync", "messages 3..4 lost and the publisher has no replay endpoint"),
                    ("data", 5),
                    ("data", 6),
                ],
            )
            m = bridge.metrics.render().decode()
            assert metric(m, "kvconductor_bridge_unfillable_gaps_total", reason="no_replay") == 1
            assert metric(m, "kvconductor_bridge_gap_messages_total") == 2
    finally:
        await pub.close()


async def test_replay_buffer_overrun_gives_a_resync(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    pub = FakePublisher(ctx, buffer_steps=3)
    cfg = bridge_config(kafka_bootstrap, (publisher(pub),), registrations=False)
    try:
        async with running_bridge(cfg):
            await pub.wait_subscribed()
            for i in range(9):
                await pub.publish(payload(i), drop=2 <= i <= 7)
            records = await records_until(kafka_bootstrap, cfg.kafka.engine_topic, 7)
            check_stream(
                records,
                [
                    ATTACHED,
                    ("data", 0),
                    ("data", 1),
                    ("resync", "messages 2..5 lost: no longer in the publisher's replay buffer"),
                    *(("data", i) for i in (6, 7, 8)),
                ],
            )
    finally:
        await pub.close()


async def dp_publishers(ctx: zmq.asyncio.Context, ranks: int) -> list[FakePublisher]:
    """One fake publisher per rank on consecutive ports (live and replay)."""
    import random

    for _ in range(50):
        base, replay_base = random.sample(range(21000, 59000, 10), 2)
        pubs: list[FakePublisher] = []
        try:
            for r in range(ranks):
                pubs.append(FakePublisher(ctx, port=base + r, replay_port=replay_base + r))
            return pubs
        except zmq.ZMQError:
            for p in pubs:
                await p.close()
    raise RuntimeError("no consecutive free ports")


async def test_dp_ranks_and_a_pool_backend(kafka_bootstrap: str, ctx: zmq.asyncio.Context) -> None:
    ranks = await dp_publishers(ctx, 2)
    pool = FakePublisher(ctx, topic=b"", replay=False)  # as mooncake_master publishes
    engine_cfg = publisher(ranks[0], id="vllm-dp", dp_size=2, tenant="t1", salt="s1")
    pool_cfg = publisher(
        pool, id="mooncake-0", kind="pool", source="mooncake", model=None, block_size=None
    )
    cfg = bridge_config(kafka_bootstrap, (engine_cfg, pool_cfg), registrations=False)
    try:
        async with running_bridge(cfg) as bridge:
            assert sorted(bridge.streams) == [("mooncake-0", 0), ("vllm-dp", 0), ("vllm-dp", 1)]
            for p in (*ranks, pool):
                await p.wait_subscribed()
            for i in range(6):
                await ranks[i % 2].publish(payload(i))
                await pool.publish(payload(i))
            engine = await records_until(kafka_bootstrap, cfg.kafka.engine_topic, 8)
            pools = await records_until(kafka_bootstrap, cfg.kafka.pool_topic, 7)
            base = {**ENGINE_HEADERS, "kv-tenant": "t1", "kv-salt": "s1"}
            for rank in (0, 1):
                mine = [r for r in engine if headers_of(r)["kv-dp-rank"] == str(rank)]
                # Each rank counts its own sequence from 0: rank 0 got payloads 0, 2, 4.
                seqs = [int(headers_of(r).get("kv-seq", -1)) for r in mine]
                assert seqs == [-1, 0, 1, 2]
                assert [r.value for r in mine[1:]] == [payload(i) for i in range(rank, 6, 2)]
                check_stream_headers(mine, {**base, "kv-dp-rank": str(rank)})
            pool_base = {
                "kv-source": "mooncake",
                "kv-tenant": "default",
                "kv-salt": "",
                "kv-dp-rank": "0",
            }
            check_stream(
                pools, [ATTACHED, *(("data", i) for i in range(6))], "mooncake-0", pool_base
            )
            assert all("kv-model" not in headers_of(r) for r in pools)
    finally:
        for p in (*ranks, pool):
            await p.close()


def check_stream_headers(records: list[Any], base: dict[str, str]) -> None:
    for r in records:
        h = headers_of(r)
        assert {k: h[k] for k in base} == base
        extra = set(h) - set(base)
        assert extra in ({"kv-seq"}, {"kv-control", "kv-control-reason", "kv-control-kind"}), extra


def rfc_body(pub: FakePublisher, instance: str, **kw: Any) -> dict[str, Any]:
    """A Mooncake RFC #1403 registration body."""
    body: dict[str, Any] = {
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint or "",
        "type": "vLLM",
        "modelname": "m",
        "lora_name": None,
        "tenant_id": "default",
        "instance_id": instance,
        "block_size": 4,
        "dp_rank": 0,
        "additionalsalt": "",
    }
    body.update(kw)
    return body


async def test_registrations_survive_a_bridge_restart(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    pub = FakePublisher(ctx)
    static = FakePublisher(ctx)
    cfg = bridge_config(kafka_bootstrap, (publisher(static, id="static-0"),))
    topic = cfg.kafka.engine_topic
    try:
        async with running_bridge(cfg) as bridge:
            port = bridge.http_port
            assert port is not None
            code, answer = await http_json(port, "POST", "/register", rfc_body(pub, "vllm-reg"))
            assert (code, answer) == (
                200,
                {"status": "registered successfully", "instance_id": "vllm-reg"},
            )
            bad = [
                rfc_body(pub, "x", type="Ollama"),
                rfc_body(pub, "x", modelname=None),
                rfc_body(pub, "x", endpoint="tcp://*:5557"),
                {"instance_id": "x"},
            ]
            for body in bad:
                code, answer = await http_json(port, "POST", "/register", body)
                assert code == 400 and "error" in answer, answer
            code, _ = await http_json(port, "POST", "/register", rfc_body(static, "static-0"))
            assert code == 409
            await wait_for(lambda: ("vllm-reg", 0) in bridge.streams, 30, "registered stream")
            await pub.wait_subscribed()
            for i in range(3):
                await pub.publish(payload(i))
            await records_until(kafka_bootstrap, topic, 4)
            code, listing = await http_json(port, "GET", "/publishers")
            assert code == 200
            assert [s["id"] for s in listing["streams"]] == ["static-0", "vllm-reg"]
            assert listing["registrations"][0]["registration"]["modelname"] == "m"

        # Published while no bridge runs: only the publisher's replay buffer has them.
        for i in range(3, 6):
            await pub.publish(payload(i))

        async with running_bridge(cfg) as bridge:  # a restarted (or another) bridge
            await wait_for(lambda: ("vllm-reg", 0) in bridge.streams, 30, "registration reloaded")
            await pub.wait_subscribed()
            await pub.publish(payload(6))
            records = await records_until(kafka_bootstrap, topic, 12)
            port = bridge.http_port
            assert port is not None
            code, answer = await http_json(
                port, "POST", "/unregister", {"instance_id": "vllm-reg", "dp_rank": 0}
            )
            assert code == 200, answer
            assert answer["removed_instances"] == ["vllm-reg|default|0"]
            await wait_for(lambda: ("vllm-reg", 0) not in bridge.streams, 30, "unregistered")
            code, _ = await http_json(
                port, "POST", "/unregister", {"instance_id": "vllm-reg", "dp_rank": 0}
            )
            assert code == 404
            records = await records_until(kafka_bootstrap, topic, 13)
        check_stream(
            records,
            [
                ATTACHED,
                *(("data", i) for i in range(3)),
                ATTACHED,  # the new bridge cannot know what the old one relayed last
                *(("data", i) for i in range(7)),  # the publisher's history, then live
                ("resync", "publisher unregistered"),
            ],
            key="vllm-reg",
        )
    finally:
        await pub.close()
        await static.close()


async def test_failed_producer_recovers_without_duplicates(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    """Records written but never acknowledged (the producer then fails) are
    found on the topic by the recovery's read-back and not sent again."""
    from aiokafka.errors import KafkaError

    pub = FakePublisher(ctx)
    cfg = bridge_config(kafka_bootstrap, (publisher(pub),), registrations=False)
    topic = cfg.kafka.engine_topic
    try:
        async with running_bridge(cfg) as bridge:
            sink = bridge.sink
            await pub.wait_subscribed()
            for i in range(10):
                await pub.publish(payload(i))
            await wait_for(lambda: relayed(bridge) == 10, 20, "acks")
            delivered = sink._delivered
            sink._delivered = lambda *args: None  # type: ignore[method-assign]  # acks lost
            for i in range(10, 20):
                await pub.publish(payload(i))
            await records_until(kafka_bootstrap, topic, 21)
            assert bridge.budget.messages == 10
            sink._delivered = delivered  # type: ignore[method-assign]
            sink._fail(sink.generation, KafkaError("simulated producer failure"))
            await wait_for(lambda: bridge.budget.messages == 0, 30, "recovered")
            for i in range(20, 25):
                await pub.publish(payload(i))
            await wait_for(lambda: relayed(bridge) == 25, 20, "acks after recovery")
            records = await records_until(kafka_bootstrap, topic, 26)
            check_stream(records, [ATTACHED, *(("data", i) for i in range(25))])
            m = bridge.metrics.render().decode()
            assert metric(m, "kvconductor_bridge_producer_recoveries_total") == 1
            assert metric(m, "kvconductor_bridge_recovery_confirmed_total") == 10
    finally:
        await pub.close()


async def test_second_bridge_takes_over_registrations(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context
) -> None:
    pub = FakePublisher(ctx)
    first = bridge_config(kafka_bootstrap)
    k = first.kafka
    second = bridge_config(
        kafka_bootstrap,
        engine_topic=k.engine_topic,
        pool_topic=k.pool_topic,
        registrations_topic=first.bridge.registrations_topic,
        group_id=first.bridge.group_id,
    )
    key = ("vllm-ha", 0)
    try:
        async with running_bridge(first) as a, running_bridge(second) as b:
            ra, rb = a.registry, b.registry
            assert ra is not None and rb is not None
            await wait_for(
                lambda: bool(ra.owned and rb.owned and len(ra.owned | rb.owned) == 3),
                30,
                "the group split the registration partitions",
            )
            port = a.http_port
            assert port is not None
            code, _ = await http_json(port, "POST", "/register", rfc_body(pub, "vllm-ha"))
            assert code == 200

            def owners() -> list[Any]:
                return [x for x in (a, b) if key in x.streams]

            # Exactly one bridge relays it: the one the group gave its partition.
            await wait_for(lambda: len(owners()) == 1 and key in rb.log.catalog, 30, "one owner")
            await pub.wait_subscribed()
            for i in range(3):
                await pub.publish(payload(i))
            await records_until(kafka_bootstrap, k.engine_topic, 4)
            owner = owners()[0]
            other = b if owner is a else a
            assert key not in other.streams
            owner.stop()  # leaves the group: the other bridge takes the registration over
            await wait_for(lambda: key in other.streams, 30, "takeover")
            await pub.wait_subscribed()
            await asyncio.sleep(0.2)
            await pub.publish(payload(3))
            records = await records_until(kafka_bootstrap, k.engine_topic, 9)
        check_stream(
            records,
            [
                ATTACHED,
                *(("data", i) for i in range(3)),
                ATTACHED,
                *(("data", i) for i in range(4)),
            ],
            key="vllm-ha",
        )
    finally:
        await pub.close()
