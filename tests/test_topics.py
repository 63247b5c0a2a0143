"""Topic creation and checks at start-up: replication for one broker and for a
cluster, min.insync.replicas, the check of existing topics."""

from __future__ import annotations

import uuid

import pytest
import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

from kvconductor.config import load_config
from kvconductor.kafka.topics import (
    Replication,
    TopicError,
    TopicSpec,
    ensure_topics_on,
    replication_for,
    topic_specs,
)


def _spec(name: str, factor: int | None = None) -> TopicSpec:
    return TopicSpec(name, 1, factor, {}, {})


@pytest.mark.parametrize(
    ("brokers", "factor", "min_isr", "expected"),
    [
        (1, None, None, (1, 1)),
        (2, None, None, (2, 1)),
        (3, None, None, (3, 2)),
        (5, None, None, (3, 2)),
        (5, 2, None, (2, 1)),
        (3, None, 3, (3, 3)),
        (1, None, 2, (1, 1)),  # a single broker: never more in sync than replicas
    ],
)
def test_replication_defaults(
    brokers: int, factor: int | None, min_isr: int | None, expected: tuple[int, int]
) -> None:
    assert replication_for(_spec("t", factor), brokers, Replication(min_isr)) == expected


def test_every_topic_spec_follows_the_configured_replication() -> None:
    specs = topic_specs(load_config(None, {"KVCONDUCTOR_KAFKA_REPLICATION_FACTOR": "2"}))
    assert {s.replication_factor for s in specs} == {2}
    assert {s.replication_factor for s in topic_specs(load_config(None, {}))} == {None}


async def _topic_state(bootstrap: str, name: str) -> tuple[int, str]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        (topic,) = await admin.describe_topics([name])
        (response,) = await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, name)])
        configs = {e[0]: e[1] for e in response.resources[0][4]}
        return len(topic["partitions"][0]["replicas"]), configs["min.insync.replicas"]
    finally:
        await admin.close()


@pytest.mark.kafka
async def test_created_topics_get_the_clusters_replication(kafka_bootstrap: str) -> None:
    name = f"topics-{uuid.uuid4().hex[:8]}"
    created = await ensure_topics_on(kafka_bootstrap, "topics-test", {}, [_spec(name)])
    assert created == [name]
    # One broker: one replica, one in sync, set on the topic itself.
    assert await _topic_state(kafka_bootstrap, name) == (1, "1")
    assert await ensure_topics_on(kafka_bootstrap, "topics-test", {}, [_spec(name)]) == []


@pytest.mark.kafka
async def test_an_existing_topic_below_the_replication_warns_or_stops(
    kafka_bootstrap: str,
) -> None:
    name = f"topics-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka_bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, 1, 1)])
    finally:
        await admin.close()
    wants_two = [_spec(name, 2)]
    with structlog.testing.capture_logs() as logs:
        await ensure_topics_on(kafka_bootstrap, "topics-test", {}, wants_two)
    (line,) = [e for e in logs if e["event"] == "topic under-replicated"]
    assert line["log_level"] == "warning"
    assert f"topic {name} has 1 replica(s) per partition, wants 2" in line["problem"]
    with pytest.raises(TopicError, match=f"topic {name} has 1 replica"):
        await ensure_topics_on(
            kafka_bootstrap, "topics-test", {}, wants_two, Replication(check="error")
        )
    # The broker's default of one in sync is below what is asked for.
    with pytest.raises(TopicError, match=r"wants 2 .*; topic .* min.insync.replicas=1, wants 2"):
        await ensure_topics_on(
            kafka_bootstrap, "topics-test", {}, wants_two, Replication(2, "error")
        )
