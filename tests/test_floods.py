"""Floods (issue #7, item 4): the index's bounds hold whatever comes in.

Core floods drive `Index` directly with event Structs built up front (no
wire decoding), 10^6 events each: pool confirmations for hashes no engine
ever stored, instances announced once, namespaces announced once, and one
instance storing far past its capacity. Each checks that the configured
bound holds exactly, that the overflow counter counts exactly the excess,
and that a query after the flood answers exactly what it answered before
(the query's work does not grow with the flood: same answer, same walk).
Query latency before and after is printed (`-s`), never asserted.

One broker-level flood runs the same kinds of overflow through a real
`kvconductor run`: the bounds hold, the counters are on /metrics, and the
overflow should be in the log.

Floods of instances and namespaces are counted per record or event (one
announce each), pending and owner overflow per block.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any, NamedTuple

import aiohttp
import pytest
import pytest_asyncio

from kvconductor.config import KafkaConfig
from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.index.namespace import NamespaceKey
from kvconductor.index.pending import UNRESOLVED, WAITING
from kvconductor.tools.api_client import metric_by, metric_sum, parse_metrics
from kvconductor.tools.kafka_local.broker import free_ports
from kvconductor.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    PoolBatch,
    PoolEvent,
)
from kvconductor.wire.query import HashQuery, TokenQuery
from kvconductor.wire.records import EngineMeta, PoolMeta
from tests.harness import (
    Record,
    daemon_config,
    engine_headers,
    http_json,
    pool_payload,
    produce,
    stored,
    vllm_payload,
    wait_for,
)
from tests.test_write_errors import daemon_env, spawn_daemon, stop_daemon, wait_ready

FLOOD = 1_000_000
BATCH = 1_000  # hashes (or events) per record of a flood
BS = 4
KEY = NamespaceKey("default", "m", BS, None, "")
ENGINE = EngineMeta("m", BS, "vllm", None, "default", "", 0, False)
OFFLOAD = ENGINE._replace(offload_pool=True)
POOL = PoolMeta("m", BS, "default", "", None)

PROMPT = list(range(1, 65))  # 16 blocks
PROMPT_HASHES = [10_000 + i for i in range(16)]
QUERY = TokenQuery(model="m", block_size=BS, token_ids=PROMPT)
HIT = {"longest_matched": 64, "GPU": 64, "CPU": 64, "DISK": 64, "DP": {"0": 64}}
MISS = {"longest_matched": 0, "GPU": 0, "CPU": 0, "DISK": 0, "DP": {"0": 0}}
ANSWER = {"default": {"a": HIT}}
# Once `big` holds blocks of the namespace it is listed too (with zeros).
ANSWER_WITH_BIG = {"default": {"a": HIT, "big": MISS}}
# A second prompt, for what happens after a flood.
PROMPT2 = list(range(1_001, 1_065))
PROMPT2_HASHES = [20_000 + i for i in range(16)]
QUERY2 = TokenQuery(model="m", block_size=BS, token_ids=PROMPT2)
JUNK = 1 << 40  # flood hashes start here: no engine ever stores them


def engine(ix: Index, instance: str, event: Any, meta: EngineMeta = ENGINE) -> int:
    return ix.apply_engine(instance, meta, EngineBatch(1.0, [event], 0), 1.0)


def seeded(limits: IndexLimits | None = None) -> Index:
    """An index where instance `a` holds PROMPT on its GPU."""
    ix = Index(limits)
    engine(ix, "a", BlockStored(PROMPT_HASHES, None, PROMPT, BS))
    assert ix.query(QUERY) == ANSWER
    return ix


def query_us(ix: Index, req: TokenQuery | HashQuery = QUERY, n: int = 300) -> float:
    """Median time of one query, in microseconds."""
    times = []
    for _ in range(n):
        t = time.perf_counter()
        ix.query(req)
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


def report(
    flood: str, events: int, seconds: float, before: float, after: float, **bounds: int
) -> None:
    held = ", ".join(f"{k} {v:,}" for k, v in bounds.items())
    print(
        f"\nflood {flood}: {events:,} events in {seconds:.1f} s ({events / seconds:,.0f}/s); "
        f"query {before:.0f} us before, {after:.0f} us after; {held}"
    )


class Timer:
    def __enter__(self) -> Timer:
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started


# ------------------------------------------------------ pool confirmations


def test_confirmation_flood_keeps_pending_at_its_bound() -> None:
    ix = seeded()
    lim = ix.limits
    before = query_us(ix)
    with Timer() as t:
        for start in range(JUNK, JUNK + FLOOD, BATCH):
            confirm = PoolEvent("stored", list(range(start, start + BATCH)))
            ix.apply_pool("mc-0", POOL, PoolBatch(1.0, [confirm]), 1.0)
    ns = ix.namespaces[KEY]
    assert len(ns.pending) == ns.pending.by_kind[WAITING] == lim.max_pending
    assert ix.counters["pending_dropped_confirmation_count"] == FLOOD - lim.max_pending
    assert ix.query(QUERY) == ANSWER
    after = query_us(ix)
    report("pool confirmations", FLOOD, t.seconds, before, after, pending=len(ns.pending))

    # A real two-phase offload still joins while the queue is at its bound:
    # the pool confirms first, the engine's offload intent comes after.
    confirm = PoolEvent("stored", PROMPT2_HASHES)
    ix.apply_pool("mc-0", POOL, PoolBatch(1.0, [confirm]), 1.0)
    engine(ix, "b", BlockStored(PROMPT2_HASHES, None, PROMPT2, BS, medium="CPU"), OFFLOAD)
    hit = ix.query(QUERY2)["default"]["a"]
    assert (hit["GPU"], hit["CPU"]) == (0, 64)
    assert len(ns.pending) <= lim.max_pending

    # The age bound empties the queue of what never found its other half.
    waiting = len(ns.pending)
    ix.expire(1.0 + lim.max_pending_age_s + 1.0)
    assert len(ns.pending) == 0
    assert ix.counters["pending_dropped_confirmation_age"] == waiting
    assert ix.query(QUERY) == ANSWER


# --------------------------------------------------------------- instances


def announce_instances(ix: Index, count: int) -> None:
    """`count` instances that each announce themselves once (AllBlocksCleared,
    as engines do at start) and are never heard of again."""
    clear = EngineBatch(1.0, [AllBlocksCleared()], 0)
    for i in range(count):
        ix.apply_engine(f"flood-{i}", ENGINE, clear, 1.0)


def test_instance_flood_keeps_instances_at_their_bound() -> None:
    ix = seeded()
    lim = ix.limits
    before = query_us(ix)
    with Timer() as t:
        announce_instances(ix, FLOOD)
    assert len(ix.instances) == lim.max_instances
    # Today every announce beyond the bound is dropped (instance_limit_dropped);
    # an instance_limit_* counter for reclaimed ones would count here too.
    beyond = sum(n for kind, n in ix.counters.items() if kind.startswith("instance_limit_"))
    assert beyond == FLOOD - (lim.max_instances - 1)
    assert ix.query(QUERY) == ANSWER
    after = query_us(ix)
    report("instances", FLOOD, t.seconds, before, after, instances=len(ix.instances))
    # An instance known before the flood keeps indexing.
    engine(ix, "a", BlockStored(PROMPT2_HASHES, None, PROMPT2, BS))
    assert ix.query(QUERY2)["default"]["a"]["GPU"] == 64


def test_instance_flood_leaves_room_for_new_instances() -> None:
    ix = seeded(IndexLimits(max_instances=1_000))
    announce_instances(ix, 10_000)
    engine(ix, "new", BlockStored(PROMPT2_HASHES, None, PROMPT2, BS))
    assert ix.query(QUERY2).get("default", {}).get("new", {}).get("GPU") == 64


def test_owner_flood_in_one_namespace_keeps_owners_at_their_bound() -> None:
    ix = seeded(IndexLimits(max_owners_per_namespace=1_000))  # type: ignore[call-arg]
    flood = 20_000
    for i in range(flood):
        engine(ix, f"flood-{i}", BlockStored([JUNK + i], None, [i, 0, 0, 1], BS))
    ns = ix.namespaces[KEY]
    assert sum(len(ranks) for ranks in ns.owners.values()) == 1_000
    assert ix.counters["owner_limit_dropped"] == flood - 999
    assert ix.query(QUERY)["default"]["a"] == ANSWER["default"]["a"]


def test_ten_thousand_owners_fit_one_namespace_by_default() -> None:
    """Fleet scale (issue #22): 10,000 (instance, rank) owners in one
    namespace under the default bound, every answer still exact."""
    ix = seeded()
    for i in range(10_000):
        engine(ix, f"w{i:05d}", BlockStored([JUNK + i], None, [i, 0, 0, 1], BS))
    ns = ix.namespaces[KEY]
    assert sum(len(ranks) for ranks in ns.owners.values()) == 10_001
    assert not ix.counters["owner_limit_dropped"]
    answer = ix.query(QUERY)["default"]
    assert len(answer) == 10_001 and answer["a"] == HIT and answer["w09999"] == MISS
    assert json.loads(ix.query_json(QUERY)) == {"default": answer}
    one = TokenQuery(model="m", block_size=BS, token_ids=[9_999, 0, 0, 1], instance_id="w09999")
    hit = {"longest_matched": 4, "GPU": 4, "CPU": 4, "DISK": 4, "DP": {"0": 4}}
    assert ix.query(one) == {"default": {"w09999": hit}}
    assert json.loads(ix.query_json(one)) == ix.query(one)
    # An owner leaving and another joining re-lay the answer's shape.
    engine(ix, "w00000", BlockRemoved([JUNK]))
    engine(ix, "late", BlockStored([JUNK - 1], None, [7, 7, 7, 7], BS))
    after = json.loads(ix.query_json(QUERY))["default"]
    assert "w00000" not in after and after["late"] == MISS and len(after) == 10_001


# -------------------------------------------------------------- namespaces


def test_namespace_flood_keeps_namespaces_at_their_bound() -> None:
    ix = seeded()
    lim = ix.limits
    no_model = PoolMeta(None, BS, "default", "", None)
    before = query_us(ix)
    with Timer() as t:
        for start in range(0, FLOOD, BATCH):
            events = [
                PoolEvent("stored", [7], token_ids=[1, 2, 3, 4], model_name=f"flood-{i}")
                for i in range(start, start + BATCH)
            ]
            ix.apply_pool("mc-0", no_model, PoolBatch(1.0, events), 1.0)
    assert len(ix.namespaces) == lim.max_namespaces
    assert ix.counters["namespace_limit_dropped"] == FLOOD - (lim.max_namespaces - 1)
    assert ix.query(QUERY) == ANSWER
    after = query_us(ix)
    report("namespaces", FLOOD, t.seconds, before, after, namespaces=len(ix.namespaces))


def test_instance_namespace_set_stays_within_the_namespace_bound() -> None:
    ix = Index(IndexLimits(max_namespaces=64, max_pending_age_s=1.0))
    for i in range(20_000):
        # A token-less store in a namespace of its own waits for content that
        # never comes; once it ages out the namespace is empty and dropped.
        salted = ENGINE._replace(salt=f"s{i}")
        now = 10.0 * i
        ix.apply_engine("a", salted, EngineBatch(now, [BlockStored([JUNK + i])], 0), now)
        ix.expire(now + 5.0)
    assert len(ix.namespaces) <= 64
    # The namespaces it holds something in, and at most as many the index has
    # dropped since it last looked.
    assert len(ix.instances["a"].namespaces) <= 2 * 64


# ------------------------------------------------------- one owner, too much


class OwnerFlood(NamedTuple):
    ix: Index
    seconds: float
    before: float
    after: float


CAPACITY = FLOOD // 4
BIG = 1 << 41  # the flooding instance's hashes
LATE = 4242  # a confirmation another producer left waiting before the flood


@pytest.fixture(scope="module")
def owner_flood() -> OwnerFlood:
    """Instance `big` stores one chain of FLOOD blocks, in records of BATCH
    blocks (each record's parent the previous record's last block), four
    times its capacity."""
    ix = seeded(IndexLimits(max_blocks_per_owner=CAPACITY))
    ix.apply_pool("mc-0", POOL, PoolBatch(1.0, [PoolEvent("stored", [LATE])]), 1.0)
    before = query_us(ix)
    parent: int | None = None
    with Timer() as t:
        for start in range(0, FLOOD, BATCH):
            hashes = list(range(BIG + start, BIG + start + BATCH))
            tokens = list(range(start * BS, (start + BATCH) * BS))
            engine(ix, "big", BlockStored(hashes, parent, tokens, BS))
            parent = hashes[-1]
    return OwnerFlood(ix, t.seconds, before, query_us(ix))


def test_owner_flood_keeps_the_owner_at_its_capacity(owner_flood: OwnerFlood) -> None:
    ix = owner_flood.ix
    ns = ix.namespaces[KEY]
    big = ns.owners["big"][0]
    assert ns.store.owner_size(big.slot) == CAPACITY
    assert ix.query(QUERY) == ANSWER_WITH_BIG
    first = HashQuery(model="m", block_size=BS, seq_hashes=list(range(BIG, BIG + BATCH)))
    assert ix.query(first)["default"]["big"]["GPU"] == BATCH * BS
    report(
        "one owner past capacity",
        FLOOD,
        owner_flood.seconds,
        owner_flood.before,
        owner_flood.after,
        owner_blocks=ns.store.owner_size(big.slot),
        owner_capacity_dropped=ix.counters["owner_capacity_dropped"],
        pending=len(ns.pending),
    )


def test_owner_flood_counts_its_excess_and_spares_other_halves(owner_flood: OwnerFlood) -> None:
    ix = owner_flood.ix
    ns = ix.namespaces[KEY]
    assert ix.counters["owner_capacity_dropped"] == FLOOD - CAPACITY
    assert ns.pending.by_kind[UNRESOLVED] == 0
    assert LATE in ns.waiting


# ---------------------------------------------------------- through a broker


class BrokerFlood(NamedTuple):
    metrics: dict[str, Any]
    answer: Any
    logs: list[dict[str, Any]]
    exit_code: int


BROKER_LIMITS = {
    "KVCONDUCTOR_INDEX_MAX_PENDING": "1000",
    "KVCONDUCTOR_INDEX_MAX_NAMESPACES": "16",
    "KVCONDUCTOR_INDEX_MAX_INSTANCES": "100",
    "KVCONDUCTOR_INDEX_MAX_BLOCKS_PER_OWNER": "1000",
}
CONFIRMATIONS = 100_000  # in 10 records
NAMESPACE_EVENTS = 2_000  # in 1 record
ANNOUNCES = 1_000  # 1 record each
BIG_BLOCKS = 10_000  # in 5 records of fresh chains
# Overflow by counter kind (a prefix: instances beyond the bound may one day be
# reclaimed rather than dropped, see above), with the excess it must count.
OVERFLOW = {
    "pending_dropped_confirmation_count": CONFIRMATIONS - 1000,
    "namespace_limit_dropped": NAMESPACE_EVENTS - 15,
    "instance_limit_": ANNOUNCES - 98,
    "owner_capacity_dropped": BIG_BLOCKS - 1000,
}


async def query_ms(port: int, n: int = 50) -> float:
    """Median round trip of POST /query for PROMPT, in milliseconds."""
    body = {"model": "m", "block_size": BS, "token_ids": PROMPT}
    times = []
    async with aiohttp.ClientSession() as session:
        for _ in range(n):
            t = time.perf_counter()
            async with session.post(f"http://127.0.0.1:{port}/query", json=body) as resp:
                await resp.read()
            times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


async def consumed(port: int, k: KafkaConfig, engine_records: int, pool_records: int) -> bool:
    _, text = await http_json(port, "GET", "/metrics")
    by_topic = metric_by(parse_metrics(text), "kvconductor_records_consumed_total", "topic")
    return (by_topic.get(k.engine_topic, 0), by_topic.get(k.pool_topic, 0)) == (
        engine_records,
        pool_records,
    )


def seed_records() -> list[Record]:
    """Before the flood: `a` holds PROMPT; `big` stores 10x its capacity in
    fresh chains (so that its overflow is counted as such, see above)."""
    big = [
        stored(list(range(JUNK + s, JUNK + s + 2000)), list(range(s * BS, (s + 2000) * BS)))
        for s in range(0, BIG_BLOCKS, 2000)
    ]
    return [
        ("a", vllm_payload([stored(PROMPT_HASHES, PROMPT)]), engine_headers()),
        *(("big", vllm_payload([ev]), engine_headers()) for ev in big),
    ]


def pool_flood_records() -> list[Record]:
    """Confirmations of hashes nobody stored, then one record of namespaces."""
    confirm = [
        {"event_type": "stored", "seq_hashes": list(range(s, s + 10_000))}
        for s in range(BIG, BIG + CONFIRMATIONS, 10_000)
    ]
    namespaces = [
        {
            "event_type": "stored",
            "seq_hashes": [7],
            "token_ids": [1, 2, 3, 4],
            "model_name": f"f{i}",
        }
        for i in range(NAMESPACE_EVENTS)
    ]
    return [
        *(("mc-0", pool_payload([ev]), engine_headers()) for ev in confirm),
        ("mc-1", pool_payload(namespaces), engine_headers()),
    ]


def announce_records() -> list[Record]:
    clear = vllm_payload([{"type": "AllBlocksCleared"}])
    return [(f"flood-{i}", clear, engine_headers()) for i in range(ANNOUNCES)]


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def broker_flood(
    kafka_bootstrap: str, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[BrokerFlood]:
    cfg = daemon_config(kafka_bootstrap)
    k = cfg.kafka
    (port,) = free_ports(1)
    logs = tmp_path_factory.mktemp("broker-flood")
    seed, pool, announces = seed_records(), pool_flood_records(), announce_records()
    with (logs / "stdout").open("wb") as out, (logs / "stderr").open("wb") as err:
        proc = spawn_daemon(daemon_env(cfg, port, **BROKER_LIMITS), out, err)
        try:
            await wait_ready(proc, port)
            await produce(kafka_bootstrap, k.engine_topic, seed)
            await wait_for(lambda: consumed(port, k, len(seed), 0), 120, "the seed applied")
            before = await query_ms(port)
            await produce(kafka_bootstrap, k.pool_topic, pool)
            await produce(kafka_bootstrap, k.engine_topic, announces)
            engine_records = len(seed) + len(announces)
            await wait_for(
                lambda: consumed(port, k, engine_records, len(pool)), 120, "the flood applied"
            )
            after = await query_ms(port)
            _, text = await http_json(port, "GET", "/metrics")
            _, answer = await http_json(
                port, "POST", "/query", {"model": "m", "block_size": BS, "token_ids": PROMPT}
            )
        finally:
            code = await stop_daemon(proc)
    events = CONFIRMATIONS + NAMESPACE_EVENTS + ANNOUNCES + BIG_BLOCKS
    print(
        f"\nbroker flood: {events:,} events in {engine_records + len(pool):,} records; "
        f"POST /query {before:.1f} ms before, {after:.1f} ms after"
    )
    lines = (logs / "stdout").read_text().splitlines()
    logged = [json.loads(line) for line in lines if line.startswith("{")]
    yield BrokerFlood(parse_metrics(text), answer, logged, code)


@pytest.mark.kafka
async def test_broker_flood_holds_the_bounds_and_counts_on_metrics(
    broker_flood: BrokerFlood,
) -> None:
    m = broker_flood.metrics
    events = metric_by(m, "kvconductor_index_events_total", "kind")
    counted = {p: sum(n for k, n in events.items() if k.startswith(p)) for p in OVERFLOW}
    assert counted == OVERFLOW
    pending = metric_by(m, "kvconductor_pending", "kind")
    assert pending["waiting"] == 1000
    assert metric_sum(m, "kvconductor_namespaces") == 16
    assert metric_sum(m, "kvconductor_instances") == 100
    assert broker_flood.answer == ANSWER_WITH_BIG
    assert broker_flood.exit_code == 0


@pytest.mark.kafka
async def test_broker_flood_logs_each_overflow(broker_flood: BrokerFlood) -> None:
    warnings = [json.dumps(line) for line in broker_flood.logs if line.get("level") == "warning"]
    missing = [kind for kind in OVERFLOW if not any(kind in w for w in warnings)]
    assert not missing, f"no warning names {missing}"
