"""Hits as vLLM computes them (contract section 2, v2: copies and hybrid
models), against vLLM's own numbers.

- tests/fixtures/vllm-hybrid: records of vLLM's real `KVCacheManager` for
  hybrid layouts (full attention + sliding window, MLA + sliding-window MLA,
  full attention + Mamba, with and without a finer prefix-match unit) and
  dense controls, with vLLM's hit for every probe at four checkpoints;
- tests/fixtures/vllm-live: every message a real running vLLM published,
  with its own `cached_tokens` for each request, including a block held
  twice under one hash;
- tests/fixtures/vllm-live-hybrid: the same of a real vLLM serving a Gemma 3
  (five sliding-window groups, then the full-attention group 5).
- tests/fixtures/vllm-hybrid-order: records of vLLM's real `KVCacheManager`
  for layouts whose full-attention group is not group 0 (Gemma 3: group 5,
  GPT-OSS: group 1, Kimi Linear: Mamba groups then MLA, two full-attention
  groups around a sliding-window one) and a dense control, with vLLM's hits.

In process (both block stores in CI), through Kafka and the daemon's HTTP
API, across a SIGKILL of the daemon and its restore, and from a ZMQ
publisher through the bridge.
"""

from __future__ import annotations

import base64
import json
import random
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
import zmq.asyncio
from aiokafka import AIOKafkaProducer

from kvconductor.config import Config, load_config
from kvconductor.index.conductor import Conductor
from kvconductor.service.replica import Replica
from kvconductor.snapshots.units import (
    InstanceUnit,
    OwnerUnit,
    UnitKey,
    decode_unit,
    state_fingerprint,
)
from kvconductor.tools.bench import field_fleet
from kvconductor.tools.kafka_local import broker as kafka_local
from kvconductor.wire.errors import BadRecord
from kvconductor.wire.query import TokenQuery
from tests.bridge_fakes import FakePublisher, bridge_config, publisher, running_bridge
from tests.harness import (
    FIXTURE_ROOT,
    DaemonLives,
    create_event_topics,
    daemon_config,
    http_json,
    removed,
    running,
    stored,
    vllm_payload,
    wait_for,
    write_daemon_config,
)

HYBRID = FIXTURE_ROOT / "vllm-hybrid"
LIVE = FIXTURE_ROOT / "vllm-live"
LIVE_HYBRID = FIXTURE_ROOT / "vllm-live-hybrid"
HYBRID_ORDER = FIXTURE_ROOT / "vllm-hybrid-order"
CHECKPOINTS = (141, 325, 392, 393)
# The fixtures of vLLM's KV-cache manager with its hits: each is replayed alike.
MANAGER_FIXTURES = [
    pytest.param(HYBRID, id="vllm-hybrid"),
    pytest.param(HYBRID_ORDER, id="vllm-hybrid-order"),
]


def hybrid_records(root: Path = HYBRID) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "records.jsonl").read_text().splitlines()]


def hybrid_probes(root: Path = HYBRID) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (root / "probes.jsonl").read_text().splitlines()]


def headers(record: dict[str, Any]) -> list[tuple[str, bytes]]:
    return [(k, v.encode()) for k, v in record["headers"].items()]


def value(record: dict[str, Any]) -> bytes:
    return base64.b64decode(record["value_b64"])


def want(probe: dict[str, Any], uncapped: bool) -> int:
    """vLLM's hit; where it rests on a prefix no event names, the part the
    events determine (the fixture's README)."""
    key = "events_only_gpu" if not probe.get("determined_by_events", True) else "expected_gpu"
    return int(probe[key + ("_uncapped" if uncapped else "")])


def probe_body(probe: dict[str, Any], uncapped: bool) -> dict[str, Any]:
    tokens = probe["prompt_token_ids"]
    return {
        "model": probe["model"],
        "block_size": probe["block_size"],
        "instance_id": probe["instance"],
        # vLLM recomputes the last prompt token: its hit is the uncapped hit
        # of the prompt without it.
        "token_ids": tokens if uncapped else tokens[:-1],
    }


def gpu_of(answer: Any, instance: str) -> int:
    return int(answer.get("default", {}).get(instance, {}).get("GPU", 0))


