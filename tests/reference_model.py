"""An independent, deliberately naive reference model of the index contract.

Written from docs CONTRACT.md sections 1-4 and the core's documented design
decisions, not from the core's code. Everything is plain dicts and sets of
tuples; nothing is fast and nothing is bounded (the property tests keep the
core's bounds large so that nothing it drops would be visible).

Identity: a block is the tuple of its token blocks from the root of its
namespace (a tuple of tuples). Two blocks match iff these tuples are equal.

State per namespace:

- ``own[(instance, rank, tier)]``: ``{seq: chain}``, an engine rank's tier;
  ``copies[(instance, rank, tier, seq)]``: how many copies beyond the first
  it holds (contract v2: a store of a held block adds a copy, a removal
  takes one; where the engine declares `kv-report-mode: full`, a store from
  the root of blocks all held is a re-announcement).
- ``pools[(backend, medium)]``: ``{seq: chain}``, a pool store; its class
  (host or disk) follows from the medium name.
- ``intents``: ``{seq: chain}``, offload intents pinning their content
  until a pool confirmation of that seq consumes them.
- ``waiting``: ``{(seq, target)}``, token-less placements and pool
  confirmations whose content is not known yet.
- ``unresolved``: ``{seq: [parent_seq, token_block, targets]}``, blocks that
  came with their tokens but whose parent's content was unknown; a record
  with no targets left is only a link for its children.

- ``catalog``: ``{seq: chain}``, every content ever learned (from a
  placement, a pinned intent or a resolved chain). The core keeps content
  that nothing holds any more as "retired" for late halves, bounded in count
  and age; the tests make those bounds too large to matter, so here the
  catalog simply never forgets (contract section 2: the content comes from
  an event "before or after it").

After every event a fixpoint resolves every chain whose parent has become
known and places every waiting half whose content has.
"""

from __future__ import annotations

from typing import Any

from kvconductor.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    PoolBatch,
    PoolEvent,
)
from kvconductor.wire.query import HashQuery, TokenQuery
from kvconductor.wire.records import EngineMeta, PoolMeta

MASK = (1 << 64) - 1
DEVICE, HOST, DISK = 0, 1, 2

MEDIA = {
    "gpu": DEVICE,
    "cpu": HOST,
    "cpu_pinned": HOST,
    "cpu_tier1": HOST,
    "storage": DISK,
    "disk": DISK,
    "cpu_tier2": DISK,
    "nvme": DISK,
    "fs": DISK,
    "obj": DISK,
}

Chain = tuple[tuple[int, ...], ...]
# ("own", instance, rank, tier) | ("pool", backend, medium) | ("intent",)
Target = tuple[Any, ...]
NsKey = tuple[str, str, int, str | None, str]


def engine_tier(medium: str | None) -> int | None:
    if medium is None:
        return DEVICE
    return MEDIA.get(medium.lower())


def pool_class(medium: str | None) -> int | None:
    """HOST or DISK for a pool medium name (missing = cpu, gpu serves as host)."""
    tier = MEDIA.get("cpu" if medium is None else medium.lower())
    if tier == DEVICE:
        return HOST
    return tier


def normalise_hash(h: int | str) -> int:
    if isinstance(h, str):
        return int.from_bytes(bytes.fromhex(h), "big") & MASK
    return h & MASK


def token_blocks(tokens: list[int], block_size: int) -> list[tuple[int, ...]]:
    n = len(tokens) // block_size
    return [tuple(tokens[i * block_size : (i + 1) * block_size]) for i in range(n)]


