"""Optional dependencies: which extra installs which module, and the one-line
error a command gives when its extra is not installed.

    with needs_extra("bridge", "kvconductor bridge"):
        from kvconductor.bridge.app import run_bridge

The daemon's install (`pip install kvconductor`) leaves out what only the
engine bridge and the demo use, so that it carries no ZMQ library it never
loads: `bridge` brings pyzmq, `demo` pyzmq and rich (rich only draws the
live view and tables; without it output is plain text), `bench` the
benchmark's peers and chart (pyproject.toml).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from kvconductor.tools.termui import ToolError

# The top-level module an extra provides -> the PyPI package that holds it.
EXTRA_MODULES: dict[str, str] = {"zmq": "pyzmq", "rich": "rich"}


@contextlib.contextmanager
def needs_extra(extra: str, what: str) -> Iterator[None]:
    """Turn a missing optional module imported inside into a one-line
    `ToolError` naming the extra (exit code 1); other import errors pass."""
    try:
        yield
    except ModuleNotFoundError as exc:
        module = (exc.name or "").partition(".")[0]
        package = EXTRA_MODULES.get(module)
        if package is None:
            raise
        raise ToolError(
            f"{what} needs {package}, which the '{extra}' extra installs: "
            f"pip install 'kvconductor[{extra}]'"
        ) from None
