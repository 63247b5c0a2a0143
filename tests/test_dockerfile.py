"""The Dockerfile builds from what the repository holds.

No Docker engine here, and no image pulls: the build stage is replayed in a
scratch folder instead. Its COPY list is copied from the repository (less
what .dockerignore leaves out of the build context), its `pip wheel` step is
run there, and the runtime stage's check that the compiled kernel loads is
run against the wheel it made. A file the wheel needs but the COPY list
misses fails here, not on a user's `docker build`.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shlex
import shutil
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"


@dataclass
class Instruction:
    keyword: str
    args: str


@dataclass
class Stage:
    name: str
    instructions: list[Instruction]

    def each(self, keyword: str) -> list[str]:
        return [i.args for i in self.instructions if i.keyword == keyword]


def instructions(text: str | None = None) -> list[Instruction]:
    """The Dockerfile's instructions, continuation lines joined, comments dropped."""
    joined = (DOCKERFILE.read_text() if text is None else text).replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, args = line.partition(" ")
            out.append(Instruction(keyword.upper(), args.strip()))
    return out


def stages() -> dict[str, Stage]:
    """The build stages by name (`FROM image AS name`; the last one is `final`)."""
    found: list[Stage] = []
    for ins in instructions():
        if ins.keyword == "FROM":
            words = ins.args.split()
            found.append(Stage(words[2] if len(words) == 3 else "", []))
        else:
            found[-1].instructions.append(ins)
    found[-1].name = found[-1].name or "final"
    return {s.name: s for s in found}


def copies(stage: Stage) -> list[tuple[list[str], str]]:
    """The stage's COPY sources and destination, from the build context only."""
    out = []
    for args in stage.each("COPY"):
        words = shlex.split(args)
        if not any(w.startswith("--from=") for w in words):
            out.append((words[:-1], words[-1]))
    return out


def ignored(rel: Path) -> bool:
    """Whether .dockerignore leaves `rel` out of the build context (the subset of
    its syntax this repository uses: globs, `**/` prefixes, no `!` exceptions)."""
    patterns = [
        p.strip()
        for p in (REPO / ".dockerignore").read_text().splitlines()
        if p.strip() and not p.startswith("#")
    ]
    parts = rel.parts
    for i in range(1, len(parts) + 1):
        prefix = "/".join(parts[:i])
        for pattern in patterns:
            if fnmatch.fnmatchcase(prefix, pattern):
                return True
            if pattern.startswith("**/") and fnmatch.fnmatchcase(parts[i - 1], pattern[3:]):
                return True
    return False


def copy_context(src: Path, dest: Path) -> None:
    """`COPY src dest` from the repository, as Docker's build context has it."""
    if src.is_file():
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest)
        return
    for path in sorted(src.rglob("*")):
        rel = path.relative_to(REPO)
        if path.is_file() and not ignored(rel):
            target = dest / path.relative_to(src)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)


def test_every_copy_source_is_in_the_repository() -> None:
    for stage in stages().values():
        for sources, _ in copies(stage):
            for source in sources:
                path = REPO / source
                assert path.exists(), f"COPY {source}: not in the repository"
                assert not ignored(path.relative_to(REPO)), f"COPY {source}: in .dockerignore"


