"""Daemon configuration: a TOML file, then `KVCONDUCTOR_<SECTION>_<KEY>` env vars.

    cfg = load_config(Path("config/kvconductor.toml"))      # or None: defaults
    consumer = AIOKafkaConsumer(..., **kafka_client_options(cfg.kafka))

Precedence: built-in defaults < the TOML file < the environment. Every key of
every section can be set by env var `KVCONDUCTOR_<SECTION>_<KEY>` (both upper
case, e.g. `KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS`); the value is parsed to the
key's type (ints in decimal, floats, booleans as true/false/1/0/yes/no/on/off,
choices case-insensitively). An empty value of an optional key (secrets,
TLS files) means unset, in the file as in the environment.

Strict on purpose: an unknown section or key (in the file, or an env var
that starts with `KVCONDUCTOR_<known section>_`), a wrong type or an
out-of-range value raises `ConfigError` whose message is one line naming the
key and where its value came from. A typo never passes silently.

Secrets (`sasl_password`, `ssl_password`, `auth_token`) are held as `Secret`,
whose repr and str are redacted, so printing or logging a `Config` shows no
secret; each can be read from a file instead through its `*_file` key
(trailing newline stripped). `Secret.reveal()` gives the value.
"""

from __future__ import annotations

import difflib
import ipaddress
import math
import os
import re
import tomllib
import types
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, NamedTuple, Union, get_args, get_origin

import msgspec

from kvconductor.index.limits import IndexLimits, limit_error
from kvconductor.kernel import KERNEL

ENV_PREFIX = "KVCONDUCTOR_"

SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"]
LogLevel = Literal["debug", "info", "warning", "error"]
LogFormat = Literal["auto", "json", "console"]
TopicCheck = Literal["warn", "error"]
FetchPath = Literal["auto", "aiokafka", "native"]


class ConfigError(ValueError):
    """A configuration problem; `str()` is one line naming the key."""

    def __init__(self, message: str) -> None:
        one_line = " ".join(message.split("\n"))
        super().__init__(f"config error: {one_line}")


class Secret:
    """A secret string that never shows itself in repr, str or f-strings."""

    __slots__ = ("_value",)

    def __init__(self, value: str) -> None:
        self._value = value

    def reveal(self) -> str:
        return self._value

    def __repr__(self) -> str:
        return "Secret('**********')"

    def __str__(self) -> str:
        return "**********"

    def __format__(self, spec: str) -> str:
        return "**********"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Secret) and other._value == self._value

    def __hash__(self) -> int:
        return hash((Secret, self._value))


def reveal(secret: Secret | None) -> str | None:
    """The value of an optional secret (None when unset)."""
    return None if secret is None else secret.reveal()


# ---------------------------------------------------------------- sections


class KafkaConfig(msgspec.Struct, frozen=True, kw_only=True):
    bootstrap_servers: str = "127.0.0.1:39092"
    engine_topic: str = "kv-events"
    pool_topic: str = "kv-pool-events"
    snapshot_topic: str = "kv-index-snapshots"
    dead_letter_topic: str = "kv-dead-letters"
    group_id: str = "kvconductor"
    client_id: str = "kvconductor"
    partitions: int = 6  # for topics the daemon creates
    # Unset: min(3, brokers in the cluster), and RF - 1 (at least 1) in sync.
    replication_factor: int | None = None
    min_insync_replicas: int | None = None
    # An existing topic below them: a warning line, or a stop.
    topic_check: TopicCheck = "warn"
    # Static group membership: a restart takes its partitions back at once
    # instead of waiting out the old member's session. Unset: client_id.
    static_membership: bool = True
    group_instance_id: str | None = None
    # Failover timeouts (docs/operations.md, "Failover and timeouts", has
    # the measurements and why): a frozen coordinator is replaced before the
    # session expires (request < broker fencing 9 s + session), a JoinGroup
    # outlasts the rebalance (request > session).
    session_timeout_ms: int = 10_000
    heartbeat_interval_ms: int = 3_000
    request_timeout_ms: int = 15_000
    metadata_max_age_ms: int = 30_000
    # A partition whose index is this far behind makes /ready 503.
    stale_after_s: float = 10.0
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism = "PLAIN"
    sasl_username: str | None = None
    sasl_password: Secret | None = None
    sasl_password_file: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    ssl_password: Secret | None = None
    ssl_password_file: str | None = None
    # The event consumer's fetches (docs/configuration.md has the measurements).
    fetch_max_records: int = 2000
    fetch_max_bytes: int = 50 * 1024 * 1024
    max_partition_fetch_bytes: int = 4 * 1024 * 1024
    fetch_min_bytes: int = 1
    fetch_max_wait_ms: int = 100
    # Who fetches the event topics: aiokafka's fetcher, or the daemon's own
    # requests read by the compiled kernel (kvconductor/consumers/fetcher.py); auto:
    # the daemon's own wherever the kernel is loaded.
    fetch_path: FetchPath = "auto"
    # Scale-out: several daemons in one group share the work by namespace.
    repartition: bool = False
    repartition_topic: str = "kv-index-input"

    @property
    def native_fetch(self) -> bool:
        """Whether the daemon fetches the event topics itself (`fetch_path`)."""
        return self.fetch_path == "native" or (self.fetch_path == "auto" and KERNEL is not None)


