"""`kvconductor demo`: a local broker, the daemon and simulated engines, live.

    kvconductor demo                      # local broker (kafka-local), daemon, engines
    kvconductor demo --bootstrap H:P      # an existing broker instead
    kvconductor demo --duration 20        # stop by itself (CI, tests)
    kvconductor demo --engines-only --bootstrap kafka:9092   # only the traffic

What it starts, in order: the local Kafka broker of `kvconductor kafka-local`
unless one already runs there or another broker is configured; the daemon
(`kvconductor.service.daemon.Daemon`, in this process, with the usual configuration
file and `KVCONDUCTOR_*` environment); the simulated engines and pool
backend of `kvconductor.tools.demo.engines`, publishing real-format payloads to the
engine and pool topics. Then it shows, from the daemon's HTTP API: records
consumed per second, blocks per tier per instance, pending two-phase
entries, dead letters, and a stream of sample `/query` calls with their
per-tier hits. On a terminal the view is drawn with rich; otherwise it prints
plain lines.

Ctrl-C (or SIGTERM, or the end of `--duration`) stops the engines, then the
daemon (which publishes a last snapshot), then the broker if, and only if,
the demo started it. A broker it found running is left alone.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import errno
import io
import logging
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from kvconductor.config import Config, kafka_client_options, reveal
from kvconductor.kafka.clients import started
from kvconductor.tools.demo.engines import (
    DEMO_BLOCK_SIZE,
    DEMO_MODEL,
    DEMO_POOL,
    SYSTEM_PROMPTS,
    KafkaSink,
    Traffic,
    ZmqSink,
    default_fleet,
    text_tokens,
)
from kvconductor.tools.termui import (
    Spinner,
    ToolError,
    fail,
    is_tty,
    rich,
    rich_console,
    tool_config,
)

PROG = "kvconductor demo"
TICK_S = 0.5
PLAIN_STATUS_EVERY_S = 2.0
START_TIMEOUT_S = 90.0


def _say(message: str) -> None:
    print(f"demo: {message}", file=sys.stderr, flush=True)


def _line(out: IO[str], text: str) -> None:
    """One line of the demo's own output (a full disk or closed pipe ends the demo)."""
    from kvconductor.tools.dead_letters.tool import writing_stdout

    with writing_stdout():
        print(text, file=out, flush=True)


class _Stderr:
    """Writes to whatever `sys.stderr` is at the time (rich's live view swaps it)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _quiet_logging(cfg: Config) -> None:
    """The daemon's warnings and errors on stderr, above the live view; no info chatter."""
    import structlog

    level = logging.DEBUG if cfg.log.level == "debug" else logging.WARNING
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="%H:%M:%S"),
            structlog.processors.format_exc_info,
            structlog.dev.ConsoleRenderer(colors=is_tty(sys.stderr)),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=True,
    )
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)


def _with_bootstrap(cfg: Config, bootstrap: str) -> Config:
    import msgspec

    return msgspec.structs.replace(
        cfg, kafka=msgspec.structs.replace(cfg.kafka, bootstrap_servers=bootstrap)
    )


# ------------------------------------------------------------------ broker


@dataclass
class Broker:
    bootstrap: str
    started_here: bool = False
    data_dir: Path | None = None

    @property
    def note(self) -> str:
        if self.started_here:
            return f"{self.bootstrap} (local broker started by the demo)"
        if self.data_dir is not None:
            return f"{self.bootstrap} (local broker already running, left running)"
        return self.bootstrap

    def stop(self) -> None:
        if not self.started_here:
            return
        from kvconductor.tools.kafka_local import broker as kafka_local

        _say("stopping the local Kafka broker the demo started")
        try:
            kafka_local.stop(self.data_dir)
        except (kafka_local.KafkaLocalError, OSError) as exc:
            _say(f"could not stop the local broker: {exc}")
        self.started_here = False


