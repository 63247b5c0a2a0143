"""A simulated fleet of engines and pool backends that emits KV events.

Each instance has a GPU block pool of fixed capacity with LRU eviction and
either a host tier of its own (`kv-offload: local`, write-through like
vLLM's CPU offloading connector) or a pool backend it offloads into
(`kv-offload: pool`: offload intents, then the backend's RFC #1527
confirmation, in either order). Every request served becomes one vLLM 0.33
payload (tagged maps, msgpack) on the engine topic, plus pool records.

Besides kvconductor's records the cluster writes, for the same requests,
the device-tier events each peer consumes: a device-only vLLM payload,
Dynamo `RadixTree` JSON events, and plain tuples for the naive baseline.
"""

from __future__ import annotations

import random
from array import array
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec

from kvconductor.wire.encode import VllmEvent, vllm_payload, vllm_removed, vllm_stored
from kvconductor.wire.records import KV_BLOCK_SIZE, KV_MODEL, KV_OFFLOAD, KV_SEQ, KV_SOURCE

# A block of a prompt: (engine sequence hash, contract local hash, identity).
Block = tuple[int, int, int]

_mp = msgspec.msgpack.encode
_js = msgspec.json.encode


class Record(NamedTuple):
    """One Kafka record: `pool` False for the engine topic, True for pools."""

    pool: bool
    key: bytes
    headers: list[tuple[str, bytes]]
    payload: bytes
    ts: float
    blocks: int  # block events carried (stores and removals, all tiers)
    events: int = 0  # KV events carried (each store or removal, whatever its hashes)


class NaiveOp(NamedTuple):
    """Device-tier events of one record for the naive baseline."""

    worker: int
    removed: array[int]  # sequence hashes ('Q')
    stored_seqs: array[int]
    stored_idents: array[int]


@dataclass
class Streams:
    """Everything the cluster emitted, per consumer."""

    records: list[Record] = field(default_factory=list)
    # kvconductor fed the device tier only (for the pair with Dynamo).
    device_records: list[Record] = field(default_factory=list)
    dynamo: list[tuple[int, bytes, int]] = field(default_factory=list)  # worker, json, blocks
    naive: list[NaiveOp] = field(default_factory=list)
    # After each request: the lengths of the four streams above, so that a
    # prefix of the requests can be cut out of every stream alike.
    marks: list[tuple[int, int, int, int]] = field(default_factory=list)

    def mark(self) -> None:
        self.marks.append(
            (len(self.records), len(self.device_records), len(self.dynamo), len(self.naive))
        )

    def requests_for(self, block_events: int) -> int:
        """The fewest requests whose records carry `block_events` (all tiers)."""
        total = 0
        records = self.records
        for n, mark in enumerate(self.marks):
            start = self.marks[n - 1][0] if n else 0
            total += sum(r.blocks for r in records[start : mark[0]])
            if total >= block_events:
                return n + 1
        return len(self.marks)


class Instance:
    __slots__ = ("gpu", "headers", "host", "index", "key", "pool_mode", "seq")

    def __init__(self, index: int, model: str, block_size: int, pool_mode: bool) -> None:
        self.index = index
        self.key = f"vllm-{index}".encode()
        self.pool_mode = pool_mode
        self.gpu: OrderedDict[int, None] = OrderedDict()
        self.host: OrderedDict[int, None] = OrderedDict()
        self.seq = 0
        self.headers = [
            (KV_MODEL, model.encode()),
            (KV_BLOCK_SIZE, str(block_size).encode()),
            (KV_SOURCE, b"vllm"),
            (KV_OFFLOAD, b"pool" if pool_mode else b"local"),
        ]


