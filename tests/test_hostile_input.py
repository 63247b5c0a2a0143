"""Hostile input (issue #7 item 3): absurd records at the decoders and the core.

Arbitrary bytes at the decoders are covered by test_decode_engine.py and
test_decode_pool.py. Here the records are mostly *structurally valid* and
absurd in their values: hashes repeated or at the ends of the u64 range,
blocks that name themselves or a descendant as parent, token lists that do
not fit their blocks, 10**6 tokens, NaN and infinite timestamps, dp ranks up
to 2**64, unknown tags, wrong types, hostile headers. They go through the
`Conductor` (decode, then apply) and, for every record:

* the outcome is `Applied` or a `BadRecord` with a kind and a reason (what
  the daemon dead-letters); any other exception is a crash;
* a `BadRecord` leaves the index exactly as it was (no partial apply);
* the index stays internally consistent and within its `IndexLimits`
  (`check_consistent`).

`pytest --hypothesis-show-statistics` prints how many inputs of each outcome
were tried. Core bugs found are at the end, each pinned by its test.
"""

from __future__ import annotations

import contextlib
import functools
import io
import math
import pickle
import random
from collections import Counter
from collections.abc import Iterator
from typing import Any, NamedTuple

import msgspec
import pytest
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from kvconductor.index.answer_shape import PyAnswerShape
from kvconductor.index.block_store import PyBlockStore
from kvconductor.index.conductor import Conductor
from kvconductor.index.fleet import Index, IndexLimits
from kvconductor.index.namespace import NamespaceIndex
from kvconductor.index.pending import INTENT, UNRESOLVED, WAITING
from kvconductor.wire.engine import (
    ARRAY_FIELDS,
    MAX_GROUP_IDX,
    MAX_NAME,
    U32_MAX,
    decode_engine_payload,
)
from kvconductor.wire.errors import BadRecord, DecodeError, RejectedEvent
from kvconductor.wire.events import BlockRemoved, BlockStored, PoolEvent
from kvconductor.wire.media import DEVICE, DISK, HOST, pool_tier
from kvconductor.wire.pool import decode_pool_payload
from kvconductor.wire.query import HashQuery, TokenQuery
from tests import harness
from tests.harness import engine_headers, pool_payload, removed, vllm_payload

MASK = (1 << 64) - 1
BS = 2  # kv-block-size of the well-formed records: small, so chains are cheap
enc = msgspec.msgpack.encode
Ext = msgspec.msgpack.Ext
BAD_KINDS = frozenset({"undecodable", "missing_header", "invalid_header", "rejected"})


@st.composite
def rarely(
    draw: st.DrawFn, common: st.SearchStrategy[Any], rare: st.SearchStrategy[Any], one_in: int = 8
) -> Any:
    """`common`, or `rare` one time in `one_in` (one_of would weigh them evenly)."""
    return draw(rare if draw(st.integers(0, one_in - 1)) == 0 else common)


def deep(depth: int) -> Any:
    out: Any = None
    for _ in range(depth):
        out = [out]
    return out


# ------------------------------------------------------------------ wire values

# A small alphabet of hashes and tokens, so that hashes repeat within an
# event, blocks name themselves or a descendant as parent, and content collides.
ALPHABET = st.integers(0, 7)
edge_ints = st.sampled_from([0, 1, MASK, MASK - 1, 1 << 63, (1 << 63) - 1, -1, -(1 << 63)])
wrong_type = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(),
    st.text(max_size=4),
    st.just(Ext(1, b"x")),
    st.lists(st.integers(0, 3), max_size=2),
    st.dictionaries(st.text(max_size=2), st.integers(0, 3), max_size=1),
)
hash_value = st.one_of(
    ALPHABET,
    ALPHABET.map(lambda h: h.to_bytes(8, "big")),  # the same hashes as digests
    st.integers(0, 3).map(lambda k: MASK - k),  # the top of the range, unsigned...
    st.integers(0, 3).map(lambda k: -1 - k),  # ...and the same hashes signed
    edge_ints,
    st.integers(-(1 << 63), MASK),
    st.binary(max_size=40),
)
hash_list = st.one_of(
    st.lists(hash_value, max_size=6),
    st.integers(200, 2000).map(lambda n: [i % 8 for i in range(n)]),
)
parent_value = st.one_of(st.none(), hash_value)
medium_value = st.one_of(
    st.sampled_from([None, "GPU", "gpu", "CPU", "cpu_pinned", "DISK", "NVME", "cpu", "disk"]),
    st.sampled_from(["tape", "", "GpU", "x" * 5000]),
)
text_value = st.sampled_from([None, "", "a", "b", "é", "x" * 5000])
int_value = st.one_of(st.none(), st.integers(-3, 3), edge_ints)
block_size_value = st.sampled_from([BS, BS, None, 0, 1, 3, -1, MASK, 1 << 20])
extra_key = st.one_of(
    st.none(),
    st.just([]),
    st.tuples(st.text(max_size=3), st.integers(0, 3)).map(list),
    st.builds(deep, st.integers(1, 120)),
    st.floats(),
    st.just(Ext(5, b"\x00")),
    st.dictionaries(st.integers(0, 2), st.none(), max_size=2),
)


def wire(s: st.SearchStrategy[Any]) -> Any:
    """A field's value: mostly of its type, sometimes of a wrong one."""
    return rarely(s, wrong_type, one_in=12)


def pattern_tokens(pattern: int, count: int) -> list[int]:
    """`count` tokens of 0/1 repeating the 16 bits of `pattern`: cheap to draw
    for long lists, and equal content under different hashes is frequent."""
    return [pattern >> (i & 15) & 1 for i in range(count)]


patterns = st.integers(0, 0xFFFF)


@st.composite
def token_list(draw: st.DrawFn, n_blocks: int) -> Any:
    """Tokens for `n_blocks` full blocks: exact, off by some, with an absurd
    id, as SGLang bigram pairs, empty or missing."""
    shape = draw(st.sampled_from(["exact"] * 4 + ["off", "absurd", "bigram", "empty", "none"]))
    if shape == "none":
        return None
    count = n_blocks * BS
    if shape == "empty":
        count = 0
    elif shape == "off":
        count = max(0, count + draw(st.sampled_from([-BS - 1, -1, 1, BS + 1])))
    toks: list[Any] = pattern_tokens(draw(patterns), count)
    if shape == "absurd" and toks:
        bad = draw(st.sampled_from([U32_MAX + 1, -1, MASK, -(1 << 63), 1.5, "7", None]))
        toks[draw(st.integers(0, len(toks) - 1))] = bad
    if shape == "bigram":
        toks = [[t, t + 1] for t in toks]
    return toks


