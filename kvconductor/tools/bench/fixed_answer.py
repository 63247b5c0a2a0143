"""Figure 6b: the cost curve at a fixed answer.

The workload's curve (figure 6) grows the fleet and the prefixes it holds
with the index: at 10^5 entries three instances hold short prefixes, at
4.3M 122 instances hold deep ones, so an answer lists 40x the owners and
its walk goes deeper. That is the answer growing, not the index. This
figure holds the answer still: a workload's index is built once, then
filler joins it on the same instances (conversations nobody asks about:
fresh chains on the device tier, written through to the host tier on
local-mode instances) until the index holds each size in turn. At every
size the same prompts are timed, and their answers must equal the
first size's; what is left to grow is how far the walk's probes are from
the caches. The suite runs it from the smallest curve workload (a few
instances, 100x the entries) and from the full one (its whole fleet).

Dynamo's tree gets the same chains on its device tier: the same engine
hashes, and the local hashes of the same tokens.
"""

from __future__ import annotations

import gc
import random
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, TypeVar

import xxhash

from kvconductor.tools.bench.cluster import Record, dynamo_stored, engine_record
from kvconductor.tools.bench.measure import forked, summary
from kvconductor.tools.bench.peers import KvconductorPeer, Peer, make_peer, peer_items
from kvconductor.tools.bench.report import cpu_probe_ms, fixed_ok
from kvconductor.tools.bench.runners import device_answers, sync, timed_rounds
from kvconductor.tools.bench.workload import Tokens, Workload
from kvconductor.wire.encode import vllm_stored
from kvconductor.wire.hashing import BASE_SEED
from kvconductor.wire.records import KV_OFFLOAD, KV_SEQ

# Blocks per filler chain: a long conversation's context (4,096 tokens).
CHAIN = 256
# Filler records applied at a time: ten million entries' worth would hold
# about 400 MB of payloads at once.
FILL_BATCH = 256
PEERS = ("kvconductor", "dynamo")

_xxh3 = xxhash.xxh3_64_intdigest
T = TypeVar("T")


class FilledInstance:
    """An engine instance of the base workload, as filler writes to it."""

    __slots__ = ("headers", "key", "local", "seq", "worker")

    def __init__(self, key: bytes, headers: Sequence[tuple[str, bytes]]) -> None:
        self.key = key
        self.worker = int(key.rsplit(b"-", 1)[1])
        fields = dict(headers)
        self.seq = int(fields.get(KV_SEQ, b"0"))
        self.local = fields.get(KV_OFFLOAD) != b"pool"
        self.headers = [(k, v) for k, v in headers if k != KV_SEQ]


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
    """Deterministic filler chains, chain `k` on owner `k % owners`: each
    chain's first block has tokens of its own (so its identities are new
    all the way down), the blocks after it share theirs."""

    def __init__(self, w: Workload) -> None:
        self.owners = instances_of(w)
        self.bs = w.config.block_size
        self.vocab = w.config.vocab
        self.rng = random.Random(w.config.seed ^ 0xF111E5)
        tail = array("I", (self.rng.randrange(self.vocab) for _ in range((CHAIN - 1) * self.bs)))
        self.tail = tail.tolist()
        step = self.bs * tail.itemsize
        data = tail.tobytes()
        self.tail_locals = [_xxh3(data[i : i + step], BASE_SEED) for i in range(0, len(data), step)]
        self.ts = max((r.ts for r in w.streams.records), default=0.0)
        self.made = 0
        self.dynamo_event = 1 << 40  # clear of the workload's event ids
        # The last chain made, (worker, its first block's tokens).
        self.last: tuple[int, Tokens] | None = None

    def _chain(self) -> tuple[FilledInstance, list[int], Tokens]:
        owner = self.owners[self.made % len(self.owners)]
        self.made += 1
        rng = self.rng
        seqs = array("Q", rng.randbytes(8 * CHAIN)).tolist()
        head = array("I", (rng.randrange(self.vocab) for _ in range(self.bs)))
        self.last = (owner.worker, head)
        return owner, seqs, head

    def last_chain(self) -> tuple[int, list[int]] | None:
        """The last chain's worker and tokens: a query for them must find it."""
        if self.last is None:
            return None
        worker, head = self.last
        return worker, head.tolist() + self.tail

    def records(self, chains: int) -> Iterator[Record]:
        """kvconductor's records: a device store, written through to the
        host tier on local-mode instances."""
        for _ in range(chains):
            owner, seqs, head = self._chain()
            tokens = head.tolist() + self.tail
            events = [vllm_stored(seqs, None, tokens, "GPU", self.bs)]
            if owner.local:
                events.append(vllm_stored(seqs, None, [], "CPU", self.bs))
            owner.seq += 1
            yield engine_record(
                owner.key, owner.headers, owner.seq, events, self.ts, len(events) * CHAIN
            )

    def dynamo(self, chains: int) -> Iterator[tuple[int, bytes, int]]:
        """Dynamo's events for the same chains' device stores."""
        for _ in range(chains):
            owner, seqs, head = self._chain()
            locals_ = [_xxh3(head.tobytes(), BASE_SEED), *self.tail_locals]
            self.dynamo_event += 1
            payload = dynamo_stored(self.dynamo_event, None, zip(seqs, locals_, strict=True))
            yield owner.worker, payload, CHAIN


