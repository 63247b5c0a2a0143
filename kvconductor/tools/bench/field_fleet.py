"""A varied fleet's records, kind by kind: what an index sees in the field.

Figure 7 feeds the index one kind of record, dense vLLM on one DP rank with
int hashes, the one the compiled engine lane is built for. A fleet mixes
engines, releases and deployments; each kind here is a list of records of
its own instances, one record per engine step:

- `dense`: vLLM 0.33, one DP rank, int hashes (figure 7's engine);
- `dp8`: one instance of 8 DP ranks, the rank in the payload (vLLM >= 0.10);
- `dp2-lora`: 2 ranks in `kv-dp-rank`, the payload's rank nil, a quarter
  of the sessions on one of 4 LoRA adapters;
- `lora`: every session on one of 4 adapters (`lora_name`, `extra_keys`,
  hashes apart per adapter);
- `cpu-offload`: `kv-offload: local`, the offloading connector's hash-only
  CPU stores of what the GPU stored, and its CPU removals;
- `pool-offload`: `kv-offload: pool`, the engine's hash-only intents and
  a backend's RFC #1527 confirmations on the pool topic
  (`cluster.PoolBackend`);
- `bytes-hashes`: 32-byte digest hashes (fixture 0.33.0-bytes-hashes);
- `sglang`: SGLang's map form, signed hashes, `kv-source: sglang` (the same
  scheduler model: the shape of SGLang's steps is not modelled apart);
- `vllm-array`: vLLM <= 0.23 tagged arrays (fixture 0.22.0);

all of these from the engine model (`vllm_engine`), and from vLLM's own
output, replayed under fresh instance ids:

- `hybrid-swa`, `hybrid-mla-swa`, `hybrid-mamba`: vLLM's real
  `KVCacheManager` on hybrid layouts (tests/fixtures/vllm-hybrid);
- `hybrid-gemma3`: a live vLLM serving Gemma 3, six KV-cache groups
  (tests/fixtures/vllm-live-hybrid).

Every kind is cut at about `FieldConfig.records` records. The fixture
kinds are replayed under fresh instance ids, as many copies as that takes.

    kinds = field_fleet(FieldConfig(records=1000))
"""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import msgspec

from kvconductor.tools.bench.cluster import Record
from kvconductor.tools.bench.vllm_engine import EngineConfig, FleetConfig, VllmFleet
from kvconductor.wire.records import KV_BLOCK_SIZE, KV_MODEL, KV_SEQ, KV_SOURCE

__all__ = [
    "FIXTURES",
    "KINDS",
    "FieldConfig",
    "copies",
    "events_of",
    "field_fleet",
    "fleet_kind",
    "hybrid_kind",
    "live_messages",
]

# The repository's fixtures (the bench runs from a checkout).
FIXTURES = Path(__file__).resolve().parents[3] / "tests" / "fixtures"

# Figure 7's engine (`FleetConfig.engine_default`), its pool small enough
# that evictions start early in a short run.
FIELD_ENGINE = EngineConfig(gpu_blocks=8192, max_num_seqs=64, max_batched_tokens=2048)

FIELD_FLEET = FleetConfig(instances=2, sessions_per_instance=80)

# Each hybrid kind: the fixture instances it replays.
HYBRID_INSTANCES = {
    "hybrid-swa": ("hyb-a0",),
    "hybrid-mla-swa": ("hyb-b0",),
    "hybrid-mamba": ("hyb-c0", "hyb-e0"),
}
LIVE_GEMMA3 = ("vllm-live-hybrid", "scripted", "vllm-cpu-0", "tiny-gemma3", 32)


@dataclass(frozen=True)
class FieldConfig:
    records: int = 1000  # per kind, about
    seed: int = 7
    engine: EngineConfig = FIELD_ENGINE
    # The engine-model kinds' fleet (instances, sessions, prompts); each
    # kind changes what it is about.
    fleet: FleetConfig = FIELD_FLEET
    fixtures: Path = FIXTURES


def _fleet_kinds(cfg: FieldConfig) -> dict[str, FleetConfig]:
    base = replace(cfg.fleet, seed=cfg.seed, engine=cfg.engine)
    return {
        "dense": base,
        # Each rank is an engine of its own, as busy as a dense instance.
        "dp8": replace(base, instances=1, dp_ranks=8),
        "dp2-lora": replace(
            base, instances=1, dp_ranks=2, rank_in_header=True, lora_share=0.25, loras=4
        ),
        "lora": replace(base, lora_share=1.0, loras=4),
        "cpu-offload": replace(
            base, engine=replace(cfg.engine, offload="local", host_blocks=4 * cfg.engine.gpu_blocks)
        ),
        "pool-offload": replace(
            base,
            engine=replace(cfg.engine, offload="pool"),
            pool_blocks=4 * cfg.engine.gpu_blocks,
        ),
        "bytes-hashes": replace(base, wire="vllm-bytes"),
        "sglang": replace(base, wire="sglang"),
        "vllm-array": replace(base, wire="vllm-array"),
    }


