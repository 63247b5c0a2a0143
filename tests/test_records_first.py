"""Snapshot work gives way to records (issue #5, produce-to-queryable p99).

- `RecordsFirst.turn` lets ready tasks run, waits while a batch is being
  applied, and still returns when records never stop (the generation must
  finish under full load).
- A unit exported at a cut is completed a piece at a time, with the same
  identities as in one piece, whatever the catalog forgets between pieces.

No timing is asserted: the latency belongs to `kvconductor bench`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from kvconductor.index.block_store import BlockStore, PyBlockStore
from kvconductor.kernel import KERNEL
from kvconductor.records_first import RecordsFirst
from kvconductor.snapshots import units as snapshots
from kvconductor.snapshots.units import CutUnit, OwnerUnit, PoolUnit, completing
from kvconductor.wire.media import DEVICE, HOST
from kvconductor.wire.packing import unpack_u64


async def test_a_turn_while_idle_lets_ready_tasks_run() -> None:
    first = RecordsFirst()
    ran: list[str] = []

    async def query() -> None:
        ran.append("query")

    task = asyncio.create_task(query())
    await first.turn()
    assert ran == ["query"]
    await task


async def test_a_turn_waits_for_the_batch_being_applied() -> None:
    first = RecordsFirst()
    order: list[str] = []
    batch_started = asyncio.Event()

    async def consumer() -> None:
        first.applying()
        batch_started.set()
        for _ in range(3):
            await asyncio.sleep(0)  # the batch yields to queries now and then
            order.append("record")
        first.done()

    task = asyncio.create_task(consumer())
    await batch_started.wait()
    await first.turn()
    order.append("snapshot step")
    await task
    # The batch's yields did not let the snapshot's step in.
    assert order == ["record", "record", "record", "snapshot step"]


async def test_a_turn_returns_when_records_never_stop() -> None:
    first = RecordsFirst()
    first.applying()  # and never done
    await asyncio.wait_for(first.turn(), timeout=30)
    assert first.busy


# ------------------------------------------------------ completed in pieces


def _compiled(max_retired: int, max_age_s: float) -> BlockStore:
    if KERNEL is None:
        pytest.skip("the compiled kernel is not built")
    store: BlockStore = KERNEL.BlockStore(max_retired, max_age_s)
    return store


@pytest.mark.parametrize("make", [PyBlockStore, _compiled], ids=["reference", "compiled"])
def test_a_cut_unit_completes_in_pieces_as_it_was_at_the_cut(
    make: Callable[[int, float], BlockStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(snapshots, "CUT_PIECE_BYTES", 8 * 3)  # three hashes a piece
    store = make(1000, 1e9)
    seqs = list(range(1, 11))
    store.add_owner(0)
    store.place_owner(0, DEVICE, seqs, [s * 100 for s in seqs], 100)
    store.add_pool(7, HOST)
    store.place_pool(7, seqs, [s * 100 for s in seqs], 100, None)
    store.begin_cut()
    store.freeze_owner(0)
    store.freeze_pool(7)
    owner = CutUnit(store, OwnerUnit("i", 0, [], []), 0)
    pool = CutUnit(store, PoolUnit("b", "cpu", HOST, b"", b""), 7)
    steps = completing(pool)
    next(steps)
    # Between pieces, records change the blocks and the catalog: the cut's
    # blocks and identities stay.
    store.clear_owner(0)
    store.clear_pool(7)
    store.place_owner(0, DEVICE, seqs, [s * 100 + 1 for s in seqs], 100)
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
    unit = done.value.value
    pairs = dict(zip(unpack_u64(unit.seqs), unpack_u64(unit.idents), strict=True))
    assert pairs == {s: s * 100 for s in seqs}
    steps = completing(owner)
    taken = 0
    with pytest.raises(StopIteration) as done:
        while True:
            next(steps)
            taken += 1
    assert taken > 3  # one step a piece and one a tier
    unit = done.value.value
    tiers = [
        dict(zip(unpack_u64(s), unpack_u64(i), strict=True))
        for s, i in zip(unit.seqs, unit.idents, strict=True)
    ]
    assert tiers == [{s: s * 100 for s in seqs}, {}, {}]
    store.end_cut()
