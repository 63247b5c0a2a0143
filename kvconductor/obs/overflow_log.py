"""Index bounds that dropped input, said in the log (they are also counters
on /metrics): at most one warning a kind per interval, naming the
`[index]` key to raise."""

from __future__ import annotations

from collections.abc import Mapping

import structlog

log = structlog.get_logger("kvconductor.daemon")

OVERFLOW_LOG_EVERY_S = 60.0
# Index counters that mean a bound dropped input, and the [index] key to raise.
OVERFLOW_LIMITS = {
    "owner_capacity_dropped": "max_blocks_per_owner",
    "instance_limit_dropped": "max_instances",
    "instance_limit_reclaimed": "max_instances",
    "namespace_limit_dropped": "max_namespaces",
    "owner_limit_dropped": "max_owners_per_namespace",
}


class OverflowLog:
    """A warning whenever an index bound dropped input: at most one a kind
    per interval, with what was dropped since the last one."""

    def __init__(self, interval_s: float = OVERFLOW_LOG_EVERY_S) -> None:
        self.interval_s = interval_s
        self._last: dict[str, tuple[float, int]] = {}

    def check(self, counters: Mapping[str, int], now: float, force: bool = False) -> None:
        for kind, total in counters.items():
            limit = OVERFLOW_LIMITS.get(kind)
            if limit is None and kind.startswith("pending_dropped_"):
                limit = "max_pending" if kind.endswith("_count") else "max_pending_age_s"
            if limit is None:
                continue
            at, seen = self._last.get(kind, (float("-inf"), 0))
            if total > seen and (force or now - at >= self.interval_s):
                log.warning(
                    "index bound reached: input dropped and counted",
                    kind=kind,
                    dropped=total - seen,
                    total=total,
                    limit=f"[index] {limit}",
                )
                self._last[kind] = (now, total)
