"""Property tests: the core `Index` against the naive `reference_model`.

Random event streams (engine stores in every tier with and without tokens,
removals, clears, offload intents, pool confirmations, pool stores with
tokens, pool removals and clears, instance removal) go through both; after
every operation every query of interest must give the same answer.

Sequence hashes are realistic: a function of the block's chain (and of the
engine's hashing scheme), so the same content has the same hash across the
instances that share a scheme, as with vLLM, and a different one for an
instance that hashes differently (contract section 1: matching is on content).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, replace
from typing import Any

import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.control import current_build_context
from hypothesis.errors import InvalidArgument
from reference_model import ReferenceModel

from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.snapshots.units import (
    PendingUnit,
    all_unit_ids,
    export_unit,
    restore,
    retired_entries,
)
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

MODEL = "m"
NOW = 1000.0
MASK = (1 << 64) - 1
LORAS: tuple[str | None, ...] = (None, "ad-a")
# instance -> (offload to pool?, hashing scheme)
# instance -> (offloads into the pool, hash scheme, declares `kv-report-mode: full`)
INSTANCES = {"i0": (False, "A", True), "i1": (False, "B", False), "i2": (True, "A", False)}
BACKENDS = ("p0", "p1")
ENGINE_MEDIA = (None, "GPU", "gpu", "CPU", "cpu_pinned", "DISK", "nvme", "tape")
POOL_MEDIA = (None, "cpu", "CPU", "disk", "gpu", "nvme", "tape")

Block = tuple[int, ...]


def seq_hash(scheme: str, lora: str | None, blocks: list[Block] | tuple[Block, ...]) -> int:
    """The engine's name for the block that ends `blocks` (a chain from the root)."""
    return xxhash.xxh3_64_intdigest(repr((scheme, lora, tuple(blocks))).encode())


def seqs_of(scheme: str, lora: str | None, prompt: list[Block]) -> list[int]:
    return [seq_hash(scheme, lora, prompt[: i + 1]) for i in range(len(prompt))]


def flat(blocks: list[Block]) -> list[int]:
    return [t for b in blocks for t in b]


def engine_meta(instance: str, block_size: int) -> EngineMeta:
    return EngineMeta(
        model=MODEL,
        block_size=block_size,
        source="vllm",
        seq=None,
        tenant="default",
        salt="",
        dp_rank=0,
        offload_pool=INSTANCES[instance][0],
        report_full=INSTANCES[instance][2],
    )


def pool_meta(block_size: int) -> PoolMeta:
    return PoolMeta(model=MODEL, block_size=block_size, tenant="default", salt="", seq=None)


# ------------------------------------------------------------------ operations


@dataclass(frozen=True, repr=False)
class Op:
    """One record (or remove_instance) in a readable, shrinkable form."""

    kind: str  # store | remove | clear | pool_store | pool_remove | pool_clear | drop
    who: str  # instance or backend
    rank: int = 0
    lora: str | None = None
    prompt: int = 0
    start: int = 0
    end: int = 0
    medium: str | None = None
    tokens: bool = True
    partial: bool = False  # cut the last block's tokens short
    junk: bool = False  # add a hash nobody ever gives content for
    glue: bool = False  # same record as the op before, when it can be
    scheme: str = "A"  # pool ops: whose hashes

    def __repr__(self) -> str:
        fields = [f"{self.kind} {self.who}"]
        if self.kind in ("store", "remove", "clear"):
            fields.append(f"r{self.rank}")
        if self.kind not in ("clear", "drop"):
            fields.append(f"lora={self.lora}")
        if self.kind in ("store", "remove", "pool_store", "pool_remove"):
            fields.append(f"p{self.prompt}[{self.start}:{self.end}]")
        if self.kind not in ("clear", "drop"):
            fields.append(f"medium={self.medium}")
        if self.kind in ("store", "pool_store"):
            fields.append("tokens" if self.tokens else "hashes-only")
            if self.partial:
                fields.append("partial")
        if self.junk:
            fields.append("junk")
        if self.kind.startswith("pool_") and self.kind != "pool_clear":
            fields.append(f"scheme={self.scheme}")
        if self.glue:
            fields.append("glued")
        return "<" + " ".join(fields) + ">"


JUNK = 0xDEAD_BEEF_0000_0001


