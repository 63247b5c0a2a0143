"""The bridge's configuration: the example file, env overrides, one-line errors."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvconductor.bridge.config import load_bridge_config
from kvconductor.bridge.registry import InvalidRegistration, RegisterBody, to_publisher
from kvconductor.cli import build_parser
from kvconductor.config import ConfigError

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
    assert (pool.kind, pool.source, pool.model) == ("pool", "mooncake", None)
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
        (BASE.replace('model = "m"\n', ""), {}, "#1 (e) model: required for an engine"),
        (BASE.replace("block_size = 16\n", ""), {}, "#1 (e) block_size: required"),
        (BASE.replace("tcp://h:5557", "tcp://*:5557"), {}, "endpoint: a subscriber connects"),
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
