"""Cache-hit queries (contract section 4).

For every listed (instance, dp rank) of a namespace, in one pass over the
prompt's block identities:

- `GPU`: the longest prefix in the rank's device tier;
- `CPU`: from there, extended while each next block is in the rank's own
  host tier or in any pool store of the host class;
- `DISK`: the same extension when disk-class tiers (own or pool) serve too.

Each of the three is a set of still-matching owners kept as a bitmask over
owner slots, so one block costs a few map lookups however many owners there
are; the pass stops at the first block that no owner can serve, and prompt
hashing is lazy, so a short hit never hashes the rest of a long prompt. The
walk itself is the namespace store's (`BlockStore.match_*`) and the
answer's shape the namespace's (`AnswerShape`); here are the request's
checks and the salted namespace's merge.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from kvconductor.index.block_store import Matched
from kvconductor.index.cache_groups import Prefix, hybrid_hit
from kvconductor.index.namespace import NamespaceIndex, NamespaceKey, namespace_key
from kvconductor.index.tokenless import EngineProfiles, Owners, PromptNames, extend
from kvconductor.wire.hashing import MASK64, chain_identities, extra_keys_fingerprint, pack_tokens
from kvconductor.wire.media import DEVICE
from kvconductor.wire.query import HashQuery, InvalidQuery, QueryResponse, TokenQuery

_encoder = msgspec.json.Encoder()


def namespace_of(req: TokenQuery | HashQuery) -> NamespaceKey:
    if req.block_size <= 0:
        raise InvalidQuery("block_size must be a positive integer")
    return namespace_key(req.tenant_id, req.model, req.block_size, req.lora_name, req.cache_salt)


def packed_prompt(req: TokenQuery) -> bytes:
    """The prompt's full blocks as little-endian u32 tokens."""
    tokens = req.token_ids
    full = len(tokens) - len(tokens) % req.block_size
    try:
        # A trailing partial block is not a block: left out, unchecked.
        return pack_tokens(tokens if full == len(tokens) else tokens[:full])
    except (OverflowError, TypeError, ValueError) as exc:
        raise InvalidQuery("token_ids must be integers in [0, 2**32)") from exc


def normalise_query_hash(value: int | str) -> int:
    if isinstance(value, int):
        if not -(1 << 63) <= value <= MASK64:
            raise InvalidQuery("seq_hashes must fit in 64 bits")
        return value & MASK64
    try:
        return int.from_bytes(bytes.fromhex(value), "big") & MASK64
    except ValueError as exc:
        raise InvalidQuery("a string seq_hash must be the hex of a digest") from exc


def match(ns: NamespaceIndex, prompt: bytes | list[int], listed: int, salt: int = 0) -> Matched:
    """Per listed owner slot: (slot, GPU, CPU, DISK) matched lengths in blocks.

    `prompt`: packed tokens of whole blocks, hashed lazily from the
    namespace seed xor-ed with `salt` (a per-request salt's fingerprint:
    only block 0 is hashed from the seed, so that is where an engine mixes
    it); or engine block hashes."""
    if not isinstance(prompt, bytes):
        return match_identities(ns, ns.identities_of(prompt), listed)
    found = ns.store.match_tokens(prompt, ns.block_size, ns.seed ^ salt, listed)
    if ns.hybrid and any(m[0] in ns.hybrid for m in found):
        return _hybrid(ns, prompt, found, salt)
    return found


def match_identities(ns: NamespaceIndex, idents: list[int], listed: int) -> Matched:
    """`match` for a prompt given by its block identities from the first."""
    found = ns.store.match_identities(idents, listed)
    if ns.hybrid and any(m[0] in ns.hybrid for m in found):
        return _hybrid(ns, idents, found, 0)
    return found


def _hybrid(ns: NamespaceIndex, prompt: bytes | list[int], found: Matched, salt: int) -> Matched:
    """The device hit of owners with several KV-cache groups: vLLM's hybrid
    rule over their groups, capped by the primary group's prefix the walk
    found. Lower tiers hold the primary group only, so they continue the
    prefix only where the groups do not cut it.

    `prompt`: packed tokens, or the prompt's identities."""
    bs = ns.block_size
    total = len(prompt) // (4 * bs) if isinstance(prompt, bytes) else len(prompt)
    # An owner whose primary group holds or held blocks is capped by its
    # prefix; one without (its attention group is not group 0) is not.
    limits = {
        slot: gpu if _has_primary(ns, slot) else total
        for slot, gpu, _, _ in found
        if slot in ns.hybrid
    }
    reach = max(limits.values())
    base = ns.seed ^ salt
    if isinstance(prompt, bytes):
        data = prompt[: reach * bs * 4]
        prefix = Prefix(data, base, bs, chain_identities(data, reach, bs, base, None))
    else:
        prefix = Prefix(None, base, bs, prompt[:reach])
    out: Matched = []
    for slot, gpu, cpu, disk in found:
        limit = limits.get(slot)
        owner = ns.slots[slot]
        if limit is None or owner is None:
            out.append((slot, gpu, cpu, disk))
            continue
        hit = hybrid_hit(list(owner.groups.values()), prefix, min(limit, len(prefix.idents)))
        if hit < gpu:
            out.append((slot, hit, hit, hit))
        else:
            out.append((slot, hit, max(hit, cpu), max(hit, disk)))
    return out