def render(op: Op, prompts: list[list[Block]], bs: int) -> tuple[str, Any]:
    """The (api, payload) of one operation."""
    if op.kind == "drop":
        return "drop", None
    if op.kind == "clear":
        return "engine", EngineBatch(ts=NOW, events=[AllBlocksCleared()], dp_rank=op.rank)
    if op.kind == "pool_clear":
        ev = PoolEvent(event_type="cleared", medium=op.medium, lora_name=op.lora)
        return "pool", PoolBatch(ts=NOW, events=[ev])
    prompt = prompts[op.prompt]
    scheme = INSTANCES[op.who][1] if op.kind in ("store", "remove") else op.scheme
    all_seqs = seqs_of(scheme, op.lora, prompt)
    seqs = all_seqs[op.start : op.end]
    parent = all_seqs[op.start - 1] if op.start > 0 else None
    tokens = flat(prompt[op.start : op.end]) if op.tokens else None
    if tokens and op.partial:
        tokens = tokens[:-1]
    if op.junk:
        seqs = [*seqs, JUNK]
    if op.kind == "store":
        ev: Any = BlockStored(
            block_hashes=seqs,
            parent_block_hash=parent,
            token_ids=tokens,
            block_size=bs,
            medium=op.medium,
            lora_name=op.lora,
        )
        return "engine", EngineBatch(ts=NOW, events=[ev], dp_rank=op.rank)
    if op.kind == "remove":
        ev = BlockRemoved(block_hashes=seqs, medium=op.medium)
        return "engine", EngineBatch(ts=NOW, events=[ev], dp_rank=op.rank)
    if op.kind == "pool_store":
        ev = PoolEvent(
            event_type="stored",
            seq_hashes=seqs,
            parent_hash=parent,
            token_ids=tokens,
            medium=op.medium,
            lora_name=op.lora,
        )
        return "pool", PoolBatch(ts=NOW, events=[ev])
    assert op.kind == "pool_remove"
    ev = PoolEvent(event_type="removed", seq_hashes=seqs, medium=op.medium, lora_name=op.lora)
    return "pool", PoolBatch(ts=NOW, events=[ev])


def apply_op(index: Index, model: ReferenceModel, op: Op, prompts: list[list[Block]], bs: int):
    apply_record(index, model, [op], prompts, bs)


ENGINE_KINDS = frozenset({"store", "remove", "clear"})
POOL_KINDS = frozenset({"pool_store", "pool_remove", "pool_clear"})


def records(ops: list[Op]) -> list[list[Op]]:
    """Ops grouped into records: a glued op joins the record before it when
    both are engine events of one instance and rank, or pool events of one
    backend."""
    out: list[list[Op]] = []
    for op in ops:
        if op.glue and out:
            head = out[-1][0]
            same_engine = {op.kind, head.kind} <= ENGINE_KINDS and (op.who, op.rank) == (
                head.who,
                head.rank,
            )
            same_pool = {op.kind, head.kind} <= POOL_KINDS and op.who == head.who
            if same_engine or same_pool:
                out[-1].append(op)
                continue
        out.append([op])
    return out


def apply_record(
    index: Index, model: ReferenceModel, group: list[Op], prompts: list[list[Block]], bs: int
) -> None:
    rendered = [render(op, prompts, bs) for op in group]
    api, who = rendered[0][0], group[0].who
    if api == "drop":
        index.remove_instance(who)
        model.remove_instance(who)
        return
    events = [e for _, payload in rendered for e in payload.events]
    if api == "engine":
        batch: Any = EngineBatch(ts=NOW, events=events, dp_rank=group[0].rank)
        index.apply_engine(who, engine_meta(who, bs), batch, NOW)
        model.apply_engine(who, engine_meta(who, bs), batch)
    else:
        batch = PoolBatch(ts=NOW, events=events)
        index.apply_pool(who, pool_meta(bs), batch, NOW)
        model.apply_pool(who, pool_meta(bs), batch)


def queries(
    prompts: list[list[Block]], bs: int, every_prefix: bool
) -> list[TokenQuery | HashQuery]:
    out: list[TokenQuery | HashQuery] = []
    for lora in LORAS:
        for prompt in prompts:
            cuts = range(len(prompt) + 1) if every_prefix else [len(prompt)]
            for cut in cuts:
                tokens = flat(prompt[:cut])
                out.append(TokenQuery(MODEL, bs, tokens, lora_name=lora))
            # A trailing partial block is never matched.
            out.append(TokenQuery(MODEL, bs, [*flat(prompt), 0], lora_name=lora))
            out.append(TokenQuery(MODEL, bs, flat(prompt), lora_name=lora, instance_id="i1"))
            a = seqs_of("A", lora, prompt)
            b = seqs_of("B", lora, prompt)
            out.append(HashQuery(MODEL, bs, list(a), lora_name=lora))
            # Signed form of the same hashes, and a mix of both schemes.
            signed = [h - (1 << 64) if h >= 1 << 63 else h for h in b]
            out.append(HashQuery(MODEL, bs, list(signed), lora_name=lora))
            mixed = [a[i] if i % 2 else b[i] for i in range(len(a))]
            out.append(HashQuery(MODEL, bs, list(mixed), lora_name=lora, instance_id="i0"))
            # Hex digests: 8 bytes, and 32 bytes whose low 64 bits are the hash.
            hexes: list[int | str] = [h.to_bytes(8, "big").hex() for h in a]
            out.append(HashQuery(MODEL, bs, hexes, lora_name=lora))
            long = [(0xAB << 248 | h).to_bytes(32, "big").hex() for h in b]
            out.append(HashQuery(MODEL, bs, list(long), lora_name=lora, instance_id="i1"))
    # Namespaces nobody wrote to.
    out.append(TokenQuery(MODEL, bs + 1, flat(prompts[0])))
    out.append(TokenQuery("other", bs, flat(prompts[0])))
    out.append(TokenQuery(MODEL, bs, flat(prompts[0]), tenant_id="t2"))
    return out


