"""Where a record belongs when several daemons share the work.

Engine records are keyed by instance and pool records by backend, but the
two-phase join and the content catalog need every record of a namespace in
one place. In scale-out mode each record is therefore re-keyed by its
namespace group, `(tenant, model, block_size, salt)`, onto an internal topic
(the repartition step Kafka Streams runs before a join). LoRA adapters stay
with their base model so that an instance's state never spans daemons.

A pool record whose events name several groups is split into one payload per
group, each event's bytes kept as they were. A record that cannot be routed
(undecodable, no model) goes under the empty key: the index stage then
dead-letters it with the real reason, so bad records are judged in one place.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from kvconductor.wire.records import KV_BLOCK_SIZE, KV_MODEL, KV_PREFIX, KV_SALT, KV_TENANT

UNROUTABLE = b""

_SEP = "\x1f"


def group_key(tenant: str, model: str, block_size: int | str, salt: str) -> bytes:
    return _SEP.join((tenant, model, str(block_size), salt)).encode("utf-8")


def _headers(headers: Iterable[tuple[str, bytes]]) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, value in headers:
        if name.startswith(KV_PREFIX) and value is not None:
            out[name] = value.decode("utf-8", "replace")
    return out


def engine_route(headers: Iterable[tuple[str, bytes]]) -> bytes:
    h = _headers(headers)
    model = h.get(KV_MODEL)
    block_size = h.get(KV_BLOCK_SIZE)
    if not model or not block_size:
        return UNROUTABLE
    return group_key(h.get(KV_TENANT) or "default", model, block_size.strip(), h.get(KV_SALT, ""))


class _Namespace(msgspec.Struct, gc=False):
    tenant_id: str | None = None
    model_name: str | None = None
    block_size: int | None = None
    additional_salt: str | None = None


class _Envelope(msgspec.Struct, array_like=True, gc=False):
    ts: msgspec.Raw
    events: list[msgspec.Raw]
    dp_rank: msgspec.Raw = msgspec.Raw(b"\xc0")


_decode_envelope = msgspec.msgpack.Decoder(_Envelope).decode
_decode_namespace = msgspec.msgpack.Decoder(_Namespace).decode
_encode = msgspec.msgpack.encode


def pool_routes(
    headers: Iterable[tuple[str, bytes]], payload: bytes | None
) -> list[tuple[bytes, bytes | None]]:
    """(group key, payload) pairs for one pool record; the original payload
    when every event belongs to one group."""
    h = _headers(headers)
    if payload is None:
        return [(UNROUTABLE, payload)]
    try:
        envelope = _decode_envelope(payload)
        spaces = [_decode_namespace(raw) for raw in envelope.events]
    except (msgspec.DecodeError, msgspec.ValidationError):
        return [(UNROUTABLE, payload)]
    groups: dict[bytes, list[msgspec.Raw]] = {}
    for raw, ns in zip(envelope.events, spaces, strict=True):
        model = ns.model_name or h.get(KV_MODEL)
        block_size = ns.block_size or h.get(KV_BLOCK_SIZE)
        if not model or not block_size:
            key = UNROUTABLE
        else:
            key = group_key(
                ns.tenant_id or h.get(KV_TENANT) or "default",
                model,
                str(block_size).strip(),
                ns.additional_salt or h.get(KV_SALT, ""),
            )
        groups.setdefault(key, []).append(raw)
    if len(groups) <= 1:
        key = next(iter(groups), UNROUTABLE)
        return [(key, payload)]
    return [
        (key, _encode(_Envelope(envelope.ts, raws, envelope.dp_rank)))
        for key, raws in groups.items()
    ]
