"""The Kafka records the bridge writes (contract sections 2 and 3).

One record per ZMQ message: key = instance or backend id, value = the payload
bytes untouched, headers from the publisher's configuration plus `kv-seq`.
A resync control record (`kv-control: resync`) has an empty value and the
same key and headers, minus `kv-seq`, plus `kv-control-reason` (what
happened, in words) and `kv-control-kind` (its label: `attached` on a normal
first attach, `restarted`, `no_replay`, `replay_failed`, `replay_overrun`,
`too_large`, `unregistered`), from which the daemon logs it at its level.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvconductor.registry.publishers import PublisherConfig
from kvconductor.wire.records import (
    KV_BLOCK_SIZE,
    KV_CONTROL,
    KV_CONTROL_KIND,
    KV_CONTROL_REASON,
    KV_DP_RANK,
    KV_MODEL,
    KV_OFFLOAD,
    KV_REPORT_MODE,
    KV_SALT,
    KV_SEQ,
    KV_SOURCE,
    KV_TENANT,
)

Headers = list[tuple[str, bytes]]


@dataclass(slots=True, eq=False)
class Entry:
    """A record waiting in a stream's buffer until Kafka acknowledges it."""

    key: bytes
    value: bytes
    headers: Headers
    seq: int | None  # None: a control record
    size: int
    enqueued: float = field(default_factory=time.monotonic)
    too_large: bool = False  # Kafka refused it for its size

    @property
    def control(self) -> bool:
        return self.seq is None


def base_headers(pub: PublisherConfig, rank: int) -> Headers:
    """The headers every record of this publisher's rank carries."""
    h: dict[str, str] = {}
    if pub.model is not None:
        h[KV_MODEL] = pub.model
    if pub.block_size is not None:
        h[KV_BLOCK_SIZE] = str(pub.block_size)
    h[KV_SOURCE] = pub.source
    h[KV_TENANT] = pub.tenant
    h[KV_SALT] = pub.salt
    h[KV_DP_RANK] = str(rank)
    if pub.kind == "engine":
        h[KV_OFFLOAD] = pub.offload
    if pub.report_mode is not None:
        h[KV_REPORT_MODE] = pub.report_mode
    return [(k, v.encode()) for k, v in h.items()]


def data_entry(pub: PublisherConfig, rank: int, seq: int, payload: bytes) -> Entry:
    headers = [*base_headers(pub, rank), (KV_SEQ, str(seq).encode())]
    key = pub.id.encode()
    return Entry(key, payload, headers, seq, len(payload) + len(key) + 64)


def resync_entry(pub: PublisherConfig, rank: int, kind: str, reason: str) -> Entry:
    headers = [
        (KV_CONTROL, b"resync"),
        (KV_CONTROL_REASON, reason.encode()),
        (KV_CONTROL_KIND, kind.encode()),
        *base_headers(pub, rank),
    ]
    key = pub.id.encode()
    return Entry(key, b"", headers, None, len(key) + len(reason) + 64)