def local_broker(cfg: Config, args: argparse.Namespace) -> Broker:
    """The broker to use: `--bootstrap` or a configured one as they are; else the
    local broker of `kvconductor kafka-local` (its data folder and port, or
    `--broker-dir` and `--broker-port`), started here unless it already runs.
    A configured `bootstrap_servers` other than the local broker's address, or
    `--no-local-broker`, means: start nothing."""
    bootstrap = cfg.kafka.bootstrap_servers
    explicit = args.broker_dir is not None or args.broker_port is not None
    if args.bootstrap or args.no_local_broker:
        return Broker(bootstrap)
    from kvconductor.tools.kafka_local import broker as kafka_local

    try:
        port = args.broker_port if args.broker_port is not None else kafka_local.default_port()
    except kafka_local.KafkaLocalError as exc:
        raise ToolError(str(exc)) from None
    local_addr = f"{kafka_local.HOST}:{port}"
    if bootstrap != local_addr and not explicit:
        return Broker(bootstrap)
    data_dir = (
        (Path(args.broker_dir) if args.broker_dir else kafka_local.default_data_dir())
        .expanduser()
        .resolve()
    )
    with contextlib.redirect_stdout(io.StringIO()):
        status = kafka_local.status(data_dir)
    if status.running:
        return Broker(status.bootstrap or local_addr, False, data_dir)
    _say(
        f"starting a local Kafka broker in {data_dir} (needs Java 17+; the first start "
        "fetches the broker's jars from Maven Central with mvn, once)"
    )
    try:
        with Spinner("starting the local Kafka broker"):
            address = kafka_local.start(data_dir, port=port)
    except kafka_local.KafkaLocalError as exc:
        raise ToolError(f"cannot start the local Kafka broker: {exc}") from None
    except OSError as exc:  # its data folder: not a folder, read-only, disk full
        raise ToolError(
            f"cannot start the local Kafka broker in {exc.filename or data_dir}: "
            f"{exc.strerror or exc}"
        ) from None
    except KeyboardInterrupt:
        with contextlib.suppress(Exception):
            kafka_local.stop(data_dir)
        raise
    return Broker(address, True, data_dir)


async def check_kafka(cfg: Config, timeout_s: float) -> None:
    """Raise a one-line ToolError unless the broker answers within `timeout_s`."""
    from aiokafka.admin import AIOKafkaAdminClient

    from kvconductor.tools.dead_letters.tool import unreachable

    k = cfg.kafka
    admin = AIOKafkaAdminClient(
        bootstrap_servers=k.bootstrap_servers,
        client_id=f"{k.client_id}-demo",
        request_timeout_ms=int(timeout_s * 1000),
        **kafka_client_options(k),
    )
    try:
        async with asyncio.timeout(timeout_s):
            await admin.start()
            await admin.describe_cluster()
    except Exception as exc:
        raise unreachable(k.bootstrap_servers, exc) from None
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


# -------------------------------------------------------------------- view


@dataclass
class QueryResult:
    n: int
    label: str
    tokens: int
    answer: dict[str, Any]
    ms: float

    def instances(self) -> list[tuple[str, dict[str, Any]]]:
        hits = [(i, h) for tenant in self.answer.values() for i, h in tenant.items()]
        hits.sort(key=lambda ih: (-int(ih[1]["longest_matched"]), -int(ih[1]["GPU"]), ih[0]))
        return hits

    def best(self) -> tuple[str, dict[str, Any]] | None:
        hits = self.instances()
        return hits[0] if hits and hits[0][1]["longest_matched"] > 0 else None