class NsModel:
    def __init__(self) -> None:
        self.own: dict[tuple[str, int, int], dict[int, Chain]] = {}
        self.copies: dict[tuple[str, int, int, int], int] = {}
        self.pools: dict[tuple[str, str], dict[int, Chain]] = {}
        self.intents: dict[int, Chain] = {}
        self.waiting: set[tuple[int, Target]] = set()
        self.unresolved: dict[int, list[Any]] = {}
        self.catalog: dict[int, Chain] = {}

    # ------------------------------------------------------------ catalog

    def known(self, seq: int) -> Chain | None:
        return self.catalog.get(seq)

    def resolvable(self, seq: int) -> Chain | None:
        """Content of seq from the catalog, or through unresolved links."""
        tail: list[tuple[int, ...]] = []
        seen: set[int] = set()
        while (base := self.known(seq)) is None:
            rec = self.unresolved.get(seq)
            if rec is None or seq in seen:
                return None
            seen.add(seq)
            tail.append(rec[1])
            seq = rec[0]
        return (*base, *reversed(tail))

    # ---------------------------------------------------------- placement

    def place(self, target: Target, seq: int, chain: Chain) -> None:
        kind = target[0]
        held_by_pool = any(chain in store.values() for store in self.pools.values())
        # Whatever names a seq with its content teaches the catalog, even an
        # intent that pins nothing.
        self.catalog.setdefault(seq, chain)
        if kind == "own":
            self.own.setdefault(target[1:], {}).setdefault(seq, chain)
        elif kind == "pool":
            self.pools.setdefault(target[1:], {}).setdefault(seq, chain)
            # A pool confirmation consumes the offload intent of that seq.
            self.intents.pop(seq, None)
        elif not held_by_pool:
            # An intent for a block (content) some pool already holds pins
            # nothing: the join already happened the other way round.
            self.intents.setdefault(seq, chain)

    def place_or_wait(self, target: Target, seq: int) -> None:
        """A token-less half: place now if the content is known, else wait."""
        chain = self.known(seq)
        if chain is not None:
            self.place(target, seq, chain)
        else:
            self.waiting.add((seq, target))

    def store_chain(
        self,
        target: Target,
        seqs: list[int],
        parent: int | None,
        blocks: list[tuple[int, ...]],
    ) -> None:
        """Blocks that carry their tokens: chain from `parent` (None = root)."""
        n = min(len(seqs), len(blocks))
        if parent is None:
            base: Chain | None = ()
        else:
            base = self.known(parent)
        if base is not None:
            chain = base
            for i in range(n):
                chain = (*chain, blocks[i])
                self.place(target, seqs[i], chain)
            return
        prev = parent
        for i in range(n):
            rec = self.unresolved.get(seqs[i])
            if rec is None:
                rec = self.unresolved[seqs[i]] = [prev, blocks[i], set()]
            rec[2].add(target)
            prev = seqs[i]

    def fixpoint(self) -> None:
        changed = True
        while changed:
            changed = False
            # Every record whose content follows from the catalog through its
            # links resolves: the catalog learns it (even when no target is
            # left) and its targets get it.
            resolved = {s: self.resolvable(s) for s in self.unresolved}
            for seq, chain in resolved.items():
                if chain is None:
                    continue
                self.catalog.setdefault(seq, chain)
                for target in self.unresolved.pop(seq)[2]:
                    self.place(target, seq, chain)
                changed = True
            for seq, target in sorted(self.waiting, key=repr):
                chain = self.known(seq)
                if chain is not None:
                    self.waiting.discard((seq, target))
                    self.place(target, seq, chain)
                    changed = True

    # ----------------------------------------------------------- removals

    def cancel(self, seq: int | None, match: Any) -> None:
        """Cancel pending placements (of `seq`, or all) whose target matches."""
        self.waiting = {
            (s, t) for s, t in self.waiting if not ((seq is None or s == seq) and match(t))
        }
        for s, rec in self.unresolved.items():
            if seq is None or s == seq:
                rec[2] = {t for t in rec[2] if not match(t)}

    def add_copies(self, instance: str, rank: int, tier: int, held: list[int]) -> None:
        for seq in held:
            key = (instance, rank, tier, seq)
            self.copies[key] = self.copies.get(key, 0) + 1

    def remove_own(self, instance: str, rank: int, tier: int, seq: int) -> None:
        key = (instance, rank, tier, seq)
        if self.copies.get(key):
            self.copies[key] -= 1
            return
        self.own.get((instance, rank, tier), {}).pop(seq, None)
        target = ("own", instance, rank, tier)
        self.cancel(seq, lambda t: t == target)

    def clear_own(self, instance: str, rank: int | None) -> None:
        for key in list(self.own):
            if key[0] == instance and (rank is None or key[1] == rank):
                del self.own[key]
        self.copies = {
            k: n
            for k, n in self.copies.items()
            if not (k[0] == instance and (rank is None or k[1] == rank))
        }
        self.cancel(
            None,
            lambda t: t[0] == "own" and t[1] == instance and (rank is None or t[2] == rank),
        )

    def pool_stores(self, backend: str, medium: str | None) -> list[tuple[str, str]]:
        return [
            k for k in self.pools if k[0] == backend and (medium is None or k[1] == medium.lower())
        ]

    def remove_pool(self, backend: str, medium: str | None, seq: int) -> None:
        for key in self.pool_stores(backend, medium):
            self.pools[key].pop(seq, None)
        self.cancel(
            seq,
            lambda t: (
                t[0] == "pool" and t[1] == backend and (medium is None or t[2] == medium.lower())
            ),
        )

    def clear_pool(self, backend: str, medium: str | None) -> None:
        for key in self.pool_stores(backend, medium):
            del self.pools[key]
        self.cancel(
            None,
            lambda t: (
                t[0] == "pool" and t[1] == backend and (medium is None or t[2] == medium.lower())
            ),
        )

    def tidy(self) -> None:
        self.own = {k: v for k, v in self.own.items() if v}
        self.pools = {k: v for k, v in self.pools.items() if v}

    # ------------------------------------------------------------- query

    def listed(self) -> dict[str, set[int]]:
        out: dict[str, set[int]] = {}
        for (instance, rank, _tier), held in self.own.items():
            if held:
                out.setdefault(instance, set()).add(rank)
        return out

    def contents(self, seqs: dict[int, Chain] | None) -> set[Chain]:
        return set(seqs.values()) if seqs else set()

    def answer(
        self, chains: list[Chain], block_size: int, only: str | None
    ) -> dict[str, dict[str, Any]]:
        pool_host: set[Chain] = set()
        pool_any: set[Chain] = set()
        for (_backend, medium), store in self.pools.items():
            pool_any |= self.contents(store)
            if pool_class(medium) == HOST:
                pool_host |= self.contents(store)
        n = len(chains)
        out: dict[str, dict[str, Any]] = {}
        for instance, ranks in sorted(self.listed().items()):
            if only is not None and instance != only:
                continue
            per_rank: dict[int, tuple[int, int, int]] = {}
            for rank in sorted(ranks):
                dev = self.contents(self.own.get((instance, rank, DEVICE)))
                host = self.contents(self.own.get((instance, rank, HOST)))
                disk = self.contents(self.own.get((instance, rank, DISK)))
                g = 0
                while g < n and chains[g] in dev:
                    g += 1
                c = g
                while c < n and (chains[c] in host or chains[c] in pool_host):
                    c += 1
                d = g
                while d < n and (chains[d] in host or chains[d] in disk or chains[d] in pool_any):
                    d += 1
                per_rank[rank] = (g, c, d)
            best = max(per_rank, key=lambda r: (per_rank[r][2], per_rank[r][0], per_rank[r][1], -r))
            g, c, d = per_rank[best]
            out[instance] = {
                "longest_matched": d * block_size,
                "GPU": g * block_size,
                "CPU": c * block_size,
                "DISK": d * block_size,
                "DP": {str(r): v[2] * block_size for r, v in per_rank.items()},
            }
        return out


