"""Configuration: defaults, file, env overrides, one-line errors, secrets, docs."""

from __future__ import annotations

import re
import ssl
import tomllib
from pathlib import Path

import pytest

from kvconductor.config import (
    DEFAULT_MAX_BODY_BYTES,
    Config,
    ConfigError,
    KeyInfo,
    Secret,
    config_keys,
    env_var,
    kafka_client_options,
    load_config,
    reveal,
)
from kvconductor.index.fleet import IndexLimits

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILE = ROOT / "config" / "kvconductor.toml"
DOC = ROOT / "docs" / "configuration.md"


def write(tmp_path: Path, text: str, name: str = "kv.toml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def error_of(path: Path | None, env: dict[str, str] | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, env or {})
    message = str(info.value)
    assert "\n" not in message and "\r" not in message, message
    assert message.startswith("config error: "), message
    return message


# ----------------------------------------------------------------- defaults


def test_defaults() -> None:
    cfg = load_config(None, {})
    assert cfg == Config()
    k = cfg.kafka
    assert k.bootstrap_servers == "127.0.0.1:39092"
    assert (k.engine_topic, k.pool_topic) == ("kv-events", "kv-pool-events")
    assert (k.snapshot_topic, k.dead_letter_topic) == ("kv-index-snapshots", "kv-dead-letters")
    assert (k.group_id, k.client_id) == ("kvconductor", "kvconductor")
    assert (k.partitions, k.replication_factor, k.fetch_max_records) == (6, None, 2000)
    assert (k.min_insync_replicas, k.topic_check, k.group_instance_id) == (None, "warn", None)
    assert k.security_protocol == "PLAINTEXT"
    assert k.sasl_username is None and k.sasl_password is None
    assert (cfg.http.host, cfg.http.port) == ("127.0.0.1", 8787)
    assert cfg.http.max_body_bytes == DEFAULT_MAX_BODY_BYTES == 16 * 1024 * 1024
    assert cfg.http.auth_token is None
    assert cfg.index == IndexLimits()
    assert (cfg.snapshot.interval_s, cfg.snapshot.enabled) == (10.0, True)
    assert (cfg.log.level, cfg.log.format) == ("info", "auto")


def test_index_section_mirrors_index_limits() -> None:
    index_keys = [k.key for k in config_keys() if k.section == "index"]
    assert index_keys == list(IndexLimits.__struct_fields__)
    for info in config_keys():
        if info.section == "index":
            assert info.default == getattr(IndexLimits(), info.key)


def test_default_file_is_every_key_at_its_default() -> None:
    assert load_config(DEFAULT_FILE, {}) == Config()
    doc = tomllib.loads(DEFAULT_FILE.read_text(encoding="utf-8"))
    in_file = {(s, k) for s, table in doc.items() for k in table}
    assert in_file == {(i.section, i.key) for i in config_keys()}
    for info in config_keys():
        expected = "" if info.default is None else info.default
        assert doc[info.section][info.key] == expected, info


def test_default_file_comments_every_key() -> None:
    previous = ""
    for line in DEFAULT_FILE.read_text(encoding="utf-8").splitlines():
        if re.match(r"^\w+ = ", line):
            assert previous.startswith("# "), f"no comment above {line!r}"
        previous = line


# --------------------------------------------------------- file and env


def test_file_values(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[kafka]
bootstrap_servers = "k1:9092,k2:9093"
partitions = 12
security_protocol = "sasl_plaintext"   # choices are case-insensitive
sasl_mechanism = "SCRAM-SHA-512"
sasl_username = "svc"
sasl_password = "pw"

[http]
port = 9000
auth_token = "tok"

[index]
max_pending_age_s = 60   # an int is fine for a float
local_hash_map = 1000

[snapshot]
enabled = false

[log]
level = "DEBUG"
format = "json"
""",
    )
    cfg = load_config(path, {})
    assert cfg.kafka.bootstrap_servers == "k1:9092,k2:9093"
    assert cfg.kafka.partitions == 12
    assert cfg.kafka.security_protocol == "SASL_PLAINTEXT"
    assert cfg.kafka.sasl_mechanism == "SCRAM-SHA-512"
    assert reveal(cfg.kafka.sasl_password) == "pw"
    assert cfg.http.port == 9000
    assert reveal(cfg.http.auth_token) == "tok"
    assert cfg.index.max_pending_age_s == 60.0
    assert isinstance(cfg.index.max_pending_age_s, float)
    assert cfg.index.local_hash_map == 1000
    assert cfg.snapshot.enabled is False
    assert (cfg.log.level, cfg.log.format) == ("debug", "json")
    # untouched keys keep their defaults
    assert cfg.kafka.engine_topic == "kv-events"
    assert cfg.index.max_pending == IndexLimits().max_pending


def test_env_overrides_file(tmp_path: Path) -> None:
    path = write(tmp_path, '[kafka]\npartitions = 12\nengine_topic = "from-file"\n')
    env = {
        "KVCONDUCTOR_KAFKA_PARTITIONS": "24",
        "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": "broker:9092",
        "KVCONDUCTOR_HTTP_MAX_BODY_BYTES": "1_048_576",
        "KVCONDUCTOR_INDEX_MAX_PENDING_AGE_S": "1e3",
        "KVCONDUCTOR_INDEX_MAX_NAMESPACES": "7",
        "KVCONDUCTOR_SNAPSHOT_INTERVAL_S": "2.5",
        "KVCONDUCTOR_SNAPSHOT_ENABLED": "off",
        "KVCONDUCTOR_LOG_FORMAT": "Console",
        "KVCONDUCTOR_KAFKA_SSL_CAFILE": "",  # empty: unset
        # not config: ignored
        "KVCONDUCTOR_TEST_BOOTSTRAP": "elsewhere:1",
        "KVCONDUCTOR_CONFIG": "/etc/x.toml",
        "PATH": "/usr/bin",
    }
    cfg = load_config(path, env)
    assert cfg.kafka.partitions == 24
    assert cfg.kafka.engine_topic == "from-file"
    assert cfg.kafka.bootstrap_servers == "broker:9092"
    assert cfg.http.max_body_bytes == 1 << 20
    assert cfg.index.max_pending_age_s == 1000.0
    assert cfg.index.max_namespaces == 7
    assert cfg.snapshot.interval_s == 2.5
    assert cfg.snapshot.enabled is False
    assert cfg.log.format == "console"
    assert cfg.kafka.ssl_cafile is None


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        *[("true", True), ("1", True), ("YES", True), ("on", True)],
        *[("false", False), ("0", False), ("No", False), ("off", False)],
    ],
)
def test_env_bools(raw: str, expected: bool) -> None:
    cfg = load_config(None, {"KVCONDUCTOR_SNAPSHOT_ENABLED": raw})
    assert cfg.snapshot.enabled is expected


def test_every_key_has_an_env_var() -> None:
    names = [info.env for info in config_keys()]
    assert len(names) == len(set(names))
    for info in config_keys():
        assert info.env == f"KVCONDUCTOR_{info.section.upper()}_{info.key.upper()}"
        assert env_var(info.section, info.key) == info.env


def test_every_key_is_settable_from_env(tmp_path: Path) -> None:
    """Each key's env var reaches its field (a value that differs from the default)."""
    secret_file = write(tmp_path, "s3cret\n", "secret.txt")
    samples: dict[str, tuple[str, object]] = {
        "string": ("x-changed", "x-changed"),
        "int": ("4321", 4321),
        "float": ("12.5", 12.5),
        "bool": ("false", False),
    }
    for info in config_keys():
        env: dict[str, str] = {}
        raw: str
        want: object
        if info.section == "kafka" and info.key.startswith(("sasl", "ssl")):
            env["KVCONDUCTOR_KAFKA_SECURITY_PROTOCOL"] = "SASL_SSL"
            env["KVCONDUCTOR_KAFKA_SASL_USERNAME"] = "u"
            if info.key not in ("sasl_password", "sasl_password_file"):
                env["KVCONDUCTOR_KAFKA_SASL_PASSWORD"] = "pw"
            if info.key == "ssl_keyfile":
                env["KVCONDUCTOR_KAFKA_SSL_CERTFILE"] = str(secret_file)
        if info.section == "http" and info.key == "host":
            env["KVCONDUCTOR_HTTP_AUTH_TOKEN"] = "t"  # any other host than loopback needs one
        if info.key.endswith("file"):
            raw, want = str(secret_file), str(secret_file)
        elif info.key == "security_protocol":
            raw = want = "SSL"
        elif info.key == "fetch_path":  # every build takes it (native needs the kernel)
            raw = want = "aiokafka"
        elif "|" in info.type:
            choices = [c.strip() for c in info.type.split("|")]
            raw = want = next(c for c in reversed(choices) if c != info.default)
        elif info.key == "bootstrap_servers":
            raw = want = "other:1234"
        elif info.key == "request_timeout_ms":  # above session_timeout_ms
            raw, want = "43210", 43210
        else:
            raw, want = samples[info.type]
        if info.secret:
            want = Secret(str(want))
        env[info.env] = raw
        cfg = load_config(None, env)
        got = getattr(getattr(cfg, info.section), info.key)
        assert got == want, info


# ----------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[kafak]\npartitions = 1\n", "[kafak]: unknown section (did you mean [kafka]?)"),
        ("[kafka]\npartition = 1\n", "[kafka] partition: unknown key (did you mean partitions?)"),
        ("[kafka]\nzzz = 1\n", "[kafka] zzz: unknown key"),
        ("[kafka]\npartitions = 'abc'\n", "[kafka] partitions: expected int, got 'abc'"),
        ("[kafka]\npartitions = true\n", "[kafka] partitions: expected int, got True"),
        ("[kafka]\npartitions = 1.5\n", "[kafka] partitions: expected int, got 1.5"),
        ("[kafka]\nengine_topic = 5\n", "[kafka] engine_topic: expected string, got 5"),
        ("[kafka]\nsasl = { username = 'x' }\n", "[kafka] sasl: unknown key"),
        ("[snapshot]\nenabled = 'yes'\n", "[snapshot] enabled: expected bool, got 'yes'"),
        ("[snapshot]\ninterval_s = true\n", "[snapshot] interval_s: expected float, got True"),
        ("[snapshot]\ninterval_s = nan\n", "[snapshot] interval_s: expected float, got nan"),
        ("[snapshot]\ninterval_s = 1" + "0" * 400 + "\n", "[snapshot] interval_s: expected float"),
        (
            "[kafka]\nsecurity_protocol = 'TLS'\n",
            "[kafka] security_protocol: expected one of PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL",
        ),
        ("[log]\nlevel = 'loud'\n", "[log] level: expected one of debug, info, warning, error"),
        ("kafka = 3\n", "[kafka]: expected a table, got 3"),
        ("port = 8787\n", "port: unknown top-level key"),
        ("[kafka]\npartitions = 0\n", "[kafka] partitions: must be at least 1, got 0"),
        ("[kafka]\nfetch_max_records = -1\n", "[kafka] fetch_max_records: must be at least 1"),
        (
            "[kafka]\nmax_partition_fetch_bytes = 0\n",
            "[kafka] max_partition_fetch_bytes: must be at",
        ),
        (
            "[kafka]\nfetch_max_wait_ms = 10000\n",
            "[kafka] fetch_max_wait_ms: must be in [0, min(request_timeout_ms, stale_after_s))",
        ),
        ("[kafka]\nreplication_factor = 0\n", "[kafka] replication_factor: must be at least 1"),
        (
            "[kafka]\nreplication_factor = 2\nmin_insync_replicas = 3\n",
            "[kafka] min_insync_replicas: must not exceed replication_factor 2, got 3",
        ),
        (
            "[kafka]\nheartbeat_interval_ms = 10000\n",
            "[kafka] heartbeat_interval_ms: must be below session_timeout_ms 10000",
        ),
        ("[kafka]\nsession_timeout_ms = 0\n", "[kafka] session_timeout_ms: must be at least 1"),
        (
            "[kafka]\nsession_timeout_ms = 20000\nrequest_timeout_ms = 20000\n",
            "[kafka] request_timeout_ms: must exceed session_timeout_ms 20000, got 20000",
        ),
        ("[kafka]\ngroup_instance_id = ' '\n", "[kafka] group_instance_id: must not be blank"),
        ("[kafka]\nstale_after_s = 0\n", "[kafka] stale_after_s: must be positive, got 0"),
        ("[kafka]\ntopic_check = 'maybe'\n", "[kafka] topic_check: expected one of warn, error"),
        ("[kafka]\nengine_topic = 'bad topic'\n", "[kafka] engine_topic: not a valid Kafka topic"),
        ("[kafka]\nsnapshot_topic = ''\n", "[kafka] snapshot_topic: not a valid Kafka topic"),
        (
            "[kafka]\npool_topic = 'kv-events'\n",
            "[kafka] pool_topic: must differ from engine_topic",
        ),
        ("[kafka]\nbootstrap_servers = 'nohost'\n", "[kafka] bootstrap_servers: expected comma"),
        ("[kafka]\nbootstrap_servers = 'a:1,'\n", "[kafka] bootstrap_servers: expected comma"),
        ("[kafka]\ngroup_id = ' '\n", "[kafka] group_id: must not be empty"),
        (
            "[kafka]\nsecurity_protocol = 'SASL_SSL'\n",
            "[kafka] sasl_username: required with security_protocol SASL_SSL from /",
        ),
        (
            "[kafka]\nsecurity_protocol = 'SASL_PLAINTEXT'\nsasl_username = 'u'\n",
            "[kafka] sasl_password: required (or sasl_password_file) with security_protocol "
            "SASL_PLAINTEXT from /",
        ),
        (
            "[kafka]\nsasl_username = 'u'\n",
            "[kafka] sasl_username: set, but security_protocol is PLAINTEXT",
        ),
        (
            "[kafka]\nssl_cafile = '/etc/hostname'\n",
            "[kafka] ssl_cafile: set, but security_protocol is PLAINTEXT",
        ),
        (
            "[kafka]\nsecurity_protocol = 'SSL'\nssl_cafile = '/no/such/ca.pem'\n",
            "[kafka] ssl_cafile: no such file: '/no/such/ca.pem'",
        ),
        ("[http]\nport = 70000\n", "[http] port: must be in [0, 65535], got 70000"),
        ("[http]\nmax_body_bytes = 10\n", "[http] max_body_bytes: must be at least 1024"),
        ("[http]\nhost = ''\n", "[http] host: must not be empty"),
        ("[http]\nauth_token = ' '\n", "[http] auth_token: must not be blank"),
        ("[index]\nmax_pending = 0\n", "[index] max_pending: must be positive, got 0"),
        ("[index]\nmax_pending_age_s = -1.0\n", "[index] max_pending_age_s: must be positive"),
        ("[index]\nlocal_hash_map = -1\n", "[index] local_hash_map: must be zero or positive"),
        ("[index]\nmax_namespace = 1\n", "[index] max_namespace: unknown key (did you mean"),
        ("[snapshot]\ninterval_s = 0\n", "[snapshot] interval_s: must be positive"),
    ],
)
def test_file_errors_name_the_key(tmp_path: Path, text: str, needle: str) -> None:
    path = write(tmp_path, text)
    message = error_of(path)
    assert needle in message
    assert f"from {path}" in message


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        ("KVCONDUCTOR_KAFKA_PARTITIONS", "abc", "[kafka] partitions: expected int, got 'abc'"),
        ("KVCONDUCTOR_KAFKA_PARTITIONS", "1.0", "[kafka] partitions: expected int, got '1.0'"),
        ("KVCONDUCTOR_KAFKA_PARTITIONS", "", "[kafka] partitions: expected int, got ''"),
        ("KVCONDUCTOR_KAFKA_PARTITIONS", "1__0", "[kafka] partitions: expected int, got '1__0'"),
        ("KVCONDUCTOR_KAFKA_PARTITIONS", "0x10", "[kafka] partitions: expected int, got '0x10'"),
        ("KVCONDUCTOR_KAFKA_PARTITION", "3", "[kafka] partition: unknown key"),
        ("KVCONDUCTOR_HTTP_PROT", "3", "[http] prot: unknown key (did you mean port?)"),
        ("KVCONDUCTOR_SNAPSHOT_ENABLED", "nah", "[snapshot] enabled: expected bool, got 'nah'"),
        ("KVCONDUCTOR_SNAPSHOT_INTERVAL_S", "soon", "[snapshot] interval_s: expected float"),
        ("KVCONDUCTOR_SNAPSHOT_INTERVAL_S", "inf", "[snapshot] interval_s: expected float"),
        ("KVCONDUCTOR_LOG_FORMAT", "xml", "[log] format: expected one of auto, json, console"),
        ("KVCONDUCTOR_INDEX_MAX_INSTANCES", "-5", "[index] max_instances: must be positive"),
        ("KVCONDUCTOR_HTTP_PORT", "-1", "[http] port: must be in [0, 65535]"),
    ],
)
def test_env_errors_name_the_key_and_var(name: str, value: str, needle: str) -> None:
    message = error_of(None, {name: value})
    assert needle in message
    assert f"(from {name})" in message


