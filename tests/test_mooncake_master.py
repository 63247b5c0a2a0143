"""The real `mooncake_master` (PyPI, 0.3.14) -> bridge -> Kafka -> daemon.

Mooncake's own store client puts, removes and clears objects under vLLM's
connector keys; the master publishes its KV events; the bridge relays them
and reconciles against the master's key list; the daemon's answers must
follow: a vLLM rank's offload intents are confirmed by the master's stores
(once per block whatever the TP ranks), removals and `remove_all` take
blocks out, evictions and a dead client's objects (which the master does not
announce) are taken out by the reconciliation, and a key naming no block is
counted.

Needs the wheels `.ci/mooncake` installs (CI runs it); skipped without them.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from kvconductor.registry.publishers import PublisherConfig
from kvconductor.tools.kafka_local.broker import free_ports
from tests.bridge_fakes import bridge_config, running_bridge
from tests.harness import (
    daemon_config,
    engine_headers,
    http_json,
    produce,
    running,
    stored,
    vllm_payload,
    wait_for,
)

pytestmark = pytest.mark.kafka

ROOT = Path(__file__).resolve().parents[1]
MOONCAKE = Path(os.environ.get("KVCONDUCTOR_MOONCAKE_DIR", ROOT / ".mooncake"))
MASTER = MOONCAKE / "master" / "mooncake" / "mooncake_master"
CLIENT = MOONCAKE / "client"
BS = 4
TOKENS = list(range(300, 316))  # four blocks of four
DIGESTS = [hashlib.sha256(f"block {i}".encode()).digest() for i in range(4)]
MASK = (1 << 64) - 1
MB = 1 << 20

if not MASTER.exists() or not (CLIENT / "mooncake").exists():
    pytest.skip(
        f"Mooncake's master and store client are not installed in {MOONCAKE} "
        "(run .ci/mooncake: PyPI mooncake-transfer-engine-cuda13==0.3.14 and "
        "mooncake-transfer-engine-non-cuda==0.3.13.post1, Debian libibverbs1)",
        allow_module_level=True,
    )


def vllm_int(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & MASK


def key(block: int, tp: int) -> str:
    """vLLM's MooncakeStoreConnector key of a block for TP rank `tp`."""
    return f"m@tp_rank:{tp}@pcp0@dcp0@pp_rank:0@group:0@{DIGESTS[block].hex()}"


class Master:
    def __init__(self) -> None:
        self.rpc, self.metrics, self.meta, self.events = free_ports(4)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, log: Path) -> None:
        args = [
            str(MASTER),
            f"--rpc_port={self.rpc}",
            f"--metrics_port={self.metrics}",
            "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.meta}",
            "--enable_kv_events=true",
            f"--kv_events_bind_endpoint=tcp://127.0.0.1:{self.events}",
            "--kv_events_backend_id=mc-real",
            # short leases: objects may be removed and evicted at once
            "--default_kv_lease_ttl=20",
            "--eviction_high_watermark_ratio=0.6",
            "--eviction_ratio=0.5",
            # a client gone this long loses its segment, and its objects
            "--client_ttl=2",
        ]
        with log.open("wb") as out:
            self.proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)

    def get(self, path: str) -> str:
        url = f"http://127.0.0.1:{self.metrics}{path}"
        with urllib.request.urlopen(url, timeout=2) as resp:
            body: bytes = resp.read()
        return body.decode()

    def keys(self) -> set[str]:
        return set(self.get("/get_all_keys").split())

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class Client:
    """Mooncake's store client in a subprocess (`mooncake_store_client.py`)."""

    def __init__(self, master: Master, segment: int) -> None:
        env = {**os.environ, "PYTHONPATH": str(CLIENT)}
        self.proc = subprocess.Popen(
            [
                sys.executable,
                str(Path(__file__).with_name("mooncake_store_client.py")),
                f"127.0.0.1:{master.rpc}",
                f"http://127.0.0.1:{master.meta}/metadata",
                str(segment),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )

    async def _reply(self) -> int:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), 30)
        assert line, "the store client exited"
        rc: int = json.loads(line)["rc"]
        return rc

    async def ready(self) -> None:
        assert await self._reply() == 0, "store client setup failed"

    async def do(self, **cmd: Any) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()
        return await self._reply()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def master(tmp_path: Path) -> Iterator[Master]:
    m = Master()
    m.start(tmp_path / "mooncake_master.log")
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture
async def client(master: Master) -> AsyncIterator[Client]:
    def up() -> bool:
        try:
            return '"enabled":true' in master.get("/kv_events/status")
        except OSError:
            return False

    await wait_for(up, 20, "mooncake_master up")
    c = Client(master, 32 * MB)
    try:
        await c.ready()
        yield c
    finally:
        c.stop()


