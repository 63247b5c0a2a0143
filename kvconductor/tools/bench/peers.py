"""The indexes under test, behind one small interface.

- `kvconductor` (full): every record of the workload, all tiers and pools,
  through `Conductor.ingest` in batches of `INGEST_BATCH` records, as the
  daemon hands it a fetch (decode, chain rebuild, index update).
- `kvconductor-device`: the same requests' device-tier events only, as
  vLLM payloads: the exact counterpart of what the two peers below get.
- `dynamo`: NVIDIA Dynamo's `RadixTree` (PyPI `ai-dynamo-runtime`), fed the
  device-tier events as its JSON (encoded ahead, not timed), queried with
  `compute_block_hash_for_seq` + `find_matches` (hashing timed).
- `naive`: a dict of identity sets per worker, walked worker by worker.

Each peer reports its answer as {worker: GPU-matched blocks} so that the
runner can check that all of them agree on the device tier.
"""

from __future__ import annotations

import importlib
import os
from array import array
from collections.abc import Sequence
from typing import Any, Protocol

import xxhash

from kvconductor.index.conductor import Conductor, Incoming
from kvconductor.tools.bench.cluster import NaiveOp, Record
from kvconductor.tools.bench.workload import Workload
from kvconductor.wire.hashing import BASE_SEED
from kvconductor.wire.query import TokenQuery

_xxh3 = xxhash.xxh3_64_intdigest

# Records per `Conductor.ingest` call: the daemon's fetch (`kafka.max_records`'
# default, 2,000 records).
INGEST_BATCH = 2000


class Peer(Protocol):
    name: str
    stream: int  # which of the `Streams` marks counts this peer's items

    def items(self, w: Workload) -> Sequence[Any]:
        """The stream this peer consumes (built by the generator, untimed)."""

    def blocks(self, item: Any) -> int:
        """Block events in one item."""

    def prepare(self, items: Sequence[Any]) -> Any:
        """What `apply` takes for `items`, made before the clock starts."""

    def apply(self, prepared: Any) -> None: ...

    def query(self, tokens: list[int]) -> object: ...

    def gpu_blocks(self, answer: object) -> dict[int, int]:
        """{worker index: device-tier blocks matched} from a query answer."""


def _import_dynamo() -> Any:
    # Dynamo logs every event it skips at WARN; the benchmark counts them.
    os.environ.setdefault("DYN_LOG", "error")
    return importlib.import_module("dynamo.llm")


def dynamo_available() -> str | None:
    """None when Dynamo's binding imports, else why not."""
    try:
        _import_dynamo()
    except Exception as exc:  # ImportError, or a native library that will not load
        return f"{type(exc).__name__}: {exc}"
    return None


def _worker_of(instance: str) -> int:
    return int(instance.rsplit("-", 1)[1])


class KvconductorPeer:
    def __init__(self, model: str, block_size: int, device_only: bool = False) -> None:
        self.name = "kvconductor-device" if device_only else "kvconductor"
        self.stream = 1 if device_only else 0
        self.device_only = device_only
        self.model = model
        self.block_size = block_size
        self.conductor = Conductor()
        self.notices = 0  # records skipped, or applied with a gap to report

    def items(self, w: Workload) -> Sequence[Record]:
        return w.streams.device_records if self.device_only else w.streams.records

    def blocks(self, item: Record) -> int:
        return item.blocks

    def prepare(self, items: Sequence[Record]) -> list[list[Incoming]]:
        incoming = [Incoming(r.pool, r.key, r.headers, r.payload, r.ts) for r in items]
        return [incoming[i : i + INGEST_BATCH] for i in range(0, len(incoming), INGEST_BATCH)]

    def apply(self, prepared: list[list[Incoming]]) -> None:
        ingest = self.conductor.ingest
        for batch in prepared:
            notices = ingest(batch)
            if notices:
                self.notices += len(notices)

    def query(self, tokens: list[int]) -> object:
        return self.conductor.query(TokenQuery(self.model, self.block_size, tokens))

    def gpu_blocks(self, answer: object) -> dict[int, int]:
        assert isinstance(answer, dict)
        out: dict[int, int] = {}
        for per_instance in answer.values():
            for instance, fig in per_instance.items():
                if fig["GPU"]:
                    out[_worker_of(instance)] = fig["GPU"] // self.block_size
        return out

    def entries(self) -> int:
        """(block, owner) entries held: owner tiers and pool stores."""
        return self.conductor.entries()