def test_the_brief_example_message() -> None:
    assert error_of(None, {"KVCONDUCTOR_KAFKA_PARTITIONS": "abc"}) == (
        "config error: [kafka] partitions: expected int, got 'abc' "
        "(from KVCONDUCTOR_KAFKA_PARTITIONS)"
    )


def test_file_level_errors(tmp_path: Path) -> None:
    missing = tmp_path / "nope.toml"
    assert f"cannot read config file {str(missing)!r}" in error_of(missing)
    bad = write(tmp_path, "[kafka\npartitions = 1\n")
    assert "is not valid TOML" in error_of(bad)
    binary = tmp_path / "bin.toml"
    binary.write_bytes(b"[kafka]\nclient_id = '\xff'\n")
    assert "not valid UTF-8" in error_of(binary)


def test_a_long_bad_value_is_shortened() -> None:
    message = error_of(None, {"KVCONDUCTOR_KAFKA_PARTITIONS": "9" * 30 + "x" * 500})
    assert len(message) < 250


# ----------------------------------------------------------------- secrets


def test_secrets_are_redacted(tmp_path: Path) -> None:
    env = {
        "KVCONDUCTOR_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "KVCONDUCTOR_KAFKA_SASL_USERNAME": "svc",
        "KVCONDUCTOR_KAFKA_SASL_PASSWORD": "hunter2-sasl",
        "KVCONDUCTOR_HTTP_AUTH_TOKEN": "hunter2-token",
    }
    cfg = load_config(None, env)
    for text in (repr(cfg), str(cfg), f"{cfg}", repr(cfg.kafka), str(cfg.http)):
        assert "hunter2" not in text
    assert f"{cfg.http.auth_token}" == str(cfg.http.auth_token) == "**********"
    assert "**********" in repr(cfg.kafka)
    assert reveal(cfg.kafka.sasl_password) == "hunter2-sasl"
    assert reveal(cfg.http.auth_token) == "hunter2-token"
    assert reveal(None) is None


