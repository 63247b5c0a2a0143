"""docker-compose.yml: valid against the Compose Specification's JSON schema, and
every service that runs kvconductor runs a command (and options, and env vars)
that the package really has, and the daemon and the bridge, listening on
0.0.0.0, get the bearer token that the one-shot `http-token` service
generates, which the engines send when they register with the bridge.

The schema is the one `check-jsonschema` vendors (`vendor.compose-spec`, from
the compose-spec/compose-spec repository, Apache-2.0); the YAML is read with
ruamel.yaml, which check-jsonschema depends on. Without check-jsonschema
installed the tests skip and say so.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import getpass
import json
import os
import re
import runpy
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from kvconductor.config import ConfigError, load_config
from kvconductor.tools.cli import build_parser
from tests.test_dockerfile import stages

REPO = Path(__file__).resolve().parent.parent
COMPOSE = REPO / "docker-compose.yml"
# The Dockerfile copies the repository's config/ folder here.
IMAGE_CONFIG_DIR = "/etc/kvconductor/"

check_jsonschema = pytest.importorskip(
    "check_jsonschema", reason="check-jsonschema (it ships the Compose schema) is not installed"
)


def compose_schema() -> dict[str, Any]:
    path = Path(check_jsonschema.__file__).parent / "builtin_schemas/vendor/compose-spec.json"
    schema: dict[str, Any] = json.loads(path.read_text())
    return schema


def load_compose(text: str | None = None) -> dict[str, Any]:
    from ruamel.yaml import YAML

    doc: dict[str, Any] = YAML(typ="safe").load(COMPOSE.read_text() if text is None else text)
    return doc


def schema_errors(doc: dict[str, Any]) -> list[str]:
    import jsonschema  # type: ignore[import-untyped,unused-ignore]

    schema = compose_schema()
    validator_cls = jsonschema.validators.validator_for(schema)
    validator = validator_cls(schema)
    return sorted(
        f"{'/'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in validator.iter_errors(doc)
    )


def kvconductor_services() -> dict[str, dict[str, Any]]:
    services: dict[str, dict[str, Any]] = load_compose()["services"]
    return {
        name: svc
        for name, svc in services.items()
        if isinstance(svc.get("command"), list) and svc["command"][:1] == ["kvconductor"]
    }


def test_compose_file_is_valid_against_the_compose_specification() -> None:
    doc = load_compose()
    assert schema_errors(doc) == []


def test_the_schema_check_catches_a_broken_file() -> None:
    doc = copy.deepcopy(load_compose())
    doc["services"]["kvconductor"]["comand"] = ["typo"]
    doc["services"]["kafka"]["healthcheck"]["test"] = {"not": "a command"}
    errors = schema_errors(doc)
    assert any("comand" in e for e in errors), errors
    assert any(e.startswith("services/kafka/healthcheck/test") for e in errors), errors


def test_stack_has_the_expected_services() -> None:
    doc = load_compose()
    services = doc["services"]
    assert {"kafka", "topics", "kvconductor", "bridge", "engines"} <= set(services)
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "broker,controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft
    assert "kafka-broker-api-versions.sh" in " ".join(kafka["healthcheck"]["test"])
    # The same Kafka release as the local broker of `kvconductor kafka-local`.
    from kvconductor.tools.kafka_local.broker import kafka_version

    assert kafka["image"] == f"apache/kafka:{kafka_version()}"
    topics = services["topics"]
    assert topics["restart"] == "no"
    assert topics["depends_on"]["kafka"]["condition"] == "service_healthy"
    script = topics["command"][0]
    snapshot_line = next(
        line for line in script.splitlines() if "KVCONDUCTOR_KAFKA_SNAPSHOT_TOPIC" in line
    )
    assert "$$compacted" in snapshot_line and "cleanup.policy=compact" in script
    for name in ("kvconductor", "bridge"):
        condition = services[name]["depends_on"]["topics"]["condition"]
        assert condition == "service_completed_successfully"
    # engines -> bridge -> Kafka: the engines register with the bridge service.
    engines = services["engines"]["command"]
    assert engines[engines.index("--via-bridge") + 1] == "http://bridge:8788"
    assert "bridge" in services["engines"]["depends_on"]
    bridge_port = services["bridge"]["environment"]["KVCONDUCTOR_BRIDGE_PORT"]
    assert f"http://bridge:{bridge_port}" == engines[engines.index("--via-bridge") + 1]


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("kvconductor's parser has no subcommands")


@pytest.mark.parametrize("service", ["kvconductor", "bridge", "engines"])
def test_service_command_exists_in_the_package(service: str) -> None:
    command = kvconductor_services()[service]["command"]
    sub = command[1]
    if sub not in _subcommands():
        pytest.skip(
            f"`kvconductor {sub}` is not in kvconductor.tools.cli yet (being built elsewhere)"
        )
    # Parses exactly as the container would run it: options must exist too.
    args = build_parser().parse_args(command[1:])
    assert args.command == sub
    config = getattr(args, "config", None)
    if config is not None:
        assert config.startswith(IMAGE_CONFIG_DIR), config
        local = REPO / "config" / config[len(IMAGE_CONFIG_DIR) :]
        if not local.is_file():
            pytest.skip(f"{local.relative_to(REPO)} (mounted as {config}) does not exist yet")


def image_env() -> dict[str, str]:
    """The KVCONDUCTOR_* variables the Dockerfile's ENV sets for every container."""
    out: dict[str, str] = {}
    for args in stages()["final"].each("ENV"):
        for pair in args.split():
            key, _, value = pair.partition("=")
            if key.startswith("KVCONDUCTOR_"):
                out[key] = value
    return out


