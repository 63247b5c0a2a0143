"""Creating and checking the daemon's topics at start-up."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

import structlog
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType
from aiokafka.errors import TopicAlreadyExistsError

from kvconductor.config import Config, KafkaConfig
from kvconductor.kafka.access import check_access
from kvconductor.kafka.clients import LiveAdminClient
from kvconductor.lifecycle import FatalError

log = structlog.get_logger("kvconductor.topics")

MIN_ISR = "min.insync.replicas"
# A replicated cluster's usual factor: one broker down leaves two copies.
DEFAULT_MAX_REPLICATION = 3

# What a compacted topic (snapshots, the bridge's registrations) is created
# with: dirty segments cleaned soon, so a restore reads little beyond the
# latest value of each key.
COMPACTED = {
    "cleanup.policy": "compact",
    "min.cleanable.dirty.ratio": "0.1",
    "segment.ms": str(10 * 60 * 1000),
}


class TopicSpec(NamedTuple):
    name: str
    partitions: int
    # None: min(3, brokers in the cluster).
    replication_factor: int | None
    configs: Mapping[str, str]
    # Settings an existing topic must have (checked, never changed).
    required: Mapping[str, str]


def compacted_spec(name: str, partitions: int, replication_factor: int | None) -> TopicSpec:
    return TopicSpec(name, partitions, replication_factor, COMPACTED, {"cleanup.policy": "compact"})


def event_topic_specs(k: KafkaConfig) -> list[TopicSpec]:
    """The engine and pool topics: the bridge writes them, the daemon reads them."""
    return [
        TopicSpec(k.engine_topic, k.partitions, k.replication_factor, {}, {}),
        TopicSpec(k.pool_topic, k.partitions, k.replication_factor, {}, {}),
    ]


def topic_specs(cfg: Config) -> list[TopicSpec]:
    """Every topic the daemon reads or writes."""
    k = cfg.kafka
    internal = (
        [TopicSpec(k.repartition_topic, k.partitions, k.replication_factor, {}, {})]
        if k.repartition
        else []
    )
    registrations = cfg.http.registrations_topic
    if registrations:
        # Keyed by instance rank: compaction keeps each one's last registration.
        internal.append(compacted_spec(registrations, k.partitions, k.replication_factor))
    return [
        *internal,
        *event_topic_specs(k),
        TopicSpec(k.dead_letter_topic, 1, k.replication_factor, {}, {}),
        compacted_spec(k.snapshot_topic, 1, k.replication_factor),
    ]


class Replication(NamedTuple):
    """How the topics kvconductor creates are replicated, and what an
    existing topic below that gets: a warning line or a `TopicError`."""

    min_insync_replicas: int | None = None  # None: replication factor - 1, at least 1
    check: Literal["warn", "error"] = "warn"

    @classmethod
    def of(cls, kafka: KafkaConfig) -> Replication:
        return cls(kafka.min_insync_replicas, kafka.topic_check)


DEFAULT_REPLICATION = Replication()


class TopicError(RuntimeError):
    pass


def replication_for(spec: TopicSpec, brokers: int, replication: Replication) -> tuple[int, int]:
    """(replication factor, min in-sync replicas) the spec asks for on a
    cluster of `brokers`."""
    factor = spec.replication_factor or max(1, min(DEFAULT_MAX_REPLICATION, brokers))
    min_isr = replication.min_insync_replicas or max(1, factor - 1)
    return factor, min(min_isr, factor)


async def ensure_topics(
    admin: AIOKafkaAdminClient,
    specs: Sequence[TopicSpec],
    replication: Replication = DEFAULT_REPLICATION,
) -> list[str]:
    """Create missing topics with their configs and replication; check the
    existing ones.

    Returns the names created. Raises TopicError when an existing topic lacks
    a required setting (a snapshot topic that is not compacted would lose the
    index to retention), or, with `replication.check` "error", has fewer
    replicas or a lower `min.insync.replicas` than asked for (else a warning)."""
    brokers = len((await admin.describe_cluster()).get("brokers") or [])
    existing = set(await admin.list_topics())
    missing = [s for s in specs if s.name not in existing]
    created: list[str] = []
    if missing:
        new = []
        for s in missing:
            factor, min_isr = replication_for(s, brokers, replication)
            configs = {MIN_ISR: str(min_isr), **s.configs}
            new.append(NewTopic(s.name, s.partitions, factor, topic_configs=configs))
        try:
            response = await admin.create_topics(new)
        except TopicAlreadyExistsError:  # another daemon created them first
            response = None
        raced = set()
        for name, code, message in _topic_errors(response):
            # 36: TOPIC_ALREADY_EXISTS: raced with another daemon, or the
            # broker that listed the topics had not learnt them yet.
            if code == 36:
                raced.add(name)
            elif code:
                raise TopicError(f"cannot create topic {name}: error {code} {message or ''}")
        created = [s.name for s in missing if response is not None and s.name not in raced]
    present = [s for s in specs if s.name in existing]
    if present:
        actual = await _configs(admin, present)
        for spec in present:
            _check_required(spec, actual.get(spec.name, {}))
        replicas = await _replica_counts(admin, [s.name for s in present])
        for spec in present:
            problem = _replication_problem(
                spec, brokers, replication, replicas.get(spec.name), actual.get(spec.name, {})
            )
            if problem is None:
                continue
            if replication.check == "error":
                raise TopicError(problem)
            log.warning("topic under-replicated", topic=spec.name, problem=problem)
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


async def _configs(
    admin: AIOKafkaAdminClient, specs: Sequence[TopicSpec]
) -> dict[str, dict[str, str]]:
    resources = [ConfigResource(ConfigResourceType.TOPIC, s.name) for s in specs]
    responses = await admin.describe_configs(resources)
    actual: dict[str, dict[str, str]] = {}
    for response in responses:
        for resource in response.resources:
            actual[resource[3]] = {entry[0]: entry[1] for entry in resource[4]}
    return actual


def _check_required(spec: TopicSpec, have: Mapping[str, str]) -> None:
    for key, want in spec.required.items():
        if have.get(key) != want:
            raise TopicError(
                f"topic {spec.name} has {key}={have.get(key)!r}, needs {want!r}; "
                f"fix it with kafka-configs.sh --alter --entity-type topics "
                f"--entity-name {spec.name} --add-config {key}={want}"
            )


async def _replica_counts(admin: AIOKafkaAdminClient, names: Sequence[str]) -> dict[str, int]:
    """Per topic, the fewest replicas any of its partitions has."""
    out: dict[str, int] = {}
    for topic in await admin.describe_topics(list(names)):
        counts = [len(p["replicas"]) for p in topic.get("partitions") or []]
        if counts:
            out[topic["topic"]] = min(counts)
    return out


def _replication_problem(
    spec: TopicSpec,
    brokers: int,
    replication: Replication,
    replicas: int | None,
    configs: Mapping[str, str],
) -> str | None:
    factor, min_isr = replication_for(spec, brokers, replication)
    problems = []
    if replicas is not None and replicas < factor:
        problems.append(
            f"topic {spec.name} has {replicas} replica(s) per partition, wants {factor} "
            f"(kafka.replication_factor, unset: min(3, brokers)); losing a broker can take "
            f"it offline: reassign it with kafka-reassign-partitions.sh"
        )
    have = configs.get(MIN_ISR)
    if have is not None and have.isdigit() and int(have) < min_isr:
        problems.append(
            f"topic {spec.name} has {MIN_ISR}={have}, wants {min_isr} "
            f"(kafka.min_insync_replicas, unset: replication factor - 1); fix it with "
            f"kafka-configs.sh --alter --entity-type topics --entity-name {spec.name} "
            f"--add-config {MIN_ISR}={min_isr}"
        )
    return "; ".join(problems) or None


async def ensure_topics_on(
    bootstrap_servers: str,
    client_id: str,
    options: Mapping[str, object],
    specs: Sequence[TopicSpec],
    replication: Replication = DEFAULT_REPLICATION,
) -> list[str]:
    """`ensure_topics` through an admin client of its own, closed afterwards."""
    admin = LiveAdminClient(bootstrap_servers=bootstrap_servers, client_id=client_id, **options)
    await admin.start()
    try:
        return await ensure_topics(admin, specs, replication)
    finally:
        await admin.close()


async def ensure_service_topics(
    k: KafkaConfig, client_id: str, options: Mapping[str, Any], specs: Sequence[TopicSpec]
) -> None:
    """A service's start-up: its access checked (a refused login or
    certificate stops it), its topics created or checked (a topic that cannot
    serve stops it with one line)."""
    await check_access(k)
    try:
        created = await ensure_topics_on(
            k.bootstrap_servers, client_id, options, specs, Replication.of(k)
        )
    except TopicError as exc:
        raise FatalError(str(exc)) from exc
    if created:
        log.info("topics created", topics=created)