class ReferenceModel:
    def __init__(self) -> None:
        self.ns: dict[NsKey, NsModel] = {}

    def _ns(self, key: NsKey) -> NsModel:
        return self.ns.setdefault(key, NsModel())

    def _settle(self) -> None:
        for ns in self.ns.values():
            ns.fixpoint()
            ns.tidy()

    # ------------------------------------------------------------- engine

    def apply_engine(self, instance: str, meta: EngineMeta, batch: EngineBatch) -> None:
        rank = batch.dp_rank if batch.dp_rank is not None else meta.dp_rank
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                self._engine_stored(instance, rank, meta, ev)
            elif isinstance(ev, BlockRemoved):
                tier = engine_tier(ev.medium)
                if tier is None or (meta.offload_pool and tier != DEVICE):
                    continue
                for ns in self.ns.values():
                    for seq in ev.block_hashes:
                        ns.remove_own(instance, rank, tier, seq)
            elif isinstance(ev, AllBlocksCleared):
                for ns in self.ns.values():
                    ns.clear_own(instance, rank)
            self._settle()

    def _engine_stored(self, instance: str, rank: int, meta: EngineMeta, ev: BlockStored) -> None:
        if ev.block_size is not None and ev.block_size != meta.block_size:
            return
        tier = engine_tier(ev.medium)
        if tier is None:
            return
        ns = self._ns((meta.tenant, meta.model, meta.block_size, ev.lora_name, meta.salt))
        intent = meta.offload_pool and tier != DEVICE
        target: Target = ("intent",) if intent else ("own", instance, rank, tier)
        if not intent:
            mine = ns.own.get((instance, rank, tier), {})
            held = [seq for seq in ev.block_hashes if seq in mine]
            root = ev.parent_block_hash is None and len(held) == len(ev.block_hashes)
            if not (meta.report_full and root):
                ns.add_copies(instance, rank, tier, held)
        if ev.token_ids:
            blocks = token_blocks(ev.token_ids, meta.block_size)
            ns.store_chain(target, list(ev.block_hashes), ev.parent_block_hash, blocks)
        else:
            for seq in ev.block_hashes:
                if intent:
                    chain = ns.known(seq)
                    if chain is not None:
                        ns.place(target, seq, chain)
                else:
                    ns.place_or_wait(target, seq)

    def remove_instance(self, instance: str) -> None:
        for ns in self.ns.values():
            ns.clear_own(instance, None)
        self._settle()

    # --------------------------------------------------------------- pool

    def apply_pool(self, backend_key: str, meta: PoolMeta, batch: PoolBatch) -> None:
        for ev in batch.events:
            self._pool_event(backend_key, meta, ev)
            self._settle()

    def _pool_event(self, backend_key: str, meta: PoolMeta, ev: PoolEvent) -> None:
        model = ev.model_name if ev.model_name is not None else meta.model
        block_size = ev.block_size if ev.block_size is not None else meta.block_size
        assert model is not None and block_size is not None
        key: NsKey = (
            ev.tenant_id if ev.tenant_id is not None else meta.tenant,
            model,
            block_size,
            ev.lora_name,
            ev.additional_salt if ev.additional_salt is not None else meta.salt,
        )
        backend = ev.backend_id if ev.backend_id is not None else backend_key
        if ev.event_type == "cleared":
            if key in self.ns:
                self.ns[key].clear_pool(backend, ev.medium)
            return
        cls = pool_class(ev.medium)
        if cls is None:
            return
        if ev.event_type == "removed":
            if key in self.ns:
                for seq in ev.seq_hashes:
                    self.ns[key].remove_pool(backend, ev.medium, seq)
            return
        ns = self._ns(key)
        medium = "cpu" if ev.medium is None else ev.medium.lower()
        target: Target = ("pool", backend, medium)
        if ev.token_ids:
            blocks = token_blocks(ev.token_ids, key[2])
            ns.store_chain(target, list(ev.seq_hashes), ev.parent_hash, blocks)
        else:
            for seq in ev.seq_hashes:
                ns.place_or_wait(target, seq)

    # -------------------------------------------------------------- query

    def query(self, req: TokenQuery | HashQuery) -> dict[str, dict[str, Any]]:
        tenant = req.tenant_id if req.tenant_id is not None else "default"
        key: NsKey = (tenant, req.model, req.block_size, req.lora_name, req.cache_salt or "")
        ns = self.ns.get(key)
        if ns is None:
            return {}
        if isinstance(req, TokenQuery):
            chains: list[Chain] = []
            chain: Chain = ()
            for block in token_blocks(req.token_ids, req.block_size):
                chain = (*chain, block)
                chains.append(chain)
        else:
            chains = []
            for h in req.seq_hashes:
                known = ns.known(normalise_hash(h))
                if known is None:
                    break
                chains.append(known)
        answer = ns.answer(chains, req.block_size, req.instance_id)
        return {tenant: answer} if answer else {}

    # ------------------------------------------------------------- memory

    def is_empty(self) -> bool:
        return all(
            not (ns.own or ns.pools or ns.intents or ns.waiting or ns.unresolved)
            for ns in self.ns.values()
        )