STORED_FIELDS = ARRAY_FIELDS["BlockStored"][1:]
REMOVED_FIELDS = ARRAY_FIELDS["BlockRemoved"][1:]


def as_array(ev: dict[str, Any], cut: int | None = None) -> list[Any]:
    """The positional form (vLLM <= 0.23) of a tagged map event."""
    names = {"BlockStored": STORED_FIELDS, "BlockRemoved": REMOVED_FIELDS}.get(ev["type"], ())
    values = [ev.get(name) for name in names]
    return [ev["type"], *values[: len(values) if cut is None else max(cut, 1)]]


@st.composite
def wire_engine_event(draw: st.DrawFn) -> Any:
    tag = draw(
        rarely(
            st.sampled_from(["BlockStored"] * 3 + ["BlockRemoved", "AllBlocksCleared"]),
            st.sampled_from(["BlockMoved", "blockstored", "", None, 7]),
        )
    )
    hashes = draw(wire(hash_list))
    ev: dict[str, Any] = {"type": tag, "block_hashes": hashes, "medium": draw(wire(medium_value))}
    if draw(st.integers(0, 3)) == 0:
        ev["group_idx"] = draw(wire(int_value))
    if tag == "BlockStored":
        n = len(hashes) if isinstance(hashes, list) else 1
        ev["parent_block_hash"] = draw(wire(parent_value))
        ev["token_ids"] = draw(wire(token_list(n)))
        ev["block_size"] = draw(wire(block_size_value))
        if draw(st.integers(0, 3)) == 0:
            ev["lora_id"] = draw(wire(int_value))
            ev["lora_name"] = draw(wire(text_value))
        if draw(st.integers(0, 3)) == 0:
            size = max(0, n + draw(st.sampled_from([0, 0, 0, -1, 1])))
            ev["extra_keys"] = draw(wire(st.lists(extra_key, min_size=size, max_size=size)))
        if draw(st.integers(0, 3)) == 0:
            kinds = st.sampled_from(["full_attention", "sliding_window", "mamba", ""])
            ev["kv_cache_spec_kind"] = draw(wire(kinds))
    elif tag == "AllBlocksCleared":
        ev = {"type": tag, "medium": ev["medium"]}
    if tag is None:
        del ev["type"]
    elif tag in ARRAY_FIELDS and draw(st.booleans()):
        # Positional, cut short or with trailing junk.
        cut = draw(st.integers(1, 11))
        return as_array(ev, cut) + draw(st.lists(wrong_type, max_size=2))
    if draw(st.integers(0, 3)) == 0:
        ev["x_unknown"] = draw(wrong_type)
    return ev


ts_value = rarely(
    st.floats(0.0, 2e9),
    st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 1e300, 0, 1 << 62, MASK, "1.0", None]),
    one_in=4,
)
rank_value = rarely(
    st.sampled_from([None, 0, 1]),
    st.sampled_from([1 << 16, (1 << 16) + 1, 1 << 40, MASK, -1, -(1 << 63), "0", 1.0]),
    one_in=4,
)


@st.composite
def wire_engine_payload(draw: st.DrawFn) -> bytes:
    events: list[Any] = draw(st.lists(rarely(wire_engine_event(), wrong_type, 20), max_size=4))
    shape = draw(st.sampled_from(["batch"] * 6 + ["vllm-0.9", "map envelope", "trailing junk"]))
    ts, rank = draw(ts_value), draw(rank_value)
    if shape == "vllm-0.9":
        return enc([ts, events])
    if shape == "map envelope":
        key = draw(st.sampled_from(["data_parallel_rank", "attn_dp_rank", "dp_rank"]))
        return enc({"ts": ts, "events": events, key: rank})
    if shape == "trailing junk":
        return enc([ts, events, rank, draw(wrong_type)])
    return enc([ts, events, rank])


@st.composite
def wire_pool_event(draw: st.DrawFn) -> Any:
    ev: dict[str, Any] = {
        "event_type": draw(
            rarely(
                st.sampled_from(["stored"] * 3 + ["removed", "cleared"]),
                st.sampled_from(["Stored", "updated", "", None, 1]),
            )
        ),
        "seq_hashes": draw(wire(hash_list)),
    }
    optional: dict[str, st.SearchStrategy[Any]] = {
        "parent_hash": parent_value,
        "token_ids": st.integers(0, 4).flatmap(token_list),
        "medium": medium_value,
        "backend_id": st.one_of(st.sampled_from(["p0", "p1"]), text_value),
        "model_name": st.one_of(st.sampled_from(["m", "m2"]), text_value),
        "block_size": block_size_value,
        "lora_name": text_value,
        "tenant_id": text_value,
        "additional_salt": text_value,
        "base_block_idx": int_value,
        "event_id": int_value,
        "block_hashes": hash_list,
        "parent_block_hash": parent_value,
        "object_key": text_value,
        "x_unknown": wrong_type,
    }
    for name in draw(st.lists(st.sampled_from(sorted(optional)), max_size=6, unique=True)):
        ev[name] = draw(wire(optional[name]))
    return ev


@st.composite
def wire_pool_payload(draw: st.DrawFn) -> bytes:
    events: list[Any] = draw(st.lists(rarely(wire_pool_event(), wrong_type, 20), max_size=4))
    if draw(st.integers(0, 9)) == 0:
        return enc([draw(ts_value), events])
    return enc([draw(ts_value), events, draw(rank_value)])


# ------------------------------------------------------------------ records


class Record(msgspec.Struct, frozen=True):
    """One Kafka record as the daemon hands it to the `Conductor`."""

    pool: bool
    key: bytes | str | None
    headers: list[tuple[str, bytes]]
    payload: bytes
    now: float

    def __repr__(self) -> str:  # hypothesis prints failing examples with it
        try:
            body = repr(msgspec.msgpack.decode(self.payload))
        except (msgspec.DecodeError, RecursionError):
            body = repr(self.payload)
        topic = "pool" if self.pool else "engine"
        return f"<{topic} {self.key!r:.40} {self.headers} {body:.400} at {self.now}>"


