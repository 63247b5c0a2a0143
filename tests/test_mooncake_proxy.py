"""Mooncake's own example router, unmodified, with kvconductor as its Conductor
(issues #24 and #35): `mooncake-conductor/example/cache_aware_disagg_proxy.py`
from Mooncake's `dev/conductor` branch, pointed at the daemon, registers every
prefill rank there, and routes every request by kvconductor's msgpack answer
(no fallback in its log) to the instance kvconductor's JSON answer ranks best.
The engines also register themselves (one at the bridge, one at the daemon,
with their replay sockets and report mode, without a hash profile), before
the router starts, after it, or one on each side: the router's registration
of the same ranks merges with theirs, so it starts (it needs 200 for every
rank) and routes all 12 requests in each order.

The proxy is Mooncake's file, kept unmodified in tests/fixtures/mooncake-conductor
(KVCONDUCTOR_MOONCAKE_PROXY: another copy's path). It runs under
KVCONDUCTOR_MOONCAKE_PYTHON, default this interpreter, which needs its
README's dependencies (`pip install fastapi httpx uvicorn msgpack`); the test
is skipped without them. The engines are ZMQ publishers speaking vLLM's wire
form through the real bridge and broker; their HTTP side (`/tokenize`,
`/v1/completions`) is a stub that records which prefill instance the proxy
chose.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvconductor.registry.log import RegistrationLog
from kvconductor.registry.publishers import StreamKey
from tests.bridge_fakes import FakePublisher, running_bridge
from tests.harness import http_json, running, stored, vllm_payload, wait_for
from tests.test_registrations import daemon_and_bridge

FIXTURE = Path(__file__).parent / "fixtures" / "mooncake-conductor" / "cache_aware_disagg_proxy.py"
PROXY = os.environ.get("KVCONDUCTOR_MOONCAKE_PROXY") or str(FIXTURE)
PYTHON = os.environ.get("KVCONDUCTOR_MOONCAKE_PYTHON", sys.executable)


def proxy_runs() -> bool:
    """Whether PYTHON has the proxy's dependencies."""
    needs = ("fastapi", "httpx", "uvicorn", "msgpack")
    if sys.executable == PYTHON:
        return all(importlib.util.find_spec(name) is not None for name in needs)
    probe = [PYTHON, "-c", f"import {', '.join(needs)}"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


pytestmark = [
    pytest.mark.kafka,
    pytest.mark.skipif(
        not proxy_runs(),
        reason=f"{PYTHON} lacks the proxy's dependencies (fastapi httpx uvicorn msgpack; "
        "or set KVCONDUCTOR_MOONCAKE_PYTHON, see this module's docstring)",
    ),
]

BS = 16
MODEL = "Qwen/Qwen2.5-7B-Instruct"
# Two prompts of four blocks; prefill-a holds all of A and one block of B,
# prefill-b two blocks of A and all of B.
PROMPTS = {
    "A": [1000 + i for i in range(4 * BS)],
    "B": [5000 + i for i in range(4 * BS)],
}
HOLDS = {"prefill-a": {"A": 4, "B": 1}, "prefill-b": {"A": 2, "B": 4}}
REQUESTS = ["A", "B"] * 6
PROFILE = {
    "strategy": "vllm_v1",
    "algorithm": "sha256_cbor",
    "python_hash_seed": "0",
    "index_projection": "low64_be",
}
# Where each engine registers itself: one at the bridge, one at the daemon.
SELF_REGISTERED_AT = {"prefill-a": "bridge", "prefill-b": "daemon"}
# The engines that register themselves before the router starts, per order;
# the others register after it.
BEFORE_ROUTER = {
    "router-first": (),
    "engines-first": ("prefill-a", "prefill-b"),
    "router-between": ("prefill-a",),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Engines:
    """The prefill instances' and the decode instance's HTTP side."""

    def __init__(self) -> None:
        self.prefilled: list[tuple[str, str]] = []  # (instance, prompt)
        self.runners: list[web.AppRunner] = []

    async def serve(self, name: str) -> str:
        app = web.Application()

        async def tokenize(request: web.Request) -> web.Response:
            prompt = (await request.json())["prompt"]
            return web.json_response({"tokens": PROMPTS[prompt]})

        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            if body.get("kv_transfer_params", {}).get("do_remote_decode"):
                self.prefilled.append((name, body["prompt"]))
                return web.json_response({"kv_transfer_params": {"done": True}})
            return web.json_response({"choices": [{"text": "ok"}]})

        app.router.add_post("/tokenize", tokenize)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        port = free_port()
        await web.TCPSite(runner, "127.0.0.1", port).start()
        self.runners.append(runner)
        return f"http://127.0.0.1:{port}"

    async def close(self) -> None:
        for runner in self.runners:
            await runner.cleanup()


@pytest.fixture
async def ctx() -> AsyncIterator[zmq.asyncio.Context]:
    context = zmq.asyncio.Context()
    yield context
    context.term()


def blocks(prompt: str, count: int) -> dict[str, Any]:
    tokens = PROMPTS[prompt][: count * BS]
    base = 0xA000 if prompt == "A" else 0xB000
    return stored([base + i for i in range(count)], tokens, block_size=BS)


def engine_registration(name: str, pub: FakePublisher) -> dict[str, Any]:
    """An engine's own registration of its rank 0 (the JSON form): what the
    router's leaves out (its replay socket, report mode) and no profile."""
    return {
        "endpoint": pub.endpoint,
        "replay_endpoint": pub.replay_endpoint,
        "type": "vLLM",
        "modelname": MODEL,
        "instance_id": name,
        "block_size": BS,
        "dp_rank": 0,
        "kv_offload": "local",
        "kv_report_mode": "incremental",
    }


def merged(log: RegistrationLog, key: StreamKey) -> bool:
    """Whether `log` holds the router's and the engine's registration of `key`
    merged: the router's profile and the engine's replay socket."""
    entry = log.catalog.get(key)
    return (
        entry is not None
        and entry.body.hash_profile is not None
        and entry.publisher.replay_endpoint is not None
        and entry.publisher.report_mode == "incremental"
    )


@pytest.mark.parametrize("order", list(BEFORE_ROUTER))
async def test_mooncakes_router_routes_every_request_by_kvconductor(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context, tmp_path: Path, order: str
) -> None:
    cfg, bcfg = daemon_and_bridge(kafka_bootstrap)
    pubs = {name: FakePublisher(ctx) for name in HOLDS}
    keys = {name: StreamKey(name, 0) for name in pubs}
    engines = Engines()
    proxy: asyncio.subprocess.Process | None = None
    log_path = tmp_path / "proxy.log"
    try:
        async with running(cfg) as daemon, running_bridge(bcfg) as bridge:
            assert daemon.registrations is not None and daemon.http_port is not None
            assert bridge.registry is not None and bridge.http_port is not None
            await wait_for(daemon.registrations.loaded.is_set, 30, "registrations loaded")
            logs = {"daemon": daemon.registrations, "bridge": bridge.registry.log}
            ports = {"daemon": daemon.http_port, "bridge": bridge.http_port}

            async def register_engines(names: tuple[str, ...]) -> None:
                for name in names:
                    where = SELF_REGISTERED_AT[name]
                    status, answer = await http_json(
                        ports[where], "POST", "/register", engine_registration(name, pubs[name])
                    )
                    assert (status, answer) == (
                        200,
                        {"status": "registered successfully", "instance_id": name},
                    ), (where, answer)
                    # Read back by both, so each checks the next one against it.
                    await wait_for(
                        lambda k=keys[name]: all(k in log.catalog for log in logs.values()),
                        30,
                        f"{name}'s registration read back",
                    )

            config = {
                "conductor": {
                    "address": f"http://127.0.0.1:{daemon.http_port}",
                    "query_timeout_seconds": 5.0,
                    "registration_timeout_seconds": 10.0,
                },
                "prefill": {
                    "config": {
                        "modelname": MODEL,
                        "block_size": BS,
                        "tenant_id": "default",
                        "lora_name": "",
                        "hash_profile": PROFILE,
                    },
                    "instances": [
                        {
                            "instance_id": name,
                            "http_endpoint": await engines.serve(name),
                            "registrations": [{"endpoint": pub.endpoint, "dp_rank": 0}],
                        }
                        for name, pub in pubs.items()
                    ],
                },
                "decode": {"instances": [{"http_endpoint": await engines.serve("decode")}]},
            }
            (tmp_path / "proxy.json").write_text(json.dumps(config))
            port = free_port()
            session = aiohttp.ClientSession()

            async def healthy() -> bool:
                try:
                    async with session.get(f"http://127.0.0.1:{port}/healthcheck") as r:
                        return r.status == 200
                except aiohttp.ClientError:
                    return False

            await register_engines(BEFORE_ROUTER[order])
            with log_path.open("wb") as log:
                proxy = await asyncio.create_subprocess_exec(
                    PYTHON,
                    PROXY,
                    "--config",
                    str(tmp_path / "proxy.json"),
                    "--port",
                    str(port),
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                )
            try:
                # It serves only once every rank's registration was answered 200.
                await wait_for(healthy, 60, "the proxy up")
                await wait_for(
                    lambda: all(
                        log.catalog.get(k) is not None
                        and log.catalog[k].body.hash_profile is not None
                        for log in logs.values()
                        for k in keys.values()
                    ),
                    30,
                    "the router's registrations read back",
                )
                await register_engines(tuple(n for n in pubs if n not in BEFORE_ROUTER[order]))
                # One registration per rank, the two merged, at both nodes; the
                # bridge relays each rank from its replay-capable socket.
                for key in keys.values():
                    await wait_for(
                        lambda k=key: all(merged(log, k) for log in logs.values()),
                        30,
                        f"{key} merged",
                    )
                async with session.get(
                    f"http://127.0.0.1:{daemon.http_port}/services",
                    headers={"Accept": "application/json"},
                ) as r:
                    services = await r.json()
                assert services["count"] == 2, services
                for view in services["services"]:
                    assert view["HashProfile"]["python_hash_seed"] == "0", view
                    assert view["ReplayEndpoint"] == pubs[view["InstanceID"]].replay_endpoint
                for name, key in keys.items():
                    await wait_for(
                        lambda k=key, n=name: (
                            k in bridge.streams
                            and bridge.streams[k].pub.replay_endpoint == pubs[n].replay_endpoint
                        ),
                        30,
                        f"the bridge relays {key}",
                    )
                for name, pub in pubs.items():
                    await pub.wait_subscribed()
                    events = [blocks(p, n) for p, n in HOLDS[name].items()]
                    await pub.publish(vllm_payload(events, 0))

                async def indexed() -> bool:
                    _, answer = await http_json(
                        daemon.http_port or 0,
                        "POST",
                        "/query",
                        {"model": MODEL, "block_size": BS, "token_ids": PROMPTS["B"]},
                    )
                    return len(answer.get("default", {})) == 2

                await wait_for(indexed, 30, "the engines' blocks indexed")
                best = {}
                for prompt, tokens in PROMPTS.items():
                    body = {"model": MODEL, "block_size": BS, "token_ids": tokens}
                    _, answer = await http_json(daemon.http_port, "POST", "/query", body)
                    rows = answer["default"]
                    best[prompt] = max(rows, key=lambda n: (rows[n]["longest_matched"], n))
                assert best == {"A": "prefill-a", "B": "prefill-b"}

                for prompt in REQUESTS:
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                    async with session.post(
                        f"http://127.0.0.1:{port}/v1/completions", json=body
                    ) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
            finally:
                await session.close()
        text = log_path.read_text(errors="replace")
        assert "cache_aware_fallback" not in text, text
        assert text.count("selected_instance=") == len(REQUESTS), text
        assert engines.prefilled == [(best[p], p) for p in REQUESTS]
    finally:
        if proxy is not None and proxy.returncode is None:
            proxy.terminate()
            await proxy.wait()
        await engines.close()
        for pub in pubs.values():
            await pub.close()
