"""Reconciling a pool master's objects the events did not announce going.

`mooncake_master` (0.3.14) sends `stored` and `removed` for puts and removes,
but nothing when it evicts an object under memory pressure or drops the
objects of a client whose segment went away (`docs/mooncake-master-events.md`).
Left alone, the index would serve those blocks as pool hits for ever.

For a pool publisher with `reconcile_url` (the master's HTTP metrics address),
the bridge keeps the object keys it relayed as stored and not removed
(`LiveKeys`), and every `reconcile_interval_s` reads the master's own list
(`GET /get_all_keys`, one key a line). Keys it relayed before the list was
asked for that the list no longer has are gone without an event: the bridge
writes a `removed` event for each, in the master's shape, into the same
stream after everything relayed so far, so the daemon applies it in order
like any removal. A key stored again after the list was asked for is left
for the next round. What stays stale is at most one interval (plus the
daemon's lag) per evicted object.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable

import aiohttp
import msgspec
import structlog

log = structlog.get_logger("kvconductor.bridge.reconcile")

# Removals per record: a master key is ~100-200 bytes, so a record stays far
# below the default max_request_size (1 MiB).
REMOVALS_PER_RECORD = 1000
# The key list of a large master is large: read at most this much of it.
MAX_LIST_BYTES = 1 << 30


class _Event(msgspec.Struct, gc=False):
    event_type: str
    object_key: str | None = None
    backend_id: str | None = None
    tenant_id: str | None = None
    medium: str | None = None


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Event]


_decode = msgspec.msgpack.Decoder(_Batch).decode

# (generation relayed at, backend_id, tenant_id, medium)
Held = tuple[int, str | None, str | None, str | None]


class LiveKeys:
    """Object keys a pool stream relayed as stored and not yet removed."""

    def __init__(self) -> None:
        self.keys: dict[str, Held] = {}
        self.generation = 0

    def observe(self, payload: bytes) -> None:
        """A payload relayed to Kafka (the daemon decodes it properly; a
        payload this cannot read changes nothing here)."""
        try:
            batch = _decode(payload)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        self.generation += 1
        for ev in batch.events:
            if ev.event_type == "cleared":
                self.keys = {
                    k: h
                    for k, h in self.keys.items()
                    if (h[1], h[2]) != (ev.backend_id, ev.tenant_id)
                }
            elif ev.object_key is None:
                continue
            elif ev.event_type == "stored":
                self.keys[ev.object_key] = (
                    self.generation,
                    ev.backend_id,
                    ev.tenant_id,
                    ev.medium,
                )
            elif ev.event_type == "removed":
                self.keys.pop(ev.object_key, None)

    def clear(self) -> None:
        """A resync: the daemon forgets the pool's blocks, so do we."""
        self.keys.clear()
        self.generation += 1

    def gone(self, listed: set[str], before: int) -> list[tuple[str, Held]]:
        """Keys relayed before generation `before` that the master no longer
        lists; they are forgotten here."""
        out = [(k, h) for k, h in self.keys.items() if h[0] < before and k not in listed]
        for k, _ in out:
            del self.keys[k]
        return out

    def removals(self, gone: Iterable[tuple[str, Held]]) -> list[bytes]:
        """`removed` events for `gone`, in the master's own shape, batched."""
        ts = int(time.time() * 1000)
        events: list[dict[str, object]] = [
            {
                "event_type": "removed",
                "object_key": k,
                "backend_id": h[1],
                "tenant_id": h[2],
                "medium": h[3],
                "seq_hashes": [],
                "reconciled": True,  # not the master's: the bridge's inference
            }
            for k, h in gone
        ]
        return [
            msgspec.msgpack.encode([ts, events[i : i + REMOVALS_PER_RECORD], 0])
            for i in range(0, len(events), REMOVALS_PER_RECORD)
        ]


async def fetch_keys(session: aiohttp.ClientSession, url: str, timeout_s: float) -> set[str]:
    """The master's object keys (`GET <url>/get_all_keys`, one key a line)."""
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(url.rstrip("/") + "/get_all_keys", timeout=timeout) as resp:
        if resp.status != 200:
            raise aiohttp.ClientResponseError(
                resp.request_info, (), status=resp.status, message="not 200"
            )
        body = await resp.content.read(MAX_LIST_BYTES)
    return {line for line in body.decode("utf-8", "replace").splitlines() if line}


async def reconcile_forever(
    live: LiveKeys,
    lock: asyncio.Lock,
    url: str,
    interval_s: float,
    write: Callable[[bytes], Awaitable[None]],
    on_round: Callable[[str, int], None],
    stream: str,
) -> None:
    """Every `interval_s`: compare, and `write` a removal record per batch of
    keys gone; `on_round(outcome, removed)` counts. `lock` is the stream's:
    held from the comparison to the last write, so no message of the stream
    is relayed in between (a key stored again then would be removed after
    its new store)."""
    async with aiohttp.ClientSession() as session:
        while True:
            await asyncio.sleep(interval_s)
            if not live.keys:
                continue
            before = live.generation + 1  # everything relayed until now
            try:
                listed = await fetch_keys(session, url, max(1.0, interval_s / 2))
            except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                log.warning("reconcile: master key list unavailable", stream=stream, error=str(exc))
                on_round("failed", 0)
                continue
            async with lock:
                gone = live.gone(listed, before)
                for payload in live.removals(gone):
                    await write(payload)
            if gone:
                log.info("reconcile: objects gone without an event", stream=stream, keys=len(gone))
            on_round("ok", len(gone))