def leftovers_differ(index: Index, model: ReferenceModel) -> str | None:
    """Memory: the core holds blocks, and has halves pending, exactly when the
    model does (a leak shows here long before any query notices it)."""
    for key, m in model.ns.items():
        ns = index.namespaces.get(key)  # type: ignore[call-overload]
        got = (bool(ns and (ns.owners or ns.pools)), bool(ns and len(ns.pending)))
        want = (bool(m.own or m.pools), bool(m.waiting or m.intents or m.unresolved))
        if got != want:
            return (
                f"namespace {key}: core (holds, pending) {got}, model {want}; "
                f"core pending {ns and dict(ns.pending.by_kind)}"
            )
    return None


def check_same_leftovers(
    index: Index, model: ReferenceModel, prompts: list[list[Block]], bs: int, ops: list[Op]
) -> None:
    problem = leftovers_differ(index, model)
    if problem is not None:
        raise AssertionError(problem + minimal_report(bs, prompts, ops))


def minimal_report(bs: int, prompts: list[list[Block]], ops: list[Op]) -> str:
    if not final_run():
        return ""
    small = minimise(bs, prompts, ops)
    return (
        f"\nminimal stream (block_size={bs}, prompts={prompts}):\n   "
        + "\n   ".join(map(repr, small))
        + f"\n {first_disagreement(bs, prompts, small)}"
    )


def final_run() -> bool:
    """True outside hypothesis, or on the run that hypothesis reports."""
    try:
        return bool(current_build_context().is_final)
    except InvalidArgument:
        return True


def check_agree(
    index: Index,
    model: ReferenceModel,
    prompts: list[list[Block]],
    bs: int,
    ops: list[Op] | None,
    every_prefix: bool = False,
) -> None:
    """Every query of interest answers the same; on a difference, report the
    smallest sub-stream of `ops` that still shows one."""
    for q in queries(prompts, bs, every_prefix):
        got = index.query(q)
        want = model.query(q)
        if got == want:
            continue
        detail = f"query {q}\n core:  {got}\n model: {want}"
        if ops is not None:
            detail += minimal_report(bs, prompts, ops)
        raise AssertionError(detail)


def first_disagreement(bs: int, prompts: list[list[Block]], ops: list[Op]) -> str | None:
    """The first query on which core and model differ after some op, if any."""
    index = Index(BIG)
    model = ReferenceModel()
    groups = records(ops)
    for i, group in enumerate(groups):
        apply_record(index, model, group, prompts, bs)
        for q in queries(prompts, bs, every_prefix=i == len(groups) - 1):
            got, want = index.query(q), model.query(q)
            if got != want:
                return f"after record {i}: {q}\n core:  {got}\n model: {want}"
        problem = leftovers_differ(index, model)
        if problem is not None:
            return f"after record {i}: {problem}"
    return None


def minimise(bs: int, prompts: list[list[Block]], ops: list[Op]) -> list[Op]:
    """Drop operations one at a time while core and model still disagree
    (hypothesis shrinks these streams poorly: most "simpler" ops are not no-ops)."""
    ops = list(ops)
    progress = True
    while progress:
        progress = False
        for i in range(len(ops)):
            trial = ops[:i] + ops[i + 1 :]
            if first_disagreement(bs, prompts, trial) is not None:
                ops = trial
                progress = True
                break
    return ops


# ------------------------------------------------------------------ strategies


@st.composite
def prompt_pools(draw: st.DrawFn, bs: int) -> list[list[Block]]:
    """3-5 prompts over a 2-token alphabet; later ones often extend earlier prefixes."""
    block = st.tuples(*[st.integers(0, 1)] * bs)
    prompts: list[list[Block]] = []
    for _ in range(draw(st.integers(3, 5))):
        head: list[Block] = []
        if prompts and draw(st.booleans()):
            base = draw(st.sampled_from(prompts))
            head = base[: draw(st.integers(0, len(base)))]
        tail = draw(st.lists(block, min_size=0 if head else 1, max_size=4))
        prompts.append((head + tail)[:6] or [tuple([0] * bs)])
    return prompts


