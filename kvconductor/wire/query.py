"""Wire shapes of the query API (contract section 4, Mooncake RFC #1403)."""

from __future__ import annotations

import msgspec

from kvconductor.kernel import KERNEL
from kvconductor.wire.hashing import tokens_from_json

if KERNEL is not None:
    from kvconductor import _kernel


class TokenQuery(msgspec.Struct, frozen=True):
    model: str
    block_size: int
    token_ids: list[int]
    lora_name: str | None = None
    tenant_id: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None


class RawTokenQuery(msgspec.Struct, frozen=True):
    """`TokenQuery` as the HTTP server first decodes it: `token_ids` left raw
    and packed by `hashing.tokens_from_json`, without a Python int per token
    (that decoding was two thirds of a query's cost)."""

    model: str
    block_size: int
    token_ids: msgspec.Raw
    lora_name: str | None = None
    tenant_id: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None


class HashQuery(msgspec.Struct, frozen=True):
    model: str
    block_size: int
    # Engine sequence hashes from the prompt's first block: ints of any sign
    # (normalised like event hashes) or hex strings of a bytes digest.
    seq_hashes: list[int | str]
    lora_name: str | None = None
    tenant_id: str | None = None
    instance_id: str | None = None
    cache_salt: str | None = None


_raw_token_decoder = msgspec.json.Decoder(RawTokenQuery)


def read_token_query(body: bytes) -> tuple[TokenQuery, bytes] | None:
    """A `POST /query` body as its query (without `token_ids`) and its
    prompt packed (`hashing.pack_tokens`), without a Python int per token;
    None when it is not plainly valid: the `TokenQuery` decoder then says
    why, or takes it (a token id outside u32 is the index's 400).

    With the kernel the body is read in one pass (`kernel/core/src/query/token_query.rs`):
    msgspec's `Raw` cost a scan of the whole prompt before the tokens were
    parsed in a second."""
    if KERNEL is not None:
        read = _kernel.read_token_query(body)
        if read is None:
            return None
        model, block_size, packed, lora, tenant, instance, salt = read
        return TokenQuery(model, block_size, [], lora, tenant, instance, salt), packed
    try:
        raw = _raw_token_decoder.decode(body)
    except msgspec.DecodeError:
        return None
    tokens = tokens_from_json(raw.token_ids)
    if tokens is None:
        return None
    req = TokenQuery(
        raw.model,
        raw.block_size,
        [],
        raw.lora_name,
        raw.tenant_id,
        raw.instance_id,
        raw.cache_salt,
    )
    return req, tokens


class InvalidQuery(ValueError):
    """A well-formed request with values the index cannot take (400)."""


# {tenant: {instance: {"longest_matched", "GPU", "CPU", "DISK", "DP": {rank: n}}}}
QueryResponse = dict[str, dict[str, dict[str, object]]]
