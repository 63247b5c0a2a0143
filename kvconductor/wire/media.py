"""Media names to tiers (contract section 2).

Engine media: GPU is the device tier, CPU-like names the host tier,
storage-like names the disk tier, a missing medium means GPU, and anything
else is unknown (counted and skipped by the caller, never guessed).

Pool media follow the same table; a pool has no device tier of its own, so a
pool `gpu` medium (GPU-direct stores) serves like host memory, and a pool
event that names no medium is taken as `cpu`, the Mooncake store's default.
"""

from __future__ import annotations

DEVICE = 0
HOST = 1
DISK = 2
TIER_NAMES = ("GPU", "CPU", "DISK")

_ENGINE_TIERS: dict[str, int] = {
    "gpu": DEVICE,
    "cpu": HOST,
    "cpu_pinned": HOST,
    "cpu_tier1": HOST,
    "storage": DISK,
    "disk": DISK,
    "cpu_tier2": DISK,
    "nvme": DISK,
    "fs": DISK,
    "obj": DISK,
}

# Exact-case lookups first: media arrive as a handful of fixed strings.
_ENGINE_CACHE: dict[str | None, int | None] = {None: DEVICE}
_POOL_CACHE: dict[str | None, int | None] = {None: HOST}


def engine_tier(medium: str | None) -> int | None:
    """Tier of an engine medium, or None when the medium is unknown."""
    try:
        return _ENGINE_CACHE[medium]
    except KeyError:
        pass
    assert medium is not None
    tier = _ENGINE_TIERS.get(medium.lower())
    if len(_ENGINE_CACHE) < 256:
        _ENGINE_CACHE[medium] = tier
    return tier


def pool_tier(medium: str | None) -> int | None:
    """HOST or DISK for a pool medium, or None when it is unknown."""
    try:
        return _POOL_CACHE[medium]
    except KeyError:
        pass
    assert medium is not None
    tier = _ENGINE_TIERS.get(medium.lower())
    if tier == DEVICE:
        tier = HOST
    if len(_POOL_CACHE) < 256:
        _POOL_CACHE[medium] = tier
    return tier


def pool_medium_name(medium: str | None) -> str:
    """The name a pool store is kept under: case-folded, `cpu` when absent."""
    return "cpu" if medium is None else medium.lower()
