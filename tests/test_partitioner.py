"""Our default partition is the one aiokafka's producer picks for the same key,
so the bridge's and the daemon's choices match what Kafka clients do."""

from __future__ import annotations

from aiokafka.partitioner import DefaultPartitioner
from hypothesis import given
from hypothesis import strategies as st

from kvconductor.kafka.partitioner import default_partition


@given(st.binary(max_size=64), st.integers(1, 64))
def test_default_partition_is_the_producers(key: bytes, partitions: int) -> None:
    every = list(range(partitions))
    assert default_partition(key, partitions) == DefaultPartitioner()(key, every, every)
