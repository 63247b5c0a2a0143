"""The typed stub `kvconductor/_kernel.pyi` against the compiled module it
describes: every class, method, argument and function, by mypy's stubtest
(names the stub keeps on purpose are in kernel/stubtest-allowlist.txt)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvconductor.kernel import KERNEL

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(KERNEL is None, reason="the compiled kernel is not built or is turned off")
def test_the_stub_matches_the_compiled_kernel() -> None:
    allowlist = ROOT / "kernel" / "stubtest-allowlist.txt"
    cmd = [
        sys.executable,
        "-m",
        "mypy.stubtest",
        "kvconductor._kernel",
        "--allowlist",
        str(allowlist),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