# 16 MiB: a JSON array of token ids costs at most 11 bytes a token (10 digits
# for a u32 and a comma), about 7 for real vocabularies (< 1M ids, 6 digits),
# so 16 MiB takes a 1M-token prompt with 2x headroom (1.5M tokens even at the
# worst case), and `seq_hashes` (<= 21 bytes each, one per block) far more.
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


# No honest client needs a minute to send one request's body.
DEFAULT_CLIENT_TIMEOUT_S = 60.0

# A router queries continuously, so a connection idle this long is gone; and
# no honest client needs a minute to send one request's headers. Longer than
# the idle timeouts of HTTP clients' pools (aiohttp's 15 s, httpx's 5 s), so
# that a client drops its idle connection before the daemon does and does not
# reuse one that the daemon is closing.
DEFAULT_IDLE_TIMEOUT_S = 60.0

# Routers keep a few pooled connections each: 512 is far more than a fleet's
# routers hold, and stays below the 1024 open files that systemd and many
# shells allow a process by default, with room for the Kafka connections and
# files (raise `ulimit -n` with it).
DEFAULT_MAX_CONNECTIONS = 512

# One TCP handshake per 10,000 queries is lost in the noise of the queries
# themselves, and long-lived connections still move across the replicas
# behind a load balancer.
DEFAULT_MAX_REQUESTS_PER_CONNECTION = 10_000


class HttpConfig(msgspec.Struct, frozen=True, kw_only=True):
    host: str = "127.0.0.1"
    port: int = 8787
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    client_timeout_s: float = DEFAULT_CLIENT_TIMEOUT_S
    idle_timeout_s: float = DEFAULT_IDLE_TIMEOUT_S
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_requests_per_connection: int = DEFAULT_MAX_REQUESTS_PER_CONNECTION
    auth_token: Secret | None = None
    auth_token_file: str | None = None
    # Serve without a token on a non-loopback address (a router that cannot
    # send one); docs/configuration.md spells out the risk.
    allow_unauthenticated: bool = False
    # Where `POST /register` at this address writes (the bridges' topic,
    # `bridge.registrations_topic`); empty: no registration here.
    registrations_topic: str = "kv-bridge-registrations"


def is_loopback(host: str) -> bool:
    """True when `host` (a listen address) is reachable from this machine only."""
    if host.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip().strip("[]")).is_loopback
    except ValueError:  # a host name: it may resolve to anything
        return False


class SnapshotConfig(msgspec.Struct, frozen=True, kw_only=True):
    interval_s: float = 10.0
    enabled: bool = True


class LogConfig(msgspec.Struct, frozen=True, kw_only=True):
    level: LogLevel = "info"
    format: LogFormat = "auto"


class Config(msgspec.Struct, frozen=True, kw_only=True):
    kafka: KafkaConfig = msgspec.field(default_factory=KafkaConfig)
    http: HttpConfig = msgspec.field(default_factory=HttpConfig)
    index: IndexLimits = msgspec.field(default_factory=IndexLimits)
    snapshot: SnapshotConfig = msgspec.field(default_factory=SnapshotConfig)
    log: LogConfig = msgspec.field(default_factory=LogConfig)


