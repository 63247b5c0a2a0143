"""Registrations: the bodies of `POST /register` and `/unregister`, their
rules, and their records on the registrations topic.

Two request forms, one registration:

- JSON (Mooncake RFC #1403's body, the bridge's first form): `endpoint`,
  `replay_endpoint` ("" or null: none), `type` (`vLLM`, `SGLang`, `TRTLLM`
  or `TensorRT-LLM`: an engine; `Mooncake`: a pool backend; any case),
  `modelname`, `lora_name`, `tenant_id` (default "default"), `instance_id`,
  `block_size`, `dp_rank` (default 0), `additionalsalt`, and optionally
  `hash_profile` and `cache_group` as below; kvconductor's extensions
  `kv_offload` (`local` or `pool`, engines only) and `kv_report_mode`
  (`incremental` or `full`, vLLM's `kv_cache_report_mode`, engines only;
  null or absent: not said). Unknown fields are ignored.
- msgpack (Mooncake Conductor's, `indexer-api-design.md`): `endpoint`,
  `type`, `modelname`, `instance_id`, `block_size`, `dp_rank` and
  `hash_profile` required, `replay_endpoint`, `lora_name`, `tenant_id`,
  `cache_group` (0 or null), `kv_offload` and `kv_report_mode` optional,
  nothing else.

`hash_profile` is `{strategy: "vllm_v1", algorithm: "sha256_cbor" | "sha256",
python_hash_seed: "random" or decimal text in 0..4294967295, index_projection:
"low64_be"}`: how the engine names its blocks (vLLM's `NONE_HASH` root is
the hash of the seed text, `root_digest`). kvconductor also takes the seed
`"vllm-none-hash"`, vLLM's own for these algorithms when `PYTHONHASHSEED` is
unset (Conductor has no way to say it). kvconductor matches blocks on their
content and answers without the profile; with it, a query also finds the
blocks an engine stored without token ids (`registered_profiles`,
`tokenless`).

A registration is one socket of one rank. Its service key is Conductor's
`instance|tenant|rank`; on the topic it is keyed by `["<instance_id>",
<dp_rank>]` (one stream per instance and rank), so a second tenant for the
same instance and rank is a conflict. Two registrations of one stream (an
engine's own and a router's, in either order) merge (`merge_registrations`):
the fields that name the stream and its namespace must agree, and each
other field is taken from whichever registration sets it, so a repeat, or
a registration that says less, changes nothing. A registration that
contradicts the registered one in a field, or whose endpoint another key
has, is refused (`invalid_registration`, naming the field): unregister
first to replace it.

Nothing here touches Kafka or HTTP: `registration_log` keeps the topic,
`registration_http` serves the routes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated

import msgspec

from kvconductor.config import ConfigError
from kvconductor.registry.publishers import PublisherConfig, StreamKey, publisher_from_mapping
from kvconductor.wire.engine_hashes import DEFAULT_NONE_HASH_SEED, VllmProfile, none_hash
from kvconductor.wire.records import REPORT_MODES

VERSION = 1

TYPES: dict[str, tuple[str, str]] = {
    "vllm": ("engine", "vllm"),
    "sglang": ("engine", "sglang"),
    "trtllm": ("engine", "trtllm"),
    "trt-llm": ("engine", "trtllm"),
    "tensorrt-llm": ("engine", "trtllm"),
    "tensorrt_llm": ("engine", "trtllm"),
    "mooncake": ("pool", "mooncake"),
}
# Conductor's names for the publisher kinds, in `/services`.
_TYPE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "trtllm": "TRTLLM", "mooncake": "Mooncake"}

NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
Rank = Annotated[int, msgspec.Meta(ge=0, le=2**31 - 1)]
_MAX_SEED = 2**32 - 1


class HashProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    strategy: NonEmpty
    algorithm: NonEmpty
    python_hash_seed: NonEmpty
    index_projection: NonEmpty


class RegisterBody(msgspec.Struct, kw_only=True):
    endpoint: str
    type: str
    instance_id: str
    replay_endpoint: str | None = None
    modelname: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    block_size: int | None = None
    dp_rank: int = 0
    additionalsalt: str | None = None
    kv_offload: str | None = None
    hash_profile: HashProfile | None = None
    cache_group: int | None = None
    kv_report_mode: str | None = None


class ConductorRegister(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    endpoint: NonEmpty
    type: NonEmpty
    modelname: NonEmpty
    instance_id: NonEmpty
    block_size: Annotated[int, msgspec.Meta(ge=1)]
    dp_rank: Rank
    hash_profile: HashProfile
    replay_endpoint: str = ""
    lora_name: str | None = None
    tenant_id: str | None = None
    cache_group: int | None = None
    kv_offload: str | None = None
    kv_report_mode: str | None = None

    def body(self) -> RegisterBody:
        # Every field here is one of RegisterBody's, under the same name.
        return RegisterBody(**msgspec.structs.asdict(self))


class UnregisterBody(msgspec.Struct, kw_only=True):
    """The JSON form: RFC #1403's other fields are accepted and ignored."""

    instance_id: str
    dp_rank: int = 0
    type: str | None = None
    modelname: str | None = None
    lora_name: str | None = None
    tenant_id: str | None = None
    block_size: int | None = None


