"""Several daemons in one group (scale-out mode) on the real broker: the union
of their states equals one daemon's, across a stop and restart mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator

import msgspec
import pytest
from aiokafka.errors import KafkaError

from kvconductor.config import Config
from kvconductor.consumers.routing import pool_routes
from kvconductor.index.conductor import Conductor
from kvconductor.service.daemon import Daemon
from kvconductor.snapshots.units import state_fingerprint
from tests.harness import (
    Record,
    daemon_config,
    engine_headers,
    pool_payload,
    produce,
    removed,
    stored,
    vllm_payload,
    wait_for,
)

pytestmark = pytest.mark.kafka

MODELS = [f"model-{i}" for i in range(6)]


def stream(seed: int, n: int) -> tuple[list[Record], list[Record]]:
    """Instances of six models, with offloads into one pool backend whose
    records mix namespaces (so the repartitioner splits them)."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(40) for _ in range(4 * 5)] for _ in range(5)]
    engine: list[Record] = []
    pool: list[Record] = []
    held: dict[str, list[int]] = {}
    mask = (1 << 64) - 1

    def h(model: str, tokens: list[int]) -> int:
        return hash((model, tuple(tokens))) & mask

    for _ in range(n):
        i = rng.randrange(12)
        inst, model = f"vllm-{i}", MODELS[i % len(MODELS)]
        p = rng.choice(prompts)
        k = rng.randrange(1, 6)
        hashes = [h(model, p[: 4 * (j + 1)]) for j in range(k)]
        r = rng.random()
        if r < 0.5:
            medium = rng.choice(["GPU", "GPU", "CPU"])
            engine.append(
                (
                    inst,
                    vllm_payload([stored(hashes, p[: 4 * k], medium=medium)]),
                    engine_headers(model),
                )
            )
            held.setdefault(inst, []).extend(hashes)
        elif r < 0.65 and held.get(inst):
            gone = rng.sample(held[inst], min(2, len(held[inst])))
            engine.append((inst, vllm_payload([removed(gone)]), engine_headers(model)))
        elif r < 0.8:
            engine.append(
                (
                    f"offloader-{model}",
                    vllm_payload([stored(hashes, p[: 4 * k], medium="CPU")]),
                    engine_headers(model, **{"kv-offload": "pool"}),
                )
            )
        else:
            other = rng.choice(MODELS)
            events = [
                {
                    "event_type": "stored",
                    "seq_hashes": hashes,
                    "medium": "cpu",
                    "model_name": model,
                    "block_size": 4,
                },
                {
                    "event_type": "stored",
                    "seq_hashes": [h(other, p[:4])],
                    "medium": "disk",
                    "model_name": other,
                    "block_size": 4,
                },
            ]
            pool.append(("mooncake-0", pool_payload(events), []))
    return engine, pool


def oracle_state(engine: list[Record], pool: list[Record]) -> dict[object, bytes]:
    c = Conductor()
    for key, value, headers in engine:
        c.ingest_engine_record(key, headers, value, 1.0)
    for key, value, headers in pool:
        c.ingest_pool_record(key, headers, value, 1.0)
    return state_fingerprint(c.snapshot_state())


def member(cfg: Config, name: str) -> Config:
    return msgspec.structs.replace(cfg, kafka=msgspec.structs.replace(cfg.kafka, client_id=name))


class Group:
    """Daemons sharing one group id, started and stopped one by one."""

    def __init__(self, cfg: Config) -> None:
        self.cfg = cfg
        self.daemons: dict[str, tuple[Daemon, asyncio.Task[None]]] = {}

    async def start(self, name: str) -> None:
        daemon = Daemon(member(self.cfg, name))
        self.daemons[name] = (daemon, asyncio.create_task(daemon.run()))
        await wait_for(lambda: daemon.status == "running", 60, f"{name} running")

    async def stop(self, name: str) -> None:
        daemon, task = self.daemons.pop(name)
        daemon.stop()
        await asyncio.wait_for(task, 60)

    def union(self) -> dict[object, bytes]:
        out: dict[object, bytes] = {}
        for daemon, _ in self.daemons.values():
            out.update(state_fingerprint(daemon.conductor.snapshot_state()))
        return out

    async def close(self) -> None:
        for name in list(self.daemons):
            await self.stop(name)


@contextlib.asynccontextmanager
async def group(cfg: Config) -> AsyncIterator[Group]:
    g = Group(cfg)
    try:
        yield g
    finally:
        await g.close()


def test_pool_records_spanning_namespaces_are_split_by_group() -> None:
    events = [
        {"event_type": "stored", "seq_hashes": [1], "model_name": "a", "block_size": 4},
        {"event_type": "removed", "seq_hashes": [2], "model_name": "b", "block_size": 4},
        {"event_type": "stored", "seq_hashes": [3], "model_name": "a", "block_size": 4},
    ]
    payload = pool_payload(events)
    routes = pool_routes([], payload)
    assert len(routes) == 2
    decoded = {k: msgspec.msgpack.decode(v) for k, v in routes}  # type: ignore[arg-type]
    assert sorted(len(v[1]) for v in decoded.values()) == [1, 2]
    one = pool_payload(events[:1])
    assert pool_routes([], one) == [(routes[0][0], one)]  # untouched when not split
    assert pool_routes([], b"\xc1")[0][0] == b""


