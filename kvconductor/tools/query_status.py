"""`kvconductor query` and `kvconductor status`: the daemon's HTTP API from a terminal.

    kvconductor query --model M --block-size 16 --tokens 1,2,3,...
    kvconductor query --model M --block-size 16 --text "You are ..."   # bytes as token ids
    kvconductor status

kvconductor has no tokenizer: `--text` maps the UTF-8 bytes of the text to
token ids 0..255, which is how the demo's simulated engines "tokenise".
Against real engines, pass the ids of the model's tokenizer with
`--tokens` (or engine sequence hashes with `--seq-hashes`).

Exit codes: 0 success; 1 the daemon cannot be reached or refused the
request; 2 bad arguments or configuration; `status` returns 3 when the
daemon answers but is not ready.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from kvconductor.config import ConfigError, load_config
from kvconductor.tools.api_client import Api, Metrics, metric_by, metric_sum
from kvconductor.tools.termui import ToolError, fail, print_table
from kvconductor.wire.media import HOST, pool_tier

U32 = (1 << 32) - 1


def _api(args: argparse.Namespace) -> Api:
    try:
        cfg = load_config(Path(args.config) if args.config else None)
    except ConfigError as exc:
        raise ToolError(str(exc), 2) from None
    return Api.from_config(cfg, args.url, args.timeout)


# ------------------------------------------------------------------- query


def parse_ints(text: str, what: str, hi: int | None = U32) -> list[int]:
    """Comma- or space-separated integers (decimal, or 0x hex)."""
    out: list[int] = []
    for item in re.split(r"[\s,]+", text.strip()):
        if not item:
            continue
        try:
            value = int(item, 0)
        except ValueError:
            raise ToolError(f"{what}: {item[:30]!r} is not an integer", 2) from None
        if hi is not None and not 0 <= value <= hi:
            raise ToolError(f"{what}: {value} is outside [0, {hi}]", 2)
        out.append(value)
    if not out:
        raise ToolError(f"{what}: no values given", 2)
    return out


def _query_body(args: argparse.Namespace) -> tuple[str, dict[str, Any], str]:
    """(path, JSON body, description of the prompt)."""
    if args.block_size < 1:
        raise ToolError("--block-size must be at least 1", 2)
    body: dict[str, Any] = {"model": args.model, "block_size": args.block_size}
    for flag, key in (
        ("lora", "lora_name"),
        ("tenant", "tenant_id"),
        ("instance", "instance_id"),
        ("salt", "cache_salt"),
    ):
        value = getattr(args, flag)
        if value is not None:
            body[key] = value
    if args.seq_hashes is not None:
        hashes = parse_ints(args.seq_hashes, "--seq-hashes", hi=None)
        body["seq_hashes"] = hashes
        return "/query_by_hash", body, f"{len(hashes)} sequence hashes"
    if args.tokens is not None:
        tokens = parse_ints(args.tokens, "--tokens")
    else:
        if args.text_file is not None:
            try:
                raw = (
                    sys.stdin.buffer.read()
                    if args.text_file == "-"
                    else Path(args.text_file).read_bytes()
                )
            except OSError as exc:
                raise ToolError(f"cannot read {args.text_file}: {exc.strerror}", 2) from None
        else:
            raw = str(args.text).encode("utf-8")
        tokens = list(raw)
    body["token_ids"] = tokens
    blocks = len(tokens) // args.block_size
    return "/query", body, f"{len(tokens)} tokens, {blocks} full blocks of {args.block_size}"


def query_rows(answer: dict[str, dict[str, dict[str, Any]]]) -> list[list[str]]:
    """Rows (tenant, instance, matched, GPU, CPU, DISK, per-rank), best first."""
    rows: list[tuple[tuple[int, int], list[str]]] = []
    for tenant, instances in answer.items():
        for instance, hit in instances.items():
            dp = hit.get("DP", {})
            ranks = " ".join(f"{r}:{n}" for r, n in sorted(dp.items(), key=lambda kv: int(kv[0])))
            rows.append(
                (
                    (-int(hit.get("longest_matched", 0)), -int(hit.get("GPU", 0))),
                    [
                        tenant,
                        instance,
                        str(hit.get("longest_matched", 0)),
                        str(hit.get("GPU", 0)),
                        str(hit.get("CPU", 0)),
                        str(hit.get("DISK", 0)),
                        ranks,
                    ],
                )
            )
    rows.sort(key=lambda r: (r[0], r[1][1]))
    return [r for _, r in rows]


def run_query(args: argparse.Namespace) -> int:
    try:
        api = _api(args)
        path, body, what = _query_body(args)
        status, answer = api.json("POST", path, body)
    except ToolError as exc:
        return fail(exc, "kvconductor query")
    if status != 200:
        error = answer.get("error") if isinstance(answer, dict) else None
        return fail(
            ToolError(f"{api.url}{path} answered {status}: {error or answer}"), "kvconductor query"
        )
    if args.json:
        print(json.dumps(answer, sort_keys=True))
        return 0
    print(f"{api.url}{path}  model {args.model}  {what}")
    rows = query_rows(answer)
    if not rows:
        print(
            "no instance holds any block of this prompt (nothing cached yet, or no instance "
            "in this namespace: tenant, model, block size, LoRA and salt must match)"
        )
        return 0
    print_table(
        ["TENANT", "INSTANCE", "MATCHED", "GPU", "CPU", "DISK", "DP RANK:MATCHED"],
        rows,
        title="Cached prefix per instance (tokens; CPU and DISK include the tiers above)",
    )
    best = rows[0]
    if best[2] == "0":
        print("no instance has a cached prefix of this prompt yet")
        return 0
    print(
        f"best: {best[1]} ({best[2]} tokens cached, {best[3]} on GPU, "
        f"{best[4]} up to host memory, {best[5]} up to disk)"
    )
    return 0


# ------------------------------------------------------------------ status


def _age(ts: float | None) -> str:
    if not ts:
        return "-"
    age = time.time() - ts
    if age < 0 or age > 10 * 365 * 86400:
        return "-"
    if age < 120:
        return f"{age:.0f}s ago"
    if age < 7200:
        return f"{age / 60:.0f}m ago"
    return f"{age / 3600:.1f}h ago"


def _fmt(counts: dict[str, float]) -> str:
    if not counts:
        return "none"
    return ", ".join(f"{k} {int(v)}" for k, v in sorted(counts.items()))


def _partitions(metrics: Metrics) -> list[dict[str, Any]]:
    """Per assigned partition: lag, seconds since its last fetch answer,
    seconds its waiting records have waited, stale or not."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    for name, field in (
        ("kvconductor_consumer_lag", "lag"),
        ("kvconductor_partition_fetch_age_seconds", "fetch_age_s"),
        ("kvconductor_partition_behind_seconds", "behind_s"),
        ("kvconductor_partition_stale", "stale"),
    ):
        for labels, value in metrics.get(name, []):
            key = (labels.get("topic", ""), int(labels.get("partition", "0")))
            row = rows.setdefault(key, {"topic": key[0], "partition": key[1]})
            row[field] = bool(value) if field == "stale" else value
    return [rows[key] for key in sorted(rows)]