@st.composite
def ops_strategy(draw: st.DrawFn, prompts: list[list[Block]], max_ops: int) -> list[Op]:
    n_ops = draw(st.integers(1, max_ops))
    out: list[Op] = []
    for _ in range(n_ops):
        kind = draw(
            st.sampled_from(
                ["store"] * 6
                + ["remove"] * 2
                + ["clear", "drop"]
                + ["pool_store"] * 4
                + ["pool_remove"] * 2
                + ["pool_clear"]
            )
        )
        lora = draw(st.sampled_from(LORAS))
        p = draw(st.integers(0, len(prompts) - 1))
        n = len(prompts[p])
        start = draw(st.integers(0, n - 1))
        end = draw(st.integers(start + 1, n))
        if kind in ("store", "remove", "clear"):
            who = draw(st.sampled_from(sorted(INSTANCES)))
            out.append(
                Op(
                    kind,
                    who,
                    rank=draw(st.integers(0, 1)),
                    lora=lora,
                    prompt=p,
                    start=start,
                    end=end,
                    medium=draw(st.sampled_from(ENGINE_MEDIA)),
                    tokens=draw(st.booleans()),
                    partial=draw(st.integers(0, 9)) == 0,
                    junk=draw(st.integers(0, 9)) == 0,
                    glue=draw(st.integers(0, 3)) == 0,
                )
            )
        elif kind == "drop":
            out.append(Op("drop", draw(st.sampled_from(sorted(INSTANCES)))))
            continue
        else:
            out.append(
                Op(
                    kind,
                    draw(st.sampled_from(BACKENDS)),
                    lora=lora,
                    prompt=p,
                    start=start,
                    end=end,
                    medium=draw(st.sampled_from(POOL_MEDIA)),
                    tokens=draw(st.integers(0, 2)) == 0,  # mostly confirmations
                    partial=draw(st.integers(0, 9)) == 0,
                    junk=draw(st.integers(0, 9)) == 0,
                    scheme=draw(st.sampled_from(["A", "A", "A", "B"])),
                    glue=draw(st.integers(0, 3)) == 0,
                )
            )
        # Removals mostly aim at something stored before (same owner, tier
        # and names, part of its range), so that removals meet what they
        # remove, placed or still waiting, often enough to matter.
        stores = [o for o in out[:-1] if o.kind == {"remove": "store"}.get(kind, "pool_store")]
        if kind in ("remove", "pool_remove") and stores and draw(st.integers(0, 3)) > 0:
            base = draw(st.sampled_from(stores))
            a = draw(st.integers(base.start, base.end - 1))
            b = draw(st.integers(a + 1, base.end))
            medium = base.medium if kind == "remove" or draw(st.booleans()) else None
            out[-1] = replace(
                base, kind=kind, start=a, end=b, medium=medium, glue=out[-1].glue, junk=False
            )
    return out


@st.composite
def scenarios(draw: st.DrawFn, max_ops: int = 40) -> tuple[int, list[list[Block]], list[Op]]:
    bs = draw(st.sampled_from([2, 4]))
    prompts = draw(prompt_pools(bs))
    return bs, prompts, draw(ops_strategy(prompts, max_ops))