ENGINE_HEADERS = engine_headers(block_size=BS)
NO_MODEL = ENGINE_HEADERS[1:]
POOL_MODE = engine_headers(block_size=BS, **{"kv-offload": "pool"})
HOSTILE_HEADERS = [
    ("kv-block-size", b"0"),
    ("kv-block-size", b"-2"),
    ("kv-block-size", b"1048577"),
    ("kv-block-size", b"2.0"),
    ("kv-block-size", b"9" * 400),
    ("kv-model", b""),
    ("kv-model", b"\xff\xfe"),
    ("kv-dp-rank", b"1099511627776"),
    ("kv-dp-rank", b"-1"),
    ("kv-dp-rank", b"65536"),
    ("kv-seq", b"18446744073709551615"),
    ("kv-seq", b"18446744073709551616"),
    ("kv-seq", b"-5"),
    ("kv-seq", b"7"),
    ("kv-source", b"lmcache"),
    ("kv-source", b"SGLang"),
    ("kv-offload", b"pool"),
    ("kv-offload", b"remote"),
    ("kv-tenant", b"t2"),
    ("kv-salt", b"s"),
    ("kv-control", b"resync"),
    ("kv-control", b"reboot"),
    ("kv-control-reason", b"\xff"),
]
hostile_key = st.sampled_from([None, b"", b"\xff\xfe", "i1", b"k" * 2000])


@st.composite
def wire_record(draw: st.DrawFn) -> Record:
    """Anything at all on the wire: absurd payloads and hostile headers."""
    pool = draw(st.integers(0, 2)) == 0
    headers = list(ENGINE_HEADERS)
    if draw(st.integers(0, 5)) == 0:
        headers.pop(draw(st.integers(0, 1)))
    headers += draw(st.lists(st.sampled_from(HOSTILE_HEADERS), max_size=2))
    payload = draw(wire_pool_payload() if pool else wire_engine_payload())
    key = draw(rarely(st.sampled_from([b"i0", b"i1", b"p0"]), hostile_key))
    now = draw(rarely(st.floats(1000.0, 1010.0), st.sampled_from([0.0, -5.0, 1e15])))
    return Record(pool, key, headers, payload, now)


def engine_record(
    key: bytes, events: list[Any], now: float = 1000.0, offload: str = "local"
) -> Record:
    """A vLLM record of `events`, rank 0, with good headers."""
    headers = engine_headers(block_size=BS, **{"kv-offload": offload})
    return Record(False, key, headers, vllm_payload(events, 0, now), now)


def pool_record(key: bytes, events: list[Any], now: float = 1000.0) -> Record:
    return Record(True, key, ENGINE_HEADERS, pool_payload(events, now), now)


stored = functools.partial(harness.stored, block_size=BS)
A, B, C, X = 0xA, 0xB, 0xC, 0x99  # block hashes of the hand-written records


# Absurd but well-formed records, to reach deep into the core. They are built
# with plain `random` from one drawn seed each (drawing every field through
# hypothesis made generation the whole cost), so hypothesis shrinks a stream
# by dropping records.
ENGINE_KINDS = ["tokens"] * 4 + ["hashes only"] * 3 + ["removed"] * 2 + ["clear"]
ENGINE_MEDIA = ["GPU", "GPU", "CPU", "CPU", "DISK", None, "tape"]
POOL_KINDS = ["stored"] * 4 + ["removed", "cleared"]
POOL_MEDIA = ["cpu", "cpu", "disk", None, "gpu", "tape"]
TIME_STEPS = [0.0, 0.0, 0.5, 7.0]  # 7 s is past the pending age bound of the tests


class Vocab(NamedTuple):
    """What records draw their names from. Instances named `o...` offload
    into the pool (`kv-offload: pool`)."""

    hashes: int  # block hashes are in range(hashes)
    instances: tuple[bytes, ...]
    backends: tuple[bytes, ...]
    loras: tuple[str, ...]
    ranks: tuple[int, ...]
    events: int  # at most, per record


# A tiny alphabet of hashes (and 0/1 tokens): repeated hashes, self-parents,
# cycles and one content under several hashes are frequent.
CORE = Vocab(8, (b"i0", b"i1", b"o2"), (b"p0", b"p1"), ("a",), (0, 0, 1, 1 << 16, 65537), 3)


def engine_event(rng: random.Random, v: Vocab) -> dict[str, Any]:
    kind = rng.choice(ENGINE_KINDS)
    hashes = [rng.randrange(v.hashes) for _ in range(rng.randint(1, 4))]
    medium = rng.choice(ENGINE_MEDIA)
    if kind == "removed":
        return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}
    if kind == "clear":
        return {"type": "AllBlocksCleared"}
    ev: dict[str, Any] = {
        "type": "BlockStored",
        "block_hashes": hashes,
        "parent_block_hash": rng.choice([None, None, rng.randrange(v.hashes)]),
        "medium": medium,
    }
    if kind == "tokens":
        n = max(0, len(hashes) * BS + rng.choice([0, 0, 0, 0, -1, 1, -BS]))
        ev["token_ids"] = pattern_tokens(rng.randrange(1 << 16), n)
    quirk = rng.randrange(12)
    if quirk == 0:
        ev["block_size"] = BS + 1
    elif quirk == 1:
        ev["lora_name"] = rng.choice(v.loras)
    elif quirk == 2:
        ev["kv_cache_spec_kind"] = "sliding_window"
        ev["group_idx"] = rng.randrange(3)
    elif quirk == 3:
        ev["lora_id"] = 7  # an adapter with no name
    elif quirk == 4:
        ev["extra_keys"] = [rng.choice([None, ["mm", 1]]) for _ in hashes]
    elif quirk == 5:
        ev["block_size"] = 0  # vLLM's "unknown"
    return ev


