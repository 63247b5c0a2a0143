"""A bounded, age-ordered queue of pending halves.

Everything that waits for its other half (a confirmation waiting for
content, a token-less store waiting for content, a chain waiting for its
parent, an offload intent waiting for its confirmation) is one key here.
Keys are kept in arrival order, so the oldest is always first: the count
bound evicts from the head and the age bound expires from the head.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Any

# Kinds, the first element of every key.
WAITING = "w"  # ("w", seq, target): a placement waiting for the seq's content
UNRESOLVED = "u"  # ("u", seq): content whose parent chain is not known yet
INTENT = "i"  # ("i", seq): offload-intent content pinned for a pool confirmation
RETIRED = "r"  # ("r", seq): content no tier holds any more, kept for late halves

PendingKey = tuple[Any, ...]

_changes = itertools.count(1)


class PendingQueue:
    __slots__ = ("_entries", "_on_drop", "by_kind", "max_age_s", "max_entries", "version")

    def __init__(
        self,
        max_entries: int,
        max_age_s: float,
        on_drop: Callable[[PendingKey, str], None],
    ) -> None:
        # An OrderedDict, not a dict: finding a dict's first entry walks past
        # every slot deleted at its front, so a queue at its bound (evicting
        # from the head on every add) got slower with each eviction.
        self._entries: OrderedDict[PendingKey, float] = OrderedDict()
        self._on_drop = on_drop
        self.max_entries = max_entries
        self.max_age_s = max_age_s
        self.by_kind: dict[str, int] = {WAITING: 0, UNRESOLVED: 0, INTENT: 0, RETIRED: 0}
        # A fresh number from one process-wide sequence on every change, so a
        # snapshot knows whether to publish it, even when the namespace was
        # dropped and created again meanwhile.
        self.version = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> OrderedDict[PendingKey, float]:
        """The keys and their arrival times, oldest first: read only (the
        engine lane checks the queue is empty with no Python call)."""
        return self._entries

    def __contains__(self, key: Hashable) -> bool:
        return key in self._entries

    def __iter__(self) -> Iterator[tuple[PendingKey, float]]:
        return iter(list(self._entries.items()))

    def add(self, key: PendingKey, ts: float) -> bool:
        """Add `key` unless present; evict the oldest beyond the bound."""
        entries = self._entries
        if key in entries:
            return False
        entries[key] = ts
        self.by_kind[key[0]] += 1
        self.version = next(_changes)
        while len(entries) > self.max_entries:
            oldest, _ = entries.popitem(last=False)
            self._dropped(oldest, "count")
        return True

    def discard(self, key: PendingKey) -> bool:
        if self._entries.pop(key, None) is None:
            return False
        self.by_kind[key[0]] -= 1
        self.version = next(_changes)
        return True

    def expire(self, now: float) -> None:
        entries = self._entries
        cutoff = now - self.max_age_s
        while entries:
            oldest, ts = entries.popitem(last=False)
            if ts >= cutoff:
                entries[oldest] = ts
                entries.move_to_end(oldest, last=False)
                return
            self._dropped(oldest, "age")

    def _dropped(self, key: PendingKey, why: str) -> None:
        self.by_kind[key[0]] -= 1
        self.version = next(_changes)
        self._on_drop(key, why)
