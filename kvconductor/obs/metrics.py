"""Prometheus metrics of one daemon, in its own registry.

Two kinds:

- read from the index at scrape time by `ConductorCollector` (nothing to
  keep in sync, and the index stays free of metrics code):
  `kvconductor_index_events_total{kind}` (the Conductor's `counters`: every
  skip, drop and notice by name), `kvconductor_blocks_applied_total{source,
  tier}`, `kvconductor_pending{kind}`, `kvconductor_namespaces`,
  `kvconductor_instances`;
- updated by the daemon layer through the attributes of `Metrics`: records
  consumed per topic, bad records and dead letters per reason kind, `kv-seq`
  gaps, consumer lag per partition, HTTP requests, and query latency.

Each `Metrics` owns a `CollectorRegistry`, so several daemons (tests) can live
in one process. Scrapes run on the event loop, like index updates, so the
collector reads a consistent index without locks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Mapping
from typing import NamedTuple, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvconductor.obs.logs import dropped_lines, kafka_log_lines


class IndexFigures(Protocol):
    """What a scrape reads of the index (`kvconductor.index.conductor.Conductor`);
    a Protocol, so that the bridge's metrics load no index."""

    @property
    def counters(self) -> Mapping[str, int]: ...

    @property
    def applied(self) -> Mapping[tuple[str, str], int]: ...

    @property
    def namespace_count(self) -> int: ...

    @property
    def instance_count(self) -> int: ...

    def pending(self) -> Mapping[str, int]: ...


# The text exposition format `generate_latest` writes (prometheus_client's
# CONTENT_TYPE_LATEST names a newer version in recent releases).
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Query latency: an in-memory lookup is tens of microseconds for short
# prompts and a few milliseconds for 100k-token ones (hashing dominates).
LATENCY_BUCKETS = (
    0.00005,
    0.0001,
    0.00025,
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
)

PENDING_KINDS = ("waiting", "unresolved", "intents", "retired")


class PartitionRow(NamedTuple):
    """One assigned partition, as the consumer sees it at scrape time."""

    topic: str
    partition: int
    fetch_age_s: float
    behind_s: float
    stale: bool


class PartitionCollector(Collector):
    """Per assigned partition, at scrape time: seconds since its leader
    last answered, seconds records have been waiting, and whether that
    makes the index stale (`/ready` 503)."""

    def __init__(self) -> None:
        self.source: Callable[[], Iterable[PartitionRow]] | None = None

    def describe(self) -> Iterable[Metric]:
        return self._families([])

    def collect(self) -> Iterable[Metric]:
        return self._families(self.source() if self.source is not None else [])

    @staticmethod
    def _families(rows: Iterable[PartitionRow]) -> list[Metric]:
        labels = ["topic", "partition"]
        age = GaugeMetricFamily(
            "kvconductor_partition_fetch_age_seconds",
            "Seconds since the partition's leader last answered a fetch.",
            labels=labels,
        )
        behind = GaugeMetricFamily(
            "kvconductor_partition_behind_seconds",
            "Seconds the partition's waiting records have waited (0: caught up).",
            labels=labels,
        )
        stale = GaugeMetricFamily(
            "kvconductor_partition_stale",
            "1 if the index is stale on the partition past kafka.stale_after_s, else 0.",
            labels=labels,
        )
        for row in rows:
            key = [row.topic, str(row.partition)]
            age.add_metric(key, row.fetch_age_s)
            behind.add_metric(key, row.behind_s)
            stale.add_metric(key, 1.0 if row.stale else 0.0)
        return [age, behind, stale]


