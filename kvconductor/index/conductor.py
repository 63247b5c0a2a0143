"""The index core's public API: records in, answers out.

    conductor = Conductor()
    conductor.ingest_engine_record(b"vllm-0", headers, payload, timestamp_s)
    conductor.ingest_pool_record(b"mooncake-0", headers, payload, timestamp_s)
    conductor.query(TokenQuery(model="m", block_size=16, token_ids=[...]))

A record either applies whole or raises `BadRecord` (nothing applied).
Time is whatever the caller passes (the Kafka record timestamp in the
daemon), so replaying the same records gives the same index.

The shell (daemon, replica, snapshots, HTTP, tools) uses this class alone.
Snapshots go through its snapshot port (`now`, `changes`, `snapshot_state`,
`replace_state`): `kvconductor.snapshots.units` is the one reader of the
index's internals, and it is handed them there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import NamedTuple

from kvconductor.index.engine_lane import EngineLane, Steps, run_here
from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.index.namespace import Dirty, NamespaceKey
from kvconductor.index.pending import INTENT, UNRESOLVED, WAITING
from kvconductor.kernel import KERNEL
from kvconductor.wire.engine import decode_engine_payload
from kvconductor.wire.engine_hashes import VllmProfile
from kvconductor.wire.errors import DecodeError, InvalidHeader
from kvconductor.wire.media import DEVICE, DISK, HOST
from kvconductor.wire.pool import decode_pool_payload
from kvconductor.wire.query import HashQuery, QueryResponse, TokenQuery
from kvconductor.wire.records import (
    Headers,
    Incoming,
    control_meta,
    engine_meta,
    header_map,
    pool_meta,
)

__all__ = ["Applied", "Conductor", "Incoming", "Notice"]


class Applied(NamedTuple):
    blocks: int  # blocks placed, removed or cleared by the record
    seq_missing: int  # messages missing before this one by `kv-seq` (0: none)
    resync: bool = False  # a bridge's resync control record was applied


class Notice(NamedTuple):
    """A record of a batch the caller must hear of: it was not applied
    (`error`), or it applied with something to say (`applied.seq_missing`,
    `applied.resync`). `error` is a `BadRecord`, or any other exception the
    core raised (a bug: the record is skipped all the same)."""

    at: int  # position in the batch
    applied: Applied | None
    error: Exception | None


def _key_text(key: bytes | str | None, what: str) -> str:
    if key is None:
        raise InvalidHeader(f"record has no key ({what} id)")
    if isinstance(key, str):
        return key
    try:
        return key.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InvalidHeader(f"record key ({what} id) is not valid UTF-8") from exc


class Conductor:
    def __init__(self, limits: IndexLimits | None = None, lane: bool = True) -> None:
        """`lane`: apply what the compiled kernel can of `ingest`'s batches
        there (`engine_lane`; with the kernel built). Off, every record
        takes the Python path, the reference the lane is held equal to."""
        self._lane_on = lane and KERNEL is not None
        self._index = Index(limits)
        self.lane = EngineLane(self._index) if self._lane_on else None

    # ------------------------------------------------------------ ingest

    def ingest_engine_record(
        self, key: bytes | str | None, headers: Headers, payload: bytes, now: float
    ) -> Applied:
        """One engine record, the Python way (`ingest` applies batches)."""
        try:
            return self._engine_record(key, headers, payload, now)
        finally:
            if self.lane is not None:
                self.lane.forget(key)

    def _engine_record(
        self, key: bytes | str | None, headers: Headers, payload: bytes, now: float
    ) -> Applied:
        instance = _key_text(key, "instance")
        h = header_map(headers)
        control = control_meta(h)
        if control is not None:
            return Applied(self._index.resync(instance, control.dp_rank), 0, True)
        meta = engine_meta(h)
        batch = decode_engine_payload(payload, meta.source)
        blocks = self._index.apply_engine(instance, meta, batch, now)
        rank = batch.dp_rank if batch.dp_rank is not None else meta.dp_rank
        missing = self._index.check_seq(instance, rank, meta.seq)
        return Applied(blocks, missing)

    def ingest(self, records: Sequence[Incoming]) -> list[Notice]:
        """Apply records in order, each whole or not at all; returns the
        notices, in order, of the records that were skipped or have
        something to say (most records have none)."""
        return run_here(self.ingest_steps(records))

    def ingest_steps(self, records: Sequence[Incoming]) -> Steps[list[Notice]]:
        """`ingest`, as the kernel calls it makes (`engine_lane.run_here`)."""
        notices: list[Notice] = []
        lane = self.lane
        batch = records if isinstance(records, list) else list(records)  # the lane takes lists
        i, n = 0, len(batch)
        while i < n:
            if lane is not None and not lane.declines(batch[i]):
                stop = yield from lane.run(batch, i)
                notices += [Notice(at, Applied(b, missing), None) for at, b, missing in stop.gaps]
                if not stop.python:
                    break
                i = stop.at
            rec = batch[i]
            notice = self._ingest_one(i, rec)
            if notice is not None:
                notices.append(notice)
            if lane is not None and not rec.pool:
                lane.forget(rec.key)
            i += 1
        return notices

    def _ingest_one(self, i: int, rec: Incoming) -> Notice | None:
        try:
            if rec.value is None:
                raise DecodeError("record has no value")
            ingest = self.ingest_pool_record if rec.pool else self._engine_record
            applied = ingest(rec.key, rec.headers, rec.value, rec.now)
        except Exception as exc:  # a core bug skips the record, never the batch
            return Notice(i, None, exc)
        if applied.resync or applied.seq_missing:
            return Notice(i, applied, None)
        return None

    def ingest_pool_record(
        self, key: bytes | str | None, headers: Headers, payload: bytes, now: float
    ) -> Applied:
        backend = _key_text(key, "backend")
        h = header_map(headers)
        if control_meta(h) is not None:
            return Applied(self._index.pool_resync(backend), 0, True)
        meta = pool_meta(h)
        batch = decode_pool_payload(payload)
        return Applied(self._index.apply_pool(backend, meta, batch, now), 0)

    def expire(self, now: float) -> None:
        self._index.expire(now)

    def remove_instance(self, instance: str) -> bool:
        return self._index.remove_instance(instance)

    # ----------------------------------------------------- snapshot port

    @property
    def now(self) -> float:
        """The event clock: the newest record time applied (or restored)."""
        return self._index.now

    @property
    def changes(self) -> Dirty:
        """The units changed since a snapshot capture last took these marks
        (it clears them; with nothing publishing, `changes.clear()`)."""
        return self._index.dirty

    def has_instance(self, instance: str) -> bool:
        return instance in self._index.instances

    def snapshot_state(self) -> Index:
        """The index itself, for `kvconductor.snapshots.units` to export
        units from and restore units into; nothing else reads it."""
        return self._index

    def replace_state(self, index: Index) -> None:
        """Answer from `index` from now on (a snapshot restored into a fresh
        index, all or nothing, or an empty one)."""
        self._index = index
        self.lane = EngineLane(index) if self._lane_on else None

    # ----------------------------------------------------------- queries

    def query(
        self,
        req: TokenQuery,
        packed: bytes | None = None,
        profiles: Sequence[VllmProfile] = (),
    ) -> QueryResponse:
        """`packed`: the prompt already packed, in place of `req.token_ids`
        (see `query.run_query`). `profiles`: the vLLM hash profiles that
        also name the prompt's blocks for tokenless instances (`tokenless`)."""
        return self._index.query(req, packed, profiles)

    def query_by_hash(self, req: HashQuery) -> QueryResponse:
        return self._index.query(req)

    def query_json(
        self,
        req: TokenQuery | HashQuery,
        packed: bytes | None = None,
        profiles: Sequence[VllmProfile] = (),
    ) -> bytes:
        """`query` or `query_by_hash`, answered as the HTTP API's JSON body."""
        return self._index.query_json(req, packed, profiles)

    def query_ranks(
        self,
        req: TokenQuery | HashQuery,
        packed: bytes | None = None,
        profiles: Sequence[VllmProfile] = (),
    ) -> dict[str, dict[int, tuple[int, int, int]]]:
        """Per listed instance and rank, (GPU, CPU, DISK) in tokens: the
        match behind `query`, for answers that list every rank."""
        return self._index.query_ranks(req, packed, profiles)

    @property
    def local_hash_map_on(self) -> bool:
        """Whether namespaces learn Dynamo's local block hashes (`query_local_hashes`)."""
        return self._index.limits.local_hash_map > 0

    def query_local_hashes(
        self, tenant: str, model: str, local: list[int]
    ) -> tuple[int, dict[str, dict[int, tuple[int, int, int]]]]:
        """A prompt named by Dynamo's local block hashes (u64): the block
        size of its namespace and, per listed instance and rank, (GPU, CPU,
        DISK) in tokens (`query.run_local_hash_query`)."""
        return self._index.query_local_hashes(tenant, model, local)

    # ----------------------------------------------------------- reading

    @property
    def counters(self) -> Counter[str]:
        """Everything skipped, dropped or noticed, by name."""
        return self._index.counters

    @property
    def applied(self) -> Counter[tuple[str, str]]:
        """Blocks applied by (source, tier): tiers GPU, CPU, DISK, intent."""
        return self._index.applied

    @property
    def namespace_count(self) -> int:
        return len(self._index.namespaces)

    @property
    def instance_count(self) -> int:
        return len(self._index.instances)

    def pending(self) -> dict[str, int]:
        """Pending two-phase halves across namespaces, by kind, and the content
        kept for late halves after its last holder went (`retired`)."""
        out = {"waiting": 0, "unresolved": 0, "intents": 0, "retired": 0}
        for ns in self._index.namespaces.values():
            by_kind = ns.pending.by_kind
            out["waiting"] += by_kind[WAITING]
            out["unresolved"] += by_kind[UNRESOLVED]
            out["intents"] += by_kind[INTENT]
            out["retired"] += ns.store.retired_len()
        return out

    def entries(self) -> int:
        """(block, owner) entries held: owner tiers and pool stores."""
        n = 0
        for ns in self._index.namespaces.values():
            for ranks in ns.owners.values():
                n += sum(ns.store.owner_size(o.slot) for o in ranks.values())
            n += sum(ns.store.pool_len(s.pid) for s in ns.pools.values())
        return n

    def context_blocks(self) -> dict[tuple[str, str, str, int], int]:
        """Distinct blocks held, per (tenant, model, LoRA or "", block size):
        Conductor's `prefix_count`, over every salt."""
        out: dict[tuple[str, str, str, int], int] = {}
        for key, ns in self._index.namespaces.items():
            context = (key.tenant, key.model, key.lora_name or "", key.block_size)
            held = ns.store.content_len() - ns.store.retired_len()
            out[context] = out.get(context, 0) + held
        return out

    def workers(self) -> list[dict[str, object]]:
        """Instances, ranks and per-tier block counts per namespace."""
        out: list[dict[str, object]] = []
        for key in sorted(self._index.namespaces, key=_ns_sort_key):
            ns = self._index.namespaces[key]
            instances: dict[str, dict[str, object]] = {}
            for instance in sorted(ns.owners):
                ranks = ns.owners[instance]
                instances[instance] = {
                    str(rank): {
                        "GPU": ns.store.tier_len(o.slot, DEVICE),
                        "CPU": ns.store.tier_len(o.slot, HOST),
                        "DISK": ns.store.tier_len(o.slot, DISK),
                    }
                    for rank, o in sorted(ranks.items())
                }
            pools: dict[str, dict[str, int]] = {}
            for (backend, medium), store in sorted(ns.pools.items()):
                pools.setdefault(backend, {})[medium] = ns.store.pool_len(store.pid)
            out.append(
                {
                    "tenant": key.tenant,
                    "model": key.model,
                    "block_size": key.block_size,
                    "lora_name": key.lora_name,
                    "salt": key.salt,
                    "instances": instances,
                    "pools": pools,
                    "last_event_ts": ns.now,
                }
            )
        return out

    def is_empty(self) -> bool:
        return self._index.is_empty()


def _ns_sort_key(key: NamespaceKey) -> tuple[str, str, int, str, str]:
    return (key.tenant, key.model, key.block_size, key.lora_name or "", key.salt)