SECTIONS: dict[str, type[msgspec.Struct]] = {
    "kafka": KafkaConfig,
    "http": HttpConfig,
    "index": IndexLimits,
    "snapshot": SnapshotConfig,
    "log": LogConfig,
}

# secret key -> the key that reads it from a file
SECRET_FILES: dict[tuple[str, str], str] = {
    ("kafka", "sasl_password"): "sasl_password_file",
    ("kafka", "ssl_password"): "ssl_password_file",
    ("http", "auth_token"): "auth_token_file",
}


class KeyInfo(msgspec.Struct, frozen=True):
    """One configuration key, for docs and tooling."""

    section: str
    key: str
    type: str  # as documented: string, int, float, bool, or "A | B | C"
    default: object  # None: unset
    env: str
    optional: bool
    secret: bool


def env_var(section: str, key: str) -> str:
    """The env var that overrides `[section] key`."""
    return f"{ENV_PREFIX}{section}_{key}".upper()


def config_keys() -> list[KeyInfo]:
    """Every key of every section, in declaration order."""
    out: list[KeyInfo] = []
    for section, cls in SECTIONS.items():
        for f in msgspec.structs.fields(cls):
            base, optional = _unwrap_optional(f.type)
            default = None if f.default is msgspec.NODEFAULT else f.default
            out.append(
                KeyInfo(
                    section=section,
                    key=f.name,
                    type=_type_name(base),
                    default=default,
                    env=env_var(section, f.name),
                    optional=optional,
                    secret=base is Secret,
                )
            )
    return out


# ------------------------------------------------------------ type parsing


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    if get_origin(tp) in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(args) != len(get_args(tp)):
            return args[0], True
    return tp, False


def _type_name(tp: Any) -> str:
    if get_origin(tp) is Literal:
        return " | ".join(str(a) for a in get_args(tp))
    if tp is Secret or tp is str:
        return "string"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp)  # pragma: no cover - every key has one of the types above


_TRUE = frozenset({"true", "1", "yes", "on"})
_FALSE = frozenset({"false", "0", "no", "off"})


class _BadValue(Exception):
    pass


def _shown(value: object, secret: bool) -> str:
    if secret:
        return f"a {type(value).__name__} (value hidden)"
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    return text


def _to_float(value: object, from_env: bool) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)) or (from_env and isinstance(value, str)):
        try:
            return float(value)
        except (ValueError, OverflowError):
            return None
    return None


def _parse(value: object, tp: Any, from_env: bool, secret: bool) -> object:
    """`value` (a TOML value, or an env string) as type `tp`; raises _BadValue."""
    base, optional = _unwrap_optional(tp)
    if optional and value == "":
        return None
    got = _shown(value, secret)
    if get_origin(base) is Literal:
        choices: tuple[str, ...] = get_args(base)
        if isinstance(value, str):
            for choice in choices:
                if value.lower() == choice.lower():
                    return choice
        raise _BadValue(f"expected one of {', '.join(choices)}, got {got}")
    if base is bool:
        if isinstance(value, bool):
            return value
        if from_env and isinstance(value, str):
            low = value.strip().lower()
            if low in _TRUE:
                return True
            if low in _FALSE:
                return False
        raise _BadValue(f"expected bool, got {got}")
    if base is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if from_env and isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d[\d_]*\s*", value):
            try:
                return int(value)
            except ValueError:  # misplaced underscores
                pass
        raise _BadValue(f"expected int, got {got}")
    if base is float:
        out = _to_float(value, from_env)
        if out is None or not math.isfinite(out):
            raise _BadValue(f"expected float, got {got}")
        return out
    if base is str or base is Secret:
        if not isinstance(value, str):
            raise _BadValue(f"expected string, got {got}")
        return Secret(value) if base is Secret else value
    raise AssertionError(f"unsupported config type {tp!r}")  # pragma: no cover


# ----------------------------------------------------------------- loading