@pytest.mark.parametrize("members", [2, 3])
async def test_daemons_share_partitions_and_union_equals_single_run(
    kafka_bootstrap: str, members: int
) -> None:
    cfg = daemon_config(
        kafka_bootstrap,
        KVCONDUCTOR_KAFKA_REPARTITION="true",
        KVCONDUCTOR_KAFKA_PARTITIONS="6",
    )
    engine, pool = stream(11 + members, 400)
    want = oracle_state(engine, pool)
    thirds_e = [len(engine) * i // 3 for i in range(4)]
    thirds_p = [len(pool) * i // 3 for i in range(4)]
    names = [f"daemon-{i}" for i in range(members)]
    async with group(cfg) as g:
        for name in names:
            await g.start(name)
        k = cfg.kafka
        await produce(kafka_bootstrap, k.engine_topic, engine[: thirds_e[1]])
        await produce(kafka_bootstrap, k.pool_topic, pool[: thirds_p[1]])
        await asyncio.sleep(2)
        await g.stop(names[-1])  # its partitions move to the others
        await produce(kafka_bootstrap, k.engine_topic, engine[thirds_e[1] : thirds_e[2]])
        await produce(kafka_bootstrap, k.pool_topic, pool[thirds_p[1] : thirds_p[2]])
        await asyncio.sleep(2)
        await g.start(names[-1])  # and some come back
        await produce(kafka_bootstrap, k.engine_topic, engine[thirds_e[2] :])
        await produce(kafka_bootstrap, k.pool_topic, pool[thirds_p[2] :])

        def converged() -> bool:
            ready = all(d.ready()[0] for d, _ in g.daemons.values())
            return ready and g.union() == want

        try:
            await wait_for(converged, 90, "union of the daemons equals one daemon's state")
        except AssertionError:
            got = g.union()
            diff = sorted(
                (k for k in got.keys() | want.keys() if got.get(k) != want.get(k)), key=repr
            )
            from kvconductor.snapshots.units import decode_unit

            detail = []
            for key in diff[:2]:
                a = decode_unit(got[key]) if key in got else None
                b = decode_unit(want[key]) if key in want else None
                ea = set(map(repr, getattr(a, "entries", []) + getattr(a, "retired", [])))
                eb = set(map(repr, getattr(b, "entries", []) + getattr(b, "retired", [])))
                detail.append((sorted(ea - eb)[:4], sorted(eb - ea)[:4]))
            raise AssertionError(f"{len(diff)} units differ, e.g. {diff[:5]} {detail}") from None
        owned = [set(d.conductor.snapshot_state().namespaces) for d, _ in g.daemons.values()]
        assert sum(len(o) for o in owned) == len(set().union(*owned))  # disjoint
        assert sum(1 for o in owned if o) >= 2  # the work is really shared


class GivenUp:
    """A transactional producer aiokafka gave up on (aio-libs/aiokafka#1151):
    every transaction fails."""

    def __init__(self) -> None:
        self.tried = self.stopped = False

    def transaction(self) -> None:
        self.tried = True
        raise KafkaError("the transaction manager gave up")

    async def stop(self) -> None:
        self.stopped = True


async def test_stage_one_renews_a_producer_aiokafka_gave_up_on(kafka_bootstrap: str) -> None:
    cfg = daemon_config(
        kafka_bootstrap,
        KVCONDUCTOR_KAFKA_REPARTITION="true",
        KVCONDUCTOR_KAFKA_PARTITIONS="3",
    )
    engine, pool = stream(21, 300)
    want = oracle_state(engine, pool)
    half_e, half_p = len(engine) // 2, len(pool) // 2
    k = cfg.kafka
    async with group(cfg) as g:
        await g.start("daemon-0")
        daemon, _ = g.daemons["daemon-0"]
        stage = daemon.repartitioner
        assert stage is not None
        await produce(kafka_bootstrap, k.engine_topic, engine[:half_e])
        await produce(kafka_bootstrap, k.pool_topic, pool[:half_p])
        # Swapped while stage one waits for records, not inside a transaction.
        await wait_for(lambda: stage.forwarded == half_e + half_p, 60, "first half forwarded")
        real, given_up = stage.producer, GivenUp()
        stage.producer = given_up  # type: ignore[assignment]
        await real.stop()
        await produce(kafka_bootstrap, k.engine_topic, engine[half_e:])
        await produce(kafka_bootstrap, k.pool_topic, pool[half_p:])
        await wait_for(
            lambda: daemon.ready()[0] and g.union() == want, 90, "the whole stream applied"
        )
        assert given_up.tried and given_up.stopped
        assert stage.producer is not given_up and stage.producer is not real