def _has_primary(ns: NamespaceIndex, slot: int) -> bool:
    owner = ns.slots[slot]
    return owner is not None and bool(owner.primary_block or ns.store.tier_len(slot, DEVICE))


def listed_bits(ns: NamespaceIndex, instance_id: str | None) -> int:
    if instance_id is None:
        return ns.all_bits
    bits = 0
    for owner in ns.owners.get(instance_id, {}).values():
        bits |= owner.bit
    return bits


def run_query(
    ns: NamespaceIndex | None,
    req: TokenQuery | HashQuery,
    salted: NamespaceIndex | None = None,
    packed: bytes | None = None,
    profiles: EngineProfiles | None = None,
) -> QueryResponse:
    """Answer one query against its namespace (None: unknown namespace).

    `salted`: for a token query with a `cache_salt`, the same namespace
    without salt, where an engine that salts per request (vLLM's
    `cache_salt` in the first block's extra keys) keeps its blocks;
    instances that match there are answered too. Inputs are validated
    before any namespace is consulted, so a bad request is a 400 whether or
    not its namespace exists.

    `packed`: a token query's prompt already packed (`pack_tokens`), in
    place of its `token_ids`: the HTTP server packs it straight from the
    request's JSON.

    `profiles`: the hash profiles bound to the query's context, with which
    token-less holdings are found by the engines' names (`tokenless`)."""
    prompt = _prompt(req, packed)
    names = _names(req, prompt, profiles)
    found = _matched(ns, req, prompt, names=names)
    answer = {} if found is None else found[0].answer_shape().shape(found[1], False)
    if _salted_too(req, salted):
        fp = extra_keys_fingerprint([req.cache_salt])
        extra = _matched(salted, req, prompt, fp, names)
        if extra is not None:
            answer = _merge(answer, extra[0].answer_shape().shape(extra[1], True))
    return answer


def run_query_json(
    ns: NamespaceIndex | None,
    req: TokenQuery | HashQuery,
    salted: NamespaceIndex | None = None,
    packed: bytes | None = None,
    profiles: EngineProfiles | None = None,
) -> bytes:
    """`run_query`'s answer as the JSON body the HTTP API sends, written
    straight from the matched lengths (an answer's dicts cost more than the
    walk at a hundred instances), unless two namespaces' answers merge."""
    if _salted_too(req, salted):
        return _encoder.encode(run_query(ns, req, salted, packed, profiles))
    prompt = _prompt(req, packed)
    names = _names(req, prompt, profiles)
    if names is not None:
        # Token-less holdings extend the walk's lengths (`tokenless`).
        found = _matched(ns, req, prompt, names=names)
        return b"{}" if found is None else found[0].answer_shape().shape_json(found[1])
    listed = 0 if ns is None else listed_bits(ns, req.instance_id)
    if ns is None or not listed:
        return b"{}"
    shape = ns.answer_shape()
    if ns.hybrid:
        return shape.shape_json(match(ns, prompt, listed))
    # The store writes the answer: no Python object an owner.
    if isinstance(prompt, bytes):
        return ns.store.match_tokens_json(prompt, ns.block_size, ns.seed, listed, shape)
    return ns.store.match_identities_json(ns.identities_of(prompt), listed, shape)


def run_query_ranks(
    ns: NamespaceIndex | None,
    req: TokenQuery | HashQuery,
    salted: NamespaceIndex | None = None,
    packed: bytes | None = None,
    profiles: EngineProfiles | None = None,
) -> dict[str, dict[int, tuple[int, int, int]]]:
    """`run_query`'s match per listed (instance, rank), not only each
    instance's best rank: `{instance: {rank: (GPU, CPU, DISK)}}` in tokens
    (Conductor's answer lists every rank, `conductor_wire`)."""
    prompt = _prompt(req, packed)
    names = _names(req, prompt, profiles)
    out: dict[str, dict[int, tuple[int, int, int]]] = {}
    found = _matched(ns, req, prompt, names=names)
    if found is not None:
        _ranks_into(out, *found, hits_only=False)
    if _salted_too(req, salted):
        fp = extra_keys_fingerprint([req.cache_salt])
        extra = _matched(salted, req, prompt, fp, names)
        if extra is not None:
            _ranks_into(out, *extra, hits_only=True)
    return out


