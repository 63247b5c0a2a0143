"""Figure 6b: the cost curve at a fixed answer.

The workload's curve (figure 6) grows the fleet and the prefixes it holds
with the index: at 10^5 entries three instances hold short prefixes, at
4.3M 128 instances hold deep ones, so an answer lists 40x the owners and
its walk goes deeper. That is the answer growing, not the index. This
figure holds the answer still: the smallest curve workload is built once,
then filler joins it on the same instances (conversations nobody asks
about: fresh chains on the device tier, written through to the host tier
on local-mode instances) until the index holds each size in turn. At
every size the same prompts are timed, and their answers must equal the
base's; what is left to grow is how far the walk's probes are from the
caches.

Dynamo's tree gets the same filler chains on its device tier.
"""

from __future__ import annotations

import gc
import random
from array import array
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec

from bench.cluster import Record, stored_event
from bench.measure import forked, summary
from bench.peers import Peer, make_peer, peer_items
from bench.runners import sync, timed_rounds
from bench.workload import Tokens, Workload

# Blocks per filler chain: a long conversation's context (4,096 tokens).
CHAIN = 256
PEERS = ("kvconductor", "dynamo")

_mp = msgspec.msgpack.encode
_js = msgspec.json.encode


class FilledInstance:
    """An engine instance of the base workload, as filler writes to it."""

    __slots__ = ("headers", "key", "local", "seq", "worker")

    def __init__(self, key: bytes, headers: Sequence[tuple[str, bytes]]) -> None:
        self.key = key
        self.worker = int(key.rsplit(b"-", 1)[1])
        fields = dict(headers)
        self.seq = int(fields.get("kv-seq", b"0"))
        self.local = fields.get("kv-offload") != b"pool"
        self.headers = [(k, v) for k, v in headers if k != "kv-seq"]


def instances_of(w: Workload) -> list[FilledInstance]:
    """The base's engine instances with their last `kv-seq`, in key order."""
    last: dict[bytes, Sequence[tuple[str, bytes]]] = {}
    for r in w.streams.records:
        if not r.pool:
            last[r.key] = r.headers
    return [FilledInstance(k, h) for k, h in sorted(last.items())]


def chains_for(w: Workload, sizes: Sequence[int]) -> list[int]:
    """Filler chains to add before each size, so that kvconductor's index
    holds about `size` entries (a chain is CHAIN entries on a pool-mode
    instance, twice that on a local one); sizes at or below the base add 0."""
    owners = instances_of(w)
    held = w.stats["entries"]
    chains = 0
    out = []
    for size in sizes:
        added = 0
        while held < size:
            held += CHAIN * (2 if owners[chains % len(owners)].local else 1)
            chains += 1
            added += 1
        out.append(added)
    return out


class Filler:
    """Deterministic filler chains, chain `k` on owner `k % owners`: the
    same blocks for every peer, each chain's tokens fresh in its first block
    (so its identities are new all the way down) and shared after it."""

    def __init__(self, w: Workload) -> None:
        self.owners = instances_of(w)
        self.bs = w.config.block_size
        self.rng = random.Random(w.config.seed ^ 0xF111E5)
        self.tail = [self.rng.randrange(w.config.vocab) for _ in range((CHAIN - 1) * self.bs)]
        self.vocab = w.config.vocab
        self.made = 0
        self.dynamo_event = 1 << 40  # clear of the workload's event ids

    def _chain(self) -> tuple[FilledInstance, list[int], list[int]]:
        owner = self.owners[self.made % len(self.owners)]
        self.made += 1
        rng = self.rng
        seqs = array("Q", rng.randbytes(8 * CHAIN)).tolist()
        head = [rng.randrange(self.vocab) for _ in range(self.bs)]
        return owner, seqs, head + self.tail

    def records(self, chains: int) -> Iterator[Record]:
        """kvconductor's records: a device store, written through to the
        host tier on local-mode instances."""
        for _ in range(chains):
            owner, seqs, tokens = self._chain()
            events = [stored_event(seqs, None, tokens, "GPU", self.bs)]
            if owner.local:
                events.append(stored_event(seqs, None, [], "CPU", self.bs))
            owner.seq += 1
            headers = [*owner.headers, ("kv-seq", str(owner.seq).encode())]
            yield Record(False, owner.key, headers, _mp([0.0, events, 0]), 0.0, len(events) * CHAIN)

    def dynamo(self, chains: int) -> Iterator[tuple[int, bytes, int]]:
        """Dynamo's events for the same chains' device stores; its blocks are
        named by the engine's hashes and local hashes no prompt has."""
        for _ in range(chains):
            owner, seqs, _ = self._chain()
            locals_ = array("Q", self.rng.randbytes(8 * CHAIN)).tolist()
            self.dynamo_event += 1
            pairs = zip(seqs, locals_, strict=True)
            blocks = [{"block_hash": s, "tokens_hash": t} for s, t in pairs]
            event = {
                "event_id": self.dynamo_event,
                "data": {"stored": {"parent_hash": None, "blocks": blocks}},
                "dp_rank": 0,
            }
            yield owner.worker, _js(event), CHAIN


def _answers(peer: Peer, prompts: Sequence[Tokens]) -> list[Any]:
    if peer.name == "kvconductor":
        return [peer.query(p.tolist()) for p in prompts]
    return [sorted(peer.gpu_blocks(peer.query(p.tolist())).items()) for p in prompts]


def _child(
    w: Workload, name: str, steps: Sequence[int], queries: int, rounds: int
) -> list[dict[str, Any]]:
    peer = make_peer(name, w)
    peer.apply(peer_items(peer, w))
    sync(peer)
    gc.collect()
    gc.freeze()
    prompts = w.queries[:queries]
    base = _answers(peer, prompts)
    filler = Filler(w)
    device = w.stats["entries_by_tier"]["GPU"]
    points = []
    for chains in (0, *steps):
        if name == "kvconductor":
            peer.apply(list(filler.records(chains)))
        else:
            peer.apply(list(filler.dynamo(chains)))
            device += chains * CHAIN
        sync(peer)
        gc.collect()
        per_round = timed_rounds(peer, prompts, rounds)
        entries = peer.entries() if hasattr(peer, "entries") else device
        points.append(
            {
                "entries": entries,
                "latency_us": {k: summary([x[k] for x in per_round]) for k in ("p50", "p99")},
                "identical": _answers(peer, prompts) == base,
            }
        )
    return points


def fixed_answer_figure(
    w: Workload,
    peers: Sequence[str],
    sizes: Sequence[int],
    queries: int,
    rounds: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Query latency of `w`'s prompts as filler grows its index to `sizes`
    (kvconductor entries), each peer in a forked child of its own."""
    steps = chains_for(w, sizes)
    out: dict[str, Any] = {
        "base_entries": w.stats["entries"],
        "instances": len(instances_of(w)),
        "queries": min(queries, len(w.queries)),
        "chain_blocks": CHAIN,
        "peers": {},
    }
    for name in (p for p in PEERS if p in peers):
        points = forked(lambda name=name: _child(w, name, steps, queries, rounds))  # type: ignore[misc]
        out["peers"][name] = points
        for p in points:
            lat = p["latency_us"]
            log(
                f"  fixed answer {name}: {p['entries']:,} entries, query p50 "
                f"{lat['p50']['median']:.0f} us p99 {lat['p99']['median']:.0f} us, "
                f"answers {'identical' if p['identical'] else 'DIFFERENT'}"
            )
    return out
