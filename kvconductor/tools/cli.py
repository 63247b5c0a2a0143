"""`kvconductor` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

from kvconductor.config import ConfigError, KafkaConfig, LogConfig, load_config
from kvconductor.tools.termui import ToolError


def _serve(main: Coroutine[Any, Any, int], log: LogConfig, kafka: KafkaConfig) -> int:
    """Run a long-lived command on uvloop with the configured logging.

    Not over Kafka TLS: uvloop's TLS close does not read what the broker still sends (the
    answer to a consumer's pending fetch), so a consumer's stop waited out the 30 s TLS
    shutdown timeout (MagicStack/uvloop#471); asyncio's own loop closes at once."""
    from kvconductor.obs import logs

    logs.setup_logging(log.level, log.format)
    try:
        if kafka.security_protocol in ("SSL", "SASL_SSL"):
            return asyncio.run(main)
        try:
            import uvloop
        except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
            return asyncio.run(main)
        return uvloop.run(main)
    finally:
        logs.drain(5.0)


def _run(args: argparse.Namespace) -> int:
    from kvconductor.service.daemon import run_daemon

    cfg = load_config(Path(args.config) if args.config else None)
    return _serve(run_daemon(cfg), cfg.log, cfg.kafka)


def _kafka_local(args: argparse.Namespace) -> int:
    from kvconductor.tools.kafka_local import broker as kafka_local

    return kafka_local.main(args.rest)


def _demo(args: argparse.Namespace) -> int:
    from kvconductor.tools.demo.run import run

    return run(args)


def _query(args: argparse.Namespace) -> int:
    from kvconductor.tools.query_status import run_query

    return run_query(args)


def _status(args: argparse.Namespace) -> int:
    from kvconductor.tools.query_status import run_status

    return run_status(args)


def _dead_letters(args: argparse.Namespace) -> int:
    from kvconductor.tools.dead_letters.tool import run

    return run(args)


def _bridge(args: argparse.Namespace) -> int:
    from kvconductor.tools.extras import needs_extra

    with needs_extra("bridge", "kvconductor bridge"):
        from kvconductor.bridge.app import run_bridge
        from kvconductor.bridge.config import load_bridge_config

    cfg = load_bridge_config(Path(args.config) if args.config else None)
    return _serve(run_bridge(cfg), cfg.log, cfg.kafka)


def _soak(args: argparse.Namespace) -> int:
    from kvconductor.tools.soak.run import run

    return run(args)


def _replica(args: argparse.Namespace) -> int:
    from kvconductor.service.replica_server import run_replica

    cfg = load_config(Path(args.config) if args.config else None)
    return _serve(run_replica(cfg, args.follow), cfg.log, cfg.kafka)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconductor",
        description="Exact, durable KV-cache prefix index for LLM routers, on Kafka.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", metavar="FILE", help="TOML config (default: built-in defaults)")
    run.set_defaults(func=_run)

    replica = sub.add_parser(
        "replica", help="read-only query server rebuilt from the snapshot topic (docs/replica.md)"
    )
    replica.add_argument("--config", metavar="FILE", help="TOML config (default: defaults)")
    replica.add_argument(
        "--follow",
        choices=("events", "snapshots"),
        default="events",
        help="keep fresh by tailing the event topics (default) or the snapshot topic",
    )
    replica.set_defaults(func=_replica)

    bridge = sub.add_parser("bridge", help="relay engines' ZMQ KV events into Kafka")
    bridge.add_argument("--config", metavar="FILE", help="bridge TOML (see config/bridge.toml)")
    bridge.set_defaults(func=_bridge)

    kl = sub.add_parser(
        "kafka-local",
        help="a local Apache Kafka broker from Maven Central's jars: start | stop | status",
        add_help=False,
        prefix_chars="+",  # so that REMAINDER also takes leading --options
    )
    kl.add_argument("rest", nargs=argparse.REMAINDER)
    kl.set_defaults(func=_kafka_local)

    from kvconductor.tools.bench import command as bench_cmd  # light: the benchmark loads on use

    bench = sub.add_parser(
        "bench",
        help="benchmark against Dynamo's RadixTree (docs/benchmarks.md)",
        add_help=False,
        prefix_chars="+",  # so that REMAINDER also takes leading --options
    )
    bench.add_argument("rest", nargs=argparse.REMAINDER)
    bench.set_defaults(func=bench_cmd.cli)

    demo = sub.add_parser(
        "demo", help="local broker + daemon + simulated engines, with a live view (Ctrl-C stops)"
    )
    demo.add_argument("--config", metavar="FILE", help="TOML config (default: built-in defaults)")
    demo.add_argument("--bootstrap", metavar="HOST:PORT", help="use this broker, start none")
    demo.add_argument("--duration", type=float, metavar="S", help="stop after S seconds")
    demo.add_argument("--engines-only", action="store_true", help="only publish demo traffic")
    demo.add_argument("--rate", type=float, default=20.0, help="requests/s (default 20)")
    demo.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    demo.add_argument("--plain", action="store_true", help="plain lines, even on a terminal")
    demo.add_argument("--keep-broker", action="store_true", help="leave a started broker up")
    demo.add_argument("--no-local-broker", action="store_true", help="never start a broker")
    demo.add_argument("--broker-dir", metavar="DIR", help="local broker's data folder")
    demo.add_argument("--broker-port", type=int, metavar="PORT", help="local broker's port")
    demo.add_argument("--wait", type=float, default=120.0, help="--engines-only: s for Kafka")
    demo.add_argument("--timeout", type=float, default=15.0, help="s to reach the broker")
    demo.add_argument("--via-bridge", metavar="URL", help="--engines-only: ZMQ + this bridge")
    demo.add_argument("--zmq-host", default="127.0.0.1", help="host the bridge connects to")
    demo.add_argument("--zmq-bind", default="0.0.0.0", help="address the PUB sockets bind")
    demo.add_argument("--zmq-port", type=int, default=5557, help="first PUB port (one a rank)")
    demo.set_defaults(func=_demo)

    query = sub.add_parser("query", help="cached prefix per instance and tier for a prompt")
    query.add_argument("--config", metavar="FILE", help="TOML config (for [http] and the token)")
    query.add_argument("--url", help="daemon URL (default: from [http] host and port)")
    query.add_argument("--model", required=True)
    query.add_argument("--block-size", type=int, required=True, metavar="N")
    prompt = query.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", metavar="IDS", help="token ids: 1,2,3 (or spaces)")
    prompt.add_argument("--text", help="text; its UTF-8 bytes are the token ids (no tokenizer)")
    prompt.add_argument("--text-file", metavar="FILE", help="like --text, from a file (- stdin)")
    prompt.add_argument("--seq-hashes", metavar="HASHES", help="engine block hashes instead")
    query.add_argument("--lora", help="LoRA adapter name")
    query.add_argument("--tenant", help="tenant id (default: default)")
    query.add_argument("--instance", help="only this instance")
    query.add_argument("--salt", help="cache salt")
    query.add_argument("--json", action="store_true", help="print the raw JSON answer")
    query.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout, s")
    query.set_defaults(func=_query)

    status = sub.add_parser("status", help="instances, tiers, lag, pending, dead letters")
    status.add_argument("--config", metavar="FILE", help="TOML config (for [http] and the token)")
    status.add_argument("--url", help="daemon URL (default: from [http] host and port)")
    status.add_argument("--json", action="store_true", help="one JSON object")
    status.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout, s")
    status.set_defaults(func=_status)

    dl = sub.add_parser("dead-letters", help="list or re-drive dead-lettered records")
    dl_sub = dl.add_subparsers(dest="action", required=True, metavar="ACTION")
    dl_list = dl_sub.add_parser("list", help="show dead letters, newest last")
    dl_list.add_argument("--limit", type=int, default=50, help="newest N (0: all; default 50)")
    dl_list.add_argument("--json", action="store_true", help="one JSON object per line")
    dl_redrive = dl_sub.add_parser("redrive", help="produce them back to their source topic")
    dl_redrive.add_argument("--all", action="store_true", help="also those re-driven before")
    dl_redrive.add_argument("--dry-run", action="store_true", help="show, send nothing")
    dl_redrive.add_argument("--to", metavar="TOPIC", help="target topic (default: the source)")
    dl_redrive.add_argument("--offsets", help="only these dead-letter offsets: 3,5,8")
    for action in (dl_list, dl_redrive):
        action.add_argument("--config", metavar="FILE", help="TOML config (default: defaults)")
        action.add_argument("--bootstrap", metavar="HOST:PORT", help="broker (default: config)")
        action.add_argument("--topic", help="dead-letter topic (default: from config)")
        action.add_argument("--timeout", type=float, default=15.0, help="s to reach Kafka")
        action.add_argument("--kind", help="only this dlq-kind (e.g. missing_header)")
        action.add_argument("--source-topic", help="only those from this topic")
    dl.set_defaults(func=_dead_letters)

    soak = sub.add_parser(
        "soak", help="demo traffic under broker and daemon faults, checked against a replay"
    )
    soak.add_argument(
        "--minutes", type=float, default=5.0, help="traffic minutes, >= 1 fault each (default 5)"
    )
    soak.add_argument(
        "--fault-every", type=float, default=20.0, metavar="S", help="s between faults (20)"
    )
    soak.add_argument("--seed", type=int, default=0, help="traffic and fault seed (default 0)")
    soak.add_argument("--rate", type=float, default=20.0, help="requests/s (default 20)")
    soak.add_argument("--json", metavar="PATH", help="also write the report as JSON")
    soak.add_argument("--keep", action="store_true", help="keep broker data and logs on PASS")
    soak.set_defaults(func=_soak)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except ToolError as exc:  # a command's own one-line failure (a missing extra)
        print(f"kvconductor: error: {exc}", file=sys.stderr)
        return exc.code
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
