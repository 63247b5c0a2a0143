"""Kafka record metadata: the headers of contract sections 2 and 3."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvconductor.wire.errors import InvalidHeader, MissingHeader

Headers = Iterable[tuple[str, bytes]]

# Header names, one spelling for every writer and reader. Contract sections
# 2 and 3:
KV_MODEL = "kv-model"
KV_BLOCK_SIZE = "kv-block-size"
KV_SOURCE = "kv-source"
KV_SEQ = "kv-seq"
KV_TENANT = "kv-tenant"
KV_SALT = "kv-salt"
KV_DP_RANK = "kv-dp-rank"
KV_OFFLOAD = "kv-offload"
KV_REPORT_MODE = "kv-report-mode"
# A bridge's control records (`ControlMeta`):
KV_CONTROL = "kv-control"
KV_CONTROL_REASON = "kv-control-reason"
KV_CONTROL_KIND = "kv-control-kind"
# Scale-out: what the repartition stage adds to the records it forwards, so
# that a dead letter names the input record it came from.
KV_KIND = "kv-kind"
KV_ORIGIN_KEY = "kv-origin-key"
KV_ORIGIN_TOPIC = "kv-origin-topic"
KV_ORIGIN_PARTITION = "kv-origin-partition"
KV_ORIGIN_OFFSET = "kv-origin-offset"
REPARTITION_HEADERS = frozenset(
    {KV_KIND, KV_ORIGIN_KEY, KV_ORIGIN_TOPIC, KV_ORIGIN_PARTITION, KV_ORIGIN_OFFSET}
)
KV_PREFIX = "kv-"


class Incoming(NamedTuple):
    """One Kafka record on its way in: `pool` for the pool topic's (and the
    repartitioned pool records), else an engine record."""

    pool: bool
    key: bytes | str | None
    headers: Headers
    value: bytes | None
    now: float  # the record's timestamp, in seconds


SOURCES = frozenset({"vllm", "sglang", "trtllm"})
OFFLOAD_MODES = frozenset({"local", "pool"})


class EngineMeta(NamedTuple):
    model: str
    block_size: int
    source: str
    seq: int | None
    tenant: str
    salt: str
    dp_rank: int
    offload_pool: bool


class ControlMeta(NamedTuple):
    """A bridge's control record on the engine topic (`kv-control` header).

    `resync`: the bridge lost messages it could not replay (publisher
    restarted, replay buffer overrun, no replay endpoint), so the instance's
    indexed state can no longer be trusted. `dp_rank` None means every rank."""

    action: str
    dp_rank: int | None
    reason: str


CONTROL_ACTIONS = frozenset({"resync"})


def control_meta(h: HeaderMap) -> ControlMeta | None:
    action = h.get(KV_CONTROL)
    if action is None:
        return None
    if action not in CONTROL_ACTIONS:
        raise InvalidHeader(f"header kv-control must be one of {sorted(CONTROL_ACTIONS)}")
    return ControlMeta(
        action,
        _int(h, KV_DP_RANK, 0, _MAX_RANK),
        h.get(KV_CONTROL_REASON, ""),
    )


class PoolMeta(NamedTuple):
    """Namespace defaults for pool events that leave a field out."""

    model: str | None
    block_size: int | None
    tenant: str
    salt: str
    seq: int | None


HeaderMap = dict[str, str]


def header_map(headers: Headers) -> HeaderMap:
    """The record's `kv-*` headers as text, decoded once per record."""
    out: dict[str, str] = {}
    for name, value in headers:
        if not name.startswith(KV_PREFIX):
            continue
        try:
            out[name] = value.decode("utf-8") if value is not None else ""
        except UnicodeDecodeError as exc:
            raise InvalidHeader(f"header {name} is not valid UTF-8") from exc
    return out


def _int(h: dict[str, str], name: str, lo: int, hi: int) -> int | None:
    raw = h.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = int(raw, 10)
    except ValueError as exc:
        raise InvalidHeader(f"header {name} is not a decimal integer: {raw[:40]!r}") from exc
    if not lo <= value <= hi:
        raise InvalidHeader(f"header {name} is out of range [{lo}, {hi}]: {value}")
    return value


_MAX_BLOCK_SIZE = 1 << 20
_MAX_RANK = 1 << 16
_MAX_SEQ = (1 << 64) - 1
# Characters in a name the index keeps (model, tenant, salt, LoRA, medium,
# backend): real ones are short; a 1 MB one would be kept per namespace.
MAX_NAME = 1024


def _name(h: HeaderMap, name: str) -> str | None:
    value = h.get(name)
    if value is not None and len(value) > MAX_NAME:
        raise InvalidHeader(f"header {name} is longer than {MAX_NAME} characters")
    return value


def engine_meta(h: HeaderMap) -> EngineMeta:
    model = _name(h, KV_MODEL)
    if not model:
        raise MissingHeader("required header kv-model is missing")
    block_size = _int(h, KV_BLOCK_SIZE, 1, _MAX_BLOCK_SIZE)
    if block_size is None:
        raise MissingHeader("required header kv-block-size is missing")
    source = h.get(KV_SOURCE, "vllm").lower() or "vllm"
    if source not in SOURCES:
        raise InvalidHeader(f"header kv-source must be one of {sorted(SOURCES)}: {source!r}")
    offload = h.get(KV_OFFLOAD, "local").lower() or "local"
    if offload not in OFFLOAD_MODES:
        raise InvalidHeader(f"header kv-offload must be local or pool: {offload!r}")
    return EngineMeta(
        model=model,
        block_size=block_size,
        source=source,
        seq=_int(h, KV_SEQ, 0, _MAX_SEQ),
        tenant=_name(h, KV_TENANT) or "default",
        salt=_name(h, KV_SALT) or "",
        dp_rank=_int(h, KV_DP_RANK, 0, _MAX_RANK) or 0,
        offload_pool=offload == "pool",
    )


def pool_meta(h: HeaderMap) -> PoolMeta:
    return PoolMeta(
        model=_name(h, KV_MODEL) or None,
        block_size=_int(h, KV_BLOCK_SIZE, 1, _MAX_BLOCK_SIZE),
        tenant=_name(h, KV_TENANT) or "default",
        salt=_name(h, KV_SALT) or "",
        seq=_int(h, KV_SEQ, 0, _MAX_SEQ),
    )