def _where(section: str, key: str | None = None) -> str:
    return f"[{section}]" if key is None else f"[{section}] {key}"


def _unknown_key(section: str, key: str, known: list[str], source: str) -> ConfigError:
    hint = difflib.get_close_matches(key, known, n=1)
    did = f" (did you mean {hint[0]}?)" if hint else ""
    return ConfigError(f"{_where(section, key)}: unknown key{did} (from {source})")


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {str(path)!r}: {exc.strerror}") from exc
    try:
        return tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid UTF-8") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {exc}") from exc


def _read_secret_file(section: str, key: str, path: str, source: str) -> Secret:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(
            f"{_where(section, key)}: cannot read {path!r}: {exc.strerror} (from {source})"
        ) from exc
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"{_where(section, key)}: {path!r} is not valid UTF-8 (from {source})"
        ) from exc
    value = text.rstrip("\r\n")
    if not value:
        raise ConfigError(f"{_where(section, key)}: {path!r} is empty (from {source})")
    return Secret(value)


class SectionValues(NamedTuple):
    """Parsed values per section and key, and where each came from."""

    values: dict[str, dict[str, object]]
    src: Callable[[str, str], str]
    # Arrays of tables allowed beside the sections (e.g. the bridge's
    # [[publishers]]), unparsed.
    arrays: dict[str, list[dict[str, Any]]]


def read_sections(
    path: Path | None,
    env: Mapping[str, str],
    sections: Mapping[str, type[msgspec.Struct]],
    secret_files: Mapping[tuple[str, str], str],
    arrays: Sequence[str] = (),
) -> SectionValues:
    """Defaults, then the TOML file at `path` (if any), then env overrides
    `KVCONDUCTOR_<SECTION>_<KEY>`, then secrets read from their *_file keys.
    Every problem is one ConfigError line naming the key and its source.
    Shared by every command's config (daemon, bridge)."""
    values: dict[str, dict[str, object]] = {s: {} for s in sections}
    sources: dict[tuple[str, str], str] = {}
    fields = {s: {f.name: f for f in msgspec.structs.fields(c)} for s, c in sections.items()}
    found: dict[str, list[dict[str, Any]]] = {}

    def put(section: str, key: str, value: object, from_env: bool, source: str) -> None:
        f = fields[section][key]
        secret = (section, key) in secret_files
        try:
            parsed = _parse(value, f.type, from_env, secret)
        except _BadValue as exc:
            raise ConfigError(f"{_where(section, key)}: {exc} (from {source})") from None
        values[section][key] = parsed
        sources[(section, key)] = source

    if path is not None:
        doc = _read_toml(path)
        source = str(path)
        for section, table in doc.items():
            if section in arrays:
                if not isinstance(table, list) or not all(isinstance(t, dict) for t in table):
                    raise ConfigError(f"[[{section}]]: expected an array of tables (from {source})")
                found[section] = table
                continue
            if section not in sections and not isinstance(table, dict):
                raise ConfigError(
                    f"{section}: unknown top-level key, keys belong in a [section] (from {source})"
                )
            if section not in sections:
                hint = difflib.get_close_matches(section, [*sections, *arrays], n=1)
                did = f" (did you mean [{hint[0]}]?)" if hint else ""
                raise ConfigError(f"[{section}]: unknown section{did} (from {source})")
            if not isinstance(table, dict):
                raise ConfigError(
                    f"[{section}]: expected a table, got {_shown(table, False)} (from {source})"
                )
            for key, value in table.items():
                if key not in fields[section]:
                    raise _unknown_key(section, key, list(fields[section]), source)
                put(section, key, value, False, source)

    for name in sorted(env):
        upper = name.upper()
        if not upper.startswith(ENV_PREFIX):
            continue
        rest = upper[len(ENV_PREFIX) :]
        for section in sections:
            if rest.startswith(section.upper() + "_"):
                key = rest[len(section) + 1 :].lower()
                if key not in fields[section]:
                    raise _unknown_key(section, key, list(fields[section]), name)
                put(section, key, env[name], True, name)
                break

    def src(section: str, key: str) -> str:
        return sources.get((section, key), "built-in default")

    # Secrets from files; a secret and its *_file are exclusive.
    for (section, key), file_key in secret_files.items():
        if section not in sections:
            continue
        file_path = values[section].get(file_key)
        if file_path is None:
            continue
        if values[section].get(key) is not None:
            raise ConfigError(
                f"{_where(section, file_key)}: set only one of {key} and {file_key} "
                f"(from {src(section, key)} and {src(section, file_key)})"
            )
        assert isinstance(file_path, str)
        values[section][key] = _read_secret_file(
            section, file_key, file_path, src(section, file_key)
        )
    return SectionValues(values, src, found)


