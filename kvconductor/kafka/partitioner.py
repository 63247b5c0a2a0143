"""Kafka's default partitioner, for records whose partition we choose ourselves."""

from __future__ import annotations

from aiokafka.partitioner import murmur2


def default_partition(key: bytes, partitions: int) -> int:
    """The partition of `partitions` (numbered 0 to n-1, as Kafka numbers a
    topic's) that Kafka's default partitioner gives a keyed record: murmur2,
    as Java clients compute it, so every producer agrees."""
    return (int(murmur2(key)) & 0x7FFFFFFF) % partitions
