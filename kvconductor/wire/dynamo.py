"""NVIDIA Dynamo's remote-indexer query, `POST /query_tiered_by_hash`.

Dynamo's KV router, run with a remote indexer URL, sends the standalone
indexer (ai-dynamo/dynamo, lib/kv-router: `TieredQueryByHashRequest`,
`TieredQueryResponse`, `WireTieredMatchDetails`) the JSON

    {"block_hashes": [i64, ...], "model_name": str, "routing_group": str}

where each hash is the local hash of one full block of the prompt, from the
first (contract section 1, LoRA seed included; for a salted request, its
`cache_namespace`, the salt's too: `hashing.dynamo_seed`), and reads

    {"block_size": u32,
     "tiered": {"device": {"scores": [[{"worker_id": u64, "dp_rank": u32}, blocks]],
                           "frequencies": [usize]},
                "lower_tier": [["host_pinned" | "disk" | "external",
                                {"hits": [[{"worker_id", "dp_rank"}, blocks]]}]]}}

with counts in blocks: `device` lists the ranks whose device tier matches,
and each lower tier, walked in Dynamo's order, the blocks a rank continues
with there past where the tier above left it.

kvconductor's per-rank match (`Conductor.query_local_hashes`) maps onto it
as: device = `GPU`; `host_pinned` = `CPU - GPU` (the continuation through the
rank's own host tier and the namespace's host pools); `disk` = `DISK - CPU`
(the continuation when disk tiers, own or pool, serve too). A pool is loaded
from like the rank's own tier (contract section 4), so it is counted in the
tier of its medium, never as `external`. A lower tier lists the ranks that
take part in Dynamo's walk there: those with a device hit or a hit in that
tier or one above (zeros included). Both lower tiers are listed when the
model has a namespace; an unknown model is `block_size` 0 and nothing
listed. `frequencies` is left empty.

Worker ids: an instance id that is the canonical decimal of a u64 is that
number; any other is `xxh3_64(instance id as UTF-8, seed 0)`.
`routing_group` is read as the tenant (missing, null or "" is `default`).
"""

from __future__ import annotations

import msgspec
import xxhash

from kvconductor.wire.hashing import MASK64
from kvconductor.wire.query import InvalidQuery

HOST_PINNED = "host_pinned"
DISK = "disk"


class TieredQueryByHash(msgspec.Struct):
    """The request. Unknown fields are ignored, as Dynamo's serde does."""

    # Checked by `local_hashes`: msgspec bounds stop at int64.
    block_hashes: list[int]
    model_name: str
    routing_group: str | None = None

    def local_hashes(self) -> list[int]:
        """The hashes as u64. Dynamo sends i64 (a u64 reinterpreted); the
        unsigned form is taken too."""
        for i, h in enumerate(self.block_hashes):
            if not -(1 << 63) <= h <= MASK64:
                raise InvalidQuery(f"block_hashes[{i}] does not fit in 64 bits")
        return [h & MASK64 for h in self.block_hashes]

    def tenant(self) -> str:
        return self.routing_group or "default"


class Worker(msgspec.Struct, frozen=True, order=True):
    """Dynamo's `WorkerWithDpRank`."""

    worker_id: int
    dp_rank: int


class OverlapScores(msgspec.Struct):
    """Dynamo's `WireOverlapScores`."""

    scores: list[tuple[Worker, int]]
    frequencies: list[int]


class LowerTierHits(msgspec.Struct):
    """Dynamo's `WireLowerTierMatchDetails`."""

    hits: list[tuple[Worker, int]]


class TieredMatch(msgspec.Struct):
    """Dynamo's `WireTieredMatchDetails`."""

    device: OverlapScores
    lower_tier: list[tuple[str, LowerTierHits]]


class TieredQueryResponse(msgspec.Struct):
    block_size: int
    tiered: TieredMatch


_encoder = msgspec.json.Encoder()


def worker_id(instance: str) -> int:
    """Dynamo's u64 worker id for a kvconductor instance id."""
    if instance.isascii() and instance.isdigit():
        value = int(instance)
        if value <= MASK64 and str(value) == instance:
            return value
    return xxhash.xxh3_64_intdigest(instance.encode("utf-8"), 0)


def tiered_answer(block_size: int, ranks: dict[str, dict[int, tuple[int, int, int]]]) -> bytes:
    """The JSON answer from per (instance, rank) (GPU, CPU, DISK) in tokens.

    `block_size` 0: the model has no namespace, nothing is listed."""
    if block_size == 0:
        return _encoder.encode(TieredQueryResponse(0, TieredMatch(OverlapScores([], []), [])))
    rows = sorted(
        (
            Worker(worker_id(instance), rank),
            gpu // block_size,
            cpu // block_size,
            disk // block_size,
        )
        for instance, by_rank in ranks.items()
        for rank, (gpu, cpu, disk) in by_rank.items()
    )
    device = [(w, gpu) for w, gpu, _, _ in rows if gpu]
    host = [(w, cpu - gpu) for w, gpu, cpu, _ in rows if cpu]
    disk = [(w, d - cpu) for w, _, cpu, d in rows if d]
    tiered = TieredMatch(
        OverlapScores(device, []),
        [(HOST_PINNED, LowerTierHits(host)), (DISK, LowerTierHits(disk))],
    )
    return _encoder.encode(TieredQueryResponse(block_size, tiered))
