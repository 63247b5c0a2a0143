"""Prometheus metrics of one bridge, in its own registry.

Per stream (labels `publisher`, `dp_rank`): messages and bytes relayed,
gaps and the messages they missed, replays by outcome, messages replayed,
duplicates dropped, resync records by reason, malformed frames. Global:
buffer depth (records, bytes) and bound, backpressure pauses and time,
produce latency (read off ZMQ until acknowledged by Kafka), producer
recoveries, registrations, streams, Kafka availability.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kvconductor.obs.metrics import CONTENT_TYPE

__all__ = ["CONTENT_TYPE", "BridgeMetrics"]

# Read off ZMQ until Kafka acknowledges: milliseconds when healthy (linger,
# one round trip with acks=all), minutes during an outage.
PRODUCE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class BridgeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        stream = ["publisher", "dp_rank"]
        self.messages = Counter(
            "kvconductor_bridge_messages_relayed",
            "Publisher messages acknowledged by Kafka, per stream.",
            stream,
            registry=r,
        )
        self.bytes = Counter(
            "kvconductor_bridge_bytes_relayed",
            "Payload bytes acknowledged by Kafka, per stream.",
            stream,
            registry=r,
        )
        self.gaps = Counter(
            "kvconductor_bridge_gaps",
            "Jumps in a stream's sequence numbers.",
            stream,
            registry=r,
        )
        self.gap_messages = Counter(
            "kvconductor_bridge_gap_messages",
            "Messages missing by sequence number (sum of the gaps' sizes).",
            stream,
            registry=r,
        )
        self.replays = Counter(
            "kvconductor_bridge_replays",
            "Replay requests by outcome: filled, partial (the publisher's buffer had "
            "lost the start), empty, failed (timeout or bad frames).",
            [*stream, "outcome"],
            registry=r,
        )
        self.replayed = Counter(
            "kvconductor_bridge_replayed_messages",
            "Messages taken from replay replies (duplicates excluded).",
            stream,
            registry=r,
        )
        self.duplicates = Counter(
            "kvconductor_bridge_duplicates_dropped",
            "Messages dropped because their sequence number was already relayed.",
            stream,
            registry=r,
        )
        self.resyncs = Counter(
            "kvconductor_bridge_resyncs",
            "Resync records written, by reason: attached, restarted, no_replay, "
            "replay_overrun, replay_failed, too_large, unregistered.",
            [*stream, "reason"],
            registry=r,
        )
        self.unfillable = Counter(
            "kvconductor_bridge_unfillable_gaps",
            "Gaps that could not be filled (each leads to a resync record), by reason.",
            [*stream, "reason"],
            registry=r,
        )
        self.reconciles = Counter(
            "kvconductor_bridge_reconciles",
            "Key-list reconciliations against a pool master, by outcome: ok, failed "
            "(the master did not answer with its key list).",
            [*stream, "outcome"],
            registry=r,
        )
        self.reconciled_removed = Counter(
            "kvconductor_bridge_reconciled_removals",
            "Objects the master no longer lists but announced no removal of (evicted, "
            "or lost with a client's segment): written as removed events.",
            stream,
            registry=r,
        )
        self.malformed = Counter(
            "kvconductor_bridge_malformed_frames",
            "ZMQ messages in no known frame layout (dropped), by socket (live, replay).",
            [*stream, "socket"],
            registry=r,
        )
        self.buffer_messages = Gauge(
            "kvconductor_bridge_buffer_messages",
            "Records read off ZMQ and not yet acknowledged by Kafka.",
            registry=r,
        )
        self.buffer_bytes = Gauge(
            "kvconductor_bridge_buffer_bytes",
            "Bytes of the records in the buffer (payload, key and header allowance).",
            registry=r,
        )
        self.buffer_max_messages = Gauge(
            "kvconductor_bridge_buffer_max_messages", "The buffer's record bound.", registry=r
        )
        self.buffer_max_bytes = Gauge(
            "kvconductor_bridge_buffer_max_bytes", "The buffer's byte bound.", registry=r
        )
        self.buffer_full = Counter(
            "kvconductor_bridge_buffer_full",
            "Times a stream stopped reading ZMQ because the buffer was full.",
            registry=r,
        )
        self.backpressure_seconds = Gauge(
            "kvconductor_bridge_backpressure_seconds",
            "Total time streams waited for buffer space.",
            registry=r,
        )
        self.produce_latency = Histogram(
            "kvconductor_bridge_produce_latency_seconds",
            "From reading a message off ZMQ to Kafka's acknowledgement.",
            buckets=PRODUCE_BUCKETS,
            registry=r,
        )
        self.recoveries = Counter(
            "kvconductor_bridge_producer_recoveries",
            "Producer failures recovered by a new producer and a read-back of the topic.",
            registry=r,
        )
        self.recovered_confirmed = Counter(
            "kvconductor_bridge_recovery_confirmed",
            "Unacknowledged records a recovery found already on Kafka (not sent again).",
            registry=r,
        )
        self.kafka_up = Gauge(
            "kvconductor_bridge_kafka_up",
            "1 while the producer delivers, 0 while it waits for or recovers from Kafka.",
            registry=r,
        )
        self.streams = Gauge(
            "kvconductor_bridge_streams", "Streams (publisher sockets) being relayed.", registry=r
        )
        self.registrations = Gauge(
            "kvconductor_bridge_registrations",
            "Registrations on the registrations topic (all bridges).",
            registry=r,
        )
        self.http_requests = Counter(
            "kvconductor_bridge_http_requests",
            "HTTP requests by endpoint and status code.",
            ["endpoint", "code"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