def token_script() -> str:
    script: str = load_compose()["services"]["http-token"]["command"][0]
    return script


def run_token_script(path: Path) -> None:
    """The `http-token` service's script, writing to `path`, for this user."""
    script = token_script().replace("/run/kvconductor/http-token", str(path))
    script = script.replace('"kvconductor"', repr(getpass.getuser()))
    source = path.parent / "make_token.py"
    source.write_text(script)
    runpy.run_path(str(source))


def declared_env(service: str) -> dict[str, object]:
    """The `environment` the compose file gives the service."""
    env: dict[str, object] = kvconductor_services()[service]["environment"]
    return env


def service_env(service: str, token_file: Path) -> dict[str, str]:
    """What the service's process sees: the image's ENV, then the service's;
    the token file where this test wrote one."""
    env = {**image_env(), **{k: str(v) for k, v in declared_env(service).items()}}
    for key in TOKEN_FILE_VARS:
        if key in env:
            env[key] = str(token_file)
    return env


# The daemon's and the bridge's `auth_token_file` overrides.
TOKEN_FILE_VARS = ("KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE", "KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE")


@pytest.mark.parametrize("service", ["kvconductor", "engines"])
def test_service_environment_is_a_valid_daemon_config(service: str, tmp_path: Path) -> None:
    assert image_env()["KVCONDUCTOR_HTTP_HOST"] == "0.0.0.0"  # what makes the token needed
    token_file = tmp_path / "http-token"
    run_token_script(token_file)
    env = service_env(service, token_file)
    assert all(k.startswith("KVCONDUCTOR_") for k in env)
    try:
        cfg = load_config(REPO / "config" / "kvconductor.toml", env)
    except ConfigError as exc:  # pragma: no cover - the failure message is the point
        pytest.fail(f"{service}: {exc}")
    assert cfg.kafka.bootstrap_servers == "kafka:9092"


def test_cluster_profile_runs_three_replicated_nodes_and_a_daemon(tmp_path: Path) -> None:
    services = load_compose()["services"]
    nodes = [services[f"kafka-{i}"] for i in (1, 2, 3)]
    assert {n["image"] for n in nodes} == {services["kafka"]["image"]}
    for i, node in enumerate(nodes, 1):
        env = node["environment"]
        assert node["profiles"] == ["cluster"]
        assert env["KAFKA_NODE_ID"] == str(i)
        assert env["KAFKA_CONTROLLER_QUORUM_VOTERS"] == (
            "1@kafka-1:9093,2@kafka-2:9093,3@kafka-3:9093"
        )
        assert env["KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR"] == "3"
        assert env["KAFKA_TRANSACTION_STATE_LOG_MIN_ISR"] == env["KAFKA_MIN_INSYNC_REPLICAS"] == "2"
    assert len({n["environment"]["CLUSTER_ID"] for n in nodes}) == 1
    daemon = services["kvconductor-cluster"]
    assert daemon["profiles"] == ["cluster"]
    assert {f"kafka-{i}" for i in (1, 2, 3)} <= set(daemon["depends_on"])
    token_file = tmp_path / "http-token"
    run_token_script(token_file)
    cfg = load_config(
        REPO / "config" / "kvconductor.toml", service_env("kvconductor-cluster", token_file)
    )
    assert cfg.kafka.bootstrap_servers == "kafka-1:9092,kafka-2:9092,kafka-3:9092"
    assert cfg.kafka.replication_factor is None  # min(3, brokers): 3


def test_daemon_listens_everywhere_with_the_generated_token(tmp_path: Path) -> None:
    services = load_compose()["services"]
    daemon, maker = services["kvconductor"], services["http-token"]
    token_path = declared_env("kvconductor")["KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE"]
    assert isinstance(token_path, str)
    # The daemon mounts, read-only, the volume the one-shot service writes.
    (maker_volume,) = maker["volumes"]
    volume, _, folder = maker_volume.partition(":")
    assert f"{volume}:{folder}:ro" in daemon["volumes"]
    assert token_path.startswith(folder + "/") and token_path in token_script()
    assert volume in load_compose()["volumes"]
    assert daemon["depends_on"]["http-token"]["condition"] == "service_completed_successfully"
    assert maker["restart"] == "no"

    token_file = tmp_path / "http-token"
    run_token_script(token_file)
    token = token_file.read_text().strip()
    assert len(token) >= 32 and oct(os.stat(token_file).st_mode)[-3:] == "400"
    run_token_script(token_file)  # a restart keeps the token
    assert token_file.read_text().strip() == token
    cfg = load_config(REPO / "config" / "kvconductor.toml", service_env("kvconductor", token_file))
    assert cfg.http.host == "0.0.0.0"
    assert cfg.http.auth_token is not None and cfg.http.auth_token.reveal() == token

    # Without the token, the same environment is refused, naming the key.
    env = service_env("kvconductor", token_file)
    del env["KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE"]
    with pytest.raises(ConfigError, match=re.escape("[http] auth_token: required")):
        load_config(REPO / "config" / "kvconductor.toml", env)