def run_local_hash_query(
    candidates: Sequence[NamespaceIndex], local: list[int]
) -> tuple[int, dict[str, dict[int, tuple[int, int, int]]]]:
    """A prompt named by Dynamo's local block hashes (u64, from its first
    block), against the namespaces it may be in (`candidates`: one model
    and tenant, any salt, block size and LoRA, in a stable order): the
    block size and `run_query_ranks`' match of the namespace where it
    matches longest (the first such), or of the first candidate when none
    matches; (0, {}) without candidates.

    Local hashes carry the block size and the seed of the LoRA and salt
    (`hashing.dynamo_seed`), so in practice only one namespace knows a
    prompt's first block."""
    best: tuple[int, NamespaceIndex, Matched] | None = None
    for ns in candidates:
        if ns.local_map is None or not ns.all_bits:
            continue
        found = match_identities(ns, ns.local_map.identities(local), ns.all_bits)
        longest = max((disk for _, _, _, disk in found), default=0)
        if best is None or longest > best[0]:
            best = (longest, ns, found)
    out: dict[str, dict[int, tuple[int, int, int]]] = {}
    if best is None:
        return (candidates[0].block_size if candidates else 0), out
    _ranks_into(out, best[1], best[2], hits_only=False)
    return best[1].block_size, out


def _ranks_into(
    out: dict[str, dict[int, tuple[int, int, int]]],
    ns: Owners,
    lengths: Matched,
    hits_only: bool,
) -> None:
    """Each owner's lengths into `out`, the better one (`_rank`'s order)
    where two namespaces list the same rank."""
    bs = ns.block_size
    for slot, gpu, cpu, disk in lengths:
        if hits_only and not disk:
            continue
        owner = ns.slots[slot]
        if owner is None:
            continue
        ranks = out.setdefault(owner.instance, {})
        mine = ranks.get(owner.rank)
        row = (gpu * bs, cpu * bs, disk * bs)
        if mine is None or (row[2], row[0], row[1]) > (mine[2], mine[0], mine[1]):
            ranks[owner.rank] = row


def _salted_too(req: TokenQuery | HashQuery, salted: NamespaceIndex | None) -> bool:
    """Whether the salted namespace's unsalted twin answers too: for a token
    query with a per-request salt (engine hashes already cover one)."""
    return salted is not None and isinstance(req, TokenQuery) and bool(req.cache_salt)


def _prompt(req: TokenQuery | HashQuery, packed: bytes | None) -> bytes | list[int]:
    """The prompt `match` takes, validated."""
    if isinstance(req, TokenQuery):
        return packed_prompt(req) if packed is None else packed
    # Engine hashes already cover a per-request salt: no second namespace.
    return [normalise_query_hash(h) for h in req.seq_hashes]


def _names(
    req: TokenQuery | HashQuery, prompt: bytes | list[int], profiles: EngineProfiles | None
) -> PromptNames | None:
    """A token query's blocks by the engines' names, when profiles are bound."""
    if profiles is None or not profiles.profiles or not isinstance(prompt, bytes):
        return None
    return profiles.names(prompt, req.block_size, req.lora_name, req.cache_salt)


def _matched(
    ns: NamespaceIndex | None,
    req: TokenQuery | HashQuery,
    prompt: bytes | list[int],
    salt: int = 0,
    names: PromptNames | None = None,
) -> tuple[Owners, Matched] | None:
    """The namespace's owners and the listed ones' lengths; None if none is
    listed. `names`: see `tokenless.extend`."""
    if ns is None:
        return None
    listed = listed_bits(ns, req.instance_id)
    found = match(ns, prompt, listed, salt) if listed else []
    if names is not None:
        return extend(ns, found, req.instance_id, names)
    return (ns, found) if listed else None


def _merge(a: QueryResponse, b: QueryResponse) -> QueryResponse:
    """Per instance, the better of two answers (by DISK, then GPU, then CPU)."""
    if not b:
        return a
    if not a:
        return b
    tenant = next(iter(a))
    rows = dict(a[tenant])
    for instance, row in b[tenant].items():
        mine = rows.get(instance)
        if mine is None or _rank(row) > _rank(mine):
            rows[instance] = row
    return {tenant: {k: rows[k] for k in sorted(rows)}}


def _rank(row: dict[str, object]) -> tuple[int, int, int]:
    return (int(row["DISK"]), int(row["GPU"]), int(row["CPU"]))  # type: ignore[call-overload]
