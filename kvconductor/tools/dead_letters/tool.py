"""`kvconductor dead-letters list | redrive`: inspect and re-drive dead-lettered records.

The daemon sends a record it cannot apply to the dead-letter topic with its
key, value and headers untouched plus `dlq-*` headers (why, and where it
came from: see `kvconductor.consumers.dead_letters`). After the cause is fixed (a
bridge's headers, a daemon upgrade that decodes a new engine release),
`redrive` produces each selected record back to its source topic with the
original key, value and headers, the `dlq-*` headers removed, so the daemon
applies it like any new record.

A re-drive cursor, the committed offset of consumer group
`<kafka.group_id>-dead-letters` on the dead-letter topic, remembers how far
records have been re-driven: `redrive` starts there (`--all` starts at the
beginning again) and moves it past every record it re-drove in a row from
it, so running `redrive` twice does not re-drive twice. `list` marks the
records before the cursor as re-driven.

Re-driven records are appended after everything the engines sent since, so
a re-driven store can re-add a block its engine evicted meanwhile; see
docs/operations.md ("Dead letters") for when that matters.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import logging
import re
import sys
from collections.abc import AsyncIterator, Iterator
from typing import Any, NamedTuple

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError
from aiokafka.structs import OffsetAndMetadata

from kvconductor.config import Config, KafkaConfig, kafka_client_options
from kvconductor.consumers.dead_letters import (
    DLQ_KIND,
    DLQ_OFFSET,
    DLQ_PARTITION,
    DLQ_REASON,
    DLQ_TIME,
    DLQ_TOPIC,
)
from kvconductor.kafka.access import KafkaAccessError, check_access
from kvconductor.kafka.clients import started
from kvconductor.tools.termui import Progress, ToolError, fail, print_table, tool_config


class DeadLetter(NamedTuple):
    partition: int
    offset: int  # in the dead-letter topic
    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes]]

    def header(self, name: str) -> str:
        for k, v in self.headers:
            if k == name:
                return v.decode("utf-8", "replace")
        return ""

    @property
    def source_topic(self) -> str:
        return self.header(DLQ_TOPIC)

    @property
    def kind(self) -> str:
        return self.header(DLQ_KIND)

    def original_headers(self) -> list[tuple[str, bytes]]:
        return [(k, v) for k, v in self.headers if not k.startswith("dlq-")]

    def as_json(self, redriven: bool) -> dict[str, Any]:
        return {
            "partition": self.partition,
            "offset": self.offset,
            "key": None if self.key is None else self.key.decode("utf-8", "replace"),
            "value_bytes": 0 if self.value is None else len(self.value),
            "kind": self.kind,
            "reason": self.header(DLQ_REASON),
            "source_topic": self.source_topic,
            "source_partition": self.header(DLQ_PARTITION),
            "source_offset": self.header(DLQ_OFFSET),
            "dead_lettered_at_ms": self.header(DLQ_TIME),
            "headers": {k: v.decode("utf-8", "replace") for k, v in self.original_headers()},
            "redriven": redriven,
        }


def unreachable(bootstrap: str, exc: BaseException) -> ToolError:
    detail = str(exc).split("\n")[0][:120] or type(exc).__name__
    if isinstance(exc, TimeoutError):
        detail = "timed out"
    elif "Unable to bootstrap" in detail:
        detail = "no broker answered"
    return ToolError(
        f"cannot reach Kafka at {bootstrap}: {detail} "
        "(check --bootstrap or [kafka] bootstrap_servers / KVCONDUCTOR_KAFKA_BOOTSTRAP_SERVERS)"
    )


@contextlib.contextmanager
def writing_stdout(done: str = "") -> Iterator[None]:
    """Output to stdout: a failed write (disk full, closed pipe) is one line,
    after `done` (what already happened, e.g. a re-drive).

    Only output goes in here, never Kafka calls, so an OSError is stdout's."""
    try:
        yield
    except OSError as exc:
        raise ToolError(f"{done}cannot write to stdout: {exc.strerror or exc}") from None


@contextlib.asynccontextmanager
async def _consumer(k: KafkaConfig, timeout_s: float) -> AsyncIterator[AIOKafkaConsumer]:
    try:
        # aiokafka reports a refused login or certificate as unreachable.
        await check_access(k, timeout_s)
    except KafkaAccessError as exc:
        raise ToolError(str(exc)) from None
    except (KafkaError, OSError) as exc:
        raise unreachable(k.bootstrap_servers, exc) from None
    try:
        async with asyncio.timeout(timeout_s):
            consumer = await started(
                lambda: AIOKafkaConsumer(
                    bootstrap_servers=k.bootstrap_servers,
                    client_id=f"{k.client_id}-dead-letters",
                    group_id=f"{k.group_id}-dead-letters",
                    enable_auto_commit=False,
                    auto_offset_reset="earliest",
                    request_timeout_ms=int(timeout_s * 1000),
                    **kafka_client_options(k),
                )
            )
    except (KafkaError, OSError, TimeoutError) as exc:
        raise unreachable(k.bootstrap_servers, exc) from None
    try:
        yield consumer
    finally:
        with contextlib.suppress(Exception):
            await consumer.stop()


