"""The whole index: namespaces, instances, and how decoded batches apply.

Pure and synchronous. `apply_engine` and `apply_pool` take a decoded batch
plus its record metadata; everything they skip is counted in `counters`.
Validation that can reject a record happens before anything is applied, so
a record is applied whole or not at all.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvconductor.index.cache_groups import (
    KNOWN_KINDS,
    MAX_WINDOW,
    UNCACHED_KINDS,
    WINDOW_KINDS,
    is_hybrid,
    is_primary,
    primary_group,
)
from kvconductor.index.limits import IndexLimits as IndexLimits
from kvconductor.index.namespace import Dirty, NamespaceIndex, NamespaceKey, namespace_key
from kvconductor.index.query import (
    namespace_of,
    run_local_hash_query,
    run_query,
    run_query_json,
    run_query_ranks,
)
from kvconductor.index.tokenless import EngineProfiles
from kvconductor.wire.engine_hashes import VllmProfile
from kvconductor.wire.errors import RejectedEvent
from kvconductor.wire.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBatch,
    EngineEvent,
    PoolBatch,
    PoolEvent,
)
from kvconductor.wire.media import DEVICE, TIER_NAMES, engine_tier, pool_medium_name, pool_tier
from kvconductor.wire.query import HashQuery, QueryResponse, TokenQuery
from kvconductor.wire.records import EngineMeta, PoolMeta


class InstanceState:
    """What the index remembers about one engine instance across namespaces."""

    __slots__ = ("groups", "last_event_ts", "last_seq", "namespaces")

    def __init__(self) -> None:
        self.namespaces: set[NamespaceKey] = set()
        # KV-cache group -> its spec kind, from the stores (removals name
        # only the group).
        self.groups: dict[int, str] = {}
        self.last_seq: dict[int, int] = {}
        self.last_event_ts = 0.0


class Index:
    def __init__(self, limits: IndexLimits | None = None) -> None:
        self.limits = limits or IndexLimits()
        self.namespaces: dict[NamespaceKey, NamespaceIndex] = {}
        self.instances: dict[str, InstanceState] = {}
        # Instances holding no block, least recently heard from first.
        self.idle: OrderedDict[str, None] = OrderedDict()
        self.counters: Counter[str] = Counter()
        # (source, tier name) -> blocks applied
        self.applied: Counter[tuple[str, str]] = Counter()
        self.now = 0.0
        self.dirty = Dirty()
        # Moves whenever instances or owners change other than by applying
        # engine records (a resync, a removal, a snapshot loaded): the
        # engine lane then looks its contexts up again (`engine_lane`).
        self.epoch = 0

    # -------------------------------------------------------- namespaces

    def _namespace(self, key: NamespaceKey) -> NamespaceIndex | None:
        ns = self.namespaces.get(key)
        if ns is None:
            if len(self.namespaces) >= self.limits.max_namespaces:
                self.counters["namespace_limit_dropped"] += 1
                return None
            lim = self.limits
            ns = NamespaceIndex(
                key,
                lim.max_pending,
                lim.max_pending_age_s,
                lim.max_blocks_per_owner,
                lim.max_retired_content,
                self.counters,
                self.dirty,
                lim.max_owners_per_namespace,
                lim.local_hash_map,
            )
            self.namespaces[key] = ns
        ns.expire(self.now)
        return ns

    def _gc(self, ns: NamespaceIndex) -> None:
        if ns.is_empty():
            del self.namespaces[ns.key]

    def _instance(self, instance: str) -> InstanceState | None:
        state = self.instances.get(instance)
        if state is None:
            if len(self.instances) >= self.limits.max_instances and not self._reclaim_idle():
                self.counters["instance_limit_dropped"] += 1
                return None
            state = self.instances[instance] = InstanceState()
        return state

    def _reclaim_idle(self) -> bool:
        """Forget the instance that holds nothing for longest (announced, then
        silent: a pod that restarted under a new name)."""
        if not self.idle:
            return False
        name, _ = self.idle.popitem(last=False)
        self.remove_instance(name)
        self.counters["instance_limit_reclaimed"] += 1
        return True

    def _note_idle(self, instance: str, state: InstanceState) -> None:
        held = any(
            instance in ns.owners
            for key in state.namespaces
            if (ns := self.namespaces.get(key)) is not None
        )
        if held:
            self.idle.pop(instance, None)
        else:
            self.idle[instance] = None
            self.idle.move_to_end(instance)

    def _tick(self, now: float) -> None:
        if now > self.now:
            self.now = now

    def expire(self, now: float) -> None:
        """Age out pending halves everywhere (the daemon calls this periodically)."""
        self._tick(now)
        for ns in list(self.namespaces.values()):
            ns.expire(self.now)
            self._gc(ns)

    # ------------------------------------------------------------ engine

    def check_seq(self, instance: str, rank: int, seq: int | None) -> int:
        """Track `kv-seq` per (instance, rank); returns how many were skipped."""
        if seq is None:
            return 0
        state = self.instances.get(instance)
        if state is None:
            return 0
        last = state.last_seq.get(rank)
        state.last_seq[rank] = seq
        self.dirty.instances.add(instance)
        if last is None or seq == last + 1:
            return 0
        if seq > last + 1:
            self.counters["seq_gaps"] += 1
            self.counters["seq_missing"] += seq - last - 1
            return seq - last - 1
        self.counters["seq_regressions"] += 1
        return 0

    def apply_engine(self, instance: str, meta: EngineMeta, batch: EngineBatch, now: float) -> int:
        """Apply one engine record; returns the blocks it placed or removed."""
        rank = batch.dp_rank if batch.dp_rank is not None else meta.dp_rank
        if not 0 <= rank <= 1 << 16:
            raise RejectedEvent(f"dp rank out of range: {rank}")
        # Only after validation: a rejected record must not move the clock
        # (an hour-ahead stamp would age out every pending half).
        self._tick(now)
        state = self._instance(instance)
        if state is None:
            return 0
        state.last_event_ts = self.now
        self.dirty.instances.add(instance)
        self._learn_groups(state, batch.events)
        primary = primary_group(state.groups)
        done = 0
        for ev in self._apply_order(state, primary, batch.events):
            if isinstance(ev, BlockStored):
                done += self._engine_stored(instance, state, rank, meta, ev, primary)
            elif isinstance(ev, BlockRemoved):
                done += self._engine_removed(instance, state, rank, meta, ev, primary)
            elif isinstance(ev, AllBlocksCleared):
                for key in list(state.namespaces):
                    ns = self.namespaces.get(key)
                    if ns is not None:
                        done += ns.clear_owner(instance, rank)
                        self._gc(ns)
                self.counters["engine_clears"] += 1
        self._note_idle(instance, state)
        return done

    def _learn_groups(self, state: InstanceState, events: Sequence[EngineEvent]) -> None:
        """The kinds of the groups a record's stores name first, before any
        of its events applies: which group is primary decides where each
        event goes, and a removal names only its group."""
        groups = state.groups
        for ev in events:
            if isinstance(ev, BlockStored) and ev.spec_kind is not None:
                group = ev.group_idx or 0
                if group not in groups:
                    self._group_kind(state, group, ev.spec_kind, len(ev.block_hashes))

    def _apply_order(
        self, state: InstanceState, primary: int, events: list[EngineEvent]
    ) -> list[EngineEvent]:
        """A record's events in the order they apply: between two clears,
        the primary group's first, then the other groups', each in its own
        order. vLLM emits one store per group in group order, so a window
        group listed before the full-attention group names blocks whose
        positions only that later store tells (`cache_groups.locate`);
        groups hold their blocks apart, so no other outcome changes."""
        groups = state.groups

        def primary_event(ev: EngineEvent) -> bool:
            if isinstance(ev, AllBlocksCleared):
                return True
            group = ev.group_idx or 0
            return is_primary(group, groups.get(group), primary)

        if all(map(primary_event, events)):
            return events
        out: list[EngineEvent] = []
        later: list[EngineEvent] = []
        for ev in events:
            if isinstance(ev, AllBlocksCleared):
                out += later
                later.clear()
                out.append(ev)
            elif primary_event(ev):
                out.append(ev)
            else:
                later.append(ev)
        return out + later

    def _engine_stored(
        self,
        instance: str,
        state: InstanceState,
        rank: int,
        meta: EngineMeta,
        ev: BlockStored,
        primary_idx: int,
    ) -> int:
        counters = self.counters
        n = len(ev.block_hashes)
        group = ev.group_idx or 0
        kind = ev.spec_kind
        known = state.groups.get(group)
        if kind is None:
            kind = known
        elif kind != known:
            kind = self._group_kind(state, group, kind, n)
            if kind == "":
                return 0
        if kind in UNCACHED_KINDS:
            counters["non_prefix_group_skipped"] += n
            return 0
        primary = is_primary(group, kind, primary_idx)
        size = ev.block_size
        if size is not None and size != meta.block_size and size % meta.block_size:
            # A smaller primary block is a partial-block key off the hit
            # alignment, which vLLM never looks up.
            fits = not primary and meta.block_size % size == 0
            if not fits:
                small = primary and meta.block_size % size == 0
                counters["partial_blocks_skipped" if small else "block_size_mismatch"] += n
                return 0
        if ev.lora_name is None and ev.lora_id is not None:
            # Old releases name an adapter only by a run-local id: its blocks
            # cannot be put in a namespace a router can ask for.
            counters["unnamed_lora_skipped"] += n
            return 0
        tier = engine_tier(ev.medium)
        if tier is None:
            counters["unknown_medium"] += n
            return 0
        if not primary:
            if tier != DEVICE:
                counters["group_lower_tier_skipped"] += n
                return 0
            window = ev.sliding_window
            if kind in WINDOW_KINDS and (window is None or not 0 < window <= MAX_WINDOW):
                counters["bad_group_spec"] += max(n, 1)
                return 0
        ns = self._namespace(
            namespace_key(meta.tenant, meta.model, meta.block_size, ev.lora_name, meta.salt)
        )
        if ns is None:
            return 0
        if ns.key not in state.namespaces:
            state.namespaces.add(ns.key)
            if len(state.namespaces) > 2 * self.limits.max_namespaces:
                # Forget the namespaces the index dropped since (emptied): at
                # least half of them, so this costs O(1) per store amortised.
                state.namespaces &= self.namespaces.keys()
        if not primary:
            done = ns.store_group(
                instance,
                rank,
                group,
                kind or "unknown",
                size,
                ev.sliding_window,
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids,
            )
            self.applied[(meta.source, "group")] += done
        elif meta.offload_pool and tier != DEVICE:
            done = ns.offload_intent(
                ev.block_hashes, ev.parent_block_hash, ev.token_ids, ev.extra_keys
            )
            self.applied[(meta.source, "intent")] += done
        else:
            done = ns.store_owner(
                instance,
                rank,
                tier,
                ev.block_hashes,
                ev.parent_block_hash,
                ev.token_ids,
                ev.extra_keys,
                size,
                meta.report_full and not is_hybrid(state.groups),
            )
            self.applied[(meta.source, TIER_NAMES[tier])] += done
        self._gc(ns)
        return done

    def _group_kind(self, state: InstanceState, group: int, kind: str, n: int) -> str:
        """A store's kind that differs from what its group is known as:
        remembered (for its removals) if the group is new, else "" (it
        contradicts what the group was: the event is skipped)."""
        known = state.groups.get(group)
        if known is None:
            state.groups[group] = kind
            if kind not in KNOWN_KINDS:
                self.counters["unknown_group_kind"] += 1
            return kind
        self.counters["group_kind_changed"] += max(n, 1)
        return ""

    def _engine_removed(
        self,
        instance: str,
        state: InstanceState,
        rank: int,
        meta: EngineMeta,
        ev: BlockRemoved,
        primary_idx: int,
    ) -> int:
        group = ev.group_idx or 0
        kind = state.groups.get(group)
        if kind in UNCACHED_KINDS:
            self.counters["non_prefix_group_skipped"] += len(ev.block_hashes)
            return 0
        tier = engine_tier(ev.medium)
        if tier is None:
            self.counters["unknown_medium"] += len(ev.block_hashes)
            return 0
        primary = is_primary(group, kind, primary_idx)
        if not primary and tier != DEVICE:
            self.counters["group_lower_tier_skipped"] += len(ev.block_hashes)
            return 0
        if primary and meta.offload_pool and tier != DEVICE:
            # The pool's own events say when a pooled block goes away.
            self.counters["pool_mode_removal_ignored"] += len(ev.block_hashes)
            return 0
        missing: list[int] = ev.block_hashes
        for key in list(state.namespaces):
            ns = self.namespaces.get(key)
            if ns is None:
                continue
            if primary:
                missing = ns.remove_owner(instance, rank, tier, missing)
            else:
                missing = ns.remove_group(instance, rank, group, missing)
            self._gc(ns)
            if not missing:
                break
        if missing:
            self.counters["removal_unknown"] += len(missing)
        return len(ev.block_hashes) - len(missing)

    def resync(self, instance: str, rank: int | None) -> int:
        """Forget what an instance (one rank, or all) holds: its stream had a
        gap nobody could fill, so its indexed state may be stale. Its next
        events rebuild it; until then routers see it as cold, never as warm
        on blocks it may have lost."""
        state = self.instances.get(instance)
        if state is None:
            return 0
        self.epoch += 1
        self.dirty.instances.add(instance)
        cleared = 0
        for key in list(state.namespaces):
            ns = self.namespaces.get(key)
            if ns is None:
                continue
            ranks = list(ns.owners.get(instance, {})) if rank is None else [rank]
            for r in ranks:
                cleared += ns.clear_owner(instance, r)
            self._gc(ns)
        # The publisher's numbering restarts (or jumps): take the next as is.
        if rank is None:
            state.last_seq.clear()
        else:
            state.last_seq.pop(rank, None)
        self.counters["resyncs"] += 1
        return cleared

    def pool_resync(self, backend: str) -> int:
        """A pool backend's stream had an unfillable gap: forget its blocks."""
        cleared = 0
        for ns in list(self.namespaces.values()):
            if any(b == backend for b, _ in ns.pools):
                cleared += ns.pool_clear(backend, None)
                self._gc(ns)
        self.counters["resyncs"] += 1
        return cleared

    def remove_instance(self, instance: str) -> bool:
        """Forget an instance entirely: all its tiers, pending halves, state."""
        state = self.instances.pop(instance, None)
        self.idle.pop(instance, None)
        if state is None:
            return False
        self.epoch += 1
        self.dirty.instances.add(instance)
        for key in state.namespaces:
            ns = self.namespaces.get(key)
            if ns is not None:
                ns.remove_instance(instance)
                self._gc(ns)
        return True

    # -------------------------------------------------------------- pool

    def _pool_namespace_key(self, meta: PoolMeta, ev: PoolEvent, i: int) -> NamespaceKey:
        model = ev.model_name if ev.model_name is not None else meta.model
        block_size = ev.block_size if ev.block_size is not None else meta.block_size
        if not model:
            raise RejectedEvent(f"pool event {i}: no model_name and no kv-model header")
        if block_size is None or block_size <= 0:
            raise RejectedEvent(f"pool event {i}: no valid block_size and no kv-block-size header")
        # An empty field is a missing one: the header's, or the default.
        return namespace_key(
            ev.tenant_id or meta.tenant,
            model,
            block_size,
            ev.lora_name,
            ev.additional_salt or meta.salt,
        )

    def apply_pool(self, backend_key: str, meta: PoolMeta, batch: PoolBatch, now: float) -> int:
        keys = [self._pool_namespace_key(meta, ev, i) for i, ev in enumerate(batch.events)]
        self._tick(now)  # after validation, as in apply_engine
        done = 0
        for key, ev in zip(keys, batch.events, strict=True):
            backend = ev.backend_id if ev.backend_id is not None else backend_key
            if ev.event_type == "cleared":
                ns = self.namespaces.get(key)
                medium = None if ev.medium is None else pool_medium_name(ev.medium)
                if ns is not None:
                    done += ns.pool_clear(backend, medium)
                    self._gc(ns)
                self.counters["pool_clears"] += 1
                continue
            tier = pool_tier(ev.medium)
            if tier is None:
                self.counters["unknown_medium"] += len(ev.seq_hashes)
                continue
            if ev.event_type == "removed":
                ns = self.namespaces.get(key)
                if ns is None:
                    self.counters["pool_removal_unknown"] += len(ev.seq_hashes)
                    continue
                medium = None if ev.medium is None else pool_medium_name(ev.medium)
                done += ns.pool_remove(backend, medium, ev.seq_hashes)
                self._gc(ns)
                continue
            ns = self._namespace(key)
            if ns is None:
                continue
            placed = ns.pool_store(
                backend,
                pool_medium_name(ev.medium),
                tier,
                ev.seq_hashes,
                ev.parent_hash,
                ev.token_ids,
            )
            self.applied[("pool", TIER_NAMES[tier])] += placed
            done += placed
            self._gc(ns)
        return done

    # ------------------------------------------------------------ queries

    def query(
        self,
        req: TokenQuery | HashQuery,
        packed: bytes | None = None,
        profiles: Sequence[VllmProfile] = (),
    ) -> QueryResponse:
        """`packed`: see `query.run_query`; `profiles`: the hash profiles
        bound to the query's context (`tokenless`)."""
        return run_query(*self._namespaces_of(req), packed, self._profiles(profiles))

    def query_json(
        self,
        req: TokenQuery | HashQuery,
        packed: bytes | None = None,
        profiles: Sequence[VllmProfile] = (),
    ) -> bytes:
        """`query`'s answer as JSON (`query.run_query_json`)."""
        return run_query_json(*self._namespaces_of(req), packed, self._profiles(profiles))

    def query_ranks(
        self,
        req: TokenQuery | HashQuery,
        packed: bytes | None = None,
        profiles: Sequence[VllmProfile] = (),
    ) -> dict[str, dict[int, tuple[int, int, int]]]:
        """`query`'s match per rank (`query.run_query_ranks`)."""
        return run_query_ranks(*self._namespaces_of(req), packed, self._profiles(profiles))

    def _profiles(self, profiles: Sequence[VllmProfile]) -> EngineProfiles | None:
        return EngineProfiles(profiles, self._hybrid) if profiles else None

    def _hybrid(self, instance: str) -> bool:
        """Whether the instance's stores named KV-cache groups beyond a
        primary full-attention one."""
        state = self.instances.get(instance)
        return state is not None and is_hybrid(state.groups)

    def query_local_hashes(
        self, tenant: str, model: str, local: list[int]
    ) -> tuple[int, dict[str, dict[int, tuple[int, int, int]]]]:
        """A prompt named by Dynamo's local block hashes, in the model's
        namespaces of `tenant`, salted ones included (`query.run_local_hash_query`):
        Dynamo's request does not name its salt, its hashes carry it."""
        candidates = sorted(
            (
                ns
                for key, ns in self.namespaces.items()
                if key.tenant == tenant and key.model == model
            ),
            key=lambda ns: (ns.key.salt, ns.block_size, ns.key.lora_name or ""),
        )
        return run_local_hash_query(candidates, local)

    def _namespaces_of(
        self, req: TokenQuery | HashQuery
    ) -> tuple[NamespaceIndex | None, TokenQuery | HashQuery, NamespaceIndex | None]:
        """The query's namespace, the query, and its salted namespace's
        unsalted twin (see `query.run_query`)."""
        key = namespace_of(req)
        salted = self.namespaces.get(key._replace(salt="")) if key.salt else None
        return self.namespaces.get(key), req, salted

    def is_empty(self) -> bool:
        return not self.namespaces
