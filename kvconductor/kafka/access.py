"""Kafka refusing a client as configured, said in one line instead of retried forever.

aiokafka turns every failed bootstrap into "Unable to bootstrap from [...]" (logging the
cause once per attempt), so a wrong SCRAM password or an untrusted broker certificate
looks like an outage and a service would retry it for ever. Before a service creates its
clients, `check_access` connects to the bootstrap servers the way aiokafka's bootstrap does
(TCP, TLS, API versions, SASL, one metadata request) and raises `KafkaAccessError` when
the broker refuses the credentials or the client refuses the broker's certificate. It is a
`FatalError`: the daemon and the bridge log its message, one line, and exit 1; the
replica does the same. A broker that cannot be reached stays a retryable
`KafkaConnectionError`.

    await check_access(cfg.kafka)   # then create the consumers and producers
"""

from __future__ import annotations

import asyncio
import ssl

from aiokafka.conn import create_conn
from aiokafka.errors import (
    KafkaConnectionError,
    KafkaError,
    SaslAuthenticationFailed,
    UnsupportedSaslMechanismError,
)
from aiokafka.protocol.metadata import MetadataRequest

from kvconductor.config import KafkaConfig, kafka_client_options
from kvconductor.lifecycle import FatalError

# Per bootstrap server: TCP connect, TLS handshake, SASL exchange and a metadata request.
PROBE_TIMEOUT_S = 10.0


class KafkaAccessError(FatalError):
    """Kafka refuses this client as configured (credentials, certificates): no retry helps."""


def refusal(exc: BaseException, kafka: KafkaConfig, server: str) -> str | None:
    """The one line for an error no retry can fix, or None when it may be an outage."""
    protocol = kafka.security_protocol
    if isinstance(exc, SaslAuthenticationFailed):
        return (
            f"kafka: authentication failed for user {kafka.sasl_username!r} on {server} "
            f"({kafka.sasl_mechanism} over {protocol}): check [kafka] sasl_username and "
            "sasl_password"
        )
    if isinstance(exc, UnsupportedSaslMechanismError):
        return (
            f"kafka: {server} does not accept SASL mechanism {kafka.sasl_mechanism} "
            f"(over {protocol}): check [kafka] sasl_mechanism"
        )
    if isinstance(exc, ssl.SSLCertVerificationError):
        trusted = f"ssl_cafile {kafka.ssl_cafile}" if kafka.ssl_cafile else "the system CA store"
        return (
            f"kafka: TLS certificate verification failed for {server}: {exc.verify_message} "
            f"(trusted: [kafka] {trusted})"
        )
    return None


def _unreachable(exc: BaseException, kafka: KafkaConfig, server: str) -> str:
    reason = str(exc) or type(exc).__name__
    if isinstance(exc, (ConnectionResetError, KafkaConnectionError)):
        # What a listener of another security protocol does to a client: hang up.
        reason += f" (is it a {kafka.security_protocol} listener?)"
    return f"{server}: {reason}"


async def _probe(kafka: KafkaConfig, server: str, timeout_s: float) -> None:
    host, _, port = server.rpartition(":")
    async with asyncio.timeout(timeout_s):
        conn = await create_conn(
            host.strip("[]"),
            int(port),
            client_id=kafka.client_id,
            request_timeout_ms=int(timeout_s * 1000),
            **kafka_client_options(kafka),
        )
        try:
            await conn.send(MetadataRequest([]))
        finally:
            conn.close()


async def check_access(kafka: KafkaConfig, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Return once one bootstrap server accepts this client as configured.

    Raises `KafkaAccessError` (one line, naming the server) when servers refused it and
    none accepted it, else `KafkaConnectionError` naming why each could not be reached."""
    refused: list[str] = []
    unreachable: list[str] = []
    for server in (s.strip() for s in kafka.bootstrap_servers.split(",")):
        try:
            await _probe(kafka, server, timeout_s)
        except (KafkaError, OSError, TimeoutError) as exc:
            line = refusal(exc, kafka, server)
            if line is None:
                unreachable.append(_unreachable(exc, kafka, server))
            else:
                refused.append(line)
            continue
        return
    if refused:
        raise KafkaAccessError(refused[0])
    raise KafkaConnectionError(f"cannot reach Kafka: {'; '.join(unreachable)}")
