"""Shared pytest fixtures.

``kafka_bootstrap``: a real single-node Kafka broker for the whole test session, started by
``kvconductor.tools.kafka_local.broker`` in a temporary data folder on free ports (so it
never meets the developer's own ``kafka-local`` broker) and stopped at the end. With
``KVCONDUCTOR_TEST_BOOTSTRAP=host:port`` set, the tests use that broker and start nothing.
Tests that use it are marked ``@pytest.mark.kafka``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from kvconductor.tools.kafka_local import broker as kafka_local


@pytest.fixture(scope="session")
def kafka_bootstrap(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Bootstrap address (``127.0.0.1:<port>``) of the session's Kafka broker."""
    external = os.environ.get("KVCONDUCTOR_TEST_BOOTSTRAP")
    if external:
        yield external
        return
    data_dir = tmp_path_factory.mktemp("kafka")
    port, controller_port = kafka_local.free_ports(2)
    bootstrap = kafka_local.start(data_dir, port=port, controller_port=controller_port)
    try:
        yield bootstrap
    finally:
        kafka_local.stop(data_dir)
