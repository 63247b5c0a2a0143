"""The compiled kernel's hashing gives exactly the pure-Python path's results
(its block store: tests/test_block_store.py)."""

from __future__ import annotations

import os
import shutil
import struct
from array import array
from types import ModuleType

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvconductor.kernel import KERNEL, STATUS
from kvconductor.wire import hashing
from kvconductor.wire.hashing import pack_tokens
from kvconductor.wire.query import TokenQuery, read_token_query

BLOCK = 4


def test_kernel_is_built_where_rust_is() -> None:
    # With cargo on the machine a missing kernel is a broken build, not a
    # machine without Rust: the optional build must not hide it.
    if shutil.which("cargo") and os.environ.get("KVCONDUCTOR_KERNEL", "") != "off":
        assert KERNEL is not None, STATUS


def _kernel() -> ModuleType:
    """The compiled module (typed by kvconductor/_kernel.pyi), or a skip."""
    if KERNEL is None:
        pytest.skip(STATUS)
    return KERNEL


@settings(max_examples=200, deadline=None)
@given(
    st.integers(1, 32),
    st.integers(0, 2**64 - 1),
    st.data(),
)
def test_chain_identities_matches_python(block_size: int, parent: int, data: st.DataObject) -> None:
    kernel = _kernel()
    n = data.draw(st.integers(0, 12))
    tokens = data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n * block_size))
    packed = pack_tokens(tokens)
    want = hashing._plain_chain(packed, n, block_size, parent)
    assert kernel.chain_identities(packed, n, block_size, parent) == want


@settings(max_examples=200, deadline=None)
@given(st.lists(st.one_of(st.integers(-(2**40), 2**40), st.booleans(), st.floats(), st.text())))
def test_pack_tokens_matches_array(tokens: list[object]) -> None:
    kernel = _kernel()
    try:
        want: bytes | type[Exception] = array("I", tokens).tobytes()  # type: ignore[arg-type]
    except (OverflowError, TypeError) as exc:
        want = type(exc)
    try:
        got: bytes | type[Exception] = kernel.pack_tokens(tokens)  # type: ignore[arg-type]
    except (OverflowError, TypeError) as exc:
        got = type(exc)
    assert got == want


def test_chain_identities_refuses_short_input() -> None:
    kernel = _kernel()
    with pytest.raises(ValueError):
        kernel.chain_identities(b"\0" * 15, 1, 4, 0)


tokenish = st.one_of(
    st.integers(-(2**40), 2**40), st.booleans(), st.floats(), st.text(max_size=2), st.none()
)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(st.integers(0, 2**32 + 5)), st.lists(tokenish), tokenish))
def test_msgpack_tokens_matches_python(value: object) -> None:
    kernel = _kernel()
    raw = msgspec.msgpack.encode(value)
    try:
        want: bytes | None = pack_tokens(msgspec.msgpack.decode(raw, type=list[int]))
    except (msgspec.ValidationError, OverflowError):
        want = None
    assert kernel.msgpack_tokens(raw) == want
    # Trailing bytes are not one array.
    assert kernel.msgpack_tokens(raw + b"\x00") is None


# Every msgpack encoding of an integer: (marker, struct format, range).
_INT_ENCODINGS = [
    (0xCC, ">B", 0, 2**8),
    (0xCD, ">H", 0, 2**16),
    (0xCE, ">I", 0, 2**32),
    (0xCF, ">Q", 0, 2**64),
    (0xD0, ">b", -(2**7), 2**7),
    (0xD1, ">h", -(2**15), 2**15),
    (0xD2, ">i", -(2**31), 2**31),
    (0xD3, ">q", -(2**63), 2**63),
]