BIG = IndexLimits(max_pending=10**6, max_pending_age_s=10**9, max_retired_content=10**6)
# KVC_PROPERTY_EXAMPLES=5000 hunts with fresh random examples; the default
# run is derandomized so CI sees the same examples every time.
HUNT = int(os.environ.get("KVC_PROPERTY_EXAMPLES", "0"))
FAST = settings(
    max_examples=HUNT or 400,
    deadline=None,
    derandomize=not HUNT,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


# --------------------------------------------------------------------- 1. model


@FAST
@given(scenarios())
def test_core_agrees_with_reference_model(scenario: tuple[int, list[list[Block]], list[Op]]):
    bs, prompts, ops = scenario
    index = Index(BIG)
    model = ReferenceModel()
    done: list[Op] = []
    for group in records(ops):
        apply_record(index, model, group, prompts, bs)
        done += group
        check_agree(index, model, prompts, bs, done)
        check_same_leftovers(index, model, prompts, bs, done)
    check_agree(index, model, prompts, bs, ops, every_prefix=True)


# ------------------------------------------------------------------- 2. shuffle


@st.composite
def two_phase_streams(draw: st.DrawFn):
    """One prompt's content, offload intents and pool confirmations, as events.

    Returns (block_size, prompt, items) where each item is ("engine", instance,
    event) or ("pool", backend, event); the multiset is what gets shuffled."""
    bs = draw(st.sampled_from([2, 4]))
    n = draw(st.integers(2, 6))
    prompt = [tuple(draw(st.lists(st.integers(0, 3), min_size=bs, max_size=bs))) for _ in range(n)]
    seqs = seqs_of("A", None, prompt)
    items: list[tuple[str, str, Any]] = []
    # i0 holds the first block on GPU so that a rank is listed.
    items.append(("engine", "i0", BlockStored([seqs[0]], None, flat(prompt[:1]))))
    # i2 (pool mode) has the prompt on GPU in pieces, then offloads it in pieces.
    cuts = sorted(draw(st.sets(st.integers(1, n - 1), max_size=n - 1)))
    bounds = list(zip([0, *cuts], [*cuts, n], strict=True))
    tokened_gpu = draw(st.booleans())
    for a, b in bounds:
        parent = seqs[a - 1] if a else None
        if tokened_gpu:
            items.append(("engine", "i2", BlockStored(seqs[a:b], parent, flat(prompt[a:b]))))
        with_tokens = draw(st.booleans()) or not tokened_gpu
        items.append(
            (
                "engine",
                "i2",
                BlockStored(
                    seqs[a:b],
                    parent,
                    flat(prompt[a:b]) if with_tokens else None,
                    medium=draw(st.sampled_from(["CPU", "DISK"])),
                ),
            )
        )
    # Confirmations of every block, split however, some backends twice.
    for backend in draw(st.lists(st.sampled_from(BACKENDS), min_size=1, max_size=3)):
        order = draw(st.permutations(range(n)))
        medium = draw(st.sampled_from([None, "cpu", "disk"]))
        pos = 0
        while pos < n:
            k = draw(st.integers(1, n - pos))
            chunk = [seqs[j] for j in order[pos : pos + k]]
            items.append(("pool", backend, PoolEvent("stored", chunk, medium=medium)))
            pos += k
    return bs, prompt, items


def run_items(items: list[tuple[str, str, Any]], group: list[int], bs: int) -> Index:
    """Apply `items` in order; pool events go `group[i]` per record."""
    index = Index(BIG)
    i = 0
    g = 0
    while i < len(items):
        api, who, ev = items[i]
        if api == "engine":
            batch = EngineBatch(ts=NOW, events=[ev])
            index.apply_engine(who, engine_meta(who, bs), batch, NOW)
            i += 1
            continue
        # Several consecutive pool events of one backend in one record.
        size = group[g % len(group)]
        g += 1
        events = [ev]
        while (
            len(events) < size
            and i + len(events) < len(items)
            and items[i + len(events)][:2] == ("pool", who)
        ):
            events.append(items[i + len(events)][2])
        index.apply_pool(who, pool_meta(bs), PoolBatch(ts=NOW, events=events), NOW)
        i += len(events)
    return index


def final_answers(index: Index, prompt: list[Block], bs: int) -> list[Any]:
    seqs = seqs_of("A", None, prompt)
    out: list[Any] = []
    for cut in range(len(prompt) + 1):
        out.append(index.query(TokenQuery(MODEL, bs, flat(prompt[:cut]))))
        out.append(index.query(HashQuery(MODEL, bs, list(seqs[:cut]))))
    return out


@settings(
    max_examples=HUNT or 300,
    deadline=None,
    derandomize=not HUNT,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(two_phase_streams(), st.data())
def test_either_order_split_however(stream: Any, data: st.DataObject):
    bs, prompt, items = stream
    reference = final_answers(run_items(items, [1], bs), prompt, bs)
    # Independent check of the in-order answer against the model.
    model = ReferenceModel()
    for api, who, ev in items:
        if api == "engine":
            model.apply_engine(who, engine_meta(who, bs), EngineBatch(ts=NOW, events=[ev]))
        else:
            model.apply_pool(who, pool_meta(bs), PoolBatch(ts=NOW, events=[ev]))
    seqs = seqs_of("A", None, prompt)
    want = []
    for cut in range(len(prompt) + 1):
        want.append(model.query(TokenQuery(MODEL, bs, flat(prompt[:cut]))))
        want.append(model.query(HashQuery(MODEL, bs, list(seqs[:cut]))))
    assert reference == want
    # Every block was offloaded and confirmed: the full prompt is served.
    full = reference[-2]["default"]["i0"]
    assert full["DISK"] == len(prompt) * bs
    for _ in range(3):
        shuffled = data.draw(st.permutations(items))
        group = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4))
        got = final_answers(run_items(shuffled, group, bs), prompt, bs)
        assert got == reference, f"order {shuffled}\n group {group}"


# -------------------------------------------------------------------- 3. memory


