"""Mooncake's own example router, unmodified, with kvconductor as its Conductor
(issue #24's acceptance): `mooncake-conductor/example/cache_aware_disagg_proxy.py`
from Mooncake's `dev/conductor` branch, pointed at the daemon, registers every
prefill rank there, and routes every request by kvconductor's msgpack answer
(no fallback in its log) to the instance kvconductor's JSON answer ranks best.

The proxy is Mooncake's file and is not in this repository: set
KVCONDUCTOR_MOONCAKE_PROXY to its path, and KVCONDUCTOR_MOONCAKE_PYTHON to
the interpreter of a virtualenv with its README's dependencies (`pip install
fastapi httpx uvicorn msgpack`; default: this interpreter). The engines are
ZMQ publishers speaking vLLM's wire form through the real bridge and broker;
their HTTP side (`/tokenize`, `/v1/completions`) is a stub that records
which prefill instance the proxy chose.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import zmq
import zmq.asyncio
from aiohttp import web

from kvconductor.registry.publishers import StreamKey
from tests.bridge_fakes import FakePublisher, running_bridge
from tests.harness import http_json, running, stored, vllm_payload, wait_for
from tests.test_registrations import daemon_and_bridge

PROXY = os.environ.get("KVCONDUCTOR_MOONCAKE_PROXY")
PYTHON = os.environ.get("KVCONDUCTOR_MOONCAKE_PYTHON", sys.executable)

pytestmark = [
    pytest.mark.kafka,
    pytest.mark.skipif(
        not PROXY,
        reason="KVCONDUCTOR_MOONCAKE_PROXY is not set (the path of Mooncake's "
        "cache_aware_disagg_proxy.py, branch dev/conductor; see this module's docstring)",
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


async def test_mooncakes_router_routes_every_request_by_kvconductor(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context, tmp_path: Path
) -> None:
    assert PROXY is not None
    cfg, bcfg = daemon_and_bridge(kafka_bootstrap)
    pubs = {name: FakePublisher(ctx) for name in HOLDS}
    engines = Engines()
    proxy: asyncio.subprocess.Process | None = None
    log_path = tmp_path / "proxy.log"
    try:
        async with running(cfg) as daemon, running_bridge(bcfg) as bridge:
            assert daemon.registrations is not None and daemon.http_port is not None
            await wait_for(daemon.registrations.loaded.is_set, 30, "registrations loaded")
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
                        "hash_profile": {
                            "strategy": "vllm_v1",
                            "algorithm": "sha256_cbor",
                            "python_hash_seed": "0",
                            "index_projection": "low64_be",
                        },
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
            # It registered every rank at the daemon; the bridge relays them.
            keys = [StreamKey(name, 0) for name in pubs]
            await wait_for(lambda: all(k in bridge.streams for k in keys), 60, "registered")
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

            async with aiohttp.ClientSession() as session:

                async def healthy() -> bool:
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/healthcheck") as r:
                            return r.status == 200
                    except aiohttp.ClientError:
                        return False

                await wait_for(healthy, 60, "the proxy up")
                for prompt in REQUESTS:
                    body = {"model": MODEL, "prompt": prompt, "max_tokens": 4}
                    async with session.post(
                        f"http://127.0.0.1:{port}/v1/completions", json=body
                    ) as r:
                        assert r.status == 200, await r.text()
                        await r.read()
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