@st.composite
def _any_int_encoding(draw: st.DrawFn) -> tuple[int, bytes]:
    """An integer in some msgpack encoding that holds it, smallest or not
    (encoders other than msgspec's need not pick the smallest)."""
    value = draw(st.one_of(st.integers(-40, 300), st.integers(-(2**33), 2**33)))
    fits = [e for e in _INT_ENCODINGS if e[2] <= value < e[3]]
    forms = [bytes([value])] if 0 <= value < 128 else []
    forms += [bytes([m]) + struct.pack(f, value) for m, f, _, _ in fits]
    return value, draw(st.sampled_from(forms))


@settings(max_examples=300, deadline=None)
@given(st.lists(_any_int_encoding(), max_size=40), st.integers(0, 400))
def test_msgpack_tokens_reads_every_integer_encoding(
    items: list[tuple[int, bytes]], cut: int
) -> None:
    kernel = _kernel()
    raw = b"\xdc" + struct.pack(">H", len(items)) + b"".join(form for _, form in items)
    values = [v for v, _ in items]
    want = pack_tokens(values) if all(0 <= v < 2**32 for v in values) else None
    assert kernel.msgpack_tokens(raw) == want
    # A truncated array is not one.
    if cut < len(raw) - 3:
        assert kernel.msgpack_tokens(raw[: 3 + cut]) is None


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.lists(st.integers(0, 2**32 + 5)), st.lists(tokenish), tokenish))
def test_json_tokens_matches_python(value: object) -> None:
    kernel = _kernel()
    try:
        raw = msgspec.json.encode(value)
    except (OverflowError, ValueError):  # NaN and such: not JSON a client can send
        return
    try:
        want: bytes | None = pack_tokens(msgspec.json.decode(raw, type=list[int]))
    except (msgspec.ValidationError, OverflowError):
        want = None
    assert kernel.json_tokens(raw) == want
    assert kernel.json_tokens(b" " + raw + b"\n") == want  # whitespace is JSON
    assert kernel.json_tokens(raw + b"]") is None


query_field = st.one_of(st.none(), st.text(max_size=3), st.integers(-5, 2**64), st.booleans())


@st.composite
def query_bodies(draw: st.DrawFn) -> bytes:
    """Token query bodies, mostly valid, some a field or a token off."""
    fields: dict[str, object] = {
        "model": draw(st.one_of(st.text(max_size=4), query_field)),
        "block_size": draw(st.one_of(st.integers(-3, 2**64), query_field)),
        "token_ids": draw(st.one_of(st.lists(st.integers(0, 2**32 + 5)), st.lists(tokenish))),
    }
    for name in ("lora_name", "tenant_id", "instance_id", "cache_salt", "unknown"):
        if draw(st.booleans()):
            fields[name] = draw(query_field)
    keys = draw(st.permutations(list(fields)))
    if draw(st.integers(0, 9)) == 0:
        keys = keys[1:]  # a field missing
    body = msgspec.json.encode({k: fields[k] for k in keys})
    if draw(st.integers(0, 19)) == 0:
        body = body[:-1] + b',"model":"again"}'  # a duplicate field
    if draw(st.integers(0, 19)) == 0:
        body = msgspec.json.encode([fields[k] for k in keys])  # an array
    return body


@settings(max_examples=400, deadline=None)
@given(query_bodies())
# A block size past i64 that msgspec still reads as an int (u64).
@example(b'{"block_size":9223372036854775808,"token_ids":[],"model":"again"}')
# Past u64: the one-pass reader leaves it to the typed decoder (found by hypothesis).
@example(b'{"block_size":18446744073709551616,"token_ids":[],"model":"again"}')
def test_read_token_query_takes_only_what_the_typed_decoder_takes(body: bytes) -> None:
    """One pass or two, a query is read as the `TokenQuery` decoder reads it,
    tokens packed; whatever is not plainly valid is left to that decoder."""
    try:
        typed: TokenQuery | None = msgspec.json.decode(body, type=TokenQuery)
        want = (msgspec.structs.replace(typed, token_ids=[]), pack_tokens(typed.token_ids))
    except (msgspec.ValidationError, msgspec.DecodeError, OverflowError):
        want = None
    got = read_token_query(body)
    if got is not None:
        assert got == want
    elif want is not None:
        # Only a duplicate field, or a block size past u64 (msgspec reads an
        # int of any size), may go the typed decoder's way although valid.
        assert body.count(b'"model"') > 1 or want[0].block_size >= 2**64
    read = KERNEL.read_token_query(body) if KERNEL is not None else None
    if read is not None:
        assert want is not None
        q, packed = want
        assert read == (
            q.model,
            q.block_size,
            packed,
            q.lora_name,
            q.tenant_id,
            q.instance_id,
            q.cache_salt,
        )