def misses(ask: Any, probes: list[dict[str, Any]]) -> list[str]:
    out = []
    for p in probes:
        for uncapped in (False, True):
            got = gpu_of(ask(probe_body(p, uncapped)), p["instance"])
            if got != want(p, uncapped):
                out.append(f"{p['id']} uncapped={uncapped}: GPU {got}, vLLM {want(p, uncapped)}")
    return out


def in_process(conductor: Conductor) -> Any:
    return lambda body: conductor.query(TokenQuery(**body))


def test_the_fixture_is_what_the_tests_expect() -> None:
    probes = hybrid_probes()
    assert len(hybrid_records()) == 393 and len(probes) == 229
    assert sorted({p["after_records"] for p in probes}) == list(CHECKPOINTS)
    assert {p["instance"] for p in probes} == {
        f"hyb-{x}" for x in ("a0", "b0", "c0", "e0", "d0", "d1")
    }


def test_the_order_fixture_puts_full_attention_elsewhere_than_group_0() -> None:
    """vLLM numbers groups by the first layer of each kind: the layouts the
    order fixture was made with, as its records name them."""
    stored: dict[str, dict[int, str]] = {}
    for r in hybrid_records(HYBRID_ORDER):
        for ev in msgspec.msgpack.decode(value(r))[1]:
            if ev["type"] == "BlockStored":
                stored.setdefault(r["key"], {})[ev["group_idx"]] = ev["kv_cache_spec_kind"]
    window, full, mla = "sliding_window", "full_attention", "mla_attention"
    assert stored == {
        "ord-g3": {**dict.fromkeys(range(5), window), 5: full},
        "ord-oss": {0: window, 1: full},
        "ord-kimi": {0: "mamba", 1: "mamba", 2: mla},
        "ord-2full": {0: full, 1: window, 2: full},
        "ord-d0": {0: full},
    }
    probes = hybrid_probes(HYBRID_ORDER)
    assert len(hybrid_records(HYBRID_ORDER)) == 328 and len(probes) == 245
    assert {p["instance"] for p in probes} == set(stored)


@pytest.mark.parametrize("root", MANAGER_FIXTURES)
def test_every_probe_in_file_order(root: Path) -> None:
    records, probes = hybrid_records(root), hybrid_probes(root)
    conductor = Conductor()
    done = 0
    for checkpoint in sorted({p["after_records"] for p in probes}):
        for i in range(done, checkpoint):
            conductor.ingest_engine_record(
                records[i]["key"], headers(records[i]), value(records[i]), float(i)
            )
        done = checkpoint
        at = [p for p in probes if p["after_records"] == checkpoint]
        assert misses(in_process(conductor), at) == []
    assert not conductor.counters["hash_conflicts"]


