"""The compiled kernel (`kernel/`, Rust), when it is built and allowed.

`KVCONDUCTOR_KERNEL=off` forces the pure-Python path (the tests compare the
two); any other value, or none, uses the kernel when the install built it.
`STATUS` says which path runs, for the daemon's start-up log.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Protocol, cast

# (blocks walked, GPU bits, CPU bits, DISK bits, [(tier, at, lost bits)])
Walked = tuple[int, int, int, int, list[tuple[int, int, int]]]


# A namespace's (dev, host, disk, pool_host, pool_disk) tier dicts; a lower
# tier that holds nothing is passed as None.
Tiers = tuple[
    dict[int, int],
    dict[int, int] | None,
    dict[int, int] | None,
    dict[int, int] | None,
    dict[int, int] | None,
]


class Kernel(Protocol):
    """kernel/src/lib.rs: `kvconductor.query.match`'s walk, and
    `kvconductor.hashing`'s `pack_tokens` and `chain_identities` without
    extra keys."""

    def walk_tokens(
        self, data: bytes, block_size: int, seed: int, slots: int, tiers: Tiers, listed: int
    ) -> Walked: ...

    def walk_identities(
        self, idents: list[int], slots: int, tiers: Tiers, listed: int
    ) -> Walked: ...

    def pack_tokens(self, tokens: Sequence[int]) -> bytes: ...

    def chain_identities(
        self, data: bytes, n_blocks: int, block_size: int, parent: int
    ) -> list[int]: ...


def _load() -> tuple[Kernel | None, str]:
    if os.environ.get("KVCONDUCTOR_KERNEL", "").lower() in ("off", "0", "false", "no"):
        return None, "pure-python (KVCONDUCTOR_KERNEL=off)"
    try:
        module = importlib.import_module("kvconductor._kernel")
    except ImportError:
        return None, "pure-python (the compiled kernel is not built: no Rust toolchain at install)"
    return cast(Kernel, module), "compiled"


KERNEL, STATUS = _load()
