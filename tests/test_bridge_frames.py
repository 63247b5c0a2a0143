"""Frame layouts against vLLM 0.33's captured frames, the replay client on
real sockets, and the relay's sequence logic (no Kafka here)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import zmq
import zmq.asyncio
from structlog.testing import capture_logs

from kvconductor.bridge.buffer import Budget, StreamBuffer
from kvconductor.bridge.frames import (
    END_SEQ,
    FrameError,
    Message,
    parse_live,
    parse_replay,
    replay_request,
)
from kvconductor.bridge.metrics import BridgeMetrics
from kvconductor.bridge.records import data_entry, resync_entry
from kvconductor.bridge.relay import Relay
from kvconductor.bridge.replay import ReplayClient, ReplayError
from kvconductor.registry.publishers import PublisherConfig, StreamKey, endpoint_for_rank
from kvconductor.wire.records import control_meta, engine_meta, header_map, pool_meta
from tests.bridge_fakes import END, FakePublisher, fixture_frames, fixture_payloads


@pytest.fixture
def ctx() -> Iterator[zmq.asyncio.Context]:
    c = zmq.asyncio.Context()
    yield c
    c.destroy(linger=0)


# ------------------------------------------------------------ fixture frames


def test_parsers_read_the_captured_vllm_frames() -> None:
    frames = fixture_frames()
    live = [parse_live(f) for f in frames["live"]]
    assert [m.seq for m in live] == [0, 1, 2, 3]
    assert [m.payload for m in live] == [f[2] for f in frames["live"]]
    replayed = [parse_replay(f) for f in frames["replay_dealer"]]
    assert replayed[-1] is None  # [b"", b"", 0xff..ff, b""]
    assert [(m.seq, m.payload) for m in replayed[:-1] if m] == [
        (m.seq, m.payload) for m in live[1:]
    ]
    # A REQ socket got only [topic, seq, payload] of the first replayed message.
    assert parse_replay(frames["replay_req_first"][0]) == live[1]
    assert frames["replay_dealer"][-1][2] == END == END_SEQ.to_bytes(8, "big")


def test_older_replay_generation_and_bad_frames() -> None:
    seq = (7).to_bytes(8, "big")
    assert parse_replay([b"", seq, b"p"]) == Message(7, b"p")  # older vLLM / SGLang
    assert parse_replay([seq, b"p"]) == Message(7, b"p")  # as a REQ socket sees it
    assert parse_replay([b"", END, b""]) is None
    assert parse_replay([END, b""]) is None
    assert parse_replay([b"", b"", END, b""]) is None
    assert parse_replay([b"", b"t", seq, b"p"]) == Message(7, b"p")
    assert parse_replay([b"t", seq, b"p"]) == Message(7, b"p")
    for bad in ([b"", b"x", b"p"], [b"", b"t", b"short", b"p"], [b"only"], []):
        with pytest.raises(FrameError):
            parse_replay(bad)
    for bad in ([b"t", seq], [b"t", b"abc", b"p"], [b"t", END, b""]):
        with pytest.raises(FrameError):
            parse_live(bad)
    assert replay_request(5) == [b"", (5).to_bytes(8, "big")]


async def test_fake_publisher_matches_the_captured_frames(ctx: zmq.asyncio.Context) -> None:
    """The test publisher sends exactly what vLLM 0.33 sent, live and on replay."""
    frames = fixture_frames()
    pub = FakePublisher(ctx, generation="new")
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    try:
        await pub.wait_subscribed()
        for payload in fixture_payloads():
            await pub.publish(payload)
        got = [await asyncio.wait_for(sub.recv_multipart(), 5) for _ in range(4)]
        assert got == frames["live"]
        dealer.connect(pub.replay_endpoint or "")
        await dealer.send_multipart(replay_request(1))
        replies = [await asyncio.wait_for(dealer.recv_multipart(), 5) for _ in range(4)]
        assert replies == frames["replay_dealer"]
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        await pub.close()


@pytest.mark.parametrize("generation", ["new", "old", "bare"])
async def test_replay_client_reads_every_generation(
    ctx: zmq.asyncio.Context, generation: str
) -> None:
    pub = FakePublisher(ctx, generation=generation)
    try:
        for payload in fixture_payloads():
            await pub.publish(payload, drop=True)
        client = ReplayClient(ctx, pub.replay_endpoint or "", 2.0)
        got = [m async for m in client.fetch(1)]
        assert got == [Message(i, p) for i, p in enumerate(fixture_payloads())][1:]
        assert [m async for m in client.fetch(9)] == []
    finally:
        await pub.close()


async def test_replay_client_times_out_without_a_publisher(ctx: zmq.asyncio.Context) -> None:
    client = ReplayClient(ctx, "tcp://127.0.0.1:1", 0.3)
    with pytest.raises(ReplayError):
        async for _ in client.fetch(0):
            pass


def test_dp_rank_endpoints() -> None:
    assert endpoint_for_rank("tcp://10.0.0.1:5557", 0) == "tcp://10.0.0.1:5557"
    assert endpoint_for_rank("tcp://10.0.0.1:5557", 3) == "tcp://10.0.0.1:5560"
    assert endpoint_for_rank("tcp://[::1]:5557", 1) == "tcp://[::1]:5558"
    assert endpoint_for_rank("inproc://cache", 2) == "inproc://cache_dp2"


# ------------------------------------------------------------------ records


def test_records_carry_the_contract_headers() -> None:
    pub = PublisherConfig(
        id="vllm-0",
        endpoint="tcp://h:1",
        model="m",
        block_size=16,
        source="sglang",
        tenant="t",
        salt="s",
        offload="pool",
    )
    entry = data_entry(pub, 2, 41, b"payload")
    assert entry.key == b"vllm-0" and entry.value == b"payload"
    meta = engine_meta(header_map(entry.headers))
    assert meta == (
        meta._replace(model="m", block_size=16, source="sglang", seq=41, tenant="t", salt="s")
    )
    assert meta.dp_rank == 2 and meta.offload_pool
    resync = resync_entry(pub, 2, "restarted", "why")
    assert resync.value == b"" and resync.seq is None
    control = control_meta(header_map(resync.headers))
    assert dict(resync.headers)["kv-control-kind"] == b"restarted"
    assert control is not None and control.dp_rank == 2 and control.reason == "why"
    pool = PublisherConfig(id="mc", endpoint="tcp://h:1", kind="pool", source="mooncake")
    headers = dict(data_entry(pool, 0, 3, b"x").headers)
    assert "kv-model" not in headers and "kv-offload" not in headers
    assert pool_meta(header_map(data_entry(pool, 0, 3, b"x").headers)).seq == 3


# -------------------------------------------------------------- relay logic


class FakeReplay:
    def __init__(self, held: dict[int, bytes] | None = None, fail: bool = False) -> None:
        self.held = held or {}
        self.fail = fail
        self.requests: list[int] = []

    async def __call__(self, start: int) -> AsyncIterator[Message]:
        self.requests.append(start)
        if self.fail:
            raise ReplayError("down")
        for seq in sorted(self.held):
            if seq >= start:
                yield Message(seq, self.held[seq])


def _relay(replay: FakeReplay | None) -> tuple[Relay, StreamBuffer]:
    pub = PublisherConfig(id="e", endpoint="tcp://h:1", model="m", block_size=4)
    buffer = StreamBuffer(StreamKey("e", 0), "t", Budget(10_000, 1 << 30))
    return Relay(pub, 0, buffer, replay, BridgeMetrics()), buffer


def _seen(buffer: StreamBuffer) -> list[Any]:
    """Data records as their seq, resyncs as their reason's first word."""
    out: list[Any] = []
    for e in buffer.entries:
        if e.seq is None:
            out.append("R:" + dict(e.headers)["kv-control-reason"].decode().split(":")[0])
        else:
            out.append(e.seq)
    return out