def pool_event(rng: random.Random, v: Vocab) -> dict[str, Any]:
    kind = rng.choice(POOL_KINDS)
    hashes = [rng.randrange(v.hashes) for _ in range(rng.randint(1, 4))]
    ev: dict[str, Any] = {
        "event_type": kind,
        "seq_hashes": hashes,
        "medium": rng.choice(POOL_MEDIA),
    }
    if kind == "stored" and rng.randrange(3) == 0:
        ev["token_ids"] = pattern_tokens(rng.randrange(1 << 16), len(hashes) * BS)
        ev["parent_hash"] = rng.choice([None, rng.randrange(v.hashes)])
    quirk = rng.randrange(10)
    if quirk == 0:
        ev["model_name"] = "m2"
    elif quirk == 1:
        ev["backend_id"] = "p9"
    elif quirk == 2:
        ev["lora_name"] = rng.choice(v.loras)
    elif quirk == 3:
        ev["block_size"] = BS + 1
    return ev


def core_record(rng: random.Random, now: float, v: Vocab = CORE) -> Record:
    n = rng.randint(1, v.events)
    if rng.randrange(3) == 0:
        headers = ENGINE_HEADERS if rng.randrange(10) else NO_MODEL
        events = [pool_event(rng, v) for _ in range(n)]
        return Record(True, rng.choice(v.backends), headers, pool_payload(events, now), now)
    key = rng.choice(v.instances)
    engine_events: list[Any] = [engine_event(rng, v) for _ in range(n)]
    if rng.randrange(5) == 0:
        engine_events = [as_array(ev) for ev in engine_events]
    payload = vllm_payload(engine_events, rng.choice(v.ranks), now)
    return Record(False, key, POOL_MODE if key[:1] == b"o" else ENGINE_HEADERS, payload, now)


# A stream: seeds of core records, and one record in eight anything at all.
stream_items = st.lists(
    rarely(st.integers(0, (1 << 32) - 1), wire_record()), min_size=5, max_size=40
)


def stream(items: list[int | Record]) -> list[Record]:
    """Records in event-time order; now and then time jumps past the
    pending age bound."""
    out: list[Record] = []
    now = 1000.0
    for item in items:
        if isinstance(item, Record):
            out.append(item)
            continue
        now += TIME_STEPS[item % len(TIME_STEPS)]
        out.append(core_record(random.Random(item), now))
    return out


# ------------------------------------------------------------------ checks


def state(index: Index) -> bytes:
    """Everything a record can change, except the clock
    (test_a_rejected_record_does_not_age_out_pending_halves)."""
    out = io.BytesIO()
    _StatePickler(out).dump(
        (index.namespaces, index.instances, index.idle, index.counters, index.applied, index.dirty)
    )
    return out.getvalue()


