"""Wire shapes of the query API (contract section 4, Mooncake RFC #1403)."""

from __future__ import annotations

import msgspec


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


class InvalidQuery(ValueError):
    """A well-formed request with values the index cannot take (400)."""


# {tenant: {instance: {"longest_matched", "GPU", "CPU", "DISK", "DP": {rank: n}}}}
QueryResponse = dict[str, dict[str, dict[str, object]]]