class ConductorCollector(Collector):
    """Reads the index's counters and sizes on each scrape."""

    def __init__(self, conductor: IndexFigures | None = None) -> None:
        self.conductor = conductor

    def describe(self) -> Iterable[Metric]:
        return self._families()

    def collect(self) -> Iterable[Metric]:
        return self._families(self.conductor)

    @staticmethod
    def _families(conductor: IndexFigures | None = None) -> list[Metric]:
        events = CounterMetricFamily(
            "kvconductor_index_events",
            "Index events skipped, dropped or noticed, by kind (the Conductor's counters).",
            labels=["kind"],
        )
        applied = CounterMetricFamily(
            "kvconductor_blocks_applied",
            "Blocks applied to the index by source and tier (GPU, CPU, DISK, intent).",
            labels=["source", "tier"],
        )
        pending = GaugeMetricFamily(
            "kvconductor_pending",
            "Pending two-phase halves across namespaces, by kind.",
            labels=["kind"],
        )
        namespaces = GaugeMetricFamily(
            "kvconductor_namespaces", "Namespaces (tenant, model, block size, LoRA, salt) indexed."
        )
        instances = GaugeMetricFamily("kvconductor_instances", "Engine instances tracked.")
        dropped = CounterMetricFamily(
            "kvconductor_log_lines_dropped",
            "Log lines dropped: the log stream was full or stalled.",
            value=dropped_lines(),
        )
        kafka_lines = CounterMetricFamily(
            "kvconductor_kafka_client_log_lines",
            "Warnings and errors of the Kafka client library, by level (rate-limited in the log).",
            labels=["level"],
        )
        for level, n in sorted(kafka_log_lines().items()):
            kafka_lines.add_metric([level], n)
        if conductor is not None:
            for kind, n in sorted(conductor.counters.items()):
                events.add_metric([kind], n)
            for (source, tier), n in sorted(conductor.applied.items()):
                applied.add_metric([source, tier], n)
            by_kind = conductor.pending()
            for kind in sorted(set(PENDING_KINDS) | set(by_kind)):
                pending.add_metric([kind], by_kind.get(kind, 0))
            namespaces.add_metric([], conductor.namespace_count)
            instances.add_metric([], conductor.instance_count)
        return [events, applied, pending, namespaces, instances, dropped, kafka_lines]


class Metrics:
    """The daemon's metrics; `render()` gives the text exposition format."""

    def __init__(self, conductor: IndexFigures | None = None) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.collector = ConductorCollector(conductor)
        self.registry.register(self.collector)
        self.partitions = PartitionCollector()
        self.registry.register(self.partitions)
        r = self.registry
        self.records_consumed = Counter(
            "kvconductor_records_consumed",
            "Kafka records consumed, by topic.",
            ["topic"],
            registry=r,
        )
        self.bad_records = Counter(
            "kvconductor_bad_records",
            "Records that could not be applied, by topic and reason kind "
            "(undecodable, missing_header, invalid_header, rejected, ...).",
            ["topic", "kind"],
            registry=r,
        )
        self.dead_letters = Counter(
            "kvconductor_dead_letters",
            "Records published to the dead-letter topic, by reason kind.",
            ["kind"],
            registry=r,
        )
        self.dead_letter_failures = Counter(
            "kvconductor_dead_letter_failures",
            "Dead letters that could not be published.",
            registry=r,
        )
        self.seq_gaps = Counter(
            "kvconductor_seq_gaps",
            "Engine records that arrived after a gap in their kv-seq numbering.",
            registry=r,
        )
        self.seq_missing = Counter(
            "kvconductor_seq_missing",
            "Engine messages missing by kv-seq numbering (sum of the gaps' sizes).",
            registry=r,
        )
        self.consumer_lag = Gauge(
            "kvconductor_consumer_lag",
            "Records between the consumer's position and the partition's end.",
            ["topic", "partition"],
            registry=r,
        )
        self.http_requests = Counter(
            "kvconductor_http_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "code"],
            registry=r,
        )
        self.http_connections_refused = Counter(
            "kvconductor_http_connections_refused",
            "HTTP connections closed on arrival: [http] max_connections were open.",
            registry=r,
        )
        self.query_latency = Histogram(
            "kvconductor_query_latency_seconds",
            "Time to decode, answer and encode one query, by endpoint.",
            ["endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )

    def bind(self, conductor: IndexFigures) -> None:
        """Read from `conductor` from the next scrape on (e.g. after a restore)."""
        self.collector.conductor = conductor

    def observe_seq(self, missing: int) -> None:
        """Record one engine record's `Applied.seq_missing` (0: in order)."""
        if missing > 0:
            self.seq_gaps.inc()
            self.seq_missing.inc(missing)

    def set_lag(self, topic: str, partition: int, lag: int) -> None:
        self.consumer_lag.labels(topic, str(partition)).set(max(lag, 0))

    def forget_partition(self, topic: str, partition: int) -> None:
        """Drop a revoked partition's lag series."""
        with contextlib.suppress(KeyError):
            self.consumer_lag.remove(topic, str(partition))

    def render(self) -> bytes:
        return generate_latest(self.registry)
