"""Mooncake Conductor's msgpack query form (contract v2 section 4, last paragraph).

Conductor (Mooncake branch `dev/conductor`, `indexer-api-design.md`) answers
`POST /query` bodies sent as `application/msgpack`:

    {model, block_size, token_ids, tenant_id?, lora_name?, cache_salt?, instance_id?}
    -> {"instances": {id: {longest_matched, gpu, cpu, disk,
                           dp: {rank: gpu_r}, rank_matches: {rank: {gpu, cpu, disk}}}}}

`token_ids` is a msgpack bin of little-endian int32 or an array of int32;
either way its bytes are the prompt the index hashes (a negative int32 is the
same four bytes as the u32 the local hash reads). Validation follows
Conductor's: an unknown field, a wrong type, a value out of range give 400
with a msgpack `{error, reason, field?, index?}` (`ConductorError`).

The answer is built from the per-rank lengths of the same match the JSON
answer uses (`query.run_query_ranks`): kvconductor's `GPU` (device tier),
`CPU` (continued through the rank's own host tier and the namespace's host
pools) and `DISK` (continued when disk tiers serve too) are Conductor's
`gpu`, `cpu` and `disk`; per instance `gpu`, `cpu`, `disk` are the maxima
over its ranks and `longest_matched` is `disk`, `dp[rank]` the rank's `gpu`.
docs/query-wire-forms.md sets the two forms side by side.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Mapping
from typing import Annotated

import msgspec

from kvconductor.wire.query import HashQuery, TokenQuery

MSGPACK = "application/msgpack"

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Int32 = Annotated[int, msgspec.Meta(ge=-(2**31), le=2**31 - 1)]

# Per (instance, rank): (GPU, CPU, DISK) matched, in tokens.
RankHits = dict[str, dict[int, tuple[int, int, int]]]


class ConductorQuery(msgspec.Struct, forbid_unknown_fields=True):
    model: NonEmpty
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    token_ids: bytes | list[Int32]
    # Conductor takes only strings here; a null is the default too (contract
    # section 1 holds wherever a namespace field arrives).
    tenant_id: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    instance_id: str | None = None


class ConductorHashQuery(msgspec.Struct, forbid_unknown_fields=True):
    """`/query_by_hash` in the msgpack form: kvconductor's own route, with
    `HashQuery`'s fields and Conductor's rules."""

    model: NonEmpty
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    seq_hashes: list[int | str]
    tenant_id: str | None = None
    lora_name: str | None = None
    cache_salt: str | None = None
    instance_id: str | None = None


class ConductorError(ValueError):
    """A request Conductor's rules refuse: 400 with `as_map()` in msgpack."""

    def __init__(
        self, reason: str, message: str, field: str | None = None, index: int | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.field = field
        self.index = index

    def as_map(self) -> dict[str, object]:
        out: dict[str, object] = {"error": self.message, "reason": self.reason}
        if self.field is not None:
            out["field"] = self.field
        if self.index is not None:
            out["index"] = self.index
        return out


# What a field must be, in Conductor's words, when it has the wrong type.
_EXPECTED = {
    "token_ids": "a bin or an array",
    "block_size": "an integer",
    "dp_rank": "an integer",
    "cache_group": "an integer or null",
    "cache_salt": "a string or null",
    "hash_profile": "a map",
}
# msgspec's ValidationError texts: what failed and where (`$.a.b[3]`).
_AT = re.compile(r"^(?P<what>.*?)(?: - at `\$(?P<path>[^`]*)`)?$")
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]*)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]*)`$")


def conductor_error(exc: msgspec.ValidationError | msgspec.DecodeError) -> ConductorError:
    """The error Conductor gives for what msgspec refused."""
    if isinstance(exc, msgspec.DecodeError) and not isinstance(exc, msgspec.ValidationError):
        return ConductorError("invalid_msgpack", "Invalid msgpack object")
    at = _AT.match(str(exc))
    assert at is not None  # the pattern matches any text
    what, path = at["what"], at["path"] or ""
    field: str | None = None
    index: int | None = None
    for name, element in _STEP.findall(path):
        if name:
            field, index = name, None
        else:
            index = int(element)
    if (m := _UNKNOWN.match(what)) is not None:
        name = m["name"]
        return ConductorError("unknown_field", f"unsupported request field: {name}", name)
    if (m := _MISSING.match(what)) is not None:
        return ConductorError("missing", f"{m['name']} is required", m["name"])
    if field is None:
        return ConductorError("invalid_msgpack", "request body must be a msgpack map")
    if what.startswith("Expected `str` of length"):
        return ConductorError("invalid_value", f"{field} must not be empty", field)
    if re.match(r"^Expected `int` [<>]=", what):
        if index is not None:
            text = f"{field} element is outside the int32 range"
        else:
            text = f"{field} is out of range ({what.removeprefix('Expected `int` ')})"
        return ConductorError("out_of_range", text, field, index)
    if index is not None:
        return ConductorError("invalid_type", f"{field} element must be an integer", field, index)
    expected = _EXPECTED.get(field, "a string")
    return ConductorError("invalid_type", f"{field} must be {expected}", field)


_query_decoder = msgspec.msgpack.Decoder(ConductorQuery)
_hash_decoder = msgspec.msgpack.Decoder(ConductorHashQuery)
_encoder = msgspec.msgpack.Encoder()


def is_msgpack(content_type: str) -> bool:
    """Whether a Content-Type names msgpack (Conductor looks for the text in it)."""
    return MSGPACK in content_type.lower()


def read_conductor_query(body: bytes) -> tuple[TokenQuery, bytes]:
    """A msgpack `/query` body as the query (without `token_ids`) and its
    full blocks packed as the index hashes them; ConductorError if refused."""
    try:
        q = _query_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise conductor_error(exc) from None
    if isinstance(q.token_ids, bytes):
        if len(q.token_ids) % 4:
            raise ConductorError(
                "invalid_value", "token_ids bin size must be a multiple of 4", "token_ids"
            )
        packed = q.token_ids
    else:
        packed = struct.pack(f"<{len(q.token_ids)}i", *q.token_ids)
    full = len(packed) - len(packed) % (4 * q.block_size)
    req = TokenQuery(
        q.model, q.block_size, [], q.lora_name, q.tenant_id, q.instance_id, q.cache_salt
    )
    return req, packed[:full]


def read_conductor_hash_query(body: bytes) -> HashQuery:
    try:
        q = _hash_decoder.decode(body)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise conductor_error(exc) from None
    return HashQuery(
        q.model, q.block_size, q.seq_hashes, q.lora_name, q.tenant_id, q.instance_id, q.cache_salt
    )


def conductor_answer(hits: RankHits, registered: Mapping[str, set[int]]) -> bytes:
    """The msgpack answer: every instance with a listed or registered rank,
    registered ranks without a listing at zeros."""
    instances: dict[str, dict[str, object]] = {}
    for name in sorted(hits.keys() | registered.keys()):
        ranks = dict.fromkeys(registered.get(name, ()), (0, 0, 0))
        ranks.update(hits.get(name, {}))
        if not ranks:
            continue
        order = sorted(ranks)
        instances[name] = {
            "longest_matched": max(ranks[r][2] for r in order),
            "gpu": max(ranks[r][0] for r in order),
            "cpu": max(ranks[r][1] for r in order),
            "disk": max(ranks[r][2] for r in order),
            "dp": {str(r): ranks[r][0] for r in order},
            "rank_matches": {
                str(r): {"gpu": ranks[r][0], "cpu": ranks[r][1], "disk": ranks[r][2]} for r in order
            },
        }
    return _encoder.encode({"instances": instances})


def error_body(error: ConductorError) -> bytes:
    return _encoder.encode(error.as_map())


def message_body(message: str) -> bytes:
    """An operational error as Conductor writes it: `{"error": message}`."""
    return _encoder.encode({"error": message})