class Scan(NamedTuple):
    records: list[DeadLetter]
    cursors: dict[int, int]  # partition -> re-drive cursor (next offset to re-drive)
    ends: dict[int, int]


async def _partitions(k: KafkaConfig, topic: str, timeout_s: float) -> list[int]:
    admin = AIOKafkaAdminClient(
        bootstrap_servers=k.bootstrap_servers,
        client_id=f"{k.client_id}-dead-letters",
        request_timeout_ms=int(timeout_s * 1000),
        **kafka_client_options(k),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            described = await admin.describe_topics([topic])
    except (KafkaError, OSError, TimeoutError) as exc:
        raise unreachable(k.bootstrap_servers, exc) from None
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
    info = described[0] if described else {}
    if info.get("error_code", 3) != 0 or not info.get("partitions"):
        raise ToolError(
            f"dead-letter topic {topic!r} does not exist on {k.bootstrap_servers} (the daemon "
            "creates it when it starts; check [kafka] dead_letter_topic or --topic)"
        )
    return sorted(int(p["partition"]) for p in info["partitions"])


async def scan(
    consumer: AIOKafkaConsumer, k: KafkaConfig, topic: str, from_cursor: bool, timeout_s: float
) -> Scan:
    """Every dead letter from the beginning (or from the re-drive cursor) to the
    end offsets as of now, with a progress bar when that takes a while."""
    parts = await _partitions(k, topic, timeout_s)
    tps = [TopicPartition(topic, p) for p in parts]
    consumer.assign(tps)
    begins = await consumer.beginning_offsets(tps)
    ends = await consumer.end_offsets(tps)
    cursors: dict[int, int] = {}
    starts: dict[TopicPartition, int] = {}
    for tp in tps:
        committed = await consumer.committed(tp)
        cursor = max(committed if committed is not None else 0, begins[tp])
        cursors[tp.partition] = cursor
        starts[tp] = cursor if from_cursor else begins[tp]
        consumer.seek(tp, starts[tp])
    total = sum(max(ends[tp] - starts[tp], 0) for tp in tps)
    records: list[DeadLetter] = []
    remaining = {tp for tp in tps if starts[tp] < ends[tp]}
    with Progress(f"reading {topic}", total) as bar:
        while remaining:
            async with asyncio.timeout(timeout_s):
                batch = await consumer.getmany(*remaining, timeout_ms=500, max_records=5000)
            for tp, recs in batch.items():
                for r in recs:
                    if r.offset >= ends[tp]:
                        continue
                    records.append(
                        DeadLetter(tp.partition, r.offset, r.key, r.value, list(r.headers or ()))
                    )
                    bar.advance()
            for tp in list(remaining):
                if await consumer.position(tp) >= ends[tp]:
                    remaining.discard(tp)
    records.sort(key=lambda d: (d.partition, d.offset))
    return Scan(records, cursors, {tp.partition: ends[tp] for tp in tps})


def _select(records: list[DeadLetter], args: argparse.Namespace) -> list[DeadLetter]:
    offsets: set[int] | None = None
    if getattr(args, "offsets", None):
        try:
            offsets = {int(x) for x in re.split(r"[\s,]+", args.offsets.strip()) if x}
        except ValueError:
            raise ToolError(f"--offsets: expected integers, got {args.offsets!r}", 2) from None
    out = []
    for d in records:
        if args.kind and d.kind != args.kind:
            continue
        if args.source_topic and d.source_topic != args.source_topic:
            continue
        if offsets is not None and d.offset not in offsets:
            continue
        out.append(d)
    return out


def _when(ms: str) -> str:
    try:
        stamp = dt.datetime.fromtimestamp(int(ms) / 1000, tz=dt.UTC)
    except (ValueError, OverflowError, OSError):
        return "-"
    return stamp.strftime("%Y-%m-%d %H:%M:%S")


def _short(text: str, n: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 3] + "..."


async def _list(args: argparse.Namespace, cfg: Config) -> int:
    k = cfg.kafka
    topic = args.topic or k.dead_letter_topic
    async with _consumer(k, args.timeout) as consumer:
        found = await scan(consumer, k, topic, from_cursor=False, timeout_s=args.timeout)
    selected = _select(found.records, args)
    if args.limit > 0:
        selected = selected[-args.limit :]
    with writing_stdout():
        _show(topic, found, selected, args.json)
    return 0


def _show(topic: str, found: Scan, selected: list[DeadLetter], as_json: bool) -> None:
    def redriven(d: DeadLetter) -> bool:
        return d.offset < found.cursors.get(d.partition, 0)

    if as_json:
        for d in selected:
            print(json.dumps(d.as_json(redriven(d)), sort_keys=True))
        return
    pending = sum(1 for d in found.records if not redriven(d))
    print(
        f"{topic}: {len(found.records)} dead letters, {pending} not re-driven yet"
        + (f"; showing {len(selected)}" if len(selected) != len(found.records) else "")
    )
    if not selected:
        return
    rows = [
        [
            f"{d.partition}:{d.offset}" if len(found.ends) > 1 else str(d.offset),
            _when(d.header(DLQ_TIME)),
            d.kind,
            f"{d.source_topic}/{d.header(DLQ_PARTITION)}@{d.header(DLQ_OFFSET)}",
            _short((d.key or b"").decode("utf-8", "replace"), 24),
            "yes" if redriven(d) else "no",
            _short(d.header(DLQ_REASON)),
        ]
        for d in selected
    ]
    print_table(
        ["OFFSET", "DEAD-LETTERED (UTC)", "KIND", "SOURCE", "KEY", "REDRIVEN", "REASON"], rows
    )


async def _redrive(args: argparse.Namespace, cfg: Config) -> int:
    k = cfg.kafka
    topic = args.topic or k.dead_letter_topic
    async with _consumer(k, args.timeout) as consumer:
        found = await scan(consumer, k, topic, from_cursor=not args.all, timeout_s=args.timeout)
        candidates = [
            d for d in found.records if args.all or d.offset >= found.cursors[d.partition]
        ]
        selected = _select(candidates, args)
        chosen = {(d.partition, d.offset) for d in selected}
        missing_source = [d for d in selected if not (args.to or d.source_topic)]
        if missing_source:
            raise ToolError(
                f"dead letter at offset {missing_source[0].offset} has no {DLQ_TOPIC} header; "
                "name the target with --to"
            )
        if args.dry_run or not selected:
            with writing_stdout():
                _show_dry_run(topic, candidates, selected, args)
            return 0
        try:
            async with asyncio.timeout(args.timeout):
                producer = await started(
                    lambda: AIOKafkaProducer(
                        bootstrap_servers=k.bootstrap_servers,
                        client_id=f"{k.client_id}-redrive",
                        acks="all",
                        enable_idempotence=True,
                        **kafka_client_options(k),
                    )
                )
        except (KafkaError, OSError, TimeoutError) as exc:
            raise unreachable(k.bootstrap_servers, exc) from None
        targets: dict[str, int] = {}
        try:
            with Progress("re-driving", len(selected)) as bar:
                futures = []
                for d in selected:
                    target = args.to or d.source_topic
                    futures.append(
                        await producer.send(
                            target, key=d.key, value=d.value, headers=d.original_headers()
                        )
                    )
                    targets[target] = targets.get(target, 0) + 1
                for fut in futures:
                    await fut
                    bar.advance()
        except KafkaError as exc:
            raise ToolError(f"re-drive failed, cursor not moved: {exc}") from None
        finally:
            with contextlib.suppress(Exception):
                await producer.stop()
        # Move each partition's cursor past what was re-driven in a row from it.
        commits: dict[TopicPartition, OffsetAndMetadata] = {}
        for partition, cursor in found.cursors.items():
            new = found.ends[partition]
            for d in found.records:
                same = d.partition == partition and d.offset >= cursor
                if same and (d.partition, d.offset) not in chosen:
                    new = d.offset
                    break
            if new > cursor:
                commits[TopicPartition(topic, partition)] = OffsetAndMetadata(new, "")
        if commits:
            await consumer.commit(commits)
    where = ", ".join(f"{t} {n}" for t, n in sorted(targets.items()))
    cursor_text = ", ".join(
        f"{tp.partition}:{om.offset}" if len(found.cursors) > 1 else str(om.offset)
        for tp, om in commits.items()
    )
    records = f"{len(selected)} record{'s' if len(selected) != 1 else ''}"
    with writing_stdout(f"re-drove {records}, but "):
        print(
            f"re-drove {records} ({where})"
            + (f"; cursor now at offset {cursor_text}" if commits else "; cursor not moved"),
            flush=True,
        )
    return 0


def _show_dry_run(
    topic: str, candidates: list[DeadLetter], selected: list[DeadLetter], args: argparse.Namespace
) -> None:
    verb = "would re-drive" if args.dry_run else "nothing to re-drive:"
    for d in selected:
        print(
            f"{verb} offset {d.offset} ({d.kind}) -> {args.to or d.source_topic} "
            f"key={_short((d.key or b'').decode('utf-8', 'replace'), 40)}"
        )
    if not selected:
        print(
            f"{verb} {len(candidates)} dead letters after the cursor, none selected"
            if candidates
            else f"{verb} every dead letter in {topic} was re-driven already "
            "(--all re-drives them again)"
        )
    else:
        print(f"{len(selected)} records would be re-driven (dry run: nothing sent)")


def run(args: argparse.Namespace) -> int:
    """Entry of `kvconductor dead-letters`."""
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)  # errors are ours to report
    try:
        cfg = tool_config(args)
        action = _redrive if args.action == "redrive" else _list
        code = asyncio.run(action(args, cfg))
        with writing_stdout():
            sys.stdout.flush()  # a full disk or a closed pipe shows here at the latest
        return code
    except ToolError as exc:
        return fail(exc, "kvconductor dead-letters")
    except KafkaError as exc:
        return fail(ToolError(f"Kafka error: {exc}"), "kvconductor dead-letters")