# JSON's whitespace, as clients other than msgspec write it.
space = st.text(" \n\r\t", max_size=2)


@st.composite
def written_bodies(draw: st.DrawFn) -> tuple[bytes, bool]:
    """A token query as any JSON writer may lay it out, and sometimes one
    byte off; True when untouched."""
    tokens = draw(st.lists(st.sampled_from([0, 7, 10, 99_999_999, 123_456_789, 2**32 - 1])))
    tokens += draw(st.lists(st.integers(0, 2**32 - 1), max_size=20))
    s = lambda: draw(space).encode()  # noqa: E731 - one draw per gap
    array = b"[" + s() + (s() + b"," + s()).join(b"%d" % t for t in tokens) + s() + b"]"
    fields = [
        b'"model"' + s() + b":" + s() + b'"m\\u00e9"',
        b'"block_size":16',
        b'"token_ids":' + array,
    ]
    if draw(st.booleans()):
        fields.append(b'"tenant_id":null')
    fields = draw(st.permutations(fields))
    body = s() + b"{" + s() + (s() + b"," + s()).join(fields) + s() + b"}" + s()
    if not draw(st.booleans()):
        return body, True
    at = draw(st.integers(0, len(body)))
    edit = draw(
        st.sampled_from([b"", b"0", b"-", b".", b"e", b"+", b",", b"]", b"[", b"}", b'"', b" "])
    )
    cut = draw(st.integers(0, 1))
    return body[:at] + edit + body[at + cut :], False


@settings(max_examples=500, deadline=None)
@given(written_bodies())
@example((b'{"model":"m","block_size":16,"token_ids":[01]}', False))
@example((b'{"model":"m","block_size":16,"token_ids":[-0]}', False))
@example((b'{"model":"m","block_size":16,"token_ids":[1,]}', False))
@example((b'{"model":"m","block_size":16,"token_ids":[4294967296]}', False))
@example((b'{"model":"m","block_size":16,"token_ids":[12345678901]}', False))
@example((b'{"model":"m","block_size":16,"token_ids":[1.0]}', False))
@example((b'{"model":"m","block_size":16,"token_ids":[1e3]}', False))
@example((b'{"model":"m","block_size":16,"token_ids":[1]}]', False))
@example((b'{"model":"m","block_size":16,"tok\\u0065n_ids":[1]}', False))
def test_read_token_query_reads_any_layout_as_the_typed_decoder_does(
    written: tuple[bytes, bool],
) -> None:
    """The kernel reads the prompt's array itself: whatever it takes, in any
    layout, is what the typed decoder takes; a plainly valid body is taken."""
    kernel = _kernel()
    body, untouched = written
    read = kernel.read_token_query(body)
    if untouched:
        assert read is not None
    if read is None:
        return
    q = msgspec.json.decode(body, type=TokenQuery)
    assert read == (
        q.model,
        q.block_size,
        pack_tokens(q.token_ids),
        q.lora_name,
        q.tenant_id,
        q.instance_id,
        q.cache_salt,
    )
    if untouched:
        array = body[body.index(b"[") : body.rindex(b"]") + 1]
        assert kernel.json_tokens(array) == read[2]