def load_config(path: Path | None, env: Mapping[str, str] = os.environ) -> Config:
    """Defaults, then the TOML file at `path` (if any), then env overrides."""
    values, src, _ = read_sections(path, env, SECTIONS, SECRET_FILES)
    try:
        kafka = KafkaConfig(**values["kafka"])  # type: ignore[arg-type]
        http = HttpConfig(**values["http"])  # type: ignore[arg-type]
        snapshot = SnapshotConfig(**values["snapshot"])  # type: ignore[arg-type]
        log = LogConfig(**values["log"])  # type: ignore[arg-type]
    except TypeError as exc:  # pragma: no cover - keys and types were checked above
        raise ConfigError(str(exc)) from exc
    for key, limit in values["index"].items():
        wrong = limit_error(key, limit) if isinstance(limit, (int, float)) else None
        if wrong is not None:
            where, source = _where("index", key), src("index", key)
            raise ConfigError(f"{where}: {wrong}, got {limit!r} (from {source})")
    try:
        index = IndexLimits(**values["index"])  # type: ignore[arg-type]
    except ValueError as exc:  # IndexLimits' own checks, should it gain more
        raise ConfigError(f"[index]: {exc}") from exc
    cfg = Config(kafka=kafka, http=http, index=index, snapshot=snapshot, log=log)
    _validate(cfg, src)
    return cfg


# Kafka's rule for topic names.
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")