def test_secret_values_never_appear_in_errors(tmp_path: Path) -> None:
    path = write(tmp_path, "[kafka]\nsasl_password = 987654321\n")
    message = error_of(path)
    assert "[kafka] sasl_password: expected string" in message
    assert "987654321" not in message


def test_secrets_from_files(tmp_path: Path) -> None:
    pw = write(tmp_path, "from-file-pw\n", "pw.txt")
    token = write(tmp_path, "tok-from-file\r\n", "token.txt")
    path = write(
        tmp_path,
        f"""
[kafka]
security_protocol = "SASL_PLAINTEXT"
sasl_username = "svc"
sasl_password_file = "{pw}"

[http]
auth_token_file = "{token}"
""",
    )
    cfg = load_config(path, {})
    assert reveal(cfg.kafka.sasl_password) == "from-file-pw"
    assert reveal(cfg.http.auth_token) == "tok-from-file"
    assert cfg.kafka.sasl_password_file == str(pw)
    assert "from-file-pw" not in repr(cfg) and "tok-from-file" not in repr(cfg)


def test_secret_file_errors(tmp_path: Path) -> None:
    message = error_of(None, {"KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE": str(tmp_path / "none")})
    assert "[http] auth_token_file: cannot read" in message
    assert "(from KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE)" in message
    empty = write(tmp_path, "\n", "empty.txt")
    message = error_of(None, {"KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE": str(empty)})
    assert "[http] auth_token_file:" in message and "is empty" in message
    both = write(tmp_path, f'[http]\nauth_token = "t"\nauth_token_file = "{empty}"\n')
    message = error_of(both)
    assert "[http] auth_token_file: set only one of auth_token and auth_token_file" in message