def test_bridge_environment_is_a_valid_bridge_config(tmp_path: Path) -> None:
    try:
        from kvconductor.bridge.config import load_bridge_config
    except ImportError:
        pytest.skip("kvconductor.bridge.config is not there yet (being built elsewhere)")
    token_file = tmp_path / "http-token"
    run_token_script(token_file)
    token = token_file.read_text().strip()
    env = service_env("bridge", token_file)
    cfg = load_bridge_config(REPO / "config" / "bridge.toml", env)
    assert cfg.kafka.bootstrap_servers == "kafka:9092"
    assert cfg.bridge.host == "0.0.0.0"
    assert cfg.bridge.auth_token is not None and cfg.bridge.auth_token.reveal() == token
    assert cfg.bridge.allow_unauthenticated is False

    # Without the token, the same environment is refused, naming the key.
    del env["KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE"]
    with pytest.raises(ConfigError, match=re.escape("[bridge] auth_token: required")):
        load_bridge_config(REPO / "config" / "bridge.toml", env)


def test_bridge_and_engines_share_the_generated_token() -> None:
    services = load_compose()["services"]
    (maker_volume,) = services["http-token"]["volumes"]
    volume, _, folder = maker_volume.partition(":")
    daemon_path = declared_env("kvconductor")["KVCONDUCTOR_HTTP_AUTH_TOKEN_FILE"]
    for name in ("bridge", "engines"):
        svc = services[name]
        # The same file as the daemon's, from the same volume, read-only.
        assert declared_env(name)["KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE"] == daemon_path, name
        assert f"{volume}:{folder}:ro" in svc["volumes"], name
        assert svc["depends_on"]["http-token"]["condition"] == "service_completed_successfully"


def engines_entrypoint() -> list[str]:
    """The engines' entrypoint as the container runs it: Compose turns `$$` into `$`."""
    entrypoint: list[str] = load_compose()["services"]["engines"]["entrypoint"]
    return [part.replace("$$", "$") for part in entrypoint]


def test_engines_entrypoint_hands_the_token_to_the_command(tmp_path: Path) -> None:
    sh = shutil.which("sh")
    if sh is None:  # pragma: no cover - every POSIX system has one
        pytest.skip("no sh to run the entrypoint with")
    entrypoint = engines_entrypoint()
    assert entrypoint[0] == "/bin/sh"  # the image (python:*-slim) has it
    token_file = tmp_path / "http-token"
    run_token_script(token_file)
    token = token_file.read_text().strip()
    env = {"PATH": os.environ["PATH"], "KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE": str(token_file)}
    # The service's command comes after the entrypoint; `env` stands in for it.
    run = subprocess.run(
        [sh, *entrypoint[1:], "env"], env=env, capture_output=True, text=True, timeout=30
    )
    assert run.returncode == 0, run.stderr
    assert f"KVCONDUCTOR_BRIDGE_AUTH_TOKEN={token}" in run.stdout.splitlines()
    # Arguments reach the command untouched.
    run = subprocess.run(
        [sh, *entrypoint[1:], "printf", "%s|", "a b", "$HOME"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert run.stdout == "a b|$HOME|"
    # No token file: the container fails (and restarts) instead of registering without.
    env["KVCONDUCTOR_BRIDGE_AUTH_TOKEN_FILE"] = str(tmp_path / "missing")
    run = subprocess.run(
        [sh, *entrypoint[1:], "true"], env=env, capture_output=True, text=True, timeout=30
    )
    assert run.returncode != 0


async def test_demo_engines_send_the_bridge_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """`kvconductor demo --via-bridge` registers with the token the entrypoint exports."""
    from aiohttp import web
    from aiohttp.test_utils import TestServer

    from kvconductor.tools.demo.run import register_with_bridge

    seen: list[str | None] = []

    async def register(request: web.Request) -> web.Response:
        seen.append(request.headers.get("Authorization"))
        return web.json_response({"status": "registered successfully"})

    app = web.Application()
    app.router.add_post("/register", register)
    monkeypatch.setenv("KVCONDUCTOR_BRIDGE_AUTH_TOKEN", "t0ken")
    async with TestServer(app, host="127.0.0.1") as server:
        url = str(server.make_url("")).rstrip("/")
        body = {"instance_id": "e", "dp_rank": 0}
        await register_with_bridge(url, [body], 5.0, asyncio.Event())
    assert seen == ["Bearer t0ken"]