@pytest.mark.parametrize("root", MANAGER_FIXTURES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_every_probe_with_instances_interleaved(seed: int, root: Path) -> None:
    """Another instance's records in between change nothing: each probe is
    asked once its instance has applied what it had at the checkpoint."""
    records, probes = hybrid_records(root), hybrid_probes(root)
    by_instance: dict[str, list[int]] = {}
    for i, r in enumerate(records):
        by_instance.setdefault(r["key"], []).append(i)
    rng = random.Random(seed)
    queues = {k: list(v) for k, v in by_instance.items()}
    order: list[int] = []
    while queues:
        key = rng.choice(sorted(queues))
        order.append(queues[key].pop(0))
        if not queues[key]:
            del queues[key]
    conductor = Conductor()
    applied = {k: 0 for k in by_instance}
    # (instance, how many of its records) -> the probes due then
    due: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for p in probes:
        n = sum(1 for i in by_instance[p["instance"]] if i < p["after_records"])
        due.setdefault((p["instance"], n), []).append(p)
    for instance in by_instance:
        assert misses(in_process(conductor), due.pop((instance, 0), [])) == []
    for i in order:
        r = records[i]
        conductor.ingest_engine_record(r["key"], headers(r), value(r), float(i))
        applied[r["key"]] += 1
        assert misses(in_process(conductor), due.pop((r["key"], applied[r["key"]]), [])) == []
    assert not due


def live_messages(run: str, root: Path = LIVE) -> list[list[bytes]]:
    """A captured run's ZMQ messages, each its frames (`frames.bin`)."""
    return list(field_fleet.live_messages(root / run / "frames.bin"))


def live_requests(run: str, root: Path = LIVE) -> Iterator[dict[str, Any]]:
    for line in (root / run / "requests.jsonl").read_text().splitlines():
        step = json.loads(line)
        if step["kind"] == "request" and step["compare"]:
            yield step


def capped(answer: Any, prompt: list[int], block_size: int = 32) -> int:
    """vLLM's cap: at most `len - 1` tokens, on the block."""
    return min(gpu_of(answer, "vllm-cpu-0"), (len(prompt) - 1) // block_size * block_size)


LIVE_HEADERS = [("kv-model", b"tiny-llama"), ("kv-block-size", b"32")]


@pytest.mark.parametrize("run", ["scripted", "random-seed3"])
def test_a_real_vllm_cached_tokens_in_process(run: str) -> None:
    messages = live_messages(run)
    conductor = Conductor()
    applied = 0
    for step in live_requests(run):
        while applied < step["frames_before"]:
            seq = str(int.from_bytes(messages[applied][1], "big")).encode()
            conductor.ingest_engine_record(
                "vllm-cpu-0", [*LIVE_HEADERS, ("kv-seq", seq)], messages[applied][2], 1.0
            )
            applied += 1
        body = {"model": "tiny-llama", "block_size": 32, "token_ids": step["prompt"]}
        answer = conductor.query(TokenQuery(**body))
        assert capped(answer, step["prompt"]) == step["cached_tokens"], step["name"]


def test_a_real_vllm_serving_gemma3_cached_tokens_in_process() -> None:
    """Gemma 3's full-attention group is its last (group 5), and each batch
    stores the window groups before it: every request's hit is vLLM's own.
    vLLM looks a prompt up without its last token; on a hybrid model that
    hit is not the whole prompt's rounded down (the fixture's README)."""
    messages = live_messages("scripted", LIVE_HYBRID)
    conductor = Conductor()
    applied = 0
    wrong = []
    compared = 0
    for step in live_requests("scripted", LIVE_HYBRID):
        while applied < step["frames_before"]:
            seq = str(int.from_bytes(messages[applied][1], "big")).encode()
            headers = [("kv-model", b"tiny-gemma3"), ("kv-block-size", b"32"), ("kv-seq", seq)]
            conductor.ingest_engine_record("vllm-cpu-0", headers, messages[applied][2], 1.0)
            applied += 1
        body = {"model": "tiny-gemma3", "block_size": 32, "token_ids": step["prompt"][:-1]}
        got = gpu_of(conductor.query(TokenQuery(**body)), "vllm-cpu-0")
        compared += 1
        if got != step["cached_tokens"]:
            wrong.append(f"{step['name']}: GPU {got}, vLLM {step['cached_tokens']}")
    assert compared > 50
    assert wrong == []
    counters = conductor.snapshot_state().counters
    assert counters["group_blocks_unplaced"] == 0
    assert counters["removal_unknown"] == 0


# ------------------------------------------------------------ real path

SENTINEL_MODEL = "kvc-test/sentinel"


async def produce_hybrid(
    producer: AIOKafkaProducer, topic: str, records: list[dict[str, Any]], mark: str
) -> None:
    """The records, then one sentinel record on every partition: once the
    daemon answers for all of them, it has applied everything before."""
    for r in records:
        await producer.send(topic, key=r["key"].encode(), value=value(r), headers=headers(r))
    for part in sorted(await producer.partitions_for(topic)):
        payload = sentinel_payload(mark)
        await producer.send(
            topic,
            key=f"sentinel-{part}".encode(),
            value=payload,
            headers=[("kv-model", SENTINEL_MODEL.encode()), ("kv-block-size", b"4")],
            partition=part,
        )
    await producer.flush()


def sentinel_payload(mark: str) -> bytes:
    tokens = list(mark.encode()[:4].ljust(4, b"."))
    return vllm_payload([stored([hash(mark) & 0xFFFF_FFFF], tokens)])


async def settled(port: int, mark: str, partitions: int) -> bool:
    try:
        status, answer = await http_json(port, "POST", "/query", sentinel_query(mark))
    except OSError:
        return False
    return status == 200 and sentinels_in(answer) == partitions


def sentinel_query(mark: str) -> dict[str, Any]:
    tokens = list(mark.encode()[:4].ljust(4, b"."))
    return {"model": SENTINEL_MODEL, "block_size": 4, "token_ids": tokens}


def sentinels_in(answer: Any) -> int:
    return sum(1 for row in answer.get("default", {}).values() if row["GPU"] == 4)


async def snapshot_holds(cfg: Config, mark: str) -> bool:
    """Whether the snapshot topic alone restores every sentinel of `mark`."""
    async with Replica(cfg, follow="none") as replica:
        answer = replica.conductor.snapshot_state().query(TokenQuery(**sentinel_query(mark)))
    return sentinels_in(answer) == cfg.kafka.partitions


async def http_misses(port: int, probes: list[dict[str, Any]]) -> list[str]:
    out = []
    for p in probes:
        for uncapped in (False, True):
            status, answer = await http_json(port, "POST", "/query", probe_body(p, uncapped))
            assert status == 200, answer
            got = gpu_of(answer, p["instance"])
            if got != want(p, uncapped):
                out.append(f"{p['id']} uncapped={uncapped}: GPU {got}, vLLM {want(p, uncapped)}")
    return out


@pytest.mark.kafka
async def test_every_probe_through_kafka_and_the_daemon(kafka_bootstrap: str) -> None:
    cfg = daemon_config(kafka_bootstrap)
    records, probes = hybrid_records(), hybrid_probes()
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    async with running(cfg) as daemon:
        port = daemon.http_port
        assert port is not None
        await producer.start()
        try:
            done = 0
            for checkpoint in CHECKPOINTS:
                mark = f"c{checkpoint}"
                await produce_hybrid(
                    producer, cfg.kafka.engine_topic, records[done:checkpoint], mark
                )
                done = checkpoint
                await wait_for(lambda m=mark: settled(port, m, cfg.kafka.partitions), 60, mark)
                at = [p for p in probes if p["after_records"] == checkpoint]
                assert await http_misses(port, at) == []
        finally:
            await producer.stop()


@pytest.mark.kafka
async def test_every_probe_across_daemon_sigkills(kafka_bootstrap: str, tmp_path: Path) -> None:
    """The daemon is killed after each checkpoint once a generation holds
    it, the next records arrive while it is down, and the next daemon
    answers from the snapshot plus what it replays; at the end its state
    equals an uninterrupted run's."""
    (port,) = kafka_local.free_ports(1)
    config = tmp_path / "kvconductor.toml"
    write_daemon_config(config, kafka_bootstrap, port)
    cfg = load_config(config)
    records, probes = hybrid_records(), hybrid_probes()
    await create_event_topics(kafka_bootstrap, cfg)
    lives = DaemonLives(config, tmp_path)
    producer = AIOKafkaProducer(bootstrap_servers=kafka_bootstrap, acks="all")
    await producer.start()
    try:
        done = 0
        for checkpoint in CHECKPOINTS:
            mark = f"k{checkpoint}"
            await produce_hybrid(producer, cfg.kafka.engine_topic, records[done:checkpoint], mark)
            done = checkpoint
            lives.start(cfg.kafka.group_id, cfg.kafka.client_id)
            await wait_for(lambda m=mark: settled(port, m, cfg.kafka.partitions), 90, mark)
            at = [p for p in probes if p["after_records"] == checkpoint]
            assert await http_misses(port, at) == [], lives.summary()
            await wait_for(lambda m=mark: snapshot_holds(cfg, m), 60, f"a generation with {mark}")
            assert lives.kill(signal.SIGKILL) == -signal.SIGKILL
        lives.start(cfg.kafka.group_id, cfg.kafka.client_id)
        await wait_for(lambda: settled(port, f"k{CHECKPOINTS[-1]}", cfg.kafka.partitions), 90, "up")
        assert lives.kill(signal.SIGTERM) == 0
    finally:
        await producer.stop()
        if lives.proc is not None:
            lives.kill(signal.SIGKILL)
    want_index = Conductor()
    for r in records:
        want_index.ingest_engine_record(r["key"], headers(r), value(r), 1.0)
    async with Replica(cfg, follow="none") as replica:
        got = hybrid_units(state_fingerprint(replica.conductor.snapshot_state()))
    assert got == hybrid_units(state_fingerprint(want_index.snapshot_state()))


def hybrid_units(fingerprint: dict[UnitKey, bytes]) -> dict[UnitKey, bytes]:
    """The units of the fixture's instances (not the sentinels')."""
    return {
        k: v
        for k, v in fingerprint.items()
        if not (k[0] in "opq" and k[2] == SENTINEL_MODEL)
        and not (k[0] == "i" and k[1].startswith("sentinel-"))
        and k[0] != "g"
    }


@pytest.fixture
async def ctx() -> Any:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


@pytest.mark.kafka
@pytest.mark.parametrize(
    ("root", "run", "model"),
    [
        (LIVE, "scripted", "tiny-llama"),
        (LIVE, "random-seed3", "tiny-llama"),
        (LIVE_HYBRID, "scripted", "tiny-gemma3"),
    ],
    ids=["dense-scripted", "dense-random-seed3", "gemma3-scripted"],
)
async def test_a_real_vllm_through_its_zmq_socket_the_bridge_and_the_daemon(
    kafka_bootstrap: str, ctx: zmq.asyncio.Context, root: Path, run: str, model: str
) -> None:
    """Every message of the captured run, published on a ZMQ socket as vLLM
    did, through the bridge and Kafka; before each request the daemon has
    applied what vLLM had published, and answers vLLM's `cached_tokens` for
    the prompt without its last token (vLLM's own lookup)."""
    messages = live_messages(run, root)
    dcfg = daemon_config(kafka_bootstrap)
    pub = FakePublisher(ctx)
    bcfg = bridge_config(
        kafka_bootstrap,
        (publisher(pub, id="vllm-cpu-0", model=model, block_size=32),),
        engine_topic=dcfg.kafka.engine_topic,
        pool_topic=dcfg.kafka.pool_topic,
        registrations=False,
    )
    try:
        async with running(dcfg) as daemon, running_bridge(bcfg):
            port = daemon.http_port
            assert port is not None
            await pub.wait_subscribed()
            index = daemon.conductor.snapshot_state()
            sent = 0
            for step in live_requests(run, root):
                while sent < step["frames_before"]:
                    await pub.publish(messages[sent][2])
                    sent += 1
                if sent:

                    def caught_up(n: int = sent) -> bool:
                        state = index.instances.get("vllm-cpu-0")
                        return state is not None and state.last_seq.get(0) == n - 1

                    await wait_for(caught_up, 30, f"{sent} messages applied")
                body = {"model": model, "block_size": 32, "token_ids": step["prompt"][:-1]}
                status, answer = await http_json(port, "POST", "/query", body)
                assert status == 200
                got = gpu_of(answer, "vllm-cpu-0")
                assert got == step["cached_tokens"], step["name"]
    finally:
        await pub.close()


# ------------------------------------------------------- rules, in process

BS = 4
TOKENS = list(range(100, 132))  # eight blocks of four


def record(
    conductor: Conductor, *events: dict[str, Any], instance: str = "i0", report: str = ""
) -> None:
    payload = vllm_payload(list(events))
    headers = [("kv-model", b"m"), ("kv-block-size", b"4")]
    if report:
        headers.append(("kv-report-mode", report.encode()))
    conductor.ingest_engine_record(instance, headers, payload, 1.0)


def gpu(conductor: Conductor, tokens: list[int] = TOKENS, instance: str = "i0") -> int:
    answer = conductor.query(TokenQuery(model="m", block_size=BS, token_ids=tokens))
    return gpu_of(answer, instance)


def group_store(
    hashes: list[int], tokens: list[int], group: int, kind: str, **kw: Any
) -> dict[str, Any]:
    return {
        **stored(
            hashes, tokens, parent=kw.pop("parent", None), block_size=kw.pop("block_size", BS)
        ),
        "group_idx": group,
        "kv_cache_spec_kind": kind,
        **kw,
    }


@pytest.mark.parametrize("report", ["", "incremental", "full"])
def test_a_removal_takes_one_copy_and_a_reannouncement_adds_none(report: str) -> None:
    conductor = Conductor()
    record(conductor, stored([1, 2], TOKENS[:8]), report=report)
    record(conductor, stored([2], TOKENS[4:8], parent=1), report=report)  # recomputed: a copy
    record(conductor, removed([2]), report=report)
    assert gpu(conductor) == 8
    record(conductor, removed([2]), report=report)
    assert gpu(conductor) == 4
    # From the first block, all held: where the engine declares that it
    # re-announces (`kv-report-mode: full`), vLLM re-announcing, not a new
    # copy; else (vLLM's default) a prompt of one block, fully cached, that
    # vLLM recomputed into a second copy.
    record(conductor, stored([1], TOKENS[:4]), report=report)
    record(conductor, removed([1]), report=report)
    assert gpu(conductor) == (0 if report == "full" else 4)
    record(conductor, removed([1]), report=report)
    assert gpu(conductor) == 0


def test_a_bad_report_mode_is_a_dead_letter() -> None:
    conductor = Conductor()
    with pytest.raises(BadRecord, match="kv-report-mode"):
        record(conductor, stored([1], TOKENS[:4]), report="sometimes")


def test_a_window_group_cuts_the_full_attention_prefix() -> None:
    conductor = Conductor()
    hashes = list(range(1, 9))
    record(
        conductor,
        stored(hashes, TOKENS),
        # A window of 8 tokens needs the 2 blocks ending at the hit point.
        group_store([3, 4, 7, 8], TOKENS, 1, "sliding_window", kv_cache_spec_sliding_window=9),
    )
    assert gpu(conductor) == 32
    record(conductor, {**removed([7]), "group_idx": 1})
    assert gpu(conductor) == 16  # 32 lacks block 7, 16 has 3 and 4
    record(conductor, {**removed([3]), "group_idx": 1})
    assert gpu(conductor) == 0
    # The group's removals never touch the primary group's copy of a hash.
    assert (
        gpu_of(conductor.query(TokenQuery(model="m", block_size=BS, token_ids=TOKENS[:4])), "i0")
        == 0
    )
    record(conductor, {**removed([1]), "group_idx": 1})
    assert conductor.counters["removal_unknown"] == 1


def test_a_state_group_needs_the_state_at_the_hit_point() -> None:
    conductor = Conductor()
    # Hash 5 is the primary group's fifth block: the state ends there.
    record(conductor, stored(list(range(1, 9)), TOKENS), group_store([5], TOKENS, 1, "mamba"))
    assert gpu(conductor) == 20
    # A hash no group named before ends at its store's span end.
    record(conductor, group_store([20], TOKENS[:8], 1, "mamba"))
    assert gpu(conductor, TOKENS[:16]) == 8
    record(conductor, {**removed([5]), "group_idx": 1})
    assert gpu(conductor) == 8


def test_unknown_and_local_kinds_and_bad_specs() -> None:
    conductor = Conductor()
    record(
        conductor,
        stored(list(range(1, 9)), TOKENS),
        group_store([1, 2], TOKENS[:8], 1, "some_new_kind"),
        group_store([3], TOKENS[:12], 2, "chunked_local_attention"),
        group_store([4], TOKENS[:16], 3, "sliding_window", kv_cache_spec_sliding_window=0),
        group_store([1, 2, 3], TOKENS[:8], 4, "sliding_window", kv_cache_spec_sliding_window=5),
    )
    assert conductor.counters["unknown_group_kind"] == 1
    assert conductor.counters["bad_group_spec"] == 1
    assert conductor.counters["group_blocks_unplaced"] == 3  # three hashes, two blocks of tokens
    # The unknown kind caps like full attention (two blocks); the local group
    # without its chunk too (none from the first block: nothing).
    assert gpu(conductor) == 0


def test_a_v1_snapshot_reads_as_sets_without_groups() -> None:
    v1_owner = msgspec.msgpack.encode(
        {
            "type": "owner",
            "instance": "i0",
            "rank": 0,
            "seqs": [b"", b"", b""],
            "idents": [b"", b"", b""],
        }
    )
    owner = decode_unit(v1_owner)
    assert isinstance(owner, OwnerUnit) and owner.copies == [] and owner.groups == []
    v1_instance = msgspec.msgpack.encode(
        {
            "type": "instance",
            "instance": "i0",
            "last_seq": {0: 4},
            "skip_groups": [1],
            "namespaces": [],
            "last_event_ts": 1.0,
        }
    )
    instance = decode_unit(v1_instance)
    assert isinstance(instance, InstanceUnit) and instance.groups == {}