def test_the_build_stage_copies_what_the_wheel_is_built_from() -> None:
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    copied = {source.rstrip("/") for sources, _ in copies(stages()["build"]) for source in sources}
    wanted = {
        pattern.rstrip("*")
        for pattern in project["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    wanted.add(project["project"]["readme"])
    for ext in project["tool"]["setuptools-rust"]["ext-modules"]:
        wanted.add(Path(ext["path"]).parts[0])
    assert wanted <= copied, f"the build stage does not copy {sorted(wanted - copied)}"


def test_the_command_reads_a_config_the_image_holds() -> None:
    final = stages()["final"]
    (config_copy,) = [dest for sources, dest in copies(final) if sources == ["config/"]]
    command = json.loads(final.each("CMD")[-1])
    config = command[command.index("--config") + 1]
    assert config.startswith(config_copy)
    assert (REPO / "config" / config[len(config_copy) :]).is_file()


def _pip_wheel_step(stage: Stage) -> list[str]:
    (step,) = [run for run in stage.each("RUN") if run.startswith("pip wheel")]
    return shlex.split(step)


@pytest.mark.skipif(shutil.which("cargo") is None, reason="no Rust toolchain (cargo) on PATH")
def test_the_build_stage_replayed_in_a_scratch_folder_makes_a_wheel_with_the_kernel(
    tmp_path: Path,
) -> None:
    build = stages()["build"]
    src = tmp_path / "src"  # the stage's WORKDIR
    for sources, dest in copies(build):
        for source in sources:
            # A destination ending in / is a folder the sources go into.
            target = src / dest / Path(source).name if dest.endswith("/") else src / dest
            copy_context(REPO / source, target)
    # The step as written, but only kvconductor's own wheel (the dependencies
    # come from PyPI, not from the repository) and into the scratch folder.
    argv = _pip_wheel_step(build)
    wheels = tmp_path / "wheels"
    argv[argv.index("--wheel-dir") + 1] = str(wheels)
    env = dict(os.environ)
    # The repository's own build cache: the same crate, so only it recompiles.
    env["CARGO_TARGET_DIR"] = str(REPO / "kernel" / "target")
    env.pop("KVCONDUCTOR_KERNEL", None)
    subprocess.run(
        [sys.executable, "-m", *argv, "--no-deps"],
        cwd=src,
        env=env,
        check=True,
        capture_output=True,
        timeout=900,
    )
    (wheel,) = wheels.glob("kvconductor-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.startswith("kvconductor/_kernel") and n.endswith(".so") for n in names)
    for data in ("pom.xml", "server.properties", "log4j2.yaml"):
        assert f"kvconductor/tools/kafka_local/resources/kafka/{data}" in names
    assert "kvconductor/tools/bench/suite.py" in names
    assert "kvconductor/consumers/event_consumer.py" in names
    # Only kvconductor is importable from the install: nothing else lands in
    # site-packages beside other projects.
    assert {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")} == {
        "kvconductor"
    }

    # The runtime stage's kernel check, against the unpacked wheel.
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    (check,) = [run for run in stages()["final"].each("RUN") if run.startswith("python -c")]
    env["PYTHONPATH"] = str(site)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    out = subprocess.run(
        ["/bin/sh", "-c", check], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "compiled"


@pytest.mark.kafka
async def test_the_images_command_says_which_query_path_runs(kafka_bootstrap: str) -> None:
    """The image's CMD, run here with its config file and ENV (but on 127.0.0.1
    and topics of its own): its start-up line names the query path."""
    from kvconductor.kernel import STATUS
    from tests.harness import daemon_config
    from tests.test_cli import cfg_env
    from tests.test_compose import image_env
    from tests.test_kafka_security import service

    final = stages()["final"]
    (config_copy,) = [dest for sources, dest in copies(final) if sources == ["config/"]]
    command = json.loads(final.each("CMD")[-1])
    at = command.index("--config") + 1
    command[at] = str(REPO / "config" / command[at][len(config_copy) :])
    env = {
        **cfg_env(daemon_config(kafka_bootstrap)),
        **image_env(),
        "KVCONDUCTOR_HTTP_HOST": "127.0.0.1",
        "KVCONDUCTOR_HTTP_PORT": "0",
    }
    assert command[0] == "kvconductor"
    async with service(*command[1:], env=env) as daemon:
        await daemon.http_port("http listening")
        (line,) = [e for e in daemon.events() if e.get("event") == "http listening"]
    assert line["query_path"] == STATUS


def _base(stage_name: str) -> str:
    for ins in instructions():
        if ins.keyword == "FROM":
            words = ins.args.split()
            if (words[2] if len(words) == 3 else "final") == stage_name:
                return words[0]
    raise AssertionError(f"no stage {stage_name}")


def test_the_image_runs_the_python_every_figure_was_measured_on() -> None:
    """Python 3.11 in both stages: the kernel reads token ids from CPython
    3.11's int objects directly (kernel/py/src/small_int.rs, compiled out on
    3.12+ by kernel/build.rs's cfgs) and docs/benchmarks.md's figures are
    3.11's. The build stage's interpreter is the one the kernel is built
    for, so the runtime stage must be the same minor."""
    assert _base("build") == "python:3.11-slim"
    assert _base("final") == _base("build")
    assert _base("rust") == "rust:1-slim"


def test_the_image_installs_the_daemon_and_the_bridge() -> None:
    """The `bridge` extra (pyzmq) is built and installed, for `kvconductor
    bridge` and docker-compose's ZMQ demo engines; the demo's rich is not."""
    import tomllib

    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert [r.split(">")[0] for r in extras["bridge"]] == ["pyzmq"]
    assert _pip_wheel_step(stages()["build"])[-1] == ".[bridge]"
    (install,) = [r for r in stages()["final"].each("RUN") if r.startswith("pip install")]
    assert "kvconductor[bridge]" in shlex.split(install.split("&&")[0])