# ------------------------------------------------------------ kafka options


def test_kafka_options_plaintext() -> None:
    assert kafka_client_options(load_config(None, {}).kafka) == {"security_protocol": "PLAINTEXT"}


def test_kafka_options_sasl_ssl() -> None:
    env = {
        "KVCONDUCTOR_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
        "KVCONDUCTOR_KAFKA_SASL_MECHANISM": "scram-sha-256",
        "KVCONDUCTOR_KAFKA_SASL_USERNAME": "svc",
        "KVCONDUCTOR_KAFKA_SASL_PASSWORD": "pw",
    }
    opts = kafka_client_options(load_config(None, env).kafka)
    assert opts["security_protocol"] == "SASL_SSL"
    assert opts["sasl_mechanism"] == "SCRAM-SHA-256"
    assert opts["sasl_plain_username"] == "svc"
    assert opts["sasl_plain_password"] == "pw"
    context = opts["ssl_context"]
    assert isinstance(context, ssl.SSLContext)
    assert context.verify_mode == ssl.CERT_REQUIRED


def test_kafka_options_sasl_plaintext_has_no_tls() -> None:
    env = {
        "KVCONDUCTOR_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
        "KVCONDUCTOR_KAFKA_SASL_USERNAME": "svc",
        "KVCONDUCTOR_KAFKA_SASL_PASSWORD": "pw",
    }
    opts = kafka_client_options(load_config(None, env).kafka)
    assert set(opts) == {
        "security_protocol",
        "sasl_mechanism",
        "sasl_plain_username",
        "sasl_plain_password",
    }


