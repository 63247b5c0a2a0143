"""The index's bounds, apart from the index: the configuration reads them
without loading the index (or the compiled kernel behind it).

Pure; imports nothing of kvconductor. `kvconductor.index.fleet` re-exports them.
"""

from __future__ import annotations

import msgspec


class IndexLimits(msgspec.Struct, frozen=True):
    """Bounds that hold whatever the input (per namespace where noted)."""

    max_pending: int = 200_000  # pending halves per namespace
    max_pending_age_s: float = 300.0
    max_namespaces: int = 4096
    max_instances: int = 100_000
    max_blocks_per_owner: int = 4_000_000  # per (instance, dp rank, namespace)
    # (instance, dp rank) pairs per namespace: each is a bit of every mask and
    # a row of every answer.
    max_owners_per_namespace: int = 16_384
    # Content no tier holds any more, kept (per namespace, for the pending age)
    # so that a late confirmation or token-less store still finds it.
    max_retired_content: int = 200_000
    # (parent identity, local block hash) -> identity entries kept per
    # namespace for Dynamo's `/query_tiered_by_hash`, oldest first out; 0 is
    # off (the route answers 501), so the default apply path hashes nothing more.
    local_hash_map: int = 0

    def __post_init__(self) -> None:
        for name in self.__struct_fields__:
            value = getattr(self, name)
            wrong = limit_error(name, value)
            if wrong is not None:
                raise ValueError(f"index limit {name} {wrong}, got {value}")


# Limits whose 0 turns their feature off rather than bounding it to nothing.
_ZERO_IS_OFF = frozenset({"local_hash_map"})


def limit_error(name: str, value: float) -> str | None:
    """What is wrong with an index limit's value ("must be ..."), or None."""
    if name in _ZERO_IS_OFF:
        return "must be zero or positive" if value < 0 else None
    return "must be positive" if value <= 0 else None
