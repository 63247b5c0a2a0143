"""Publishers: the engines and pool backends a bridge relays, as its
configuration (`[[publishers]]`) and registrations (`POST /register`, at
the bridge or the daemon) name them, and the ZMQ streams they open.

Pure: the bridge, the registration catalog and the daemon's registration
routes all build a publisher here, so each checks one definition.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from typing import Any, Literal, NamedTuple

import msgspec

from kvconductor import config as base
from kvconductor.config import ConfigError

Kind = Literal["engine", "pool"]
Source = Literal["vllm", "sglang", "trtllm", "mooncake"]
Offload = Literal["local", "pool"]
# vLLM's `kv_cache_report_mode`: whether the engine reports each block once
# ("incremental") or re-announces what it holds ("full"); its records carry
# it in the `kv-report-mode` header.
ReportMode = Literal["incremental", "full"]

ENGINE_SOURCES = frozenset({"vllm", "sglang", "trtllm"})
MAX_RANK = 1 << 16
MAX_BLOCK_SIZE = 1 << 20


class PublisherConfig(msgspec.Struct, frozen=True, kw_only=True):
    """One publisher: `dp_size` ZMQ sockets, rank `dp_rank + i` at port + i."""

    id: str
    endpoint: str
    kind: Kind = "engine"
    source: Source = "vllm"
    replay_endpoint: str | None = None
    zmq_topic: str = ""
    model: str | None = None
    block_size: int | None = None
    dp_rank: int = 0
    dp_size: int = 1
    tenant: str = "default"
    salt: str = ""
    lora_name: str | None = None
    offload: Offload = "local"
    report_mode: ReportMode | None = None

    @property
    def ranks(self) -> range:
        return range(self.dp_rank, self.dp_rank + self.dp_size)


class _RawPublisher(msgspec.Struct, frozen=True, kw_only=True):
    """The TOML shape: `kind` and `source` may be left out (derived)."""

    id: str
    endpoint: str
    kind: Kind | None = None
    source: Source | None = None
    replay_endpoint: str | None = None
    zmq_topic: str = ""
    model: str | None = None
    block_size: int | None = None
    dp_rank: int = 0
    dp_size: int = 1
    tenant: str = "default"
    salt: str = ""
    lora_name: str | None = None
    offload: Offload = "local"
    report_mode: ReportMode | None = None


_PUBLISHER_FIELDS = {f.name: f for f in msgspec.structs.fields(_RawPublisher)}
_REQUIRED = [n for n, f in _PUBLISHER_FIELDS.items() if f.required]


# ------------------------------------------------------------- endpoints


_TCP = re.compile(r"tcp://(?P<host>\[[^\]]+\]|[^:/\s]+):(?P<port>\d{1,5})")


def endpoint_for_rank(endpoint: str, offset: int) -> str:
    """The socket `offset` ranks after `endpoint`: tcp port + offset, or for
    ipc/inproc the `_dp<offset>` suffix vLLM uses (none for offset 0)."""
    if offset == 0:
        return endpoint
    match = _TCP.fullmatch(endpoint)
    if match is not None:
        return f"tcp://{match['host']}:{int(match['port']) + offset}"
    return f"{endpoint}_dp{offset}"


def _check_endpoint(value: str, span: int) -> str | None:
    """Why `value` cannot be connected to (None: fine)."""
    if value.startswith("tcp://"):
        match = _TCP.fullmatch(value)
        if match is None:
            return f"expected tcp://host:port, got {value!r}"
        port = int(match["port"])
        if not 1 <= port <= 65535 or port + span - 1 > 65535:
            return f"port out of range for {span} rank(s): {value!r}"
        if match["host"] == "*":
            # vLLM's own setting is this bind form; the bridge connects.
            return (
                f"{value!r} is the engine's bind address; give the address the engine "
                f"is reached at, tcp://<engine host>:{match['port']}"
            )
        return None
    if value.startswith(("ipc://", "inproc://")) and len(value.split("://", 1)[1]) > 0:
        return None
    return f"expected tcp://, ipc:// or inproc:// endpoint, got {value!r}"


# ------------------------------------------------------------ publishers


def publisher_from_mapping(raw: Mapping[str, Any], where: str) -> PublisherConfig:
    """A validated publisher from a TOML table or a registration; raises a
    one-line `ConfigError` starting with `where`."""
    values: dict[str, object] = {}
    for key, value in raw.items():
        f = _PUBLISHER_FIELDS.get(key)
        if f is None:
            hint = difflib.get_close_matches(key, list(_PUBLISHER_FIELDS), n=1)
            did = f" (did you mean {hint[0]}?)" if hint else ""
            raise ConfigError(f"{where} {key}: unknown key{did}")
        try:
            values[key] = base._parse(value, f.type, False, False)
        except base._BadValue as exc:
            raise ConfigError(f"{where} {key}: {exc}") from None
    for key in _REQUIRED:
        if key not in values:
            raise ConfigError(f"{where} {key}: required")
    p = _RawPublisher(**values)  # type: ignore[arg-type]

    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"{where} {key}: {why}")

    if not p.id.strip():
        raise fail("id", "must not be empty")
    if p.kind is None:
        kind: Kind = "pool" if p.source == "mooncake" else "engine"
    else:
        kind = p.kind
    source: Source = p.source or ("mooncake" if kind == "pool" else "vllm")
    if kind == "engine" and source not in ENGINE_SOURCES:
        raise fail("source", f"an engine publishes as vllm, sglang or trtllm, not {source}")
    if kind == "pool" and source != "mooncake":
        raise fail("source", f"a pool backend publishes as mooncake, not {source}")
    if kind == "engine":
        if not p.model:
            raise fail("model", "required for an engine (header kv-model)")
        if p.block_size is None:
            raise fail("block_size", "required for an engine (header kv-block-size)")
    elif p.offload != "local":
        raise fail("offload", "applies to engines only")
    elif p.report_mode is not None:
        raise fail("report_mode", "applies to engines only")
    if p.model is not None and not p.model.strip():
        raise fail("model", "must not be blank")
    if p.block_size is not None and not 1 <= p.block_size <= MAX_BLOCK_SIZE:
        raise fail("block_size", f"must be in [1, {MAX_BLOCK_SIZE}], got {p.block_size}")
    if not 0 <= p.dp_rank < MAX_RANK:
        raise fail("dp_rank", f"must be in [0, {MAX_RANK}), got {p.dp_rank}")
    if not 1 <= p.dp_size <= MAX_RANK - p.dp_rank:
        raise fail("dp_size", f"must be in [1, {MAX_RANK - p.dp_rank}], got {p.dp_size}")
    if not p.tenant.strip():
        raise fail("tenant", "must not be empty")
    for key in ("endpoint", "replay_endpoint"):
        value = getattr(p, key)
        if value is None:
            continue
        why = _check_endpoint(value, p.dp_size)
        if why is not None:
            raise fail(key, why)
    return PublisherConfig(
        id=p.id,
        endpoint=p.endpoint,
        kind=kind,
        source=source,
        replay_endpoint=p.replay_endpoint,
        zmq_topic=p.zmq_topic,
        model=p.model,
        block_size=p.block_size,
        dp_rank=p.dp_rank,
        dp_size=p.dp_size,
        tenant=p.tenant,
        salt=p.salt,
        lora_name=p.lora_name,
        offload=p.offload,
        report_mode=p.report_mode,
    )


class StreamKey(NamedTuple):
    """One ZMQ socket of a publisher: its id and dp rank."""

    id: str
    rank: int

    def __str__(self) -> str:
        return f"{self.id}/{self.rank}"