class DynamoPeer:
    name = "dynamo"
    stream = 2

    def __init__(self, block_size: int) -> None:
        llm = _import_dynamo()
        self.tree: Any = llm.RadixTree()
        self.hash_seq: Any = llm.compute_block_hash_for_seq
        self.block_size = block_size
        # Events the tree refused. Its removal of a block drops the worker
        # from the block's subtree too, so a later removal of a descendant
        # finds nothing: the binding raises after applying the rest of the
        # event, and Dynamo's own router logs it and carries on; so do we.
        self.errors = 0

    def items(self, w: Workload) -> Sequence[tuple[int, bytes, int]]:
        return w.streams.dynamo

    def blocks(self, item: tuple[int, bytes, int]) -> int:
        return item[2]

    def prepare(self, items: Sequence[tuple[int, bytes, int]]) -> Sequence[tuple[int, bytes, int]]:
        return items

    def apply(self, items: Sequence[tuple[int, bytes, int]]) -> None:
        apply = self.tree.apply_event
        for worker, payload, _ in items:
            try:
                apply(worker, payload)
            except RuntimeError:
                self.errors += 1

    def query(self, tokens: list[int]) -> object:
        return self.tree.find_matches(self.hash_seq(tokens, self.block_size))

    def gpu_blocks(self, answer: object) -> dict[int, int]:
        scores: dict[tuple[int, int], int] = answer.scores  # type: ignore[attr-defined]
        return {worker: n for (worker, _rank), n in scores.items() if n}


class NaivePeer:
    """The obvious index: per worker, the chained block identities it holds
    and how many copies of each (vLLM announces and removes every copy)."""

    name = "naive"
    stream = 3

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self.sets: dict[int, dict[int, int]] = {}  # worker -> identity -> copies
        self.names: dict[int, dict[int, int]] = {}  # worker -> seq hash -> identity

    def items(self, w: Workload) -> Sequence[NaiveOp]:
        return w.streams.naive

    def blocks(self, item: NaiveOp) -> int:
        return len(item.removed) + len(item.stored_seqs)

    def prepare(self, items: Sequence[NaiveOp]) -> Sequence[NaiveOp]:
        return items

    def apply(self, items: Sequence[NaiveOp]) -> None:
        for op in items:
            held = self.sets.get(op.worker)
            if held is None:
                held = self.sets[op.worker] = {}
                self.names[op.worker] = {}
            names = self.names[op.worker]
            for seq in op.removed:
                ident = names.get(seq)
                if ident is None:
                    continue
                left = held[ident] - 1
                if left:
                    held[ident] = left
                else:
                    del held[ident]
                    del names[seq]
            for seq, ident in zip(op.stored_seqs, op.stored_idents, strict=True):
                names[seq] = ident
                held[ident] = held.get(ident, 0) + 1

    def query(self, tokens: list[int]) -> object:
        data = array("I", tokens).tobytes()
        step = self.block_size * 4
        idents: list[int] = []
        ident = BASE_SEED
        for start in range(0, len(data) - step + 1, step):
            ident = _xxh3(data[start : start + step], ident)
            idents.append(ident)
        out: dict[int, int] = {}
        for worker, held in self.sets.items():
            n = 0
            for ident in idents:
                if ident not in held:
                    break
                n += 1
            if n:
                out[worker] = n
        return out

    def gpu_blocks(self, answer: object) -> dict[int, int]:
        assert isinstance(answer, dict)
        return answer

    def entries(self) -> int:
        return sum(len(s) for s in self.sets.values())


def peer_items(peer: Peer, w: Workload, requests: int | None = None) -> Sequence[Any]:
    """The peer's stream, or its part caused by the first `requests` requests."""
    items = peer.items(w)
    if requests is None or requests >= len(w.streams.marks):
        return items
    if requests <= 0:
        return items[:0]
    return items[: w.streams.marks[requests - 1][peer.stream]]


def make_peer(name: str, w: Workload) -> Peer:
    cfg = w.config
    if name == "kvconductor":
        return KvconductorPeer(cfg.model, cfg.block_size)
    if name == "kvconductor-device":
        return KvconductorPeer(cfg.model, cfg.block_size, device_only=True)
    if name == "dynamo":
        return DynamoPeer(cfg.block_size)
    if name == "naive":
        return NaivePeer(cfg.block_size)
    raise ValueError(f"unknown peer {name!r}")


ALL_PEERS = ("kvconductor", "kvconductor-device", "dynamo", "naive")