def gather_status(api: Api) -> dict[str, Any]:
    """What `status` shows, as one JSON-able dict."""
    _, health = api.json("GET", "/health")
    ready_code, ready = api.json("GET", "/ready")
    workers_code, workers = api.json("GET", "/workers")
    if workers_code != 200:
        raise ToolError(f"{api.url}/workers answered {workers_code}: {workers}")
    metrics = api.metrics()
    lag: dict[str, float] = {}
    for labels, value in metrics.get("kvconductor_consumer_lag", []):
        lag[labels.get("topic", "")] = lag.get(labels.get("topic", ""), 0) + value
    return {
        "url": api.url,
        "health": health,
        "partitions": _partitions(metrics),
        "ready": bool(ready.get("ready")) and ready_code == 200,
        "ready_reason": ready.get("reason", ""),
        "namespaces": workers.get("workers", []),
        "pending": workers.get("pending", {}),
        "records_consumed": metric_by(metrics, "kvconductor_records_consumed_total", "topic"),
        "consumer_lag": lag,
        "dead_letters": metric_by(metrics, "kvconductor_dead_letters_total", "kind"),
        "dead_letter_failures": metric_sum(metrics, "kvconductor_dead_letter_failures_total"),
        "bad_records": metric_by(metrics, "kvconductor_bad_records_total", "kind"),
        "seq_gaps": metric_sum(metrics, "kvconductor_seq_gaps_total"),
        "seq_missing": metric_sum(metrics, "kvconductor_seq_missing_total"),
        "instances": metric_sum(metrics, "kvconductor_instances"),
        "index_events": metric_by(metrics, "kvconductor_index_events_total", "kind"),
    }