class PoolBackend:
    """A Mooncake-like store: an LRU of `capacity` blocks that confirms what
    it stores and evicts on the pool topic (RFC #1527)."""

    __slots__ = ("block_size", "blocks", "capacity", "event_id", "headers", "model", "name")

    def __init__(self, name: str, model: str, block_size: int, capacity: int) -> None:
        self.name = name
        self.model = model
        self.block_size = block_size
        self.capacity = capacity
        self.blocks: OrderedDict[int, None] = OrderedDict()
        self.event_id = 0
        self.headers = [(KV_MODEL, model.encode()), (KV_BLOCK_SIZE, str(block_size).encode())]

    def confirm(self, seqs: list[int], ts: float) -> Record:
        """The backend stores an offload and says so (RFC #1527)."""
        _, evicted = lru_admit(self.blocks, seqs, self.capacity)
        events: list[dict[str, object]] = []
        if evicted:
            self.event_id += 1
            events.append(self._event("removed", evicted, ts))
        self.event_id += 1
        events.append(self._event("stored", seqs, ts))
        payload = _mp([ts, events, 0])
        blocks = len(seqs) + len(evicted)
        return Record(True, self.name.encode(), self.headers, payload, ts, blocks, len(events))

    def _event(self, kind: str, seqs: list[int], ts: float) -> dict[str, object]:
        return {
            "event_id": self.event_id,
            "timestamp": ts,
            "event_type": kind,
            "model_name": self.model,
            "block_size": self.block_size,
            "additional_salt": None,
            "lora_name": None,
            "tenant_id": None,
            "backend_id": self.name,
            "medium": "cpu",
            "dp_rank": 0,
            "seq_hashes": seqs,
            "base_block_idx": None,
            "parent_hash": None,
            "token_ids": None,
        }


def lru_admit(
    lru: OrderedDict[int, None], seqs: list[int], capacity: int
) -> tuple[list[int], list[int]]:
    """Admit a request's blocks (head first) into an LRU set.

    Blocks already held are touched, tail first, so that the head of a
    reused prefix is the most recent (vLLM frees a request's blocks tail
    first, so tails are evicted first); missing ones are inserted the same
    way after evicting the least recently used. Returns (added, evicted)."""
    move = lru.move_to_end
    added_rev: list[int] = []
    for s in reversed(seqs):
        if s in lru:
            move(s)
        else:
            added_rev.append(s)
    evicted: list[int] = []
    over = len(lru) + len(added_rev) - capacity
    if over > 0:
        pop = lru.popitem
        evicted = [pop(last=False)[0] for _ in range(min(over, len(lru)))]
    for s in added_rev:
        lru[s] = None
    added = added_rev[::-1]
    return added, evicted


def engine_record(
    key: bytes,
    headers: list[tuple[str, bytes]],
    seq: int,
    events: Sequence[VllmEvent],
    ts: float,
    blocks: int,
    rank: int | None = 0,
    encode: Callable[[Sequence[VllmEvent], int | None, float], bytes] = vllm_payload,
) -> Record:
    """One engine-topic record: the instance's headers and its `kv-seq`;
    `rank` the payload's DP rank, `encode` the engine's wire form."""
    headers = [*headers, (KV_SEQ, str(seq).encode())]
    return Record(False, key, headers, encode(events, rank, ts), ts, blocks, len(events))


def dynamo_stored(event_id: int, parent: int | None, blocks: Iterable[tuple[int, int]]) -> bytes:
    """Dynamo's JSON for a stored run: blocks as (block hash, tokens hash)."""
    return _js(
        {
            "event_id": event_id,
            "data": {
                "stored": {
                    "parent_hash": parent,
                    "blocks": [{"block_hash": b, "tokens_hash": t} for b, t in blocks],
                }
            },
            "dp_rank": 0,
        }
    )


def dynamo_removed(event_id: int, seqs: list[int]) -> bytes:
    """Dynamo's JSON for removed blocks."""
    return _js({"event_id": event_id, "data": {"removed": {"block_hashes": seqs}}, "dp_rank": 0})