def test_kafka_options_bad_ca_file(tmp_path: Path) -> None:
    ca = write(tmp_path, "not a certificate\n", "ca.pem")
    env = {"KVCONDUCTOR_KAFKA_SECURITY_PROTOCOL": "SSL", "KVCONDUCTOR_KAFKA_SSL_CAFILE": str(ca)}
    cfg = load_config(None, env)
    with pytest.raises(ConfigError) as info:
        kafka_client_options(cfg.kafka)
    assert str(info.value).startswith("config error: [kafka] ssl_cafile: ")
    assert "\n" not in str(info.value)


# -------------------------------------------------------------------- docs


def _doc_rows() -> list[tuple[str, str, str, str, str]]:
    rows: list[tuple[str, str, str, str, str]] = []
    section: str | None = None
    for line in DOC.read_text(encoding="utf-8").splitlines():
        heading = re.fullmatch(r"## \[(\w+)\]", line)
        if heading:
            section = heading.group(1)
            continue
        if line.startswith("## "):
            section = None
            continue
        row = re.fullmatch(r"\| `(\w+)` \| (.+?) \| (.+?) \| `(\w+)` \| .+ \|", line)
        if row:
            assert section is not None, f"key row outside a [section]: {line!r}"
            key, typ, default, env = row.groups()
            rows.append((section, key, typ.replace("\\|", "|"), default, env))
    return rows