@dataclass
class ViewState:
    broker: str
    url: str
    fleet: str
    started: float = field(default_factory=time.monotonic)
    workers: list[dict[str, Any]] = field(default_factory=list)
    pending: dict[str, int] = field(default_factory=dict)
    consumed_rate: float = 0.0
    events_rate: float = 0.0
    consumed: float = 0.0
    dead_letters: float = 0.0
    lag: float = 0.0
    queries: collections.deque[QueryResult] = field(
        default_factory=lambda: collections.deque(maxlen=8)
    )
    total_queries: int = 0
    first_hit_s: float | None = None

    def tier_rows(self, modes: dict[str, str]) -> list[list[str]]:
        rows: list[list[str]] = []
        for ns in self.workers:
            if ns.get("model") != DEMO_MODEL:
                continue
            for instance, ranks in sorted(ns.get("instances", {}).items()):
                for rank, t in sorted(ranks.items(), key=lambda kv: int(kv[0])):
                    mode = modes.get(instance, "?")
                    rows.append(
                        [instance, rank, mode, str(t["GPU"]), str(t["CPU"]), str(t["DISK"])]
                    )
            for backend, media in sorted(ns.get("pools", {}).items()):
                cpu = sum(n for m, n in media.items() if m == "cpu")
                disk = sum(n for m, n in media.items() if m != "cpu")
                rows.append([backend, "-", "pool backend", "-", str(cpu), str(disk)])
        return rows

    def totals(self) -> dict[str, int]:
        out = {"GPU": 0, "CPU": 0, "DISK": 0, "pool": 0}
        for ns in self.workers:
            for ranks in ns.get("instances", {}).values():
                for t in ranks.values():
                    for tier in ("GPU", "CPU", "DISK"):
                        out[tier] += int(t[tier])
            for media in ns.get("pools", {}).values():
                out["pool"] += sum(int(n) for n in media.values())
        return out

    def pending_text(self) -> str:
        p = self.pending
        return (
            f"{p.get('intents', 0)} intents, {p.get('waiting', 0)} waiting, "
            f"{p.get('unresolved', 0)} unresolved"
        )


def query_line(q: QueryResult) -> str:
    best = q.best()
    head = f"query {q.n:>3} {q.label} ({q.tokens} tokens, {q.ms:.1f} ms):"
    if best is None:
        return f"{head} no hits yet"
    name, hit = best
    others = "; ".join(
        f"{i} {h['longest_matched']}/{h['GPU']}/{h['CPU']}/{h['DISK']}"
        for i, h in q.instances()[1:]
    )
    return (
        f"{head} best {name} matched {hit['longest_matched']} "
        f"(GPU {hit['GPU']}, CPU {hit['CPU']}, DISK {hit['DISK']})"
        + (f"; others matched/GPU/CPU/DISK: {others}" if others else "")
    )


def status_line(st: ViewState) -> str:
    t = st.totals()
    return (
        f"[{time.monotonic() - st.started:6.1f}s] consumed {st.consumed_rate:.0f} records/s "
        f"({st.events_rate:.0f} KV events/s published) | blocks GPU {t['GPU']} CPU {t['CPU']} "
        f"DISK {t['DISK']} pool {t['pool']} | pending {st.pending_text()} | "
        f"dead letters {int(st.dead_letters)} | lag {int(st.lag)}"
    )


