"""Measuring helpers: percentiles, summaries, resident memory, forked runs."""

from __future__ import annotations

import ctypes
import gc
import mmap
import os
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of already sorted values."""
    if not sorted_values:
        return float("nan")
    rank = max(1, min(len(sorted_values), round(q / 100.0 * len(sorted_values) + 0.5)))
    return float(sorted_values[rank - 1])


def summary(values: Sequence[float]) -> dict[str, Any]:
    """Median and spread (min, max, relative half-range) of repeated runs."""
    vals = [float(v) for v in values]
    if not vals:
        return {"median": None, "min": None, "max": None, "spread_pct": None, "runs": []}
    med = statistics.median(vals)
    spread = (max(vals) - min(vals)) / 2 / med * 100 if med else 0.0
    return {
        "median": med,
        "min": min(vals),
        "max": max(vals),
        "spread_pct": round(spread, 2),
        "runs": vals,
    }


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc)."""
    with open("/proc/self/statm", "rb") as f:
        resident = int(f.read().split()[1])
    return resident * os.sysconf("SC_PAGE_SIZE")


def process_cpu_s(pid: int) -> tuple[float, float]:
    """User and system CPU seconds of a process (Linux /proc, clock ticks)."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def _stat_cpu_s(path: str) -> tuple[float, float]:
    """User and system CPU seconds in a process's or a thread's `stat`."""
    with open(path, "rb") as f:
        # Fields after the command name, which may hold spaces and parens.
        fields = f.read().rpartition(b")")[2].split()
    return int(fields[11]) * _TICK_S, int(fields[12]) * _TICK_S


# HotSpot's just-in-time compiler threads ("C1 CompilerThread0", cut to
# the kernel's 15 characters).
_JIT_THREADS = (b"C1 CompilerThre", b"C2 CompilerThre")


def jit_cpu_s(pid: int) -> float | None:
    """CPU seconds a JVM's just-in-time compiler threads have used (Linux
    /proc); None when the process has none (not HotSpot) or is gone."""
    total = None
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm", "rb") as f:
                if f.read().strip() not in _JIT_THREADS:
                    continue
            user, system = _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
        except OSError:  # a thread that ended meanwhile
            continue
        total = (total or 0.0) + user + system
    return total


def settle() -> int:
    """Collect garbage, hand free heap pages back to the OS, then the
    resident size. (Pages a forked child shares with its parent count in its
    resident size already, so copy-on-write faults never inflate a delta.)"""
    gc.collect()
    trim()
    return rss_bytes()


def trim() -> None:
    """Hand the heap's free pages back to the OS (glibc's `malloc_trim`)."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:  # not glibc: deltas may then reuse some freed pages
        return
    libc.malloc_trim(0)


def warm_memory(nbytes: int) -> dict[str, float]:
    """Touch and release `nbytes` of fresh memory; returns the cost per page.

    On virtual machines whose memory the host backs lazily, a process's
    first touch of a page the guest never used costs tens of microseconds,
    which would be charged to whichever index grows first. Touching the
    memory once up front makes the figures measure the index, and the cost
    per page is reported as a property of the machine."""
    page = os.sysconf("SC_PAGE_SIZE")
    pages = max(1, nbytes // page)
    started = time.perf_counter()
    with mmap.mmap(-1, pages * page) as m:
        m[::page] = b"\x01" * pages
    seconds = time.perf_counter() - started
    return {"bytes": pages * page, "seconds": seconds, "us_per_page": seconds / pages * 1e6}


def forked(fn: Callable[[], T]) -> T:
    """Run `fn` in a forked child and return its (msgspec-JSON-able) result.

    The child sees the parent's memory copy-on-write, so a workload
    generated once serves every peer, and each peer's index lives and dies
    in a process of its own (clean resident-size deltas, no allocator
    state carried from one peer to the next). Raises RuntimeError with the
    child's traceback when it fails."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(read_fd)
        code = 0
        try:
            out = msgspec.json.encode({"ok": fn()})
        except BaseException:
            out = msgspec.json.encode({"error": traceback.format_exc()})
            code = 1
        with os.fdopen(write_fd, "wb") as w:
            w.write(out)
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as r:
        data = r.read()
    os.waitpid(pid, 0)
    if not data:
        raise RuntimeError("benchmark child died without a result (killed? out of memory?)")
    reply = msgspec.json.decode(data)
    if "error" in reply:
        raise RuntimeError(f"benchmark child failed:\n{reply['error']}")
    result: T = reply["ok"]
    return result