def _doc_default(info: KeyInfo) -> str:
    d = info.default
    if d is None:
        return "unset"
    if isinstance(d, bool):
        return "`true`" if d else "`false`"
    if isinstance(d, str):
        return f'`"{d}"`'
    return f"`{d}`"


def test_doc_lists_exactly_the_keys_of_the_code() -> None:
    documented = _doc_rows()
    expected = [
        (info.section, info.key, info.type, _doc_default(info), info.env) for info in config_keys()
    ]
    assert sorted(documented) == sorted(expected)
    assert len(documented) == len(set(documented))


@pytest.mark.parametrize(
    ("fetch_path", "kernel", "native"),
    [
        ("auto", True, True),
        ("auto", False, False),
        ("native", True, True),
        ("aiokafka", True, False),
        ("aiokafka", False, False),
    ],
)
def test_the_fetch_path_auto_is_the_daemons_own_where_the_kernel_is_loaded(
    monkeypatch: pytest.MonkeyPatch, fetch_path: str, kernel: bool, native: bool
) -> None:
    import kvconductor.config as config

    monkeypatch.setattr(config, "KERNEL", object() if kernel else None)
    assert config.KafkaConfig().fetch_path == "auto"
    assert config.KafkaConfig(fetch_path=fetch_path).native_fetch is native  # type: ignore[arg-type]