def render_rich(st: ViewState, modes: dict[str, str]) -> Any:
    Group = rich("console").Group
    Panel = rich("panel").Panel
    Table = rich("table").Table
    Text = rich("text").Text

    uptime = time.monotonic() - st.started
    header = Text.assemble(
        ("kvconductor demo", "bold"),
        f"  ·  broker {st.broker}  ·  daemon {st.url}  ·  up {uptime:.0f}s\n",
        (
            f"consumed {st.consumed_rate:.0f} records/s  ·  engines publish "
            f"{st.events_rate:.0f} KV events/s  ·  pending two-phase: {st.pending_text()}  ·  "
            f"dead letters {int(st.dead_letters)}  ·  consumer lag {int(st.lag)}",
            "cyan",
        ),
    )
    tiers = Table(title="Blocks per tier (GET /workers)", title_justify="left", expand=True)
    for name in ("instance", "dp", "offload", "GPU", "CPU", "DISK"):
        tiers.add_column(name, justify="left" if name in ("instance", "offload") else "right")
    for row in st.tier_rows(modes):
        tiers.add_row(*row)
    queries = Table(
        title=f"Sample queries (POST /query), {st.total_queries} so far; tokens of the "
        "longest cached prefix",
        title_justify="left",
        expand=True,
    )
    for name in ("#", "prompt", "tokens", "best instance", "GPU", "CPU", "DISK", "others"):
        queries.add_column(
            name, justify="left" if name in ("prompt", "best instance", "others") else "right"
        )
    for q in reversed(st.queries):
        best = q.best()
        others = "  ".join(f"{i} {h['GPU']}/{h['CPU']}/{h['DISK']}" for i, h in q.instances()[1:])
        if best is None:
            queries.add_row(str(q.n), q.label, str(q.tokens), "-", "0", "0", "0", others)
        else:
            name, hit = best
            queries.add_row(
                str(q.n), q.label, str(q.tokens), name,
                str(hit["GPU"]), str(hit["CPU"]), str(hit["DISK"]), others,
            )  # fmt: skip
    sample = SYSTEM_PROMPTS["support"].split(". ")[0] + "."
    footer = Text(
        f'try: kvconductor query --model {DEMO_MODEL} --block-size {DEMO_BLOCK_SIZE} --text "'
        f'{sample}"  ·  kvconductor status  ·  kvconductor dead-letters list  ·  Ctrl-C stops '
        "what the demo started",
        style="dim",
    )
    return Group(Panel(header), tiers, queries, footer)


class Poller:
    """Reads the daemon's HTTP API for the view and runs the sample queries."""

    def __init__(self, url: str, token: str | None, traffic: Traffic) -> None:
        self.url = url
        self.token = token
        self.traffic = traffic
        self._session: Any = None
        self._last: tuple[float, float, int] | None = None  # time, consumed, events

    async def __aenter__(self) -> Poller:
        import aiohttp

        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        self._session = aiohttp.ClientSession(
            headers=headers, timeout=aiohttp.ClientTimeout(total=10)
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._session.close()

    async def refresh(self, st: ViewState) -> None:
        from kvconductor.tools.api_client import metric_by, metric_sum, parse_metrics

        async with self._session.get(f"{self.url}/workers") as resp:
            body = await resp.json()
        st.workers = body.get("workers", [])
        st.pending = body.get("pending", {})
        async with self._session.get(f"{self.url}/metrics") as resp:
            metrics = parse_metrics(await resp.text())
        consumed = sum(metric_by(metrics, "kvconductor_records_consumed_total", "topic").values())
        st.consumed = consumed
        st.dead_letters = metric_sum(metrics, "kvconductor_dead_letters_total")
        st.lag = metric_sum(metrics, "kvconductor_consumer_lag")
        now, events = time.monotonic(), self.traffic.stats.events
        if self._last is not None:
            dt = max(now - self._last[0], 1e-6)
            st.consumed_rate = (consumed - self._last[1]) / dt
            st.events_rate = (events - self._last[2]) / dt
        self._last = (now, consumed, events)

    async def query(self, st: ViewState) -> QueryResult:
        label, text = self.traffic.workload.sample_query()
        tokens = text_tokens(text)
        body = {"model": DEMO_MODEL, "block_size": DEMO_BLOCK_SIZE, "token_ids": tokens}
        started = time.perf_counter()
        async with self._session.post(f"{self.url}/query", json=body) as resp:
            answer = await resp.json()
        ms = (time.perf_counter() - started) * 1000
        st.total_queries += 1
        q = QueryResult(st.total_queries, label, len(tokens), answer, ms)
        st.queries.append(q)
        if st.first_hit_s is None and q.best() is not None:
            st.first_hit_s = time.monotonic() - st.started
        return q


# --------------------------------------------------------------------- run


def _signals(stop: asyncio.Event, on_second: Callable[[], None]) -> None:
    loop = asyncio.get_running_loop()
    count = 0

    def handler() -> None:
        nonlocal count
        count += 1
        if count == 1:
            _say("stopping (Ctrl-C again to skip the clean shutdown)")
            stop.set()
        else:
            on_second()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, handler)


