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
        h["kv-model"] = pub.model
    if pub.block_size is not None:
        h["kv-block-size"] = str(pub.block_size)
    h["kv-source"] = pub.source
    h["kv-tenant"] = pub.tenant
    h["kv-salt"] = pub.salt
    h["kv-dp-rank"] = str(rank)
    if pub.kind == "engine":
        h["kv-offload"] = pub.offload
    return [(k, v.encode()) for k, v in h.items()]


def data_entry(pub: PublisherConfig, rank: int, seq: int, payload: bytes) -> Entry:
    headers = [*base_headers(pub, rank), ("kv-seq", str(seq).encode())]
    key = pub.id.encode()
    return Entry(key, payload, headers, seq, len(payload) + len(key) + 64)


def resync_entry(pub: PublisherConfig, rank: int, kind: str, reason: str) -> Entry:
    headers = [
        ("kv-control", b"resync"),
        ("kv-control-reason", reason.encode()),
        ("kv-control-kind", kind.encode()),
        *base_headers(pub, rank),
    ]
    key = pub.id.encode()
    return Entry(key, b"", headers, None, len(key) + len(reason) + 64)
