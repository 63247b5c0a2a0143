"""Publishing a generation does not stop records from being applied, and the
generation is still exactly the index at its offsets.

In process: an applier takes the lock between the publisher's slices, so
units change while they are being exported; every generation, restored
from the topic, equals an uninterrupted run over the records before its
cut, also after failed transactions and abandoned captures.

On the broker: the daemon's transaction is held open after its cut while
more records arrive; they are applied and answered meanwhile, and the
generation, once committed, restores to the index as it was at the cut and
to a run over the records below its offsets.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.errors import KafkaError

from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.kafka.topics import ensure_topics_on, topic_specs
from kvconductor.snapshots import store as snapshot_store
from kvconductor.snapshots.store import SnapshotPublisher, read_snapshot
from kvconductor.snapshots.units import UnitKey, restore, state_fingerprint
from tests.harness import (
    daemon_config,
    engine_headers,
    http_json,
    produce,
    running,
    stored,
    vllm_payload,
    wait_for,
)
from tests.streams import (
    end_offsets,
    fingerprint_diff,
    mixed_stream,
    oracle_from_kafka,
    read_topics,
)
from tests.test_replica import FakeTxnProducer

EVENTS = TopicPartition("events", 0)


class FlakyProducer(FakeTxnProducer):
    """Aborts the transactions it is told to, after their records went out."""

    def __init__(self) -> None:
        super().__init__()
        self.fail = False

    @contextlib.asynccontextmanager
    async def transaction(self) -> AsyncIterator[None]:
        async with super().transaction():
            yield
            if self.fail:
                self.fail = False
                raise KafkaError("injected: the transaction is aborted")


def table(producer: FakeTxnProducer) -> dict[UnitKey, Any]:
    return {k: u for k, u in producer.units().items() if u is not None}


# Tight: retired content is forgotten all the time, by count and by age,
# between a generation's cut and the reading of its identities.
TIGHT = IndexLimits(max_retired_content=1, max_pending_age_s=2.0)


@pytest.mark.parametrize(("seed", "limits"), [(1, None), (2, None), (3, TIGHT)])
async def test_generations_captured_while_records_apply_are_exact(
    seed: int, limits: IndexLimits | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One unit a slice and no cheap final round: the most interleaving.
    monkeypatch.setattr(snapshot_store, "SLICE_S", 0.0)
    monkeypatch.setattr(snapshot_store, "FINAL_S", 0.0)
    engine, pool = mixed_stream(seed, 2500)
    rng = random.Random(seed)
    records = [("e", r) for r in engine] + [("p", r) for r in pool]
    rng.shuffle(records)
    live = Conductor(limits)
    lock = asyncio.Lock()
    offsets = {EVENTS: 0}
    during = 0  # records applied while a publish was under way
    publishing = False

    def ingest(conductor: Conductor, i: int) -> None:
        kind, (key, value, headers) = records[i]
        apply = conductor.ingest_engine_record if kind == "e" else conductor.ingest_pool_record
        apply(key.encode(), headers, value, 1.0 + i * 0.01)

    async def applier() -> None:
        nonlocal during
        while offsets[EVENTS] < len(records):
            async with lock:
                for _ in range(rng.randint(1, 4)):
                    if offsets[EVENTS] < len(records):
                        ingest(live, offsets[EVENTS])
                        offsets[EVENTS] += 1
                        during += publishing
            await asyncio.sleep(0)

    producer = FlakyProducer()
    publisher = SnapshotPublisher(producer, "snapshots", "group")
    task = asyncio.create_task(applier())
    generations = failed = abandoned = rounds = attempts = 0
    # After a failed or abandoned generation, the next one holds the applier
    # off: only the marks given back can bring the units the lost one took.
    quiet = False
    while True:
        last = task.done()
        publishing = True
        if generations % 4 == 3 and not (last or quiet):
            # Abandoned before its cut, as a hand-over does: one step in, it
            # has taken the marks and is copying.
            attempt = asyncio.create_task(publisher.publish(live, offsets, lock=lock))
            for _ in range(rng.randint(1, 3)):
                await asyncio.sleep(0)
            if not publisher.sending and not attempt.done():
                attempt.cancel()
                abandoned += 1
                quiet = True
            with contextlib.suppress(asyncio.CancelledError):
                await attempt
        # Failures follow a schedule of their own: drawn from `rng`, they
        # would move with the applier's batch sizes and so with timing.
        attempts += 1
        producer.fail = attempts % 5 == 2 and not (last or quiet)
        try:
            if quiet:
                async with lock:
                    stats = await publisher.publish(live, offsets)
            else:
                stats = await publisher.publish(live, offsets, lock=lock)
        except KafkaError:
            failed += 1
            quiet = True
            continue
        finally:
            publishing = False
        quiet = False
        generations += 1
        rounds += stats.rounds
        cut = stats.offsets[EVENTS]
        want = Conductor(limits)
        for i in range(cut):
            ingest(want, i)
        fresh = Index(limits)
        restore(fresh, table(producer))
        diff = fingerprint_diff(state_fingerprint(fresh), state_fingerprint(want.snapshot_state()))
        assert diff == [], (generations, cut, diff[:5])
        if last:
            break
    assert offsets[EVENTS] == len(records)
    assert during > 0 and rounds > 0
    assert generations > 5 and failed > 0 and abandoned > 0


class Gate:
    """Holds the transaction of every generation whose cut is at or past
    `after` open, just before its offsets commit, until let through; records
    the index at every cut, by generation, in `cuts`."""

    def __init__(
        self,
        publisher: SnapshotPublisher,
        after: dict[TopicPartition, int],
        monkeypatch: pytest.MonkeyPatch,
    ) -> None:
        self.held: list[dict[TopicPartition, int]] = []  # their cuts, in order
        self.cuts: dict[int, dict[UnitKey, bytes]] = {}
        self.opened = False
        self._permits = asyncio.Semaphore(0)
        real = publisher.producer.send_offsets_to_transaction

        async def send_offsets(offsets: dict[TopicPartition, int], group_id: str) -> None:
            if not self.opened and all(offsets.get(tp, 0) >= o for tp, o in after.items()):
                self.held.append(dict(offsets))
                await self._permits.acquire()
            await real(offsets, group_id)

        monkeypatch.setattr(publisher.producer, "send_offsets_to_transaction", send_offsets)
        publisher.observe_cut = self._observe

    def _observe(
        self, conductor: Conductor, generation: int, offsets: dict[TopicPartition, int]
    ) -> None:
        self.cuts[generation] = state_fingerprint(conductor.snapshot_state())

    def let_one_through(self) -> None:
        self._permits.release()

    def open(self) -> None:
        self.opened = True
        for _ in self.held:
            self._permits.release()


async def answers_gpu(port: int, instance: str, hashes: list[int]) -> bool:
    body = {"model": "late", "block_size": 4, "seq_hashes": hashes, "instance_id": instance}
    status, answer = await http_json(port, "POST", "/query_by_hash", body)
    assert status == 200, answer
    return any(
        fig.get("GPU", 0) >= 4 * len(hashes) for per in answer.values() for fig in per.values()
    )


@pytest.mark.kafka
async def test_records_apply_while_a_generation_is_sent_and_it_restores_exactly(
    kafka_bootstrap: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshot_store, "SLICE_S", 0.0005)  # many slices
    cfg = daemon_config(kafka_bootstrap, KVCONDUCTOR_SNAPSHOT_INTERVAL_S="1.0")
    k = cfg.kafka
    # Records first: the daemon applies them all at start, and the held
    # generation is the first to cover them all.
    await ensure_topics_on(kafka_bootstrap, "precopy-setup", {}, topic_specs(cfg))
    engine, pool = mixed_stream(5, 3000)
    await produce(kafka_bootstrap, k.engine_topic, engine)
    await produce(kafka_bootstrap, k.pool_topic, pool)
    first = await end_offsets(kafka_bootstrap, [k.engine_topic, k.pool_topic])
    async with running(cfg) as daemon:
        await wait_for(lambda: daemon.publisher is not None, 60, "snapshot producer")
        publisher = daemon.publisher
        assert publisher is not None
        gate = Gate(publisher, first, monkeypatch)
        await wait_for(lambda: bool(gate.held), 120, "a generation in its transaction")
        generation = publisher.generation + 1
        cut = gate.held[0]
        # Its transaction is open: records go on being applied and answered.
        hashes = [9001 + i for i in range(20)]
        late = [
            (
                "late-0",
                vllm_payload([stored([h], [i, 1, 2, 3], parent=h - 1 if i else None)]),
                engine_headers("late"),
            )
            for i, h in enumerate(hashes)
        ]
        await produce(kafka_bootstrap, k.engine_topic, late)
        ends = await end_offsets(kafka_bootstrap, [k.engine_topic, k.pool_topic])
        events, port = daemon.events, daemon.http_port
        assert events is not None and port is not None
        await wait_for(
            lambda: all(events.applied_offsets.get(tp, 0) >= o for tp, o in ends.items()),
            120,
            "the late records applied",
        )
        await wait_for(lambda: answers_gpu(port, "late-0", hashes), 60, "late blocks answered")
        assert publisher.generation < generation, "still in its transaction"
        assert sum(ends.values()) > sum(cut.values()), "the late records came after the cut"
        # Let that one generation commit; the next one (the late records)
        # stays open, so a read_committed reader stops at the one let through.
        gate.let_one_through()
        await wait_for(lambda: publisher.generation >= generation, 60, "committed")
        consumer = AIOKafkaConsumer(
            bootstrap_servers=kafka_bootstrap, group_id=None, isolation_level="read_committed"
        )
        await consumer.start()
        try:
            read = await read_snapshot(consumer, k.snapshot_topic)
        finally:
            await consumer.stop()
        gate.open()
    assert read.generation == generation
    assert read.offsets == cut
    fresh = Index()
    restore(fresh, read.units)
    got = state_fingerprint(fresh)
    assert fingerprint_diff(got, gate.cuts[generation]) == []
    below = [
        r
        for r in await read_topics(kafka_bootstrap, [k.engine_topic, k.pool_topic])
        if r.offset < cut.get(TopicPartition(r.topic, r.partition), 0)
    ]
    want = oracle_from_kafka(below, k.pool_topic)
    assert fingerprint_diff(got, state_fingerprint(want.snapshot_state())) == []
    assert not any(key[0] == "i" and key[1] == "late-0" for key in got)
