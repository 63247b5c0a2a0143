"""The compiled kernel (`kernel/`, Rust), when it is built and allowed.

`KVCONDUCTOR_KERNEL=off` forces the pure-Python path (the tests compare the
two); any other value, or none, uses the kernel when the install built it.
`STATUS` says which path runs, for the daemon's start-up log.

`KERNEL` is the module `kvconductor._kernel` or None. Its types are in
`kvconductor/_kernel.pyi`: a user checks `KERNEL is not None`, then calls
the module imported under that same test, which the stub types, so that
mypy checks the Python path (always) and the compiled one (by the stub)
whether or not the install built it:

    if KERNEL is not None:
        from kvconductor import _kernel
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType


def _load() -> tuple[ModuleType | None, str]:
    if os.environ.get("KVCONDUCTOR_KERNEL", "").lower() in ("off", "0", "false", "no"):
        return None, "pure-python (KVCONDUCTOR_KERNEL=off)"
    try:
        module = importlib.import_module("kvconductor._kernel")
    except ImportError:
        return None, "pure-python (the compiled kernel is not built: no Rust toolchain at install)"
    return module, "compiled"


KERNEL, STATUS = _load()