KINDS = (
    "dense",
    "dp8",
    "dp2-lora",
    "lora",
    "cpu-offload",
    "pool-offload",
    "bytes-hashes",
    "sglang",
    "vllm-array",
    "hybrid-swa",
    "hybrid-mla-swa",
    "hybrid-mamba",
    "hybrid-gemma3",
)


def fleet_kind(fleet: FleetConfig, records: int, prefix: str) -> list[Record]:
    """A fleet stepped until it wrote `records` records, keys `prefix`-ed."""
    f = VllmFleet(fleet)
    out = f.streams.records
    while len(out) < records:
        f.step()
    return copies(out[:records], 1, prefix)


def copies(records: list[Record], n: int, prefix: str) -> list[Record]:
    """`n` copies of the records, copy `c`'s instances (and pool backends)
    renamed `{prefix}{c}/{key}`, interleaved record by record as a topic
    partition interleaves a fleet's instances."""
    tags = [f"{prefix}{c}/".encode() for c in range(n)]
    return [r._replace(key=tag + r.key) for r in records for tag in tags]


def events_of(payload: bytes) -> int:
    """KV events in an engine or pool payload (`[ts, [events], rank]`)."""
    return len(_batch(payload)[1])


_batch = msgspec.msgpack.Decoder(tuple[float, list[msgspec.Raw], int | None]).decode


def _fixture_record(key: str, headers: list[tuple[str, bytes]], payload: bytes) -> Record:
    batch = _batch(payload)
    return Record(False, key.encode(), headers, payload, batch[0], 0, len(batch[1]))


def hybrid_records(fixtures: Path, instances: tuple[str, ...]) -> list[Record]:
    """The fixture's records of `instances`, in produce order."""
    out: list[Record] = []
    for line in (fixtures / "vllm-hybrid" / "records.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["key"] not in instances:
            continue
        headers = [(k, v.encode()) for k, v in r["headers"].items()]
        out.append(_fixture_record(r["key"], headers, base64.b64decode(r["value_b64"])))
    return out


def live_messages(path: Path) -> Iterator[list[bytes]]:
    """frames.bin: u32 frame count, f64 receive time, then u32 length +
    bytes a frame (tests/fixtures/vllm-live/README.md)."""
    data = path.read_bytes()
    at = 0
    while at < len(data):
        (n,) = struct.unpack_from("<I", data, at)
        at += 12
        frames = []
        for _ in range(n):
            (size,) = struct.unpack_from("<I", data, at)
            frames.append(data[at + 4 : at + 4 + size])
            at += 4 + size
        yield frames


def live_records(fixtures: Path) -> list[Record]:
    """The live Gemma 3 run as records of its registration."""
    folder, run, key, model, block_size = LIVE_GEMMA3
    base = [
        (KV_MODEL, model.encode()),
        (KV_BLOCK_SIZE, str(block_size).encode()),
        (KV_SOURCE, b"vllm"),
    ]
    out: list[Record] = []
    for _topic, seq, payload in live_messages(fixtures / folder / run / "frames.bin"):
        headers = [*base, (KV_SEQ, str(int.from_bytes(seq, "big")).encode())]
        out.append(_fixture_record(key, headers, payload))
    return out


def hybrid_kind(source: list[Record], records: int, prefix: str) -> list[Record]:
    """Enough copies of a fixture's records for about `records` records (a
    prefix of one copy when it is longer: the run's start)."""
    return copies(source, max(1, round(records / len(source))), prefix)[:records]


def field_fleet(
    cfg: FieldConfig = FieldConfig(), kinds: tuple[str, ...] = KINDS
) -> dict[str, list[Record]]:
    """Each kind's records (`KINDS` order), instance ids unique across kinds."""
    fleets = _fleet_kinds(cfg)
    make: dict[str, Callable[[], list[Record]]] = {
        name: (lambda f=f, name=name: fleet_kind(f, cfg.records, f"{name}/"))  # type: ignore[misc]
        for name, f in fleets.items()
    }
    for name, instances in HYBRID_INSTANCES.items():
        make[name] = lambda name=name, instances=instances: hybrid_kind(  # type: ignore[misc]
            hybrid_records(cfg.fixtures, instances), cfg.records, f"{name}/"
        )
    make["hybrid-gemma3"] = lambda: hybrid_kind(
        live_records(cfg.fixtures), cfg.records, "hybrid-gemma3/"
    )
    return {k: make[k]() for k in kinds}
