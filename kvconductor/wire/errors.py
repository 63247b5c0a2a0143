"""The one error family a record can raise on its way into the index.

The daemon catches `BadRecord`, dead-letters the record with `kind` and
`reason`, and moves the offset on; nothing of a record that raised is applied.
"""

from __future__ import annotations


class BadRecord(Exception):
    """A record that cannot be applied. `kind` is a stable counter label."""

    kind = "bad_record"

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class DecodeError(BadRecord):
    """The payload is not a valid event batch of any accepted wire form."""

    kind = "undecodable"


class MissingHeader(BadRecord):
    """A required Kafka header is absent or not valid UTF-8."""

    kind = "missing_header"


class InvalidHeader(BadRecord):
    """A header is present but its value is out of range or malformed."""

    kind = "invalid_header"


class RejectedEvent(BadRecord):
    """The payload decoded but breaks a rule of the contract (absurd values)."""

    kind = "rejected"
