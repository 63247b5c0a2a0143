"""ZMQ frame layouts of the KV-event publishers (no sockets here).

Live, on the PUB socket (vLLM, SGLang, TensorRT-LLM, `mooncake_master`):
`[topic, seq as 8 bytes big-endian, payload]`; Mooncake's topic is empty.

Replay, on the ROUTER socket, as a DEALER receives it (the DEALER sends
`[b"", seq]`: the empty delimiter, then the first sequence wanted):

- vLLM 0.33 and later: `[b"", topic, seq, payload]` per buffered message,
  then the end marker `[b"", b"", END_SEQ, b""]`;
- older vLLM releases and SGLang: `[b"", seq, payload]`, then
  `[b"", END_SEQ, b""]` (a REQ socket sees these as `[seq, payload]`).

`END_SEQ` is -1 as a signed 8-byte big-endian integer, 0xffffffffffffffff.
A publisher that leaves out the delimiter is read the same way.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

SEQ_BYTES = 8
END_SEQ = 0xFFFF_FFFF_FFFF_FFFF
END_SEQ_BYTES = END_SEQ.to_bytes(SEQ_BYTES, "big")


class FrameError(ValueError):
    """Frames that follow none of the known layouts."""


class Message(NamedTuple):
    seq: int
    payload: bytes


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big")


def _seq(frame: bytes) -> int:
    if len(frame) != SEQ_BYTES:
        raise FrameError(f"sequence frame of {len(frame)} bytes, expected {SEQ_BYTES}")
    return int.from_bytes(frame, "big")


def parse_live(frames: Sequence[bytes]) -> Message:
    """`[topic, seq, payload]` from a SUB socket."""
    if len(frames) != 3:
        raise FrameError(f"live message of {len(frames)} frames, expected 3")
    seq = _seq(frames[1])
    if seq == END_SEQ:
        raise FrameError("live message carries the replay end marker")
    return Message(seq, frames[2])


def parse_replay(frames: Sequence[bytes]) -> Message | None:
    """One replay reply as a DEALER receives it; None for the end marker."""
    parts = list(frames)
    if parts and parts[0] == b"" and len(parts) in (3, 4):
        parts = parts[1:]  # the ROUTER's empty delimiter
    if len(parts) == 3:  # vLLM >= 0.33: topic, seq, payload
        parts = parts[1:]
    if len(parts) != 2:
        raise FrameError(f"replay reply of {len(frames)} frames, expected 3 or 4")
    seq = _seq(parts[0])
    if seq == END_SEQ:
        return None
    return Message(seq, parts[1])


def replay_request(start_seq: int) -> list[bytes]:
    """What a DEALER sends to ask for every buffered message from `start_seq` on."""
    return [b"", encode_seq(start_seq)]
