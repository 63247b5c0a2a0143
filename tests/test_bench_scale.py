"""`kvconductor bench scale` runs end to end at a tiny size (its figures are
measured, never asserted: the machine is shared)."""

from __future__ import annotations

import json
from pathlib import Path

from kvconductor.tools.bench.scale import measure
from kvconductor.tools.cli import main


def test_a_point_holds_what_it_built() -> None:
    point = measure(owners=70, entries=4_480, sharing=2, chain=32, ranks=2, queries=4)
    assert point.entries == 4_480
    assert point.bytes_per_entry >= 0
    # Every instance answers a query that lists them all: 70 owners, 35 instances.
    assert point.answer_all_bytes > 35 * len('"i00000":{}')


def test_the_cli_writes_a_row_per_point(tmp_path: Path) -> None:
    out = tmp_path / "scale.jsonl"
    argv = ["bench", "scale", "--owners", "3,65", "--entries", "2e3", "--sharing", "1,4"]
    assert main([*argv, "--chain", "16", "--queries", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [(r["owners"], r["sharing"]) for r in rows] == [(3, 1), (65, 1), (65, 4)]