def _cancel_main() -> Callable[[], None]:
    task = asyncio.current_task()
    assert task is not None

    def cancel() -> None:
        _say("stopping at once")
        task.cancel()

    return cancel


async def _producer(cfg: Config) -> Any:
    from aiokafka import AIOKafkaProducer

    k = cfg.kafka
    return await started(
        lambda: AIOKafkaProducer(
            bootstrap_servers=k.bootstrap_servers,
            client_id=f"{k.client_id}-demo-engines",
            acks=1,
            linger_ms=5,
            **kafka_client_options(k),
        )
    )


async def _wait_running(daemon: Any, task: asyncio.Task[None], stop: asyncio.Event) -> bool:
    deadline = time.monotonic() + START_TIMEOUT_S
    while daemon.status != "running" or daemon.http_port is None:
        if task.done():
            exc = task.exception()
            if isinstance(exc, OSError) and daemon.http_port is None:
                http = daemon.cfg.http
                why = "address already in use" if exc.errno == errno.EADDRINUSE else exc
                raise ToolError(
                    f"the daemon cannot listen on {http.host}:{http.port}: {why} "
                    "(another kvconductor running? set KVCONDUCTOR_HTTP_PORT)"
                )
            raise ToolError(f"the daemon stopped while starting: {exc}")
        if stop.is_set():
            return False
        if time.monotonic() > deadline:
            raise ToolError(
                f"the daemon did not start within {START_TIMEOUT_S:.0f} s ({daemon.status})"
            )
        await asyncio.sleep(0.1)
    return True


async def demo(cfg: Config, args: argparse.Namespace, broker: Broker, out: IO[str]) -> int:
    from kvconductor.lifecycle import FatalError
    from kvconductor.service.daemon import Daemon

    stop = asyncio.Event()
    _signals(stop, _cancel_main())
    await check_kafka(cfg, args.timeout)
    plain = args.plain or rich_console(out) is None  # no terminal, or no rich
    fleet = default_fleet()
    modes = {s.instance: f"{s.offload}" for s in fleet}
    daemon = Daemon(cfg)
    daemon_task: asyncio.Task[None] = asyncio.create_task(daemon.run())
    traffic_stop = asyncio.Event()
    traffic_task: asyncio.Task[None] | None = None
    producer: Any = None
    code = 0
    st: ViewState | None = None
    try:
        if not await _wait_running(daemon, daemon_task, stop):
            return 0
        host = cfg.http.host if cfg.http.host not in ("0.0.0.0", "::") else "127.0.0.1"
        url = f"http://{host}:{daemon.http_port}"
        producer = await _producer(cfg)
        sink = KafkaSink(producer, cfg.kafka.engine_topic, cfg.kafka.pool_topic)
        traffic = Traffic(sink, rate=args.rate, seed=args.seed, fleet=fleet)
        traffic_task = asyncio.create_task(traffic.run(traffic_stop))
        st = ViewState(
            broker.note, url, "; ".join(s.describe for s in fleet), started=time.monotonic()
        )
        _line(out, f"kvconductor demo: broker {broker.note}, daemon {url}")
        _line(out, f"engines: {st.fleet}; pool backend {DEMO_POOL}")
        deadline = None if args.duration is None else time.monotonic() + args.duration
        async with Poller(url, reveal(cfg.http.auth_token), traffic) as poller:
            live: Any = None
            if not plain:
                live = rich("live").Live(
                    render_rich(st, modes),
                    console=rich_console(out),
                    refresh_per_second=4,
                    transient=False,
                )
                live.start()
            last_status = 0.0
            try:
                while not stop.is_set():
                    if deadline is not None and time.monotonic() >= deadline:
                        break
                    if traffic_task.done():
                        traffic_task.result()  # raises what stopped the engines
                        break
                    if daemon_task.done():
                        failure = None if daemon_task.cancelled() else daemon_task.exception()
                        raise ToolError(f"the daemon stopped: {failure or 'without an error'}")
                    with contextlib.suppress(Exception):
                        await poller.refresh(st)
                    q: QueryResult | None = None
                    with contextlib.suppress(Exception):
                        q = await poller.query(st)
                    if live is not None:
                        live.update(render_rich(st, modes))
                    else:
                        now = time.monotonic()
                        if now - last_status >= PLAIN_STATUS_EVERY_S:
                            _line(out, status_line(st))
                            last_status = now
                        if q is not None:
                            _line(out, query_line(q))
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), TICK_S)
            finally:
                if live is not None:
                    live.stop()
        if args.duration is not None and st.first_hit_s is None:
            print(f"demo: no query hit within {args.duration:.0f} s", file=sys.stderr)
            code = 1
    except FatalError as exc:
        raise ToolError(f"the daemon stopped: {exc}") from None
    finally:
        traffic_stop.set()
        if traffic_task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(traffic_task, 15)
        if producer is not None:
            with contextlib.suppress(Exception):
                await producer.stop()
        daemon.stop()
        if daemon_task.done():  # it failed, and that was reported above
            if not daemon_task.cancelled():
                daemon_task.exception()
        else:
            try:
                await asyncio.wait_for(daemon_task, 60)
            except FatalError as exc:
                _say(f"the daemon stopped with an error: {exc}")
            except Exception as exc:
                _say(f"the daemon did not stop cleanly: {type(exc).__name__}: {exc}")
    if st is not None:
        hit = (
            "no query hit" if st.first_hit_s is None else f"first hit after {st.first_hit_s:.1f} s"
        )
        _line(
            out,
            f"demo: stopped engines and daemon; {st.total_queries} sample queries, {hit}",
        )
    return code