def big_stream(rng: random.Random, ordered: bool) -> tuple[int, list[list[Block]], list[Op]]:
    """Thousands of blocks in every tier, intents and confirmations.

    With `ordered`, every block a token-less event names gets its tokens
    before or after it, every intent precedes its confirmation and nothing is
    removed, so no pending half can be left over once everything is torn
    down. Without it, anything goes (teardown then needs `expire`)."""
    bs = 2
    prompts: list[list[Block]] = []
    for _ in range(60):
        head: list[Block] = []
        if prompts and rng.random() < 0.6:
            base = rng.choice(prompts)
            head = base[: rng.randint(0, len(base))]
        tail = [tuple(rng.randint(0, 3) for _ in range(bs)) for _ in range(rng.randint(1, 12))]
        prompts.append((head + tail)[:16])
    ops: list[Op] = []
    for p, prompt in enumerate(prompts):
        lora = rng.choice(LORAS)
        n = len(prompt)
        for inst in ("i0", "i1"):
            for rank in (0, 1):
                if rng.random() < 0.5:
                    continue
                # Token-less first sometimes: it waits for the tokened one.
                medium = rng.choice([None, "CPU", "DISK"])
                if rng.random() < 0.3:
                    ops.append(Op("store", inst, rank, lora, p, 0, n, medium, tokens=False))
                ops.append(Op("store", inst, rank, lora, p, 0, n, medium))
                if rng.random() < 0.3:
                    ops.append(Op("store", inst, rank, lora, p, n // 2, n, "CPU", tokens=False))
        # The pool-mode instance: GPU with tokens, then offload, then confirm.
        rank = rng.randint(0, 1)
        ops.append(Op("store", "i2", rank, lora, p, 0, n, None))
        ops.append(Op("store", "i2", rank, lora, p, 0, n, "CPU", tokens=rng.random() < 0.5))
        backend = rng.choice(BACKENDS)
        medium = rng.choice([None, "cpu", "disk"])
        cut = rng.randint(0, n)
        # Confirmations split in two records, the later half first.
        if cut < n:
            ops.append(Op("pool_store", backend, 0, lora, p, cut, n, medium, tokens=False))
        if cut:
            ops.append(Op("pool_store", backend, 0, lora, p, 0, cut, medium, tokens=False))
        if rng.random() < 0.3:
            ops.append(Op("pool_store", "p1", 0, lora, p, 0, n, "disk", tokens=True))
    if not ordered:
        rng.shuffle(ops)
        extra: list[Op] = []
        for op in ops:
            if op.kind == "store" and rng.random() < 0.2:
                extra.append(
                    Op("remove", op.who, op.rank, op.lora, op.prompt, op.start, op.end, op.medium)
                )
            if rng.random() < 0.05:
                extra.append(Op("clear", op.who if op.kind == "store" else "i0", op.rank))
        ops += extra
        rng.shuffle(ops)
    return bs, prompts, ops


def teardown(rng: random.Random, prompts: list[list[Block]], ops: list[Op], way: int) -> list[Op]:
    """Operations that remove everything `ops` stored, in one of several ways."""
    out: list[Op] = []
    if way == 0:
        # Exact removals of everything stored, tier by tier, plus pool removals.
        for op in ops:
            if op.kind == "store":
                out.append(
                    Op("remove", op.who, op.rank, op.lora, op.prompt, op.start, op.end, op.medium)
                )
            elif op.kind == "pool_store":
                n = len(prompts[op.prompt])
                out.append(
                    Op("pool_remove", op.who, 0, op.lora, op.prompt, 0, n, None, scheme=op.scheme)
                )
        # The pool-mode instance's non-device removals are ignored; its GPU
        # blocks were removed above.
    elif way == 1:
        for inst in INSTANCES:
            for rank in (0, 1):
                out.append(Op("clear", inst, rank))
        for backend in BACKENDS:
            for lora in LORAS:
                for medium in ("cpu", "disk"):
                    out.append(Op("pool_clear", backend, lora=lora, medium=medium))
    else:
        for inst in INSTANCES:
            out.append(Op("drop", inst))
        for backend in BACKENDS:
            for lora in LORAS:
                out.append(Op("pool_clear", backend, lora=lora, medium=None))
    rng.shuffle(out)
    return out


@pytest.mark.parametrize("way", [0, 1, 2])
@pytest.mark.parametrize("ordered", [True, False])
def test_everything_removed_leaves_nothing(way: int, ordered: bool):
    rng = random.Random(1000 * way + ordered)
    bs, prompts, ops = big_stream(rng, ordered)
    index = Index(BIG)
    model = ReferenceModel()
    for op in ops:
        apply_op(index, model, op, prompts, bs)
    stored = sum(len(ns.owners) + len(ns.pools) for ns in index.namespaces.values())
    assert stored > 0
    assert sum(index.applied.values()) > 2000
    check_agree(index, model, prompts, bs, None)
    down = teardown(rng, prompts, ops, way)
    for op in down:
        apply_op(index, model, op, prompts, bs)
    check_agree(index, model, prompts, bs, None)
    for ns in index.namespaces.values():
        # Nothing is held any more; what is left is retired content (kept
        # for late halves) and, for the unordered stream, unmatched halves.
        assert not ns.owners and not ns.pools, ns.key
        dump = ns.store.dump()
        assert not any(dump["masks"]) and not any(dump["pool_counts"]), ns.key  # type: ignore[call-overload]
        if ordered:
            assert len(ns.pending) == 0, (ns.key, ns.pending.by_kind)
    if ordered:
        assert model.is_empty()
    # Both go with age.
    index.expire(NOW + BIG.max_pending_age_s + 1)
    assert index.is_empty(), {
        key: (len(ns.owners), len(ns.pools), ns.store.content_len(), len(ns.pending))
        for key, ns in index.namespaces.items()
    }
    assert index.namespaces == {}
    if way == 2:
        assert index.instances == {}


# -------------------------------------------------------------------- 4. bounds


def pending_count(index: Index) -> int:
    return sum(len(ns.pending) for ns in index.namespaces.values())


def dropped(index: Index) -> int:
    return sum(v for k, v in index.counters.items() if k.startswith("pending_dropped"))


def test_pending_is_bounded_and_ages_out():
    limits = IndexLimits(max_pending=10, max_pending_age_s=5)
    index = Index(limits)
    bs = 2
    meta = pool_meta(bs)
    root: Block = (9, 9)
    prompts = [[root, (i % 50, i // 50)] for i in range(100)]
    # i0 holds the shared first block on GPU so it is listed.
    ev = BlockStored([seq_hash("A", None, [root])], None, list(root))
    index.apply_engine("i0", engine_meta("i0", bs), EngineBatch(ts=NOW, events=[ev]), NOW)
    # Flood confirmations for second blocks nobody has given content for yet.
    for i, prompt in enumerate(prompts):
        seq = seq_hash("A", None, prompt)
        batch = PoolBatch(ts=NOW, events=[PoolEvent("stored", [seq], medium="cpu")])
        index.apply_pool("p0", meta, batch, NOW + i * 0.01)
        assert pending_count(index) <= 10
    assert pending_count(index) == 10
    assert dropped(index) == 90
    # Content arrives for all of them (i1 stores, then evicts): only the last
    # ten confirmations survived to meet it.
    t = NOW + 2
    for prompt in prompts:
        seqs = seqs_of("A", None, prompt)
        store = BlockStored(seqs[1:], seqs[0], flat(prompt[1:]))
        index.apply_engine("i1", engine_meta("i1", bs), EngineBatch(ts=t, events=[store]), t)
        remove = BlockRemoved(seqs[1:])
        index.apply_engine("i1", engine_meta("i1", bs), EngineBatch(ts=t, events=[remove]), t)
    served = [index.query(TokenQuery(MODEL, bs, flat(p)))["default"]["i0"]["DISK"] for p in prompts]
    assert served == [bs] * 90 + [2 * bs] * 10
    assert pending_count(index) == 0
    # A new flood, then time passes: every pending half ages out.
    for i in range(30):
        batch = PoolBatch(ts=t, events=[PoolEvent("stored", [JUNK + i], medium="disk")])
        index.apply_pool("p1", meta, batch, t)
        assert pending_count(index) <= 10
    before = dropped(index)
    assert before == 90 + 20
    index.expire(t + 4)
    assert pending_count(index) == 10
    index.expire(t + 5.5)
    assert pending_count(index) == 0
    assert dropped(index) == before + 10
    assert any(k.endswith("_age") for k in index.counters if k.startswith("pending_dropped"))
    assert any(k.endswith("_count") for k in index.counters if k.startswith("pending_dropped"))


def test_retired_content_is_bounded_and_ages_out():
    """Content nobody holds any more is kept for late halves, within bounds."""
    limits = IndexLimits(max_pending=10, max_pending_age_s=5, max_retired_content=10)
    index = Index(limits)
    bs = 2
    meta = engine_meta("i0", bs)
    prompts = [[(i % 50, i // 50)] for i in range(100)]
    for i, prompt in enumerate(prompts):
        seqs = seqs_of("A", None, prompt)
        t = NOW + i * 0.01
        index.apply_engine("i0", meta, EngineBatch(t, [BlockStored(seqs, None, flat(prompt))]), t)
        index.apply_engine("i0", meta, EngineBatch(t, [BlockRemoved(seqs)]), t)
        assert all(ns.store.retired_len() <= 10 for ns in index.namespaces.values())
    # The last ten evicted blocks are still known to a late confirmation.
    late = PoolBatch(NOW + 1, [PoolEvent("stored", seqs_of("A", None, p)) for p in prompts])
    index.apply_pool("p0", pool_meta(bs), late, NOW + 1)
    (ns,) = index.namespaces.values()
    assert sum(ns.store.pool_len(store.pid) for store in ns.pools.values()) == 10
    # Clear the pool; everything left (retired content, waiting confirmations)
    # goes with age and the namespace with it.
    index.apply_pool("p0", pool_meta(bs), PoolBatch(NOW + 1, [PoolEvent("cleared")]), NOW + 1)
    index.expire(NOW + 1 + 5.5)
    assert index.is_empty()


def test_retired_content_survives_a_snapshot_in_either_format():
    """Retired entries are written packed; units written before that (a
    list of structs) still restore to the same state, times included."""
    index = Index(IndexLimits(max_retired_content=100))
    meta = engine_meta("i0", 2)
    for i in range(30):
        seqs = seqs_of("A", None, [(i, i)])
        t = NOW + i * 0.25
        index.apply_engine("i0", meta, EngineBatch(t, [BlockStored(seqs, None, [i, i])]), t)
        index.apply_engine("i0", meta, EngineBatch(t, [BlockRemoved(seqs)]), t)
    units = dict(export_unit(index, kind, uid) for kind, uid in all_unit_ids(index))
    ((key, unit),) = [(k, u) for k, u in units.items() if isinstance(u, PendingUnit)]
    assert len(retired_entries(unit)) == 30
    old = PendingUnit(unit.now, unit.entries, retired_entries(unit))
    (ns,) = index.namespaces.values()
    for form in (unit, old):
        fresh = Index(IndexLimits(max_retired_content=100))
        restore(fresh, {k: u for k, u in {**units, key: form}.items() if u is not None})
        (got,) = fresh.namespaces.values()
        assert got.store.export_retired() == ns.store.export_retired()


# ------------------------------------------------------- found by the model


def _drive(index: Index, model: ReferenceModel, steps: list[tuple[str, str, Any]], bs: int):
    for api, who, ev in steps:
        if api == "engine":
            batch = EngineBatch(ts=NOW, events=[ev])
            index.apply_engine(who, engine_meta(who, bs), batch, NOW)
            model.apply_engine(who, engine_meta(who, bs), batch)
        else:
            batch = PoolBatch(ts=NOW, events=[ev])
            index.apply_pool(who, pool_meta(bs), batch, NOW)
            model.apply_pool(who, pool_meta(bs), batch)


@pytest.mark.parametrize("parent_first", [True, False])
def test_evicted_chain_block_keeps_its_content_for_late_halves(parent_first: bool):
    """i0 stores block 1 naming its parent by hash, then evicts it; the parent's
    content arrives from i1 before or after that; then the pool confirms
    block 1. Contract 2-3: the content comes from an event "before or after"
    and the halves join "in whichever order", so both orders serve 2 blocks."""
    bs = 2
    prompt: list[Block] = [(1, 2), (3, 4)]
    s0, s1 = seqs_of("A", None, prompt)
    parent = ("engine", "i1", BlockStored([s0], None, [1, 2]))
    steps = [
        ("engine", "i0", BlockStored([s1], s0, [3, 4])),
        ("engine", "i0", BlockRemoved([s1])),
        ("pool", "p0", PoolEvent("stored", [s1], medium="cpu")),
    ]
    steps.insert(0 if parent_first else 2, parent)
    index, model = Index(BIG), ReferenceModel()
    _drive(index, model, steps, bs)
    q = TokenQuery(MODEL, bs, flat(prompt))
    want = {"longest_matched": 4, "GPU": 2, "CPU": 4, "DISK": 4, "DP": {"0": 4}}
    assert model.query(q) == {"default": {"i1": want}}
    assert index.query(q) == {"default": {"i1": want}}


def test_intent_names_its_blocks_even_when_a_pool_already_holds_them():
    """p0 holds block 0 under engine B's hash; pool-mode i2 offloads the same
    block under its own hash A (an intent with tokens). The intent pins
    nothing (the pool has the content), but it named hash A with its tokens:
    /query_by_hash with A and a later token-less store of A must resolve it
    (contract 2: content comes from "another event that named the same
    sequence hash with its tokens, before or after it"; 4: seq_hashes are
    engine sequence hashes). (The core used to forget hash A here.)"""
    bs = 2
    prompt: list[Block] = [(1, 2)]
    (a0,) = seqs_of("A", None, prompt)
    (b0,) = seqs_of("B", None, prompt)
    steps = [
        ("pool", "p0", PoolEvent("stored", [b0], token_ids=[1, 2], medium="cpu")),
        ("engine", "i2", BlockStored([a0], None, [1, 2], medium="CPU")),
        ("engine", "i1", BlockStored([b0], None, [1, 2])),
        ("engine", "i0", BlockStored([a0], None, None)),  # token-less, GPU
    ]
    index, model = Index(BIG), ReferenceModel()
    _drive(index, model, steps, bs)
    one = {"longest_matched": 2, "GPU": 2, "CPU": 2, "DISK": 2, "DP": {"0": 2}}
    for q in (HashQuery(MODEL, bs, [a0]), TokenQuery(MODEL, bs, [1, 2])):
        assert model.query(q) == {"default": {"i0": one, "i1": one}}
        assert index.query(q) == model.query(q)


@pytest.mark.parametrize("intent_first", [True, False])
def test_intent_for_a_block_already_waiting_for_its_parent_still_pins(intent_first: bool):
    """i0 stores block 1 on GPU and pool-mode i2 offloads the same block 1
    (an intent), both naming block 0 by a hash whose content comes later.
    Once it does, the intent must pin block 1 whatever the order of the two:
    i0 then evicts it, churn pushes it out of the (tiny) retired window, and
    the pool's confirmation still has to find the intent's content (contract
    3: "in whichever order the two halves arrive")."""
    bs = 2
    prompt: list[Block] = [(1, 2), (3, 4)]
    s0, s1 = seqs_of("A", None, prompt)
    (x0,) = seqs_of("A", None, [(7, 7)])
    limits = IndexLimits(max_pending=1000, max_pending_age_s=1e9, max_retired_content=1)
    index = Index(limits)

    def engine(instance: str, ev: Any) -> None:
        batch = EngineBatch(ts=NOW, events=[ev])
        index.apply_engine(instance, engine_meta(instance, bs), batch, NOW)

    gpu = ("i0", BlockStored([s1], s0, [3, 4]))
    intent = ("i2", BlockStored([s1], s0, [3, 4], medium="CPU"))
    for instance, ev in [intent, gpu] if intent_first else [gpu, intent]:
        engine(instance, ev)
    engine("i1", BlockStored([s0], None, [1, 2]))  # the parent's content arrives
    engine("i0", BlockRemoved([s1]))  # i0 evicts block 1
    engine("i0", BlockStored([x0], None, [7, 7]))  # churn through the retired window
    engine("i0", BlockRemoved([x0]))
    confirm = PoolBatch(ts=NOW, events=[PoolEvent("stored", [s1], medium="cpu")])
    index.apply_pool("p0", pool_meta(bs), confirm, NOW)
    got = index.query(TokenQuery(MODEL, bs, flat(prompt)))["default"]["i1"]
    assert got == {"longest_matched": 4, "GPU": 2, "CPU": 4, "DISK": 4, "DP": {"0": 4}}