class _StatePickler(pickle.Pickler):
    """Pickles a block store and a KV-cache group (compiled or not) as their
    contents, in order, and an answer shape (derived from the owners, made
    when a query needs it) as nothing."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, PyBlockStore) or type(obj).__name__ == "BlockStore":
            return list, (_canonical(obj.dump()),)
        if isinstance(obj, PyAnswerShape) or type(obj).__name__ == "AnswerShape":
            return type(None), ()
        if type(obj).__name__ == "GroupState":  # either twin (`cache_groups.new_group`)
            return tuple, ((obj.kind, obj.block_size, obj.window, obj.export()),)
        return NotImplemented


def _canonical(value: Any) -> Any:
    if isinstance(value, dict):
        return sorted((k, _canonical(v)) for k, v in value.items())
    if isinstance(value, list | tuple):
        return [_canonical(v) for v in value]
    return value


def outcome(conductor: Conductor, rec: Record) -> str:
    """Apply one record: "applied", or the kind of `BadRecord` it raised (what
    the daemon dead-letters it as). Anything else is a crash, and propagates."""
    try:
        if rec.pool:
            got = conductor.ingest_pool_record(rec.key, rec.headers, rec.payload, rec.now)
        else:
            got = conductor.ingest_engine_record(rec.key, rec.headers, rec.payload, rec.now)
    except BadRecord as exc:
        assert exc.kind in BAD_KINDS, exc.kind
        assert exc.reason, "a dead letter needs a reason"
        return exc.kind
    assert got.blocks >= 0 and got.seq_missing >= 0
    return "applied"


def ingest(conductor: Conductor, rec: Record) -> str:
    """`outcome`, and a rejected record must leave no trace (no partial apply)."""
    before = state(conductor.snapshot_state())
    kind = outcome(conductor, rec)
    if kind != "applied":
        assert state(conductor.snapshot_state()) == before, (
            f"partial apply by a rejected record ({kind})"
        )
    return kind


def check_consistent(index: Index) -> None:
    """Every cross-reference of the index agrees and every bound holds."""
    lim = index.limits
    assert len(index.namespaces) <= lim.max_namespaces
    assert len(index.instances) <= lim.max_instances
    for key, ns in index.namespaces.items():
        assert ns.key == key and not ns.is_empty(), f"empty namespace kept: {key}"
        dump = ns.store.dump()
        content: dict[int, int] = dump["content"]  # type: ignore[assignment]
        refs: dict[int, int] = dump["refs"]  # type: ignore[assignment]
        _check_pending(ns, lim, content)
        holders = _check_owners(ns, lim, dump)
        holders += _check_pools(ns, dump)
        for k, _ in ns.pending:
            if k[0] == INTENT:
                holders[k[1]] += 1
        assert dict(holders) == refs, f"reference counts drifted in {key}"
        # Content that nobody holds is retired, and only that.
        retired = {seq for seq, _ in dump["retired"]}  # type: ignore[attr-defined]
        assert not retired & set(refs), key
        assert set(content) == set(refs) | retired, f"content leaked in {key}"


def _check_pending(ns: NamespaceIndex, lim: IndexLimits, content: dict[int, int]) -> None:
    assert len(ns.pending) <= lim.max_pending, ns.key
    assert ns.store.retired_len() <= lim.max_retired_content, ns.key
    keys = [k for k, _ in ns.pending]
    kinds = Counter(k[0] for k in keys)
    assert all(ns.pending.by_kind[k] == kinds[k] for k in (WAITING, UNRESOLVED, INTENT))
    waits = {(k[1], k[2]) for k in keys if k[0] == WAITING}
    assert waits == {(s, t) for s, ts in ns.waiting.items() for t in ts}, ns.key
    assert all(ts and len(set(ts)) == len(ts) for ts in ns.waiting.values()), ns.key
    assert {k[1] for k in keys if k[0] == UNRESOLVED} == set(ns.unresolved), ns.key
    assert all(k[1] in content for k in keys if k[0] == INTENT), ns.key
    links = {(p, k) for p, kids in ns.children.items() for k in kids}
    assert all(ns.children.values()), ns.key
    assert links == {(u.parent, k) for k, u in ns.unresolved.items()}, ns.key
    assert not set(ns.waiting) & set(content), "a placement waits for known content"
    assert not set(ns.unresolved) & set(content), "known content is still unresolved"


def _check_owners(ns: NamespaceIndex, lim: IndexLimits, dump: dict[str, Any]) -> Counter[int]:
    holders: Counter[int] = Counter()
    masks: tuple[dict[int, int], ...] = ({}, {}, {})
    all_bits = 0
    for instance, ranks in ns.owners.items():
        assert ranks, ns.key
        for rank, owner in ranks.items():
            assert (owner.instance, owner.rank) == (instance, rank)
            assert ns.slots[owner.slot] is owner
            # Contract 4: a rank is listed only while it holds a block, in
            # a tier or in a KV-cache group other than the primary one.
            size = ns.store.owner_size(owner.slot)
            assert size <= lim.max_blocks_per_owner, (ns.key, instance, rank)
            assert size or owner.group_blocks(), (ns.key, instance, rank)
            assert (owner.slot in ns.hybrid) == bool(owner.groups), (ns.key, instance, rank)
            for (tier, seq), extra in owner.copies.items():
                assert extra > 0 and seq in dump["owners"][owner.slot][0][tier]
            all_bits |= owner.bit
            tiers, dups = dump["owners"][owner.slot]
            for tier in (DEVICE, HOST, DISK):
                blocks = tiers[tier]
                for seq, ident in blocks.items():
                    assert dump["content"][seq] == ident
                    holders[seq] += 1
                for ident, n in Counter(blocks.values()).items():
                    masks[tier][ident] = masks[tier].get(ident, 0) | owner.bit
                    assert dups.get((tier, ident), 0) == n - 1
    assert all_bits == ns.all_bits, ns.key
    assert set(dump["owners"]) == {o.slot for r in ns.owners.values() for o in r.values()}
    assert list(masks) == dump["masks"], f"tier bitmasks drifted in {ns.key}"
    return holders


def _check_pools(ns: NamespaceIndex, dump: dict[str, Any]) -> Counter[int]:
    holders: Counter[int] = Counter()
    counts: tuple[Counter[int], ...] = (Counter(), Counter(), Counter())
    assert set(dump["pools"]) == {p.pid for p in ns.pools.values()}
    for (backend, medium), store in ns.pools.items():
        tier, blocks = dump["pools"][store.pid]
        assert blocks and (store.backend, store.medium) == (backend, medium), ns.key
        assert store.tier == tier == pool_tier(medium)
        for seq, ident in blocks.items():
            assert dump["content"][seq] == ident
            holders[seq] += 1
            counts[store.tier][ident] += 1
    assert not dump["pool_counts"][DEVICE]
    for tier in (HOST, DISK):
        assert dict(counts[tier]) == dump["pool_counts"][tier], ns.key
    return holders


def _known_hashes(ns: NamespaceIndex) -> list[int]:
    content: dict[int, int] = ns.store.dump()["content"]  # type: ignore[assignment]
    return list(content)[:8]


def _drained(ns: NamespaceIndex) -> bool:
    return not ns.pending and not ns.store.retired_len()


def probe_queries(index: Index) -> None:
    """Every namespace answers token and hash queries within contract 4."""
    for key, ns in index.namespaces.items():
        for q in (
            TokenQuery(key.model, key.block_size, [0, 1] * 8, key.lora_name, key.tenant),
            HashQuery(key.model, key.block_size, _known_hashes(ns), key.lora_name, key.tenant),
        ):
            for instance in index.query(q).get(key.tenant, {}).values():
                assert 0 <= instance["GPU"] <= instance["CPU"] <= instance["DISK"]  # type: ignore[operator]
                assert instance["longest_matched"] == instance["DISK"]


# ------------------------------------------------------------------ 1. decoders

DECODE_ERRORS = (DecodeError, RejectedEvent)
DECODER = settings(
    max_examples=250,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def _hashes(events: list[Any]) -> Iterator[int]:
    for ev in events:
        if isinstance(ev, BlockStored | BlockRemoved):
            yield from ev.block_hashes
        if isinstance(ev, PoolEvent):
            yield from ev.seq_hashes
        parent = getattr(ev, "parent_block_hash", None) or getattr(ev, "parent_hash", None)
        if parent is not None:
            yield parent


@DECODER
@given(wire_engine_payload(), st.sampled_from(["vllm", "sglang", "trtllm"]))
def test_absurd_engine_payloads_decode_normalised_or_raise_a_reason(
    payload: bytes, source: str
) -> None:
    try:
        batch = decode_engine_payload(payload, source)
    except DECODE_ERRORS as exc:
        event(f"engine payload: {exc.kind}")
        assert exc.reason
        return
    event("engine payload: decoded")
    assert all(type(h) is int and 0 <= h <= MASK for h in _hashes(batch.events))
    assert batch.dp_rank is None or batch.dp_rank >= 0
    for ev in batch.events:
        assert len(ev.medium or "") <= MAX_NAME
        if isinstance(ev, BlockStored | BlockRemoved):
            assert ev.group_idx is None or 0 <= ev.group_idx <= MAX_GROUP_IDX
        if isinstance(ev, BlockStored):
            assert ev.block_size is None or ev.block_size > 0
            # Packed u32 tokens (so in range by construction), or none.
            assert ev.token_ids is None or (
                type(ev.token_ids) is bytes and ev.token_ids and len(ev.token_ids) % 4 == 0
            )
            assert ev.extra_keys is None or len(ev.extra_keys) == len(ev.block_hashes)
            assert len(ev.lora_name or "") <= MAX_NAME


@DECODER
@given(wire_pool_payload())
def test_absurd_pool_payloads_decode_normalised_or_raise_a_reason(payload: bytes) -> None:
    try:
        batch = decode_pool_payload(payload)
    except DECODE_ERRORS as exc:
        event(f"pool payload: {exc.kind}")
        assert exc.reason
        return
    event("pool payload: decoded")
    assert all(type(h) is int and 0 <= h <= MASK for h in _hashes(batch.events))
    assert batch.dp_rank is None or batch.dp_rank >= 0
    for ev in batch.events:
        assert ev.block_size is None or ev.block_size > 0
        assert ev.base_block_idx is None or ev.base_block_idx >= 0
        names = (ev.medium, ev.backend_id, ev.tenant_id, ev.model_name, ev.lora_name)
        assert all(len(n or "") <= MAX_NAME for n in (*names, ev.additional_salt))
        if ev.token_ids and ev.block_size is not None:
            assert len(ev.token_ids) == len(ev.seq_hashes) * ev.block_size


NAME_FIELDS = [
    ("engine", "medium"),
    ("engine", "lora_name"),
    *[
        ("pool", name)
        for name in (
            "medium",
            "backend_id",
            "tenant_id",
            "model_name",
            "lora_name",
            "additional_salt",
        )
    ],
    *[("header", name) for name in ("kv-model", "kv-tenant", "kv-salt")],
]


@pytest.mark.parametrize(("where", "field"), NAME_FIELDS)
def test_names_longer_than_max_name_are_rejected(where: str, field: str) -> None:
    """A name becomes part of what the index keeps (a namespace, a pool
    store, the media cache): MAX_NAME characters is plenty, more is absurd."""
    for length, ok in ((MAX_NAME, True), (MAX_NAME + 1, False), (1 << 20, False)):
        name = "c" * length
        if where == "engine":
            ev: dict[str, Any] = {**stored([1], [1, 2]), field: name}
            rec = engine_record(b"i0", [ev])
        elif where == "pool":
            rec = pool_record(b"p0", [{"event_type": "stored", "seq_hashes": [1], field: name}])
        else:
            head = engine_headers(block_size=BS, **{field: name})
            rec = Record(False, b"i0", head, vllm_payload([stored([1], [1, 2])]), 1.0)
        bad = "invalid_header" if where == "header" else "rejected"
        assert ingest(Conductor(), rec) == ("applied" if ok else bad), length


@pytest.mark.parametrize("form", ["map", "array"])
@pytest.mark.parametrize("tag", ["BlockStored", "BlockRemoved"])
def test_group_indexes_above_max_group_idx_are_rejected(form: str, tag: str) -> None:
    """Each group index is kept per instance: like dp ranks, they
    stop at 2**16 (engines count their KV cache groups from 0)."""
    conductor = Conductor()
    for group, want in ((MAX_GROUP_IDX, "applied"), (MAX_GROUP_IDX + 1, "rejected")):
        ev: dict[str, Any] = {"type": tag, "block_hashes": [1], "group_idx": group}
        if tag == "BlockStored":
            ev["kv_cache_spec_kind"] = "sliding_window"
        rec = engine_record(b"i0", [ev if form == "map" else as_array(ev)])
        assert ingest(conductor, rec) == want
    assert all(len(s.groups) <= 1 for s in conductor.snapshot_state().instances.values())


def _spliced(ev: dict[str, Any], field: str, depth: int) -> bytes:
    """A payload with `field` nested `depth` lists deep: spliced in as bytes,
    since msgspec will not encode what it would not decode."""
    marker = Ext(9, b"deep")
    ev = {**ev, field: [marker] if field == "extra_keys" else marker}
    head, tail = enc([1.0, [ev], 0]).split(enc(marker))
    return head + b"\x91" * depth + b"\xc0" + tail


@pytest.mark.parametrize("depth", [1, 500, 900, 980, 990, 999, 1000, 5000])
@pytest.mark.parametrize("field", ["extra_keys", "lora_name", "token_ids", "medium"])
def test_nesting_at_the_depth_limit_decodes_or_is_undecodable(depth: int, field: str) -> None:
    """Decoded, or a DecodeError; never a RecursionError (the extra keys are
    re-encoded for their fingerprint, one level less deep)."""
    ev = {"type": "BlockStored", "block_hashes": [1], "block_size": BS}
    for source in ("vllm", "sglang"):
        for payload in (_spliced(ev, field, depth), _spliced(ev, field, depth)[:-1]):
            with contextlib.suppress(DecodeError):
                decode_engine_payload(payload, source)


def test_a_million_tokens_decode_and_apply() -> None:
    n = 500_000  # blocks of BS tokens: 10**6 token ids in one event
    tokens = [i % 50_000 for i in range(n * BS)]
    payload = enc(
        [1.0, [{"type": "BlockStored", "block_hashes": list(range(1, n + 1)), "token_ids": tokens}]]
    )
    conductor = Conductor()
    assert conductor.ingest_engine_record(b"i0", ENGINE_HEADERS, payload, 1.0).blocks == n
    assert conductor.query(TokenQuery("m", BS, tokens[:1000]))["default"]["i0"]["GPU"] == 1000
    # One token too many for one block is fine (the tail is not a full
    # block); one id out of range, anywhere in a million, rejects the record.
    for bad, want in (([*tokens, 1], "applied"), ([*tokens[:-1], U32_MAX + 1], "rejected")):
        assert ingest(conductor, engine_record(b"i1", [stored([1], bad)])) == want
    check_consistent(conductor.snapshot_state())


# ------------------------------------------------------------------ 2. core

# Small namespace, instance and owner bounds everywhere; the pending and
# retired bounds tiny one at a time (both at once: the fuzz below).
SMALL = {"max_pending_age_s": 5.0, "max_namespaces": 3, "max_instances": 3}
FUZZ_LIMITS = [
    pytest.param(IndexLimits(**SMALL, max_owners_per_namespace=4), id="roomy"),
    pytest.param(IndexLimits(**SMALL, max_pending=2, max_blocks_per_owner=6), id="tiny-pending"),
    pytest.param(IndexLimits(**SMALL, max_retired_content=1), id="tiny-retired"),
]
BOTH_TINY = IndexLimits(**SMALL, max_pending=1, max_retired_content=1)
FUZZ = settings(
    max_examples=150,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


def run_stream(limits: IndexLimits, items: list[int | Record]) -> None:
    recs = stream(items)
    conductor = Conductor(limits)
    for rec in recs:
        event(f"record: {ingest(conductor, rec)}")
        check_consistent(conductor.snapshot_state())
    probe_queries(conductor.snapshot_state())
    # Time passes: every pending half ages out, then the content it retired.
    for later in (1e16, 2e16):
        conductor.expire(max(r.now for r in recs) + later)
        check_consistent(conductor.snapshot_state())
    assert all(_drained(ns) for ns in conductor.snapshot_state().namespaces.values())


@pytest.mark.parametrize("limits", FUZZ_LIMITS)
@FUZZ
@given(stream_items)
def test_every_record_applies_whole_or_is_rejected_whole(
    limits: IndexLimits, items: list[int | Record]
) -> None:
    run_stream(limits, items)


@FUZZ
@example([1509856992, 2905536144])  # what random streams found first (minimised)
@given(stream_items)
def test_every_record_applies_whole_at_both_bounds(items: list[int | Record]) -> None:
    run_stream(BOTH_TINY, items)


CYCLES = {
    "self-parent": [stored([A], [1, 1], parent=A)],
    "two-event cycle": [stored([A], [1, 1], parent=B), stored([B], [2, 2], parent=A)],
    "parent is the event's last block": [stored([A, B, C], [1, 1, 2, 2, 3, 3], parent=C)],
    "parent is its own descendant": [stored([A, B, A, B], [1, 1, 2, 2, 3, 3, 4, 4], parent=B)],
}


@pytest.mark.parametrize("events", CYCLES.values(), ids=list(CYCLES))
@pytest.mark.parametrize("offload", ["local", "pool"])
def test_parent_cycles_terminate_join_and_age_out(events: list[Any], offload: str) -> None:
    """Blocks waiting in a parent cycle (GPU stores, or offload intents):
    when one of them gets content the rest resolve once (no loop), and
    whatever is left ages out."""
    conductor = Conductor(IndexLimits(max_pending_age_s=5))
    medium = "GPU" if offload == "local" else "CPU"
    for ev in events:
        rec = engine_record(b"i0", [{**ev, "medium": medium}], offload=offload)
        assert ingest(conductor, rec) == "applied"
        check_consistent(conductor.snapshot_state())
    (ns,) = conductor.snapshot_state().namespaces.values()
    assert ns.unresolved  # all of it waits for a parent
    for h in (A, B, C):  # content for each member in turn, from the root
        rec = engine_record(b"i1", [stored([h], [h, h])], now=1001.0)
        assert ingest(conductor, rec) == "applied"
        check_consistent(conductor.snapshot_state())
    assert not ns.unresolved and not ns.children
    if offload == "local":
        answer = conductor.query(HashQuery("m", BS, [A]))["default"]
        assert answer["i0"]["GPU"] == BS and answer["i1"]["GPU"] == BS
    else:
        assert conductor.pending()["intents"]  # resolved, so pinned for the pool
    for later in (1e6, 2e6):
        conductor.expire(later)
        check_consistent(conductor.snapshot_state())
    assert all(_drained(ns) for ns in conductor.snapshot_state().namespaces.values())


def test_a_deep_chain_delivered_child_first_resolves_without_recursion() -> None:
    """20 000 blocks, each naming the one before as parent, arrive last block
    first; the root's content then resolves the whole chain at once."""
    n = 20_000
    conductor = Conductor()
    for start in range(n - 100, 0, -100):
        chain = range(start + 99, start - 1, -1)
        events = [stored([h], [h % 7, h % 5], parent=h - 1) for h in chain]
        assert outcome(conductor, engine_record(b"i0", events)) == "applied"
    assert conductor.pending()["unresolved"] == n - 100
    tokens = [t for h in range(n) for t in (h % 7, h % 5)]
    root = stored(list(range(100)), tokens[:200])
    assert ingest(conductor, engine_record(b"i0", [root])) == "applied"
    assert conductor.pending()["unresolved"] == 0
    check_consistent(conductor.snapshot_state())
    assert conductor.query(TokenQuery("m", BS, tokens))["default"]["i0"]["GPU"] == n * BS


