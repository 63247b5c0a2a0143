"""A fetched batch is applied in produce order across its partitions, and in
offset order within each (issue #5, produce-to-queryable latency).

The end-to-end behaviour (nothing lost, nothing applied twice, restores
equal to replays) is the Kafka tests'; here is the order itself.
"""

from __future__ import annotations

from aiokafka import TopicPartition
from aiokafka.structs import ConsumerRecord
from hypothesis import given
from hypothesis import strategies as st

from kvconductor.consumers.event_consumer import in_produce_order


def record(tp: TopicPartition, offset: int, ts: int) -> ConsumerRecord[bytes, bytes]:
    return ConsumerRecord(tp.topic, tp.partition, offset, ts, 0, b"k", b"v", None, 1, 1, [])


def test_partitions_interleave_by_timestamp() -> None:
    a, b = TopicPartition("events", 0), TopicPartition("events", 1)
    batch = {
        a: [record(a, 10, 100), record(a, 11, 300)],
        b: [record(b, 5, 200), record(b, 6, 400)],
    }
    got = [(tp.partition, r.offset) for tp, r in in_produce_order(batch)]
    assert got == [(0, 10), (1, 5), (0, 11), (1, 6)]


@given(
    st.lists(
        st.lists(st.integers(0, 50), max_size=8),  # timestamps, in any order
        max_size=5,
    )
)
def test_each_partition_keeps_its_offset_order(stamps: list[list[int]]) -> None:
    batch = {
        TopicPartition("events", p): [
            record(TopicPartition("events", p), 100 + i, ts) for i, ts in enumerate(tss)
        ]
        for p, tss in enumerate(stamps)
    }
    got = list(in_produce_order(batch))
    assert sorted((tp.partition, r.offset) for tp, r in got) == sorted(
        (tp.partition, r.offset) for tp, rs in batch.items() for r in rs
    )
    for tp in batch:
        offsets = [r.offset for t, r in got if t == tp]
        assert offsets == sorted(offsets)
