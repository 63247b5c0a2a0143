"""The Helm chart's topics hook: create kvconductor's missing topics and check
the existing ones, exactly as the daemon does at start-up
(kvconductor.kafka.topics), then exit.

    python ensure-topics.py --config kvconductor.toml [--list]

--list prints the topics it would create, one JSON object a line, and
connects to nothing (deploy/check compares them with the chart's KafkaTopics).
Exit codes: 0 done, 1 Kafka unreachable or refusing (credentials, a topic
that cannot serve), 2 a configuration error.
"""

import argparse
import asyncio
import json
import sys
from pathlib import Path

from aiokafka.errors import KafkaError

from kvconductor.config import ConfigError, kafka_client_options, load_config
from kvconductor.kafka.topics import ensure_service_topics, topic_specs
from kvconductor.lifecycle import FatalError
from kvconductor.obs import logs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--list", action="store_true", help="print the topics, connect to nothing")
    args = parser.parse_args()
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        print(exc, file=sys.stderr)
        return 2
    specs = topic_specs(cfg)
    if args.list:
        for s in specs:
            print(
                json.dumps(
                    {
                        "name": s.name,
                        "partitions": s.partitions,
                        "replication_factor": s.replication_factor,
                        "configs": dict(s.configs),
                    }
                )
            )
        return 0
    k = cfg.kafka
    # The daemon's log lines ("topics created", "topic under-replicated"), as it writes them.
    logs.setup_logging(cfg.log.level, cfg.log.format)
    try:
        asyncio.run(
            ensure_service_topics(k, f"{k.client_id}-topics", kafka_client_options(k), specs)
        )
    except FatalError as exc:
        print(f"kvconductor topics: {exc}", file=sys.stderr)
        return 1
    except (KafkaError, OSError, TimeoutError) as exc:
        # Unreachable for now: the Job's next attempt (backoffLimit) retries.
        print(f"kvconductor topics: kafka unavailable: {exc!r}", file=sys.stderr)
        return 1
    finally:
        logs.drain(5.0)
    print("kvconductor topics: " + ", ".join(s.name for s in specs) + ": ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