async def _kafka_sink(cfg: Config, args: argparse.Namespace, stop: asyncio.Event) -> KafkaSink:
    """Wait for the broker, create the topics if missing, start a producer."""
    from kvconductor.kafka.topics import Replication, ensure_topics_on, topic_specs

    deadline = time.monotonic() + args.wait
    while True:
        try:
            await check_kafka(cfg, min(args.timeout, max(deadline - time.monotonic(), 1.0)))
            break
        except ToolError:
            if time.monotonic() >= deadline or stop.is_set():
                raise
            _say(f"waiting for Kafka at {cfg.kafka.bootstrap_servers}")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 2.0)
    k = cfg.kafka
    try:
        await ensure_topics_on(
            k.bootstrap_servers,
            f"{k.client_id}-demo",
            kafka_client_options(k),
            topic_specs(cfg),
            Replication.of(k),
        )
    except RuntimeError as exc:
        raise ToolError(str(exc)) from None
    return KafkaSink(await _producer(cfg), k.engine_topic, k.pool_topic)


async def _bridge_call(
    session: Any, url: str, path: str, body: dict[str, Any], token: str | None
) -> tuple[int, str]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with session.post(f"{url}{path}", json=body, headers=headers) as resp:
        return int(resp.status), await resp.text()


async def register_with_bridge(
    url: str, bodies: list[dict[str, Any]], wait_s: float, stop: asyncio.Event
) -> None:
    """POST every registration to the bridge, retrying while it is not up yet."""
    import aiohttp

    token = os.environ.get("KVCONDUCTOR_BRIDGE_AUTH_TOKEN") or None
    deadline = time.monotonic() + wait_s
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=20)) as session:
        for body in bodies:
            while True:
                try:
                    status, text = await _bridge_call(session, url, "/register", body, token)
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    status, text = 0, str(exc) or type(exc).__name__
                if status == 200:
                    break
                if 400 <= status < 500 or time.monotonic() >= deadline or stop.is_set():
                    raise ToolError(
                        f"the bridge at {url} did not register {body['instance_id']} "
                        f"dp{body['dp_rank']}: {status or 'unreachable'} {text[:200]}"
                    )
                _say(f"waiting for the bridge at {url} ({status or text[:80]})")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), 2.0)