async def test_real_master_confirms_removes_reconciles_and_clears(
    kafka_bootstrap: str, master: Master, client: Client
) -> None:
    dcfg = daemon_config(kafka_bootstrap)
    pool = PublisherConfig(
        id="mooncake-A",  # not the master's backend_id (mc-real)
        endpoint=f"tcp://127.0.0.1:{master.events}",
        kind="pool",
        source="mooncake",
        model="m",
        block_size=BS,
        reconcile_url=f"http://127.0.0.1:{master.metrics}",
        reconcile_interval_s=1.0,
    )
    bcfg = bridge_config(
        kafka_bootstrap,
        (pool,),
        engine_topic=dcfg.kafka.engine_topic,
        pool_topic=dcfg.kafka.pool_topic,
        registrations=False,
        idle_probe_s=0.0,
    )
    async with running(dcfg) as daemon, running_bridge(bcfg) as bridge:
        port = daemon.http_port
        assert port is not None

        async def host_hit() -> int:
            _, body = await http_json(
                port, "POST", "/query", {"model": "m", "block_size": BS, "token_ids": TOKENS}
            )
            rows = body.get("default", {})
            hit: int = max((r["CPU"] for r in rows.values()), default=0)
            return hit

        async def hit_is(want: int) -> bool:
            return await host_hit() == want

        # vllm-a holds block 0 on its GPU; vllm-b (kv-offload: pool) offloads
        # blocks 0..3 into the master: intents, confirmed by the master's events.
        hashes = [vllm_int(d) for d in DIGESTS]
        await produce(
            kafka_bootstrap,
            dcfg.kafka.engine_topic,
            [
                ("vllm-a", vllm_payload([stored(hashes[:1], TOKENS[:BS])]), engine_headers()),
                (
                    "vllm-b",
                    vllm_payload([stored(hashes, TOKENS, medium="CPU")]),
                    [*engine_headers(), ("kv-offload", b"pool")],
                ),
            ],
        )
        await wait_for(lambda: hit_is(BS), 30, "vllm-a's device block")
        await asyncio.sleep(0.5)  # the bridge's SUB socket joins the master's PUB

        for tp in (0, 1):
            for block in range(4):
                assert await client.do(op="put", key=key(block, tp), size=MB) == 0
        await wait_for(lambda: hit_is(4 * BS), 30, "intents confirmed by the master")
        assert await client.do(op="put", key="not-a-block", size=1024) == 0

        # one TP rank's copy of block 3 goes: the other still holds the block
        assert await client.do(op="remove", key=key(3, 0)) == 0
        await asyncio.sleep(1.0)
        assert await host_hit() == 4 * BS
        assert await client.do(op="remove", key=key(3, 1)) == 0
        await wait_for(lambda: hit_is(3 * BS), 30, "block 3 removed")

        _, metrics = await http_json(port, "GET", "/metrics")
        text = metrics if isinstance(metrics, str) else json.dumps(metrics)
        assert 'kind="pool_key_unparsed"' in text

        # fill the segment: the master evicts (oldest first) and says nothing
        for i in range(24):
            await client.do(op="put", key=f"filler-{i}", size=MB)
        await asyncio.sleep(0.5)

        def expected() -> int:
            listed = master.keys()
            # block 0 stays on vllm-a's GPU whatever the pool holds
            held = [b == 0 or any(key(b, tp) in listed for tp in (0, 1)) for b in range(3)]
            return next((i for i, h in enumerate(held) if not h), 3) * BS

        def reconciled() -> float:
            got = bridge.metrics.registry.get_sample_value(
                "kvconductor_bridge_reconciled_removals_total",
                {"publisher": "mooncake-A", "dp_rank": "0"},
            )
            return got or 0.0

        evicted = expected() < 3 * BS
        await wait_for(lambda: hit_is(expected()), 30, "evictions reconciled")
        assert reconciled() > 0

        # remove_all: per-object removals, then `cleared`
        assert await client.do(op="remove_all") >= 0
        await wait_for(lambda: hit_is(BS), 30, "remove_all cleared the pool")
        assert evicted, "the master evicted no block: the reconciliation went untested"

        # stored again (confirmed from content the index still has), then the
        # only client, whose segment holds them, dies: no event, gone anyway
        for block in (1, 2):
            assert await client.do(op="put", key=key(block, 0), size=MB) == 0
        await wait_for(lambda: hit_is(3 * BS), 30, "blocks stored again")
        before = reconciled()
        client.stop()
        await wait_for(lambda: not master.keys(), 30, "the master dropped the dead segment")
        await wait_for(lambda: hit_is(BS), 30, "segment loss reconciled")
        assert reconciled() >= before + 2  # the bridge's removals, not the master's
