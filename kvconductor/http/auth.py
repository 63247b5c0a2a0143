"""The one bearer-token check of every HTTP server (daemon, replica, bridge)."""

from __future__ import annotations

import hmac


def bearer_ok(authorization: bytes | None, token: bytes | None) -> bool:
    """Whether an Authorization header's value carries `token` as a bearer
    credential; always true when no token is configured. The scheme is
    case-insensitive (RFC 7235)."""
    if token is None:
        return True
    scheme, _, credential = (authorization or b"").partition(b" ")
    # compare_digest first, always: its time depends on the lengths only.
    return hmac.compare_digest(credential.strip(), token) and scheme.lower() == b"bearer"


def header_bytes(value: str | None) -> bytes | None:
    """An Authorization header as aiohttp gives it (text) back to bytes; the
    token is visible ASCII."""
    return None if value is None else value.encode("latin-1", "replace")
