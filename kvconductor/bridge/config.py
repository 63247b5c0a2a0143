"""Bridge configuration: `[kafka]`, `[bridge]`, `[log]` and `[[publishers]]`.

    cfg = load_bridge_config(Path("config/bridge.toml"))

Same rules as the daemon's configuration (`kvconductor.config`): defaults <
the TOML file < `KVCONDUCTOR_<SECTION>_<KEY>` env vars for the `kafka`,
`bridge` and `log` sections; unknown sections or keys, wrong types and
out-of-range values raise a one-line `ConfigError` naming the key. `[kafka]`
is the daemon's own `KafkaConfig`, parsed and validated by the daemon's
helpers, so one env file can serve both processes. `[bridge]` follows the
daemon's `[http]` rule: a non-loopback `host` needs an `auth_token` unless
`allow_unauthenticated = true`.

Publishers come from `[[publishers]]` tables (not from the environment) and
at run time from `POST /register`; both go through `publisher_from_mapping`.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Literal

import msgspec
from aiokafka import codec

from kvconductor import config as base
from kvconductor.config import (
    Config,
    ConfigError,
    KafkaConfig,
    LogConfig,
    Secret,
)
from kvconductor.registry.publishers import (
    PublisherConfig,
    publisher_from_mapping,
)

Compression = Literal["none", "gzip", "snappy", "lz4", "zstd"]
# Whether aiokafka can compress (and its consumers decompress) with each:
# gzip is Python's own; the others need the cramjam package.
CODECS: dict[str, Callable[[], bool]] = {
    "none": lambda: True,
    "gzip": codec.has_gzip,
    "snappy": codec.has_snappy,
    "lz4": codec.has_lz4,
    "zstd": codec.has_zstd,
}


class BridgeSettings(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8788
    auth_token: Secret | None = None
    auth_token_file: str | None = None
    # Serve /register and friends without a token on a non-loopback address
    # (like [http] allow_unauthenticated); docs/bridge.md spells out the risk.
    allow_unauthenticated: bool = False
    client_id: str = "kvconductor-bridge"
    group_id: str = "kvconductor-bridge"
    registrations: bool = True
    registrations_topic: str = "kv-bridge-registrations"
    buffer_max_messages: int = 100_000
    buffer_max_bytes: int = 128 * 1024 * 1024
    replay_timeout_s: float = 5.0
    idle_probe_s: float = 5.0
    zmq_rcvhwm: int = 100_000
    linger_ms: int = 5
    max_request_size: int = 1024 * 1024
    batch_size: int = 512 * 1024
    compression_type: Compression = "none"
    flush_timeout_s: float = 10.0


class BridgeConfig(msgspec.Struct, frozen=True, kw_only=True):
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    bridge: BridgeSettings = msgspec.field(default_factory=BridgeSettings)
    log: LogConfig = msgspec.field(default_factory=LogConfig)
    publishers: tuple[PublisherConfig, ...] = ()

    def topic_for(self, pub: PublisherConfig) -> str:
        return self.kafka.engine_topic if pub.kind == "engine" else self.kafka.pool_topic


SECTIONS: dict[str, type[msgspec.Struct]] = {
    "kafka": KafkaConfig,
    "bridge": BridgeSettings,
    "log": LogConfig,
}
PUBLISHERS = "publishers"
SECRET_FILES: dict[tuple[str, str], str] = {
    **{k: v for k, v in base.SECRET_FILES.items() if k[0] == "kafka"},
    ("bridge", "auth_token"): "auth_token_file",
}
# ---------------------------------------------------------------- loading


def load_bridge_config(path: Path | None, env: Mapping[str, str] = os.environ) -> BridgeConfig:
    """Defaults, then the TOML file at `path` (if any), then env overrides."""
    values, src, arrays = base.read_sections(
        path, env, SECTIONS, SECRET_FILES, arrays=(PUBLISHERS,)
    )
    tables = arrays.get(PUBLISHERS, [])
    file_source = str(path) if path is not None else ""

    kafka = KafkaConfig(**values["kafka"])  # type: ignore[arg-type]
    log = LogConfig(**values["log"])  # type: ignore[arg-type]
    settings = BridgeSettings(**values["bridge"])  # type: ignore[arg-type]
    # The daemon's checks of [kafka] (servers, topics, security), unchanged.
    base._validate(Config(kafka=kafka, log=log), src)
    _validate_settings(settings, kafka, src)

    publishers: list[PublisherConfig] = []
    seen: dict[tuple[str, int], str] = {}
    for i, table in enumerate(tables, 1):
        label = table.get("id") if isinstance(table.get("id"), str) else None
        where = f"[[{PUBLISHERS}]] #{i}" + (f" ({label})" if label else "")
        try:
            pub = publisher_from_mapping(table, where)
        except ConfigError as exc:
            text = str(exc).removeprefix("config error: ")
            raise ConfigError(f"{text} (from {file_source})") from None
        for rank in pub.ranks:
            other = seen.get((pub.id, rank))
            if other is not None:
                raise ConfigError(
                    f"{where} dp_rank: {pub.id!r} rank {rank} is also in {other} "
                    f"(from {file_source})"
                )
            seen[(pub.id, rank)] = where
        publishers.append(pub)
    return BridgeConfig(kafka=kafka, bridge=settings, log=log, publishers=tuple(publishers))


def _validate_settings(
    b: BridgeSettings, kafka: KafkaConfig, src: Callable[[str, str], str]
) -> None:
    def fail(key: str, why: str) -> ConfigError:
        return ConfigError(f"[bridge] {key}: {why} (from {src('bridge', key)})")

    if not b.host.strip():
        raise fail("host", "must not be empty")
    if not 0 <= b.port <= 65535:
        raise fail("port", f"must be in [0, 65535], got {b.port}")
    # The daemon's rule for its query API ([http] in kvconductor.config): open
    # on loopback, a token anywhere else unless explicitly opted out, since
    # whoever reaches the port can register publishers (inject events).
    if b.auth_token is not None:
        token = b.auth_token.reveal()
        if not token.strip():
            raise fail("auth_token", "must not be blank")
        # It travels in a header: visible ASCII only, as RFC 6750's b64token.
        if not all("!" <= c <= "~" for c in token):
            raise fail("auth_token", "may hold only visible ASCII characters, no spaces")
        if b.allow_unauthenticated:
            raise fail("allow_unauthenticated", "set, but auth_token is set too")
    elif not base.is_loopback(b.host) and not b.allow_unauthenticated:
        raise ConfigError(
            f"[bridge] auth_token: required (or auth_token_file) when [bridge] host is not a "
            f"loopback address, got {b.host!r} from {src('bridge', 'host')}; or set "
            "[bridge] allow_unauthenticated = true to let anyone who can reach the port "
            "register publishers"
        )
    for key in ("client_id", "group_id"):
        if not getattr(b, key).strip():
            raise fail(key, "must not be empty")
    topic = b.registrations_topic
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,249}", topic) or topic in (".", ".."):
        raise fail("registrations_topic", f"not a valid Kafka topic name: {topic!r}")
    for key in ("engine_topic", "pool_topic", "snapshot_topic", "dead_letter_topic"):
        if topic == getattr(kafka, key):
            raise fail("registrations_topic", f"must differ from [kafka] {key} ({topic!r})")
    if b.buffer_max_messages < 1:
        raise fail("buffer_max_messages", f"must be at least 1, got {b.buffer_max_messages}")
    if b.buffer_max_bytes < 64 * 1024:
        raise fail("buffer_max_bytes", f"must be at least 65536, got {b.buffer_max_bytes}")
    if not b.replay_timeout_s > 0:
        raise fail("replay_timeout_s", f"must be positive, got {b.replay_timeout_s}")
    if b.idle_probe_s < 0:
        raise fail("idle_probe_s", f"must be at least 0 (0: off), got {b.idle_probe_s}")
    if not b.flush_timeout_s > 0:
        raise fail("flush_timeout_s", f"must be positive, got {b.flush_timeout_s}")
    if b.zmq_rcvhwm < 0:
        raise fail("zmq_rcvhwm", f"must be at least 0 (0: unlimited), got {b.zmq_rcvhwm}")
    if not 0 <= b.linger_ms <= 10_000:
        raise fail("linger_ms", f"must be in [0, 10000], got {b.linger_ms}")
    if b.max_request_size < 1024:
        raise fail("max_request_size", f"must be at least 1024, got {b.max_request_size}")
    if not 1024 <= b.batch_size <= b.max_request_size:
        raise fail(
            "batch_size",
            f"must be in [1024, max_request_size ({b.max_request_size})], got {b.batch_size}",
        )
    if not CODECS[b.compression_type]():
        raise fail(
            "compression_type",
            f"{b.compression_type} needs the cramjam package, not installed "
            f"(pip install 'aiokafka[{b.compression_type}]')",
        )