def _validate(cfg: Config, src: Callable[[str, str], str]) -> None:
    def fail(section: str, key: str, why: str) -> ConfigError:
        return ConfigError(f"{_where(section, key)}: {why} (from {src(section, key)})")

    k = cfg.kafka
    servers = [s.strip() for s in k.bootstrap_servers.split(",")]
    if not all(servers) or not all(re.fullmatch(r"\S+:\d{1,5}", s) for s in servers):
        raise fail(
            "kafka",
            "bootstrap_servers",
            f"expected comma-separated host:port pairs, got {k.bootstrap_servers!r}",
        )
    topics: dict[str, str] = {}
    for key in (
        "engine_topic",
        "pool_topic",
        "snapshot_topic",
        "dead_letter_topic",
        "repartition_topic",
    ):
        topic = getattr(k, key)
        if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
            raise fail("kafka", key, f"not a valid Kafka topic name: {topic!r}")
        if topic in topics:
            raise fail("kafka", key, f"must differ from {topics[topic]} ({topic!r})")
        topics[topic] = key
    for key in ("group_id", "client_id"):
        if not getattr(k, key).strip():
            raise fail("kafka", key, "must not be empty")
    for key in (
        "partitions",
        "replication_factor",
        "min_insync_replicas",
        "fetch_max_records",
        "fetch_max_bytes",
        "max_partition_fetch_bytes",
        "fetch_min_bytes",
        "session_timeout_ms",
        "heartbeat_interval_ms",
        "request_timeout_ms",
        "metadata_max_age_ms",
    ):
        value = getattr(k, key)
        if value is not None and value < 1:
            raise fail("kafka", key, f"must be at least 1, got {value}")
    if k.replication_factor is not None and (k.min_insync_replicas or 1) > k.replication_factor:
        raise fail(
            "kafka",
            "min_insync_replicas",
            f"must not exceed replication_factor {k.replication_factor}, "
            f"got {k.min_insync_replicas}",
        )
    if k.heartbeat_interval_ms >= k.session_timeout_ms:
        raise fail(
            "kafka",
            "heartbeat_interval_ms",
            f"must be below session_timeout_ms {k.session_timeout_ms}, "
            f"got {k.heartbeat_interval_ms}",
        )
    # The coordinator holds a JoinGroup up to the rebalance timeout, which
    # aiokafka sets to the session timeout and waits for within the request
    # timeout: shorter, a rebalance of two members would time out and retry.
    if k.request_timeout_ms <= k.session_timeout_ms:
        raise fail(
            "kafka",
            "request_timeout_ms",
            f"must exceed session_timeout_ms {k.session_timeout_ms}, got {k.request_timeout_ms}",
        )
    if k.group_instance_id is not None and not k.group_instance_id.strip():
        raise fail("kafka", "group_instance_id", "must not be blank")
    if k.group_instance_id is not None and not k.static_membership:
        raise fail("kafka", "group_instance_id", "set, but static_membership is false")
    if not k.stale_after_s > 0:
        raise fail("kafka", "stale_after_s", f"must be positive, got {k.stale_after_s}")
    # A broker holds a fetch up to fetch_max_wait_ms with nothing to send:
    # as long as the request timeout, an idle partition would look gone.
    if not 0 <= k.fetch_max_wait_ms < min(k.request_timeout_ms, k.stale_after_s * 1000):
        raise fail(
            "kafka",
            "fetch_max_wait_ms",
            f"must be in [0, min(request_timeout_ms, stale_after_s)), got {k.fetch_max_wait_ms}",
        )
    if k.fetch_path == "native" and KERNEL is None:
        raise fail("kafka", "fetch_path", "native needs the compiled kernel, not loaded here")
    sasl = k.security_protocol.startswith("SASL_")
    ssl = k.security_protocol in ("SSL", "SASL_SSL")
    if sasl:
        # The key is missing: name where the protocol that needs it came from.
        why = f"security_protocol {k.security_protocol} from {src('kafka', 'security_protocol')}"
        if not k.sasl_username:
            raise ConfigError(f"[kafka] sasl_username: required with {why}")
        if k.sasl_password is None:
            raise ConfigError(f"[kafka] sasl_password: required (or sasl_password_file) with {why}")
    else:
        for key in ("sasl_username", "sasl_password", "sasl_password_file"):
            if getattr(k, key) is not None:
                raise fail("kafka", key, f"set, but security_protocol is {k.security_protocol}")
    for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile", "ssl_password", "ssl_password_file"):
        value = getattr(k, key)
        if value is None:
            continue
        if not ssl:
            raise fail("kafka", key, f"set, but security_protocol is {k.security_protocol}")
        if key.endswith("file") and key != "ssl_password_file" and not os.path.isfile(value):
            raise fail("kafka", key, f"no such file: {value!r}")
    if k.ssl_keyfile is not None and k.ssl_certfile is None:
        raise fail("kafka", "ssl_certfile", "required when ssl_keyfile is set")

    h = cfg.http
    if not h.host.strip():
        raise fail("http", "host", "must not be empty")
    if not 0 <= h.port <= 65535:
        raise fail("http", "port", f"must be in [0, 65535], got {h.port}")
    if h.max_body_bytes < 1024:
        raise fail("http", "max_body_bytes", f"must be at least 1024, got {h.max_body_bytes}")
    if not h.client_timeout_s > 0:
        raise fail("http", "client_timeout_s", f"must be positive, got {h.client_timeout_s}")
    if not h.idle_timeout_s > 0:
        raise fail("http", "idle_timeout_s", f"must be positive, got {h.idle_timeout_s}")
    for key in ("max_connections", "max_requests_per_connection"):
        if getattr(h, key) < 1:
            raise fail("http", key, f"must be at least 1, got {getattr(h, key)}")
    if h.registrations_topic:
        topic = h.registrations_topic
        if not _TOPIC.fullmatch(topic) or topic in (".", ".."):
            raise fail("http", "registrations_topic", f"not a valid Kafka topic name: {topic!r}")
        if topic in topics:
            raise fail(
                "http",
                "registrations_topic",
                f"must differ from [kafka] {topics[topic]} ({topic!r})",
            )
    if h.auth_token is not None:
        token = h.auth_token.reveal()
        if not token.strip():
            raise fail("http", "auth_token", "must not be blank")
        # It travels in a header: visible ASCII only, as RFC 6750's b64token.
        if not all("!" <= c <= "~" for c in token):
            raise fail("http", "auth_token", "may hold only visible ASCII characters, no spaces")
        if h.allow_unauthenticated:
            raise fail("http", "allow_unauthenticated", "set, but auth_token is set too")
    elif not is_loopback(h.host) and not h.allow_unauthenticated:
        raise ConfigError(
            f"[http] auth_token: required (or auth_token_file) when [http] host is not a "
            f"loopback address, got {h.host!r} from {src('http', 'host')}; or set "
            "[http] allow_unauthenticated = true to serve anyone who can reach the port"
        )

    if not cfg.snapshot.interval_s > 0:
        raise fail("snapshot", "interval_s", f"must be positive, got {cfg.snapshot.interval_s}")