async def unregister_from_bridge(url: str, bodies: list[dict[str, Any]]) -> None:
    import aiohttp

    token = os.environ.get("KVCONDUCTOR_BRIDGE_AUTH_TOKEN") or None
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
        for body in bodies:
            with contextlib.suppress(Exception):
                key = {"instance_id": body["instance_id"], "dp_rank": body["dp_rank"]}
                await _bridge_call(session, url, "/unregister", key, token)


async def engines_only(cfg: Config, args: argparse.Namespace, out: IO[str]) -> int:
    """Only the simulated engines and pool backend (docker-compose's `engines`
    service). Straight to Kafka by default (waiting for the broker and creating
    the topics if missing); with `--via-bridge URL`, on ZMQ PUB sockets like real
    engines, registered with that bridge, which relays them to Kafka."""
    stop = asyncio.Event()
    _signals(stop, _cancel_main())
    sink: KafkaSink | ZmqSink
    registrations: list[dict[str, Any]] = []
    if args.via_bridge:
        try:
            zmq_sink = ZmqSink(default_fleet(), args.zmq_bind, args.zmq_port)
        except OSError as exc:
            raise ToolError(str(exc)) from None
        registrations = zmq_sink.registrations(args.zmq_host)
        sink = zmq_sink
        where = f"ZMQ tcp://{args.zmq_host}:{args.zmq_port}+ via bridge {args.via_bridge}"
    else:
        sink = await _kafka_sink(cfg, args, stop)
        k = cfg.kafka
        where = f"{k.bootstrap_servers} topics {k.engine_topic}, {k.pool_topic}"
    traffic = Traffic(sink, rate=args.rate, seed=args.seed)
    task: asyncio.Task[None] | None = None
    try:
        if registrations:
            await register_with_bridge(args.via_bridge, registrations, args.wait, stop)
        task = asyncio.create_task(traffic.run(stop))
        _line(
            out,
            f"demo engines -> {where}: " + "; ".join(e.spec.describe for e in traffic.engines),
        )
        end = None if args.duration is None else time.monotonic() + args.duration
        while not stop.is_set() and not task.done():
            if end is not None and time.monotonic() >= end:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    stop.wait(), min(5.0, max(end - time.monotonic(), 0.1)) if end else 5.0
                )
            s = traffic.stats
            rate = s.events / max(time.monotonic() - s.started, 1e-6)
            _line(
                out,
                f"engines: {s.requests} requests, {s.engine_records} engine records, "
                f"{s.pool_records} pool records, {s.events} KV events ({rate:.0f}/s)",
            )
    finally:
        stop.set()
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(task, 15)
        if registrations:
            await unregister_from_bridge(args.via_bridge, registrations)
        if isinstance(sink, KafkaSink):
            with contextlib.suppress(Exception):
                await sink.producer.stop()
        sink.close()
    if task is not None and task.done() and not task.cancelled() and task.exception():
        raise ToolError(f"the engines stopped: {task.exception()}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry of `kvconductor demo`."""
    out = sys.stdout
    broker: Broker | None = None
    try:
        cfg = tool_config(args)
        _quiet_logging(cfg)
        if args.via_bridge and not args.engines_only:
            raise ToolError("--via-bridge goes with --engines-only", 2)
        if args.engines_only:
            return asyncio.run(engines_only(cfg, args, out))
        broker = local_broker(cfg, args)
        if broker.bootstrap != cfg.kafka.bootstrap_servers:
            cfg = _with_bootstrap(cfg, broker.bootstrap)
        return asyncio.run(demo(cfg, args, broker, out))
    except ToolError as exc:
        return fail(exc, PROG)
    except (KeyboardInterrupt, asyncio.CancelledError):
        _say("interrupted")
        return 130
    finally:
        if broker is not None and not args.keep_broker:
            broker.stop()
