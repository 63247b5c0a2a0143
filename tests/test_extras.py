"""The daemon's install has no pyzmq and no rich: the commands that need one
say which extra installs it, in one line (pyproject.toml's extras,
kvconductor/tools/extras.py)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# Runs the command line with zmq and rich not importable, as in an install
# without the extras.
WITHOUT_EXTRAS = """
import sys

class Absent:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in ("zmq", "rich"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Absent())
from kvconductor.tools.cli import main
sys.exit(main(sys.argv[1:]))
"""


def without_extras(*argv: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_EXTRAS, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
    )


def test_the_daemons_dependencies_leave_out_the_bridges_and_the_demos() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    names = {
        r.split("[")[0].split(">")[0].split("~")[0].split("<")[0] for r in project["dependencies"]
    }
    assert not names & {"pyzmq", "rich"}
    extras = project["optional-dependencies"]
    assert {r.split(">")[0] for r in extras["bridge"]} == {"pyzmq"}
    assert {r.split(">")[0] for r in extras["demo"]} == {"rich", "pyzmq"}
    assert {"bench", "test"} <= set(extras)


def test_the_bridge_without_pyzmq_is_one_line_naming_its_extra() -> None:
    out = without_extras("bridge")
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert "pyzmq" in out.stderr and "pip install 'kvconductor[bridge]'" in out.stderr


def test_the_demos_zmq_engines_without_pyzmq_are_one_line_naming_its_extra() -> None:
    out = without_extras(
        "demo", "--engines-only", "--via-bridge", "http://127.0.0.1:1", "--bootstrap", "127.0.0.1:1"
    )
    assert out.returncode == 1
    assert "Traceback" not in out.stderr
    assert out.stderr.count("\n") == 1, out.stderr
    assert "pyzmq" in out.stderr and "pip install 'kvconductor[demo]'" in out.stderr


@pytest.mark.parametrize(
    "module",
    [
        "kvconductor.service.daemon",
        "kvconductor.service.replica_server",
        "kvconductor.tools.query_status",
        "kvconductor.tools.dead_letters.tool",
        "kvconductor.tools.demo.run",
        "kvconductor.tools.bench.suite",
    ],
)
def test_the_daemon_and_the_tools_load_without_the_extras(module: str) -> None:
    code = WITHOUT_EXTRAS.replace(
        "from kvconductor.tools.cli import main\nsys.exit(main(sys.argv[1:]))",
        f"import {module}",
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=REPO
    )
    assert out.returncode == 0, out.stderr