def _batches(items: Iterable[T], n: int) -> Iterator[list[T]]:
    it = iter(items)
    while batch := list(islice(it, n)):
        yield batch


def _refused(peer: Peer) -> int:
    """Events the peer skipped or refused so far: filler must cause none."""
    if isinstance(peer, KvconductorPeer):
        return sum(peer.conductor.counters.values())
    errors: int = getattr(peer, "errors", 0)
    return errors


def _answers(peer: Peer, prompts: Sequence[Tokens]) -> list[Any]:
    if isinstance(peer, KvconductorPeer):
        return [peer.query(p.tolist()) for p in prompts]
    return device_answers(peer, prompts)


def _child(
    w: Workload, name: str, steps: Sequence[int], queries: int, rounds: int
) -> list[dict[str, Any]]:
    peer = make_peer(name, w)
    peer.apply(peer.prepare(peer_items(peer, w)))
    prompts = w.queries[:queries]
    filler = Filler(w)
    fill = filler.records if isinstance(peer, KvconductorPeer) else filler.dynamo
    base: list[Any] | None = None
    points = []
    for chains in (0, *steps):
        refused = _refused(peer)
        for batch in _batches(fill(chains), FILL_BATCH):
            peer.apply(peer.prepare(batch))
        sync(peer)
        gc.collect()
        gc.freeze()
        # Every size gets the same passes before it is timed: one over all
        # the prompts (their answers), then the warm-up and the rounds.
        answers = _answers(peer, prompts)
        base = answers if base is None else base
        found = None
        if (last := filler.last_chain()) is not None:
            worker, tokens = last
            found = peer.gpu_blocks(peer.query(tokens)).get(worker) == CHAIN
        probe = cpu_probe_ms()
        per_round = timed_rounds(peer, prompts, rounds)
        points.append(
            {
                # Dynamo's: its device tier and every filler chain (none refused).
                "entries": peer.entries()
                if isinstance(peer, KvconductorPeer)
                else w.stats["entries_by_tier"]["GPU"] + filler.made * CHAIN,
                "latency_us": {k: summary([x[k] for x in per_round]) for k in ("p50", "p99")},
                "identical": answers == base,
                "filler_found": found,
                "refused": _refused(peer) - refused,
                "cpu_probe_ms": probe,
            }
        )
    return points


def fixed_answer_figure(
    w: Workload,
    peers: Sequence[str],
    sizes: Sequence[int],
    queries: int,
    rounds: int,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Query latency of `w`'s prompts as filler grows its index to each of
    `sizes` (kvconductor entries) above it, each peer in a forked child of
    its own. Each point's `at_entries` is kvconductor's size at that step,
    so that the peers' points line up."""
    sizes = sorted(s for s in sizes if s > w.stats["entries"])
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
                f"{'answers kept, filler in place' if fixed_ok([p]) else 'FILLER OR ANSWERS WRONG'}"
            )
    kvc = out["peers"].get("kvconductor")
    for points in out["peers"].values():
        for i, p in enumerate(points):
            p["at_entries"] = kvc[i]["entries"] if kvc else p["entries"]
    return out