def test_one_hash_repeated_a_thousand_times_is_one_block() -> None:
    conductor = Conductor()
    for ev in (stored([A] * 1000, [1, 2] * 1000), stored([B] * 1000, None)):
        assert ingest(conductor, engine_record(b"i0", [ev])) == "applied"
        check_consistent(conductor.snapshot_state())
    (ns,) = conductor.snapshot_state().namespaces.values()
    assert ns.store.owner_size(ns.owners["i0"][0].slot) == 1 and len(ns.waiting[B]) == 1
    # A tier holds a set: one removal removes it.
    assert ingest(conductor, engine_record(b"i0", [removed([A])])) == "applied"
    assert "i0" not in ns.owners
    check_consistent(conductor.snapshot_state())


# ------------------------------------------------------------------ 3. memory

FLOOD = Vocab(
    hashes=1 << 12,
    instances=tuple(b"i%d" % k for k in range(20)) + tuple(b"o%d" % k for k in range(4)),
    backends=(b"p0", b"p1", b"p2"),
    loras=tuple(f"l{k}" for k in range(16)),
    ranks=(*range(8), 1 << 16),
    events=100,
)
FLOOD_BOUNDS = {
    "max_pending_age_s": 5.0,
    "max_namespaces": 6,
    "max_instances": 12,
    "max_blocks_per_owner": 16,
    "max_owners_per_namespace": 16,
}
FLOOD_RECORDS = 3_000


