"""aiokafka's standard-library log in the daemon's structured log."""

from __future__ import annotations

import logging

import structlog

from kvconductor.obs.logs import KafkaLogHandler


def test_aiokafka_errors_go_to_the_structured_log_rate_limited() -> None:
    handler = KafkaLogHandler(interval_s=60.0)
    logger = logging.getLogger("aiokafka.test-logs")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        with structlog.testing.capture_logs() as logs:
            for node in range(50):
                logger.error("Unable connect to node with id %s: %s", node, "refused")
            logger.error('Unable connect to "%s:%s": %s', "127.0.0.1", 9092, "refused")
            logger.error(
                "Group Coordinator Request failed: %s", "GroupCoordinatorNotAvailableError"
            )
            logger.error("something else went wrong")
    finally:
        logger.removeHandler(handler)
    levels = [(e["log_level"], e["event"]) for e in logs]
    assert levels == [
        ("warning", "Unable connect to node with id 0: refused"),
        ("warning", 'Unable connect to "127.0.0.1:9092": refused'),
        ("info", "Group Coordinator Request failed: GroupCoordinatorNotAvailableError"),
        ("error", "something else went wrong"),
    ]
    assert handler.counts == {"warning": 51, "error": 1}