class Cluster:
    """Serves requests on instances and records the events they cause."""

    def __init__(
        self,
        *,
        instances: int,
        gpu_blocks: int,
        host_blocks: int,
        pool_instances: int,
        pool_backends: int,
        pool_blocks: int,
        block_size: int,
        model: str,
        rng: random.Random,
        confirm_first: float = 0.1,
    ) -> None:
        self.bs = block_size
        self.model = model
        self.gpu_blocks = gpu_blocks
        self.host_blocks = host_blocks
        self.pool_blocks = pool_blocks
        self.rng = rng
        self.confirm_first = confirm_first
        self.instances = [
            Instance(i, model, block_size, i < pool_instances) for i in range(instances)
        ]
        self.backends = [
            PoolBackend(f"mooncake-{b}", model, block_size, pool_blocks)
            for b in range(max(pool_backends, 1))
        ]
        self.streams = Streams()
        self.clock = 1_700_000_000.0
        self.dynamo_event_id = 0
        self.evicted_gpu = 0

    # ----------------------------------------------------------- reading

    def entries(self) -> int:
        """Live (block, owner) entries: device and host tiers, pool stores."""
        n = sum(len(i.gpu) + len(i.host) for i in self.instances)
        return n + sum(len(b.blocks) for b in self.backends)

    def tier_entries(self) -> dict[str, int]:
        return {
            "GPU": sum(len(i.gpu) for i in self.instances),
            "CPU": sum(len(i.host) for i in self.instances),
            "pool": sum(len(b.blocks) for b in self.backends),
        }

    # ----------------------------------------------------------- serving

    def serve(self, inst: Instance, tokens: array[int], blocks: list[Block]) -> None:
        """One request on `inst` whose full blocks are `blocks` (head first)
        and whose tokens are `tokens` (at least len(blocks) * block size)."""
        bs = self.bs
        self.clock += 0.001
        ts = self.clock
        seqs = [b[0] for b in blocks]
        added, evicted = lru_admit(inst.gpu, seqs, self.gpu_blocks)
        self.evicted_gpu += len(evicted)
        events: list[VllmEvent] = []
        device: list[VllmEvent] = []
        dyn: list[tuple[bytes, int]] = []
        nblocks = 0
        if evicted:
            ev: VllmEvent = vllm_removed(evicted, "GPU")
            events.append(ev)
            device.append(ev)
            dyn.append((self._dynamo_removed(evicted), len(evicted)))
            nblocks += len(evicted)
        stored_seqs: list[int] = []
        stored_idents: list[int] = []
        if added:
            held = set(added)
            i = 0
            n = len(blocks)
            while i < n:
                if blocks[i][0] not in held:
                    i += 1
                    continue
                j = i
                while j < n and blocks[j][0] in held:
                    j += 1
                run = blocks[i:j]
                parent = blocks[i - 1][0] if i else None
                run_seqs = [b[0] for b in run]
                ev = vllm_stored(run_seqs, parent, tokens[i * bs : j * bs].tolist(), "GPU", bs)
                events.append(ev)
                device.append(ev)
                dyn.append((self._dynamo_stored(parent, run), len(run)))
                stored_seqs += run_seqs
                stored_idents += [b[2] for b in run]
                nblocks += len(run)
                i = j
        if inst.pool_mode:
            backend = self.backends[inst.index % len(self.backends)]
            offload = [s for s in seqs if s not in backend.blocks]
            if offload:
                events.append(vllm_stored(offload, None, [], "CPU", bs))
                nblocks += len(offload)
        else:
            offload = []
            host_added, host_evicted = lru_admit(inst.host, seqs, self.host_blocks)
            if host_evicted:
                events.append(vllm_removed(host_evicted, "CPU"))
                nblocks += len(host_evicted)
            if host_added:
                events.append(vllm_stored(host_added, None, [], "CPU", bs))
                nblocks += len(host_added)
        pool_record = backend.confirm(offload, ts) if offload else None
        if pool_record is not None and self.rng.random() < self.confirm_first:
            self.streams.records.append(pool_record)
            pool_record = None
        if events:
            inst.seq += 1
            self.streams.records.append(
                engine_record(inst.key, inst.headers, inst.seq, events, ts, nblocks)
            )
        if pool_record is not None:
            self.streams.records.append(pool_record)
        if device:
            dev_blocks = len(evicted) + len(stored_seqs)
            self.streams.device_records.append(
                Record(
                    False,
                    inst.key,
                    inst.headers,
                    vllm_payload(device, 0, ts),
                    ts,
                    dev_blocks,
                    len(device),
                )
            )
            for payload, count in dyn:
                self.streams.dynamo.append((inst.index, payload, count))
            self.streams.naive.append(
                NaiveOp(
                    inst.index,
                    array("Q", evicted),
                    array("Q", stored_seqs),
                    array("Q", stored_idents),
                )
            )
        self.streams.mark()

    def _dynamo_stored(self, parent: int | None, run: list[Block]) -> bytes:
        self.dynamo_event_id += 1
        return dynamo_stored(self.dynamo_event_id, parent, ((b[0], b[1]) for b in run))

    def _dynamo_removed(self, seqs: list[int]) -> bytes:
        self.dynamo_event_id += 1
        return dynamo_removed(self.dynamo_event_id, seqs)