def sizes(index: Index) -> Counter[str]:
    """The sizes every `IndexLimits` bound is about, largest per namespace."""
    out: Counter[str] = Counter(namespaces=len(index.namespaces), instances=len(index.instances))
    for ns in index.namespaces.values():
        owners = [o for ranks in ns.owners.values() for o in ranks.values()]
        here = {
            "pending": len(ns.pending),
            "retired": ns.store.retired_len(),
            "owners": len(owners),
            "owner_blocks": max((ns.store.owner_size(o.slot) for o in owners), default=0),
            "pool_store_blocks": max(
                (ns.store.pool_len(p.pid) for p in ns.pools.values()), default=0
            ),
            "content": ns.store.content_len(),
        }
        for name, n in here.items():
            out[name] = max(out[name], n)
    return out


@pytest.mark.parametrize(
    "limits",
    [
        pytest.param(IndexLimits(**FLOOD_BOUNDS, max_pending=64), id="pending-bound"),
        pytest.param(IndexLimits(**FLOOD_BOUNDS, max_retired_content=64), id="retired-bound"),
    ],
)
def test_a_flood_of_absurd_events_stays_within_every_bound(limits: IndexLimits) -> None:
    """~1.5 * 10**5 absurd events from 24 instances (4 offloading) with 9 ranks
    each, 3 pool backends and 16 LoRA adapters: every bound holds after every
    record, and each is reached. (Both pending and retired at their bound at
    once: the both-bounds fuzz above.)"""
    rng = random.Random(7)
    conductor = Conductor(limits)
    index = conductor.snapshot_state()
    most: Counter[str] = Counter()
    outcomes: Counter[str] = Counter()
    events = 0
    for i in range(FLOOD_RECORDS):
        rec = core_record(rng, 1000.0 + i * 0.01, FLOOD)
        events += len(msgspec.msgpack.decode(rec.payload)[1])
        outcomes[outcome(conductor, rec)] += 1
        now = sizes(index)
        most |= now
        assert now["namespaces"] <= limits.max_namespaces
        assert now["instances"] <= limits.max_instances
        assert now["pending"] <= limits.max_pending
        assert now["retired"] <= limits.max_retired_content
        assert now["owners"] <= limits.max_owners_per_namespace
        assert now["owner_blocks"] <= limits.max_blocks_per_owner
        if i % 500 == 0:
            check_consistent(index)
    check_consistent(index)
    assert events > 100_000 and outcomes["applied"] > FLOOD_RECORDS // 2, outcomes
    # Every bound was reached, and its overflow counted.
    assert most["namespaces"] == limits.max_namespaces and index.counters["namespace_limit_dropped"]
    assert most["instances"] == limits.max_instances
    assert index.counters["instance_limit_dropped"] + index.counters["instance_limit_reclaimed"]
    assert (
        most["owners"] == limits.max_owners_per_namespace and index.counters["owner_limit_dropped"]
    )
    assert most["owner_blocks"] == limits.max_blocks_per_owner
    assert index.counters["owner_capacity_dropped"]
    if limits.max_pending == 64:
        assert most["pending"] == 64
        assert sum(n for k, n in index.counters.items() if k.endswith("_count"))
    else:
        assert most["retired"] == 64
    print(f"\nflood {limits}: {events} events, {dict(outcomes)}, largest {dict(most)}")


