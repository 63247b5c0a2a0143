"""The engine lane: batches of engine records applied by the compiled kernel.

`EngineLane.run` hands a batch to `kernel/py/src/lane.rs`, which decodes each
record, rebuilds its chains and updates the namespace's block store with no
Python per record or event, for the shapes real engines send most (int
hashes, token ids, device or local offload tiers, one KV-cache group). It
stops at the first record it cannot apply exactly as `Index.apply_engine`
would; the caller applies that one through the Python path and calls `run`
again after it. The Python path stays the reference: `Conductor(lane=False)`
runs it alone, and tests/test_engine_lane.py holds the two equal.

A context is what the kernel needs for one (instance, header set, dp rank):
the owner's slot in its namespace's store and the facts that make the lane
exact for it, checked here (`_context`) against the index as it is. The lane
forgets an instance's contexts whenever the Python path applies one of its
records, and all of them when the index's `epoch` moves (a restore, a
resync, an instance removed).

`run` is a generator of the kernel's calls that apply records with the GIL
released (`_kernel.EngineLane.run_free`): whoever drives it runs each call
where it likes, on another thread so that the event loop serves queries
meanwhile (`kvconductor/consumers/event_consumer.py`), or right there (`run_here`).
Everything else, the Python path included, happens where the generator
runs, between those calls; nothing else may change the index while one
runs.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from functools import partial
from typing import TYPE_CHECKING, NamedTuple, TypeVar

from kvconductor.index.cache_groups import FULL_KINDS, is_hybrid
from kvconductor.index.namespace import NamespaceIndex, NamespaceKey, namespace_key
from kvconductor.kernel import KERNEL
from kvconductor.wire.errors import BadRecord
from kvconductor.wire.media import TIER_NAMES, engine_tier
from kvconductor.wire.records import Incoming, control_meta, engine_meta, header_map

if KERNEL is not None:
    from kvconductor import _kernel
if TYPE_CHECKING:
    from kvconductor.index.fleet import Index, InstanceState

DONE = 0
NEED_CONTEXT = 1
PYTHON = 2
GIL = 3
_MAX_RANK = 1 << 16
# Records of an instance the lane just failed on that go to the Python path
# before the lane tries it again: twice as many as the last time, up to this,
# until the lane applies one of its records. LoRA, copies, hybrid groups and
# the like stay the Python path's for long stretches, and every failed try
# costs a context and a decode that the Python path then repeats.
DECLINE_MAX = 64

# (record, blocks applied, kv-seq messages missing) of each gap
Gap = tuple[int, int, int]


class _Context(NamedTuple):
    ns: NamespaceIndex
    dirty_key: tuple[NamespaceKey, str, int]
    source: str
    key: bytes  # the instance's record key


class Stop(NamedTuple):
    at: int  # the record the lane stopped at (len(records): none)
    python: bool  # that record is the Python path's (else: past the end)
    gaps: list[Gap]


T = TypeVar("T")
KernelCall = Callable[[], "_kernel.RunOut"]
# A generator of kernel calls: each sent back its call's result.
Steps = Generator[KernelCall, "_kernel.RunOut", T]


def run_here(steps: Steps[T]) -> T:
    """Drives `steps` with each kernel call made on this thread."""
    try:
        call = next(steps)
        while True:
            call = steps.send(call())
    except StopIteration as done:
        return done.value  # type: ignore[no-any-return]


class EngineLane:
    def __init__(self, index: Index) -> None:
        assert KERNEL is not None
        self.index = index
        self.kernel = _kernel.EngineLane(sorted(FULL_KINDS), engine_tier)
        self.contexts: dict[int, _Context] = {}
        self.next_id = 0
        self.epoch = index.epoch
        # Instance key -> records left that go straight to the Python path,
        # and how many its last decline sent there (`DECLINE_MAX`).
        self.declined: dict[bytes, int] = {}
        self.strikes: dict[bytes, int] = {}

    def run(self, records: list[Incoming], start: int) -> Steps[Stop]:
        """Apply `records[start:]` until one the lane cannot (see the module doc)."""
        index = self.index
        if index.epoch != self.epoch:
            self.kernel.reset()
            self.contexts.clear()
            # Also where instances went: these would otherwise keep them.
            self.declined.clear()
            self.strikes.clear()
            self.epoch = index.epoch
        gaps: list[Gap] = []
        at = start
        while at < len(records):
            out = yield partial(self.kernel.run_free, records, at, index.now)
            if out[1] == GIL:
                self._flush(out)
                gaps += out[5]
                out = self.kernel.run(records, out[0], index.now, out[0] + 1)
            at, code, rank = out[0], out[1], out[2]
            self._flush(out)
            gaps += out[5]
            if code == NEED_CONTEXT and self._context(records[at], rank):
                continue
            if code != DONE:
                self._decline(records[at])
                return Stop(at, True, gaps)
        return Stop(at, False, gaps)

    def declines(self, rec: Incoming) -> bool:
        """Whether `rec` goes to the Python path without the lane trying."""
        return rec.pool or rec.key in self.declined

    def _decline(self, rec: Incoming) -> None:
        key = rec.key
        if rec.pool or not isinstance(key, bytes):
            return
        state = self.index.instances.get(key.decode("utf-8", "replace"))
        if state is not None:
            # A hybrid instance's records are never the lane's.
            n = DECLINE_MAX if is_hybrid(state.groups) else 2 * self.strikes.get(key, 1)
            self.declined[key] = self.strikes[key] = min(n, DECLINE_MAX)

    def forget(self, key: bytes | str | None) -> None:
        """The Python path applied a record of this instance."""
        if isinstance(key, bytes):
            for cid in self.kernel.forget(key):
                del self.contexts[cid]
            left = self.declined.get(key)
            if left is not None:
                if left > 1:
                    self.declined[key] = left - 1
                else:
                    del self.declined[key]

    def _flush(self, out: _kernel.RunOut) -> None:
        """What the kernel changed beside the stores, as the Python path does it."""
        index = self.index
        index.now = out[3]
        counters = index.counters
        for name, value in out[4]:
            counters[name] += value
        applied = index.applied
        dirty = index.dirty
        strikes = self.strikes
        for cid, blocks, stored, now in out[6]:
            ctx = self.contexts[cid]
            if strikes:
                strikes.pop(ctx.key, None)
            dirty.owners.add(ctx.dirty_key)
            for tier, name in enumerate(TIER_NAMES):
                if stored >> tier & 1:
                    applied[(ctx.source, name)] += blocks[tier]
            ctx.ns.now = now
        for instance, last_ts, seqs in out[7]:
            state = index.instances[instance]
            state.last_event_ts = last_ts
            for rank, seq in seqs:
                state.last_seq[rank] = seq
            dirty.instances.add(instance)
            index.idle.pop(instance, None)

    def _context(self, rec: Incoming, payload_rank: int | None) -> bool:
        """A context for `rec` when the lane can apply its records exactly;
        False: the Python path applies it."""
        index = self.index
        if not isinstance(rec.key, bytes):
            return False
        try:
            instance = rec.key.decode("utf-8")
            h = header_map(rec.headers)
            if control_meta(h) is not None:
                return False
            meta = engine_meta(h)
        except (BadRecord, UnicodeDecodeError):
            return False
        rank = payload_rank if payload_rank is not None else meta.dp_rank
        state = index.instances.get(instance)
        if state is None or not 0 <= rank <= _MAX_RANK:
            return False
        key = namespace_key(meta.tenant, meta.model, meta.block_size, None, meta.salt)
        ns = index.namespaces.get(key)
        if ns is None or not self._exact(state, ns, key):
            return False
        owner = ns.owners.get(instance, {}).get(rank)
        if owner is None or owner.copies or owner.groups or owner.primary_block != ns.block_size:
            return False
        store = ns.store
        if not isinstance(store, _kernel.BlockStore):
            return False
        cid = self.next_id
        self.next_id += 1
        self.kernel.add_context(
            cid,
            instance,
            store,
            ns.pending.entries,
            ns.waiting,
            ns.children,
            ns.unresolved,
            ns.pending.max_age_s,
            owner.slot,
            ns.block_size,
            ns.seed,
            index.limits.max_blocks_per_owner,
            meta.offload_pool,
            meta.report_full and not is_hybrid(state.groups),
            state.groups.get(0),
            rank,
            state.last_seq.get(rank),
        )
        self.contexts[cid] = _Context(ns, (key, instance, rank), meta.source, rec.key)
        return True

    def _exact(self, state: InstanceState, ns: NamespaceIndex, key: NamespaceKey) -> bool:
        """Whether the lane applies this instance's records in `ns` exactly:
        the instance lives in that namespace only (removals name none), its
        group 0 is of a full-attention kind or none, and the namespace keeps
        no Dynamo hash map."""
        kind0 = state.groups.get(0)
        return (
            state.namespaces == {key}
            and (kind0 is None or kind0 in FULL_KINDS)
            and ns.local_map is None
        )
