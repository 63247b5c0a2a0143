"""Creating and checking the daemon's topics at start-up."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError


class TopicSpec(NamedTuple):
    name: str
    partitions: int
    replication_factor: int
    configs: Mapping[str, str]
    # Settings an existing topic must have (checked, never changed).
    required: Mapping[str, str]


class TopicError(RuntimeError):
    pass


async def ensure_topics(admin: AIOKafkaAdminClient, specs: Sequence[TopicSpec]) -> list[str]:
    """Create missing topics with their configs; check the existing ones.

    Returns the names created. Raises TopicError when an existing topic lacks
    a required setting (a snapshot topic that is not compacted would lose the
    index to retention)."""
    existing = set(await admin.list_topics())
    missing = [s for s in specs if s.name not in existing]
    created: list[str] = []
    if missing:
        new = [
            NewTopic(s.name, s.partitions, s.replication_factor, topic_configs=dict(s.configs))
            for s in missing
        ]
        try:
            response = await admin.create_topics(new)
        except TopicAlreadyExistsError:  # another daemon created them first
            response = None
        for name, code, message in _topic_errors(response):
            # 36: TOPIC_ALREADY_EXISTS, raced with another daemon.
            if code not in (0, 36):
                raise TopicError(f"cannot create topic {name}: error {code} {message or ''}")
        created = [s.name for s in missing]
    to_check = [s for s in specs if s.required and s.name in existing]
    if to_check:
        await _check_configs(admin, to_check)
    return created


def _topic_errors(response: Any) -> list[tuple[str, int, str | None]]:
    if response is None:
        return []
    out: list[tuple[str, int, str | None]] = []
    for entry in getattr(response, "topic_errors", []):
        name, code = entry[0], entry[1]
        message = entry[2] if len(entry) > 2 else None
        out.append((name, code, message))
    return out


async def _check_configs(admin: AIOKafkaAdminClient, specs: Sequence[TopicSpec]) -> None:
    resources = [ConfigResource(ConfigResourceType.TOPIC, s.name) for s in specs]
    responses = await admin.describe_configs(resources)
    actual: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.resources:
            name = resource[3]
            actual[name] = {entry[0]: entry[1] for entry in resource[4]}
    for spec in specs:
        have = actual.get(spec.name, {})
        for key, want in spec.required.items():
            if have.get(key) != want:
                raise TopicError(
                    f"topic {spec.name} has {key}={have.get(key)!r}, needs {want!r}; "
                    f"fix it with kafka-configs.sh --alter --entity-type topics "
                    f"--entity-name {spec.name} --add-config {key}={want}"
                )


async def ensure_topics_on(
    bootstrap_servers: str,
    client_id: str,
    options: Mapping[str, object],
    specs: Sequence[TopicSpec],
) -> list[str]:
    """`ensure_topics` through an admin client of its own, closed afterwards."""
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap_servers, client_id=client_id, **options)
    await admin.start()
    try:
        return await ensure_topics(admin, specs)
    finally:
        await admin.close()