# ------------------------------------------------------------------ 4. core bugs found


@pytest.mark.parametrize("last", ["token-less store", "pool confirmation"])
def test_token_less_store_at_both_bounds_applies_whole(last: str) -> None:
    """Pending and retired both at their bound (1 each): A's content is known
    but held by nobody (retired), and an offload intent pins X. A token-less
    store of [A, B] sees A known, then makes B wait: that evicts the intent,
    whose release retires X, which evicts A's content; placing A then fails
    (AssertionError in _place_owner, KeyError in _place_pool) after the wait
    for B, the intent's drop and an empty owner of i1 were applied."""
    conductor = Conductor(IndexLimits(max_pending=1, max_retired_content=1))
    offload = stored([X], [3, 4], medium="CPU")
    for rec in (
        engine_record(b"i0", [stored([A], [1, 2])]),
        engine_record(b"i0", [removed([A])]),
        engine_record(b"o2", [offload], offload="pool"),
    ):
        assert ingest(conductor, rec) == "applied"
    check_consistent(conductor.snapshot_state())
    assert conductor.pending() == {"waiting": 0, "unresolved": 0, "intents": 1, "retired": 1}
    if last == "token-less store":
        rec = engine_record(b"i1", [stored([A, B], None)])
    else:
        rec = pool_record(b"p0", [{"event_type": "stored", "seq_hashes": [A, B]}])
    assert ingest(conductor, rec) == "applied"
    check_consistent(conductor.snapshot_state())


def test_a_pool_store_holds_at_most_max_blocks_per_owner() -> None:
    limits = IndexLimits(max_blocks_per_owner=100)
    conductor = Conductor(limits)
    for start in range(0, 10_000, 1_000):
        hashes = list(range(start + 1, start + 1_001))
        tokens = [t for h in hashes for t in (h, h)]
        ev = {"event_type": "stored", "seq_hashes": hashes, "token_ids": tokens}
        assert outcome(conductor, pool_record(b"p0", [ev])) == "applied"
    (ns,) = conductor.snapshot_state().namespaces.values()
    assert ns.store.pool_len(ns.pools[("p0", "cpu")].pid) <= limits.max_blocks_per_owner


def test_pool_backends_per_namespace_are_bounded() -> None:
    limits = IndexLimits(max_owners_per_namespace=16)
    conductor = Conductor(limits)
    for start in range(0, 10_000, 1_000):
        events = [
            {"event_type": "stored", "seq_hashes": [b], "token_ids": [b, b], "backend_id": f"b{b}"}
            for b in range(start, start + 1_000)
        ]
        assert outcome(conductor, pool_record(b"p0", events)) == "applied"
    (ns,) = conductor.snapshot_state().namespaces.values()
    assert len(ns.pools) <= limits.max_owners_per_namespace


@pytest.mark.parametrize("topic", ["engine", "pool"])
def test_a_rejected_record_does_not_age_out_pending_halves(topic: str) -> None:
    """A pool confirmation waits for its content; a record stamped an hour
    later is rejected (dp rank out of range; a pool event with no model); the
    content arrives a second after the confirmation and must join it."""
    conductor = Conductor()  # pending halves live 300 s
    confirm = pool_record(b"p0", [{"event_type": "stored", "seq_hashes": [A]}], now=1000.0)
    assert ingest(conductor, confirm) == "applied"
    later = 1000.0 + 3600
    if topic == "engine":
        bad = Record(
            False, b"i0", ENGINE_HEADERS, vllm_payload([stored([B], [5, 5])], 1 << 20, later), later
        )
    else:
        bad = Record(True, b"p1", NO_MODEL, pool_payload([{"event_type": "removed"}], later), later)
    assert ingest(conductor, bad) == "rejected"
    assert ingest(conductor, engine_record(b"i0", [stored([A], [1, 2])], now=1001.0)) == "applied"
    assert conductor.workers()[0]["pools"] == {"p0": {"cpu": 1}}
