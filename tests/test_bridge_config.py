"""The bridge's configuration: the example file, env overrides, one-line errors."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import pytest
from aiohttp.test_utils import TestClient, TestServer

from kvconductor.bridge.config import BridgeSettings, load_bridge_config
from kvconductor.bridge.http import make_app
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.config import ConfigError
from kvconductor.registry.bodies import InvalidRegistration, RegisterBody, to_publisher
from kvconductor.tools.cli import build_parser

EXAMPLE = Path(__file__).resolve().parent.parent / "config" / "bridge.toml"


def test_example_config_loads(tmp_path: Path) -> None:
    assert load_bridge_config(EXAMPLE, env={}).publishers == ()  # as shipped: none
    # Its commented examples, uncommented as the file says, are valid too.
    text = EXAMPLE.read_text()
    lines = [line[1:] if re.match(r"#\S", line) else line for line in text.splitlines()]
    path = tmp_path / "bridge.toml"
    path.write_text("\n".join(lines))
    cfg = load_bridge_config(path, env={})
    assert [p.id for p in cfg.publishers] == ["vllm-0", "sglang-0", "mooncake-0"]
    vllm, sglang, pool = cfg.publishers
    assert list(vllm.ranks) == [0, 1] and vllm.offload == "pool"
    assert sglang.source == "sglang" and sglang.replay_endpoint is None
    assert (pool.kind, pool.source, pool.block_size) == ("pool", "mooncake", 16)
    # the real master sends model and block size nil unless started with them
    assert pool.model and pool.reconcile_url == "http://10.0.0.7:9003"
    assert cfg.topic_for(pool) == "kv-pool-events" and cfg.topic_for(vllm) == "kv-events"
    assert cfg.bridge.port == 8788 and cfg.bridge.auth_token is None


def test_env_overrides_and_daemon_sections_ignored(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    env = {
        "KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS": "k1:9092,k2:9092",
        "KVCONDUCTOR_BRIDGE_PORT": "9000",
        "KVCONDUCTOR_BRIDGE_BUFFER_MAX_MESSAGES": "500",
        "KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE": str(token),
        "KVCONDUCTOR_HTTP_PORT": "1",  # the daemon's section: not the bridge's business
    }
    cfg = load_bridge_config(EXAMPLE, env=env)
    assert cfg.kafka.bootstrap_servers == "k1:9092,k2:9092"
    assert cfg.bridge.port == 9000 and cfg.bridge.buffer_max_messages == 500
    assert cfg.bridge.auth_token is not None and cfg.bridge.auth_token.reveal() == "s3cret"
    assert "s3cret" not in repr(cfg)
    assert load_bridge_config(None, env={}).publishers == ()


BASE = '[[publishers]]\nid = "e"\nendpoint = "tcp://h:5557"\nmodel = "m"\nblock_size = 16\n'


@pytest.mark.parametrize(
    ("text", "env", "needle"),
    [
        ("[bridge]\nbufer_max_bytes = 1\n", {}, "[bridge] bufer_max_bytes: unknown key (did you"),
        ("[brige]\n", {}, "[brige]: unknown section (did you mean [bridge]?)"),
        ("[bridge]\nport = 70000\n", {}, "[bridge] port: must be in [0, 65535]"),
        ("", {"KVCONDUCTOR_BRIDGE_PORT": "x"}, "[bridge] port: expected int"),
        ("", {"KVCONDUCTOR_BRIDGE_NOPE": "1"}, "[bridge] nope: unknown key"),
        ('[bridge]\nregistrations_topic = "kv-events"\n', {}, "must differ from [kafka] engine"),
        ('[kafka]\nbootstrap_servers = "nope"\n', {}, "[kafka] bootstrap_servers"),
        ("[bridge]\nbuffer_max_messages = 0\n", {}, "buffer_max_messages: must be at least 1"),
        ("[bridge]\nbatch_size = 1048577\n", {}, "batch_size: must be in [1024, max_request_size"),
        ('[bridge]\ncompression_type = "brotli"\n', {}, "compression_type: expected one of"),
        (BASE.replace('model = "m"\n', ""), {}, "#1 (e) model: required for an engine"),
        (BASE.replace("block_size = 16\n", ""), {}, "#1 (e) block_size: required"),
        (BASE.replace("tcp://h:5557", "tcp://*:5557"), {}, "tcp://<engine host>:5557"),
        (BASE.replace("tcp://h:5557", "http://h:1"), {}, "endpoint: expected tcp://"),
        (
            BASE + 'kind = "engine"\nsource = "mooncake"\n',
            {},
            "#1 (e) source: an engine publishes as",
        ),
        (
            BASE + 'kind = "pool"\nsource = "vllm"\n',
            {},
            "#1 (e) source: a pool backend publishes as mooncake",
        ),
        (BASE + 'offload = "remote"\n', {}, "offload: expected one of local, pool"),
        (BASE + "dp_size = 0\n", {}, "dp_size: must be in [1,"),
        (BASE + "endpont = 1\n", {}, "endpont: unknown key (did you mean endpoint?)"),
        (BASE + "dp_size = 2\n" + BASE + "dp_rank = 1\n", {}, "#2 (e) dp_rank: 'e' rank 1"),
        ('[[publishers]]\nendpoint = "tcp://h:1"\n', {}, "#1 id: required"),
        ("publishers = 3\n", {}, "[[publishers]]: expected an array of tables"),
    ],
)
def test_errors_are_one_line_and_name_the_key(
    tmp_path: Path, text: str, env: dict[str, str], needle: str
) -> None:
    path = tmp_path / "bridge.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_bridge_config(path, env=env)
    message = str(info.value)
    assert "\n" not in message
    assert needle in message, message


def test_a_codec_aiokafka_cannot_use_is_a_one_line_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvconductor.bridge import config

    monkeypatch.setitem(config.CODECS, "zstd", lambda: False)
    path = tmp_path / "bridge.toml"
    path.write_text('[bridge]\ncompression_type = "zstd"\n')
    with pytest.raises(ConfigError, match=r"compression_type: zstd needs the cramjam package"):
        load_bridge_config(path, env={})
    cfg = load_bridge_config(None, env={"KVCONDUCTOR_BRIDGE_COMPRESSION_TYPE": "gzip"})
    assert cfg.bridge.compression_type == "gzip"


def test_example_config_lists_every_bridge_key() -> None:
    text = EXAMPLE.read_text()
    section = text.split("\n[bridge]\n", 1)[1].split("\n[log]\n", 1)[0]
    listed = re.findall(r"^(\w+) = ", section, re.M)
    assert listed == [f.name for f in msgspec.structs.fields(BridgeSettings)]


# ------------------------------------------------------------ authentication
#
# The daemon's [http] rule, applied to [bridge]: open on loopback, a token on
# any other address unless allow_unauthenticated = true (never both).

REQUIRED = (
    "config error: [bridge] auth_token: required (or auth_token_file) when [bridge] host is "
    "not a loopback address, got {host!r} from {source}; or set [bridge] "
    "allow_unauthenticated = true to let anyone who can reach the port register publishers"
)


@pytest.mark.parametrize("host", ["0.0.0.0", "10.1.2.3", "::", "[::]", "bridge", "example.com"])
def test_non_loopback_host_without_token_is_one_line_error(host: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_bridge_config(None, env={"KVCONDUCTOR_BRIDGE_HOST": host})
    assert str(info.value) == REQUIRED.format(host=host, source="KVCONDUCTOR_BRIDGE_HOST")


def test_non_loopback_host_from_the_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bridge.toml"
    path.write_text('[bridge]\nhost = "0.0.0.0"\n')
    with pytest.raises(ConfigError) as info:
        load_bridge_config(path, env={})
    assert str(info.value) == REQUIRED.format(host="0.0.0.0", source=path)


def test_non_loopback_host_with_token_loads(tmp_path: Path) -> None:
    cfg = load_bridge_config(
        None, env={"KVCONDUCTOR_BRIDGE_HOST": "0.0.0.0", "KVCONDUCTOR_BRIDGE_AUTH_TOKEN": "s3cret"}
    )
    assert cfg.bridge.host == "0.0.0.0" and cfg.bridge.allow_unauthenticated is False
    assert cfg.bridge.auth_token is not None and cfg.bridge.auth_token.reveal() == "s3cret"
    token = tmp_path / "token"
    token.write_text("from-a-file\n")
    env = {"KVCONDUCTOR_BRIDGE_HOST": "10.0.0.5", "KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE": str(token)}
    cfg = load_bridge_config(EXAMPLE, env=env)
    assert cfg.bridge.auth_token is not None and cfg.bridge.auth_token.reveal() == "from-a-file"


def test_non_loopback_host_with_explicit_opt_out_loads(tmp_path: Path) -> None:
    env = {"KVCONDUCTOR_BRIDGE_HOST": "0.0.0.0", "KVCONDUCTOR_BRIDGE_ALLOW_UNAUTHENTICATED": "true"}
    cfg = load_bridge_config(EXAMPLE, env=env)
    assert cfg.bridge.allow_unauthenticated is True and cfg.bridge.auth_token is None
    path = tmp_path / "bridge.toml"
    path.write_text('[bridge]\nhost = "0.0.0.0"\nallow_unauthenticated = true\n')
    assert load_bridge_config(path, env={}).bridge.allow_unauthenticated is True


@pytest.mark.parametrize(
    "env",
    [
        {"KVCONDUCTOR_BRIDGE_AUTH_TOKEN": "s3cret"},
        {"KVCONDUCTOR_BRIDGE_AUTH_TOKEN": "s3cret", "KVCONDUCTOR_BRIDGE_HOST": "0.0.0.0"},
        {"KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE": "TOKEN_FILE"},
    ],
)
def test_opt_out_with_a_token_is_an_error(tmp_path: Path, env: dict[str, str]) -> None:
    token = tmp_path / "token"
    token.write_text("s3cret\n")
    env = {k: str(token) if v == "TOKEN_FILE" else v for k, v in env.items()}
    env["KVCONDUCTOR_BRIDGE_ALLOW_UNAUTHENTICATED"] = "true"
    with pytest.raises(ConfigError) as info:
        load_bridge_config(None, env=env)
    assert str(info.value) == (
        "config error: [bridge] allow_unauthenticated: set, but auth_token is set too "
        "(from KVCONDUCTOR_BRIDGE_ALLOW_UNAUTHENTICATED)"
    )
    assert "s3cret" not in str(info.value)


@pytest.mark.parametrize("host", ["127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"])
def test_loopback_host_needs_no_token(host: str) -> None:
    cfg = load_bridge_config(EXAMPLE, env={"KVCONDUCTOR_BRIDGE_HOST": host})
    assert cfg.bridge.host == host and cfg.bridge.auth_token is None
    assert load_bridge_config(None, env={}).bridge.host == "127.0.0.1"  # the default


@pytest.mark.parametrize(
    ("token", "needle"),
    [
        ("   ", "[bridge] auth_token: must not be blank"),
        ("two words", "[bridge] auth_token: may hold only visible ASCII characters, no spaces"),
        ("caf\u00e9", "[bridge] auth_token: may hold only visible ASCII characters, no spaces"),
    ],
)
def test_token_must_fit_in_a_header(token: str, needle: str) -> None:
    env = {"KVCONDUCTOR_BRIDGE_HOST": "0.0.0.0", "KVCONDUCTOR_BRIDGE_AUTH_TOKEN": token}
    with pytest.raises(ConfigError) as info:
        load_bridge_config(None, env=env)
    message = str(info.value)
    assert "\n" not in message and needle in message, message


class _StubBridge:
    """A `BridgeControl` without Kafka or ZMQ."""

    def __init__(self) -> None:
        self.metrics = BridgeMetrics()
        self.metrics.messages.labels("vllm-secret-0", "0").inc()
        self.registry = None  # registrations off: an authorized /register gets 404

    def update_gauges(self) -> None:
        pass

    def describe(self) -> dict[str, object]:
        return {"streams": [{"id": "vllm-secret-0", "endpoint": "tcp://10.0.0.5:5557"}]}

    def health(self) -> tuple[bool, dict[str, object]]:
        return True, {"status": "ok"}


PROTECTED = [("POST", "/register"), ("POST", "/unregister"), ("GET", "/publishers")]
OPEN = [("GET", "/health"), ("GET", "/metrics")]
REGISTRATION = {
    "endpoint": "tcp://10.0.0.9:5557",
    "type": "vLLM",
    "modelname": "m",
    "instance_id": "intruder",
    "block_size": 16,
    "dp_rank": 0,
}


async def _call(client: TestClient[Any, Any], method: str, path: str, **kw: Any) -> int:
    body = REGISTRATION if path == "/register" else {"instance_id": "x", "dp_rank": 0}
    json = body if method == "POST" else None
    async with client.request(method, path, json=json, **kw) as resp:
        await resp.read()
        return resp.status


async def test_with_a_token_state_changes_and_the_publisher_list_need_it() -> None:
    app = make_app(_StubBridge(), auth_token="s3cret")
    async with TestClient(TestServer(app)) as client:
        for method, path in PROTECTED:
            assert await _call(client, method, path) == 401, path
            for header in ("Bearer wrong", "s3cret", "Bearer s3cret2", "Basic s3cret"):
                status = await _call(client, method, path, headers={"Authorization": header})
                assert status == 401, (path, header)
            for scheme in ("Bearer", "bearer"):  # the scheme is case-insensitive (RFC 7235)
                good = await _call(
                    client, method, path, headers={"Authorization": f"{scheme} s3cret"}
                )
                assert good != 401, (path, scheme)
        # Orchestrators' probes and scrapers need none.
        for method, path in OPEN:
            assert await _call(client, method, path) == 200, path


async def test_without_a_token_everything_is_open() -> None:
    app = make_app(_StubBridge(), auth_token=None)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        for method, path in PROTECTED + OPEN:
            assert await _call(client, method, path) != 401, path


def test_registration_bodies() -> None:
    body = RegisterBody(
        endpoint="tcp://10.0.0.1:5560",
        replay_endpoint="",
        type="SGLang",
        modelname="m",
        instance_id="sg-3",
        block_size=64,
        dp_rank=3,
        tenant_id=None,
        additionalsalt="w8a8",
    )
    pub = to_publisher(body)
    assert (pub.kind, pub.source, pub.dp_rank, pub.dp_size) == ("engine", "sglang", 3, 1)
    assert (pub.replay_endpoint, pub.tenant, pub.salt) == (None, "default", "w8a8")
    pool = to_publisher(
        RegisterBody(endpoint="tcp://m:19997", type="Mooncake", instance_id="mc", dp_rank=0)
    )
    assert (pool.kind, pool.source, pool.model) == ("pool", "mooncake", None)
    with pytest.raises(InvalidRegistration, match=r"^modelname: required"):
        to_publisher(RegisterBody(endpoint="tcp://h:1", type="vLLM", instance_id="x"))
    with pytest.raises(InvalidRegistration, match=r"^type: expected"):
        to_publisher(RegisterBody(endpoint="tcp://h:1", type="Ollama", instance_id="x"))


def test_cli_has_the_bridge_command() -> None:
    args = build_parser().parse_args(["bridge", "--config", "x.toml"])
    assert args.config == "x.toml" and args.func.__name__ == "_bridge"