def _m(seq: int) -> Message:
    return Message(seq, f"p{seq}".encode())


async def test_relay_attach_fills_history_and_gaps_and_drops_duplicates() -> None:
    replay = FakeReplay({i: f"p{i}".encode() for i in range(4)})
    relay, buffer = _relay(replay)
    for seq in (2, 3):  # attach at 2: 0 and 1 come from the history
        await relay.on_live(_m(seq))
    replay.held.update({i: f"p{i}".encode() for i in range(4, 10)})
    for seq in (6, 7, 8, 9):  # gap 4..5; 7..9 already replayed with it
        await relay.on_live(_m(seq))
    assert _seen(buffer) == ["R:bridge attached to the stream", 0, 1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert replay.requests == [0, 3]  # the gap from 4, asked from 3 to check continuity
    # payloads are the publisher's, untouched
    assert [e.value for e in buffer.entries if e.seq is not None] == [
        f"p{i}".encode() for i in range(10)
    ]


async def test_relay_unfillable_gaps_and_restart() -> None:
    relay, buffer = _relay(None)
    for seq in (0, 1, 5, 6, 0, 1):
        await relay.on_live(_m(seq))
    assert _seen(buffer) == [
        "R:bridge attached to the stream",
        0,
        1,
        "R:messages 2..4 lost and the publisher has no replay endpoint",
        5,
        6,
        "R:publisher restarted",
        0,
        1,
    ]


async def test_relay_replay_overrun_and_failure() -> None:
    replay = FakeReplay({i: f"p{i}".encode() for i in range(6, 12)})
    relay, buffer = _relay(replay)
    await relay.on_live(_m(0))
    await relay.on_live(_m(10))  # 1..5 are gone from the replay buffer
    assert _seen(buffer) == [
        "R:bridge attached to the stream",
        0,
        "R:messages 1..5 lost",
        *range(6, 12),
    ]
    assert relay.expected == 12
    await relay.on_live(_m(11))  # already replayed: duplicate
    assert relay.expected == 12
    replay.fail = True
    await relay.on_live(_m(14))
    assert _seen(buffer)[-2:] == ["R:messages 12..13 lost", 14]


async def test_idle_probe_finds_a_dropped_tail() -> None:
    replay = FakeReplay({0: b"p0", 1: b"p1"})
    relay, buffer = _relay(replay)
    await relay.on_live(_m(0))
    await relay.on_live(_m(1))
    await relay.probe()  # nothing lost: nothing happens
    replay.held.update({2: b"p2", 3: b"p3"})  # published, dropped on the way
    await relay.probe()
    assert _seen(buffer) == ["R:bridge attached to the stream", 0, 1, 2, 3]
    await relay.on_live(_m(3))  # arrives late: a duplicate
    assert relay.expected == 4 and len(buffer) == 5
    replay.fail = True
    await relay.probe()  # a publisher that does not answer is no gap
    assert len(buffer) == 5
    m = relay.metrics.render().decode()
    assert 'kvconductor_bridge_replays_total{dp_rank="0",outcome="filled",publisher="e"} 1.0' in m
    assert 'outcome="empty"' not in m and 'outcome="failed"' not in m


async def test_restart_below_replayed_messages_is_not_taken_for_duplicates() -> None:
    replay = FakeReplay({0: b"p0", 1: b"p1", 2: b"p2", 3: b"p3"})
    relay, buffer = _relay(replay)
    await relay.on_live(_m(0))
    await relay.on_live(_m(1))
    await relay.probe()  # 2 and 3 relayed from the replay, ahead of the live stream
    replay.held = {2: b"new2"}  # a new process; the bridge missed its seq 0 and 1
    await relay.on_live(Message(2, b"new2"))
    assert _seen(buffer) == [
        "R:bridge attached to the stream",
        0,
        1,
        2,
        3,
        "R:publisher restarted",
        2,
    ]
    assert buffer.entries[-1].value == b"new2"


async def test_restart_past_the_old_sequence_is_caught_by_the_replay_check() -> None:
    """A new process that got past the old sequence before the bridge saw it:
    the replay holds another message under the last relayed number."""
    replay = FakeReplay({i: f"p{i}".encode() for i in range(3)})
    relay, buffer = _relay(replay)
    for seq in range(3):
        await relay.on_live(_m(seq))
    replay.held = {i: f"new{i}".encode() for i in range(6)}
    await relay.on_live(Message(5, b"new5"))
    assert replay.requests[-2:] == [2, 0]  # checked seq 2, then the new history
    assert _seen(buffer) == [
        "R:bridge attached to the stream",
        0,
        1,
        2,
        "R:publisher restarted",
        *range(6),
    ]
    assert [e.value for e in list(buffer.entries)[-6:]] == [f"new{i}".encode() for i in range(6)]
    # Idle, same process: the probe checks seq 5 and finds nothing new.
    await relay.probe()
    assert replay.requests[-1] == 5 and len(buffer) == 11
    replay.held = {5: b"other5", 6: b"other6"}  # restarted again while idle
    await relay.probe()
    assert _seen(buffer)[-3:] == ["R:publisher restarted", 5, 6]


async def test_attach_relays_an_idle_publishers_history_at_once() -> None:
    # The engine publishes nothing more after the bridge starts: its history
    # is on Kafka all the same (issue #24, item 7).
    replay = FakeReplay({i: f"p{i}".encode() for i in range(3)})
    relay, buffer = _relay(replay)
    with capture_logs() as logs:
        await relay.attach()
    assert _seen(buffer) == ["R:bridge attached to the stream", 0, 1, 2]
    levels = {e["event"]: e["log_level"] for e in logs}
    assert levels == {"resync": "info", "history replayed": "info"}
    await relay.on_live(_m(2))  # the live copy of a replayed message: a duplicate
    await relay.on_live(_m(3))
    assert _seen(buffer)[-1] == 3 and len(buffer.entries) == 5


async def test_attach_with_nothing_held_asks_again_without_a_second_resync() -> None:
    replay = FakeReplay()
    relay, buffer = _relay(replay)
    await relay.attach()
    replay.held.update({0: b"p0", 1: b"p1"})  # published before the subscription took
    await relay.on_live(_m(2))
    assert _seen(buffer) == ["R:bridge attached to the stream", 0, 1, 2]
    assert replay.requests == [0, 0]
