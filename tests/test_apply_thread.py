"""The engine lane's kernel calls on another thread (`EngineLane.run_free`,
as the event consumer makes them): queries on this thread are answered
while a call applies records, each answer is of the index between two
records, and the index ends as the Python path's.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvconductor.index.conductor import Conductor, Incoming
from kvconductor.kernel import KERNEL
from kvconductor.snapshots.units import state_fingerprint
from kvconductor.wire.encode import vllm_payload
from kvconductor.wire.query import TokenQuery
from tests.harness import engine_headers, removed, stored
from tests.streams import prompt_hashes

pytestmark = pytest.mark.skipif(KERNEL is None, reason="the lane is the compiled kernel's")

BS = 4
BLOCKS = 64
INSTANCES = 40
PROMPT = [t % 97 for t in range(BS * BLOCKS)]


def _chains() -> list[Incoming]:
    """Each instance stores the prompt one block a record, as a decoding
    vLLM does, instance after instance in turns, with a removal of a
    block of another prompt in between: an instance's hit only grows."""
    hashes = prompt_hashes("m", PROMPT, BLOCKS)
    other = prompt_hashes("m", [1] * BS * 2, 2)
    headers = engine_headers()
    out: list[Incoming] = []
    for k in range(BLOCKS):
        for i in range(INSTANCES):
            parent = hashes[k - 1] if k else None
            events = [stored([hashes[k]], PROMPT[k * BS : (k + 1) * BS], parent)]
            if k == 1:
                events.insert(0, removed([other[0]]))
            elif k == 0:
                events.append(stored(other[:1], [1] * BS))
            key = f"i{i:02d}".encode()
            out.append(Incoming(False, key, headers, vllm_payload(events), 100.0 + k))
    return out


def _hits(answer: bytes) -> dict[str, int]:
    return {name: row["GPU"] for name, row in json.loads(answer).get("default", {}).items()}


def test_queries_are_answered_while_the_apply_thread_applies() -> None:
    records = _chains()
    lane, ref = Conductor(), Conductor(lane=False)
    ref.ingest(records)
    query = TokenQuery(model="m", block_size=BS, token_ids=PROMPT)
    seen: list[dict[str, int]] = []
    during = 0
    with ThreadPoolExecutor(1) as applier:
        steps = lane.ingest_steps(records)
        try:
            call = next(steps)
            while True:
                running = applier.submit(call)
                while not running.done():
                    seen.append(_hits(lane.query_json(query)))
                    during += not running.done()
                call = steps.send(running.result())
        except StopIteration as stop:
            assert stop.value == []
    assert state_fingerprint(lane.snapshot_state()) == state_fingerprint(ref.snapshot_state())
    assert lane.query(query) == ref.query(query)
    # Queries ran while records were applied, and never saw one go back.
    assert during > 0
    last: dict[str, int] = {}
    for hits in seen:
        assert all(hits.get(name, 0) >= tokens for name, tokens in last.items())
        last = hits
    # Every answer is of the index between two records: the instances
    # applied in turns hold k or k + 1 blocks of the prompt.
    for hits in seen:
        if len(hits) == INSTANCES:
            assert max(hits.values()) - min(hits.values()) <= BS