class ConductorUnregister(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    instance_id: NonEmpty
    dp_rank: Rank
    tenant_id: str | None = None


class Stored(msgspec.Struct):
    """A registration's record value on the topic."""

    version: int
    registration: RegisterBody


class RegistrationConflict(ValueError):
    """A registration for a publisher rank a bridge's config file defines (409)."""


class ReadOnlyRegistrations(RuntimeError):
    """A registration that would have to be written where nothing writes to
    Kafka (a query replica): 403."""


class InvalidRegistration(ValueError):
    """A registration that cannot be taken (400). `reason` and `field` are
    what Conductor's msgpack errors carry."""

    def __init__(
        self, message: str, reason: str = "invalid_registration", field: str | None = None
    ) -> None:
        super().__init__(message)
        self.reason = reason
        self.field = field


def service_key(instance_id: str, tenant_id: str | None, dp_rank: int) -> str:
    """Conductor's key of a registration: `instance|tenant|rank`."""
    return f"{instance_id}|{tenant_id or 'default'}|{dp_rank}"


def body_key(body: RegisterBody) -> str:
    return service_key(body.instance_id, body.tenant_id, body.dp_rank)


# ------------------------------------------------------------ hash profile


def check_hash_profile(p: HashProfile) -> None:
    """Conductor's rules for a profile, its field named when one is wrong."""
    if p.strategy != "vllm_v1":
        raise _bad_profile("strategy", f"unsupported hash strategy: {p.strategy}")
    if p.algorithm not in ("sha256_cbor", "sha256"):
        raise _bad_profile("algorithm", f"unsupported hash algorithm: {p.algorithm}")
    if p.index_projection != "low64_be":
        raise _bad_profile(
            "index_projection", f"unsupported index projection: {p.index_projection}"
        )
    seed = p.python_hash_seed
    if seed in ("random", DEFAULT_NONE_HASH_SEED):
        return
    if not (seed.isascii() and seed.isdigit()):
        raise _bad_profile(
            "python_hash_seed",
            'python_hash_seed must be "random" or ASCII decimal text in 0..4294967295',
        )
    if int(seed) > _MAX_SEED:
        raise _bad_profile("python_hash_seed", "python_hash_seed must be in range 0..4294967295")


def _bad_profile(field: str, message: str) -> InvalidRegistration:
    return InvalidRegistration(message, "invalid_value", field)


def vllm_profile(p: HashProfile) -> VllmProfile:
    return VllmProfile(p.algorithm, p.python_hash_seed)


def root_digest(p: HashProfile) -> str:
    """vLLM's root (`NONE_HASH`) for the seed text: the SHA-256 of its
    encoding by the profile's algorithm, as lowercase hex."""
    return none_hash(vllm_profile(p)).hex()


def profile_view(p: HashProfile | None) -> dict[str, str] | None:
    """A profile as `/services` and `/global_view` report it, with its root."""
    if p is None:
        return None
    return {
        "strategy": p.strategy,
        "algorithm": p.algorithm,
        "python_hash_seed": p.python_hash_seed,
        "root_digest": root_digest(p),
        "index_projection": p.index_projection,
    }


# ------------------------------------------------------------- validation


def to_publisher(body: RegisterBody) -> PublisherConfig:
    """The publisher a registration describes; InvalidRegistration if it
    cannot be relayed."""
    kind_source = TYPES.get(body.type.strip().lower())
    if kind_source is None:
        raise InvalidRegistration(
            f"type: expected vLLM, SGLang, TRTLLM or Mooncake, got {body.type!r}",
            "invalid_value",
            "type",
        )
    if body.hash_profile is not None:
        check_hash_profile(body.hash_profile)
    if body.cache_group not in (None, 0):
        raise InvalidRegistration(
            "only cache group zero is supported", "unsupported", "cache_group"
        )
    if body.kv_report_mode is not None and body.kv_report_mode not in REPORT_MODES:
        raise InvalidRegistration(
            f"kv_report_mode: expected incremental or full, got {body.kv_report_mode!r}",
            "invalid_value",
            "kv_report_mode",
        )
    raw: dict[str, object] = {
        "id": body.instance_id,
        "endpoint": body.endpoint,
        "kind": kind_source[0],
        "source": kind_source[1],
        "replay_endpoint": body.replay_endpoint or None,
        "dp_rank": body.dp_rank,
        "tenant": body.tenant_id or "default",
        "salt": body.additionalsalt or "",
    }
    if body.modelname:
        raw["model"] = body.modelname
    if body.block_size is not None:
        raw["block_size"] = body.block_size
    if body.lora_name:
        raw["lora_name"] = body.lora_name
    if body.kv_offload:
        raw["offload"] = body.kv_offload
    if body.kv_report_mode is not None:
        raw["report_mode"] = body.kv_report_mode
    raw = {k: v for k, v in raw.items() if v is not None}
    names = {
        "id": "instance_id",
        "model": "modelname",
        "tenant": "tenant_id",
        "salt": "additionalsalt",
        "offload": "kv_offload",
        "report_mode": "kv_report_mode",
    }
    try:
        return publisher_from_mapping(raw, "registration")
    except ConfigError as exc:
        text = str(exc).removeprefix("config error: registration ")
        key, _, why = text.partition(":")
        field = names.get(key, key)
        raise InvalidRegistration(f"{field}:{why}", field=field) from None


def read_as(body: RegisterBody) -> tuple[PublisherConfig, HashProfile | None, int | None]:
    """What a valid body registers, however its defaults and names are
    spelt: its publisher, profile and cache group (every field of the body
    is read into one of them)."""
    return to_publisher(body), body.hash_profile, body.cache_group


def same_registration(a: RegisterBody, b: RegisterBody) -> bool:
    """Whether two valid bodies register the same thing (a repeat)."""
    return read_as(a) == read_as(b)


# The fields that name a stream (instance, rank, socket, kind) and its
# namespace (tenant, model, block size, LoRA), each with the publisher field
# it is read as. Their absence means a default (tenant `default`, the base
# model), never "not said", so two registrations of one stream must agree
# on them, compared as read (`vLLM` is `vllm`, a null tenant is `default`).
# Every other field is optional: absent (null, or "" for text) says
# nothing, so the other registration's value stands.
STREAM_FIELDS = {
    "endpoint": "endpoint",
    "type": "source",
    "instance_id": "id",
    "dp_rank": "dp_rank",
    "tenant_id": "tenant",
    "modelname": "model",
    "block_size": "block_size",
    "lora_name": "lora_name",
}


def _said(value: object) -> bool:
    return value is not None and value != ""


def merge_registrations(old: RegisterBody, new: RegisterBody) -> RegisterBody:
    """The registration two valid bodies of one stream make together: `old`
    where it says a field, else `new`'s. A body that says less than `old`,
    or the same, gives `old` back unchanged (a repeat). InvalidRegistration
    (naming the field) where they contradict each other: a stream field
    that differs as read, or an optional field both set differently."""
    pub_old, pub_new = to_publisher(old), to_publisher(new)
    registered = read_as(old)
    merged: dict[str, object] = {}
    for f in msgspec.structs.fields(RegisterBody):
        mine, theirs = getattr(old, f.name), getattr(new, f.name)
        attr = STREAM_FIELDS.get(f.name)
        if attr is not None:
            differs = getattr(pub_old, attr) != getattr(pub_new, attr)
        else:
            # Set in both: a contradiction unless the two read alike
            # (`Pool` is `pool`).
            differs = (
                _said(mine)
                and _said(theirs)
                and mine != theirs
                and read_as(msgspec.structs.replace(old, **{f.name: theirs})) != registered
            )
        if differs:
            raise InvalidRegistration(
                f"conflicting registration for service key {body_key(old)}: {f.name} is "
                f"{_shown(theirs)} here, {_shown(mine)} registered"
                " (unregister it first to replace it)",
                field=f.name,
            )
        merged[f.name] = mine if attr is not None or _said(mine) else theirs
    return RegisterBody(**merged)  # type: ignore[arg-type]


def _shown(value: object) -> str:
    if isinstance(value, msgspec.Struct):
        return msgspec.json.encode(value).decode()
    return repr(value)


# A context as Conductor names it: (tenant, model, LoRA or "", block size).
Context = tuple[str, str, str, int]


def context_of(pub: PublisherConfig) -> Context | None:
    """The context of an engine registration that names its model and block
    size (None for a pool backend, or an engine whose events name them)."""
    if pub.kind != "engine" or pub.model is None or pub.block_size is None:
        return None
    return (pub.tenant, pub.model, pub.lora_name or "", pub.block_size)


def registered_profiles(bodies: Iterable[RegisterBody]) -> dict[Context, tuple[VllmProfile, ...]]:
    """Per context, the distinct hash profiles of its engine registrations."""
    out: dict[Context, set[VllmProfile]] = {}
    for body in bodies:
        ctx = context_of(to_publisher(body))
        if ctx is not None and body.hash_profile is not None:
            out.setdefault(ctx, set()).add(vllm_profile(body.hash_profile))
    return {ctx: tuple(sorted(profiles)) for ctx, profiles in out.items()}


def registered_ranks(pubs: Iterable[PublisherConfig]) -> dict[Context, dict[str, set[int]]]:
    """Per context, each registered engine instance's ranks."""
    out: dict[Context, dict[str, set[int]]] = {}
    for pub in pubs:
        ctx = context_of(pub)
        if ctx is not None:
            out.setdefault(ctx, {}).setdefault(pub.id, set()).add(pub.dp_rank)
    return out


# ------------------------------------------------------------ the topic


def record_key(key: StreamKey) -> bytes:
    return msgspec.json.encode([key.id, key.rank])


def decode_record_key(raw: bytes | None) -> StreamKey | None:
    try:
        instance, rank = msgspec.json.decode(raw or b"", type=tuple[str, int])
    except (msgspec.DecodeError, ValueError):
        return None
    return StreamKey(instance, rank)


def record_value(body: RegisterBody) -> bytes:
    return msgspec.json.encode(Stored(VERSION, body))


def decode_record_value(raw: bytes) -> RegisterBody:
    """A record's registration; InvalidRegistration (or msgspec's errors)
    for one this version cannot read."""
    stored = msgspec.json.decode(raw, type=Stored)
    if stored.version != VERSION:
        raise InvalidRegistration(f"unknown version {stored.version}")
    return stored.registration


# ------------------------------------------------------------------ views


def service_view(body: RegisterBody) -> dict[str, object]:
    """One registration as Conductor's `/services` lists it."""
    pub = to_publisher(body)
    return {
        "Endpoint": pub.endpoint,
        "ReplayEndpoint": pub.replay_endpoint or "",
        "Type": _TYPE_NAMES[pub.source],
        "ModelName": pub.model or "",
        "LoraName": pub.lora_name or "",
        "TenantID": pub.tenant,
        "InstanceID": pub.id,
        "BlockSize": pub.block_size,
        "DPRank": pub.dp_rank,
        "CacheGroup": body.cache_group,
        "HashProfile": profile_view(body.hash_profile),
    }


def global_view(bodies: list[RegisterBody], prefix_count: dict[Context, int]) -> dict[str, object]:
    """Conductor's `/global_view`: one context per (tenant, model, LoRA,
    block size) of the engine registrations, with its instances' ranks.
    `prefix_count`: the blocks the index holds per context (0 if absent)."""
    profiles: dict[Context, HashProfile | None] = {}
    pubs = []
    for body in bodies:
        pub = to_publisher(body)
        pubs.append(pub)
        ctx = context_of(pub)
        if ctx is not None:
            profiles.setdefault(ctx, body.hash_profile)
    contexts = [
        {
            "model_name": ctx[1],
            "lora_name": ctx[2],
            "block_size": ctx[3],
            "tenant_id": ctx[0],
            "prefix_count": prefix_count.get(ctx, 0),
            "hash_profile": profile_view(profiles[ctx]),
            "instances": {name: sorted(ranks[name]) for name in sorted(ranks)},
        }
        for ctx, ranks in sorted(registered_ranks(pubs).items())
    ]
    return {"context_count": len(contexts), "contexts": contexts}
