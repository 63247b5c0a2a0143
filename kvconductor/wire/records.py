"""Kafka record metadata: the headers of contract sections 2 and 3."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from kvconductor.wire.errors import InvalidHeader, MissingHeader

Headers = Iterable[tuple[str, bytes]]


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
    action = h.get("kv-control")
    if action is None:
        return None
    if action not in CONTROL_ACTIONS:
        raise InvalidHeader(f"header kv-control must be one of {sorted(CONTROL_ACTIONS)}")
    return ControlMeta(
        action,
        _int(h, "kv-dp-rank", 0, _MAX_RANK),
        h.get("kv-control-reason", ""),
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
        if not name.startswith("kv-"):
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
    model = _name(h, "kv-model")
    if not model:
        raise MissingHeader("required header kv-model is missing")
    block_size = _int(h, "kv-block-size", 1, _MAX_BLOCK_SIZE)
    if block_size is None:
        raise MissingHeader("required header kv-block-size is missing")
    source = h.get("kv-source", "vllm").lower() or "vllm"
    if source not in SOURCES:
        raise InvalidHeader(f"header kv-source must be one of {sorted(SOURCES)}: {source!r}")
    offload = h.get("kv-offload", "local").lower() or "local"
    if offload not in OFFLOAD_MODES:
        raise InvalidHeader(f"header kv-offload must be local or pool: {offload!r}")
    return EngineMeta(
        model=model,
        block_size=block_size,
        source=source,
        seq=_int(h, "kv-seq", 0, _MAX_SEQ),
        tenant=_name(h, "kv-tenant") or "default",
        salt=_name(h, "kv-salt") or "",
        dp_rank=_int(h, "kv-dp-rank", 0, _MAX_RANK) or 0,
        offload_pool=offload == "pool",
    )


def pool_meta(h: HeaderMap) -> PoolMeta:
    return PoolMeta(
        model=_name(h, "kv-model") or None,
        block_size=_int(h, "kv-block-size", 1, _MAX_BLOCK_SIZE),
        tenant=_name(h, "kv-tenant") or "default",
        salt=_name(h, "kv-salt") or "",
        seq=_int(h, "kv-seq", 0, _MAX_SEQ),
    )