def print_status(st: dict[str, Any]) -> None:
    state = "ready" if st["ready"] else f"NOT ready ({st['ready_reason']})"
    print(f"kvconductor at {st['url']}: {state}")
    print(f"records consumed: {_fmt(st['records_consumed'])}")
    print(f"consumer lag:     {_fmt(st['consumer_lag'])}")
    partitions = st["partitions"]
    stale = [p for p in partitions if p.get("stale")]
    print(f"stale partitions: {len(stale)} of {len(partitions)}")
    if partitions:
        print_table(
            ["PARTITION", "LAG", "LAST FETCH", "WAITING", "STALE"],
            [
                [
                    f"{p['topic']}/{p['partition']}",
                    str(int(p.get("lag", 0))),
                    f"{p.get('fetch_age_s', 0.0):.1f}s ago",
                    f"{p.get('behind_s', 0.0):.1f}s",
                    "STALE" if p.get("stale") else "-",
                ]
                for p in partitions
            ],
        )
    print(f"pending (two-phase halves): {_fmt(st['pending'])}")
    dead = sum(st["dead_letters"].values())
    print(
        f"dead letters:     {int(dead)}"
        + (f" ({_fmt(st['dead_letters'])})" if dead else "")
        + (
            f", {int(st['dead_letter_failures'])} FAILED to publish"
            if st["dead_letter_failures"]
            else ""
        )
    )
    gaps = int(st["seq_gaps"])
    print(
        f"kv-seq gaps:      {gaps}" + (f" ({int(st['seq_missing'])} messages lost)" if gaps else "")
    )
    namespaces = st["namespaces"]
    print(f"namespaces: {len(namespaces)}, instances: {int(st['instances'])}")
    for ns in namespaces:
        lora = ns.get("lora_name") or "base"
        salt = f" salt {ns['salt']!r}" if ns.get("salt") else ""
        title = (
            f"tenant {ns['tenant']} / model {ns['model']} / block size {ns['block_size']} / "
            f"{lora}{salt}, last event {_age(ns.get('last_event_ts'))}; blocks per tier"
        )
        rows = []
        for instance, ranks in sorted(ns.get("instances", {}).items()):
            for rank, tiers in sorted(ranks.items(), key=lambda kv: int(kv[0])):
                rows.append(
                    [instance, rank, str(tiers["GPU"]), str(tiers["CPU"]), str(tiers["DISK"])]
                )
        for backend, media in sorted(ns.get("pools", {}).items()):
            for medium, n in sorted(media.items()):
                host = pool_tier(medium) == HOST
                cells = [str(n), "-"] if host else ["-", str(n)]
                rows.append([f"{backend} (pool, {medium})", "-", "-", *cells])
        print()
        print_table(["INSTANCE", "DP RANK", "GPU", "CPU", "DISK"], rows, title=title)


def run_status(args: argparse.Namespace) -> int:
    try:
        st = gather_status(_api(args))
    except ToolError as exc:
        return fail(exc, "kvconductor status")
    if args.json:
        print(json.dumps(st, sort_keys=True))
    else:
        print_status(st)
    return 0 if st["ready"] else 3
