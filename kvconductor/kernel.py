"""The compiled kernel (`kernel/`, Rust), when it is built and allowed.

`KVCONDUCTOR_KERNEL=off` forces the pure-Python path (the tests compare the
two); any other value, or none, uses the kernel when the install built it.
`STATUS` says which path runs, for the daemon's start-up log.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from typing import Protocol, cast

import msgspec

# `answer_shape.Layout` with each instance name also as JSON (msgspec's, quotes included).
EncodedLayout = Sequence[tuple[str, bytes, Sequence[tuple[int, int]]]]


class Kernel(Protocol):
    """kernel/src/lib.rs: the namespace block store (kernel/src/store.rs),
    the engine lane (kernel/src/lane.rs, typed in `engine_lane`),
    the query answer's shape (kernel/src/shape.rs), and
    `kvconductor.wire.hashing`'s `pack_tokens`, `tokens_from_msgpack`,
    `tokens_from_json` and `chain_identities` without extra keys.

    The store and the shape are typed `object` here: their Protocols live with
    their Python twins (`block_store.BlockStore`, `answer_shape.AnswerShape`),
    which import this module, so the factories there say what they are. The
    loader knows none of its users."""

    def BlockStore(self, max_retired: int, max_age_s: float) -> object: ...

    def EngineLane(
        self, full_kinds: list[str], engine_tier: Callable[[str | None], int | None]
    ) -> object: ...

    def AnswerShape(
        self,
        tenant: str,
        tenant_json: bytes,
        block_size: int,
        layout: EncodedLayout,
    ) -> object: ...

    def pack_tokens(self, tokens: Sequence[int]) -> bytes: ...

    def msgpack_tokens(self, raw: bytes | msgspec.Raw) -> bytes | None: ...

    def json_tokens(self, raw: bytes | msgspec.Raw) -> bytes | None: ...

    def read_token_query(
        self, body: bytes
    ) -> tuple[str, int, bytes, str | None, str | None, str | None, str | None] | None: ...

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
