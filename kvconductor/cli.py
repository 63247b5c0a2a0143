"""`kvconductor` command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kvconductor.config import ConfigError, load_config


def _run(args: argparse.Namespace) -> int:
    from kvconductor.daemon import run_daemon
    from kvconductor.logs import setup_logging

    cfg = load_config(Path(args.config) if args.config else None)
    setup_logging(cfg.log.level, cfg.log.format)
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency off Windows
        return asyncio.run(run_daemon(cfg))
    return uvloop.run(run_daemon(cfg))


def _kafka_local(args: argparse.Namespace) -> int:
    from kvconductor import kafka_local

    return kafka_local.main(args.rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvconductor",
        description="Exact, durable KV-cache prefix index for LLM routers, on Kafka.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the daemon")
    run.add_argument("--config", metavar="FILE", help="TOML config (default: built-in defaults)")
    run.set_defaults(func=_run)

    kl = sub.add_parser(
        "kafka-local",
        help="a local Apache Kafka broker from Maven Central's jars: start | stop | status",
        add_help=False,
    )
    kl.add_argument("rest", nargs=argparse.REMAINDER)
    kl.set_defaults(func=_kafka_local)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
    except ConfigError as exc:
        print(str(exc), file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