# ------------------------------------------------------------------- kafka


def kafka_client_options(kafka: KafkaConfig) -> dict[str, object]:
    """Security keyword arguments for aiokafka's consumer, producer and admin.

    Always `security_protocol`; with SASL_* also `sasl_mechanism`,
    `sasl_plain_username` and `sasl_plain_password` (aiokafka takes the SCRAM
    credentials through the same two arguments); with SSL or SASL_SSL an
    `ssl_context` from `aiokafka.helpers.create_ssl_context` (the system CA
    store when `ssl_cafile` is unset)."""
    opts: dict[str, object] = {"security_protocol": kafka.security_protocol}
    if kafka.security_protocol.startswith("SASL_"):
        opts["sasl_mechanism"] = kafka.sasl_mechanism
        opts["sasl_plain_username"] = kafka.sasl_username
        opts["sasl_plain_password"] = reveal(kafka.sasl_password)
    if kafka.security_protocol in ("SSL", "SASL_SSL"):
        import ssl

        from aiokafka.helpers import (  # type: ignore[import-untyped,unused-ignore]
            create_ssl_context,
        )

        try:
            opts["ssl_context"] = create_ssl_context(
                cafile=kafka.ssl_cafile,
                certfile=kafka.ssl_certfile,
                keyfile=kafka.ssl_keyfile,
                password=reveal(kafka.ssl_password),
            )
        except (ssl.SSLError, OSError) as exc:
            key = "ssl_certfile" if kafka.ssl_certfile else "ssl_cafile"
            reason = getattr(exc, "reason", None) or exc.strerror or type(exc).__name__
            raise ConfigError(f"[kafka] {key}: cannot build the TLS context: {reason}") from exc
    return opts


def kafka_service_options(kafka: KafkaConfig) -> dict[str, object]:
    """`kafka_client_options` and the request and metadata timeouts, for
    the clients of a long-running service (the daemon, a replica, the bridge)."""
    return {
        **kafka_client_options(kafka),
        "request_timeout_ms": kafka.request_timeout_ms,
        "metadata_max_age_ms": kafka.metadata_max_age_ms,
    }


def kafka_fetch_options(kafka: KafkaConfig) -> dict[str, object]:
    """The fetch sizes and wait of a consumer of the event topics (the
    daemon's, its stage one's); `fetch_max_records` goes to `getmany`."""
    return {
        "fetch_max_bytes": kafka.fetch_max_bytes,
        "max_partition_fetch_bytes": kafka.max_partition_fetch_bytes,
        "fetch_min_bytes": kafka.fetch_min_bytes,
        "fetch_max_wait_ms": kafka.fetch_max_wait_ms,
    }


def kafka_group_options(kafka: KafkaConfig) -> dict[str, object]:
    """A group consumer's membership: its session, heartbeat and static
    `group_instance_id` (`client_id` unless set; none in the scale-out mode
    unless set, where a stopped daemon must hand its partitions over at
    once, and a static member does not leave its group when it stops)."""
    instance = kafka.group_instance_id
    if instance is None and not kafka.repartition:
        instance = kafka.client_id
    if not kafka.static_membership:
        instance = None
    return {
        "session_timeout_ms": kafka.session_timeout_ms,
        "heartbeat_interval_ms": kafka.heartbeat_interval_ms,
        "group_instance_id": instance,
    }
