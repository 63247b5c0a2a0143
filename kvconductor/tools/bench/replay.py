"""Figure 8: a Mooncake trace replayed through the broker at its own rate.

The trace's requests, routed over the fleet's instances and run through
vLLM's engine model (`kvconductor.tools.bench.trace.vllm_trace_workload`), become one record
per engine step, stamped at the step's time. Here they are produced to the
daemon's topics at that time (times `speed`) while `kvconductor run`
consumes them, and:

- lag: every `LAG_EVERY_S`, records produced less records the daemon's
  /metrics shows consumed; after the last send, how long the daemon took
  to consume the rest (`catch_up_s`). It kept up when the backlog it ends
  with is under `KEPT_UP_S` of work;
- queries: one client asks `/query` for the workload's prompts back to back
  (`kvconductor.tools.bench.raw_http`'s keep-alive connection, ~25 us of CPU a request), and
  its latencies give p50/p99: what a router sees while the fleet publishes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import msgspec

from kvconductor.tools.bench import raw_http
from kvconductor.tools.bench.e2e import (
    DaemonProcess,
    bridge_like_producer,
    create_event_topics,
    frozen_run,
)
from kvconductor.tools.bench.measure import forked, percentile, process_cpu_s
from kvconductor.tools.bench.workload import Tokens, Workload

LAG_EVERY_S = 0.5
KEPT_UP_S = 1.0  # the backlog left at the end, in seconds of consuming it
QUERY_GAP_S = 0.005


async def _replay(
    w: Workload, bootstrap: str, speed: float, prompts: Sequence[Tokens], folder: Path
) -> dict[str, Any]:
    records = w.streams.records
    cfg = w.config
    daemon = DaemonProcess(bootstrap, folder)
    await create_event_topics(bootstrap, daemon)
    daemon.start()
    lags: list[int] = []
    latencies: list[float] = []
    sent = 0
    sending = True
    try:
        async with aiohttp.ClientSession() as session:
            await daemon.wait_ready(session)
            producer = bridge_like_producer(bootstrap)
            await producer.start()
            conn = await raw_http.connect(daemon.port)
            bodies = [
                msgspec.json.encode(
                    {"model": cfg.model, "block_size": cfg.block_size, "token_ids": p.tolist()}
                )
                for p in prompts
            ]

            async def watch() -> None:
                while sending:
                    consumed, _ = await daemon.counts(session)
                    lags.append(sent - consumed)
                    await asyncio.sleep(LAG_EVERY_S)

            async def ask() -> None:
                n = 0
                while sending:
                    t = time.perf_counter()
                    status, _ = await conn.exchange(
                        raw_http.post(daemon.port, "/query", bodies[n % len(bodies)])
                    )
                    if status != 200:
                        raise RuntimeError(f"/query answered {status}")
                    latencies.append(time.perf_counter() - t)
                    n += 1
                    await asyncio.sleep(QUERY_GAP_S)

            tasks = [asyncio.create_task(watch()), asyncio.create_task(ask())]
            cpu0 = sum(process_cpu_s(daemon.pid))
            try:
                ts0 = records[0].ts
                started = time.perf_counter()
                acks = []
                for r in records:
                    wait = started + (r.ts - ts0) / speed - time.perf_counter()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    acks.append(
                        await producer.send(
                            daemon.engine_topic, r.payload, key=r.key, headers=r.headers
                        )
                    )
                    sent += 1
                await producer.flush()
                await asyncio.gather(*acks)
                last_send = time.perf_counter()
                done, bad = await daemon.wait_consumed(session, sent)
            finally:
                sending = False
                await asyncio.gather(*tasks)
                conn.close()
                await producer.stop()
            wall = done - started
            cpu = sum(process_cpu_s(daemon.pid)) - cpu0
    finally:
        code = daemon.stop()
    ms = sorted(x * 1000 for x in latencies)
    events = sum(r.events for r in records)
    return {
        "records": len(records),
        "events": events,
        "speed": speed,
        "wall_s": wall,
        "offered_events_per_s": events / (last_send - started) if last_send > started else None,
        "catch_up_s": done - last_send,
        "max_lag_records": max(lags, default=0),
        "p99_lag_records": percentile(sorted(lags), 99) if lags else 0,
        "queries": len(ms),
        "query_p50_ms": percentile(ms, 50),
        "query_p99_ms": percentile(ms, 99),
        "query_max_ms": ms[-1] if ms else None,
        "daemon_cpu": cpu / wall if wall else None,
        "bad_records": bad,
        "exit_code": code,
    }


def replay_figure(
    w: Workload,
    bootstrap: str,
    speed: float,
    logs: Path,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """One replay of `w`'s records at `speed` times the trace's own rate."""
    logs.mkdir(parents=True, exist_ok=True)
    prompts = w.queries[:200]
    res = forked(lambda: frozen_run(_replay(w, bootstrap, speed, prompts, logs)))
    res["kept_up"] = res["catch_up_s"] <= KEPT_UP_S
    res["measured"] = True
    res["stats"] = w.stats
    log(
        f"  replay at {speed:g}x: {res['records']:,} records ({res['events']:,} events) over "
        f"{res['wall_s']:.1f} s; lag at most {res['max_lag_records']:,} records, "
        f"{res['catch_up_s']:.2f} s to catch up after the last send (kept up: "
        f"{res['kept_up']}); query p50 {res['query_p50_ms']:.2f} ms p99 "
        f"{res['query_p99_ms']:.2f} ms over {res['queries']:,} queries"
    )
    return res
