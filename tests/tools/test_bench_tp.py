"""`specstate bench tp`: two spawned ranks measure a few rounds; only the report's shape counts.

No test asserts a speed.
"""

from __future__ import annotations

import json

import pytest

from specstate.tools.bench_tp import TpRow, print_table
from specstate.tools.cli import main


def test_bench_tp_reports_every_size_and_mode(capsys: pytest.CaptureFixture[str]) -> None:
    """One row per batch size and checking mode, with TP = 1, TP = 2, their difference, a floor."""
    argv = ["bench", "tp", "--batch-sizes", "1,4", "--rounds", "4", "--block", "2", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == "tp"
    rows = report["results"]
    assert [(r["bs"], r["check"]) for r in rows] == [(1, False), (1, True), (4, False), (4, True)]
    for row in rows:
        assert row["tp1_us"] > 0 and row["tp2_us"] > 0 and row["floor_us"] > 0
        assert row["added_us"] == pytest.approx(row["tp2_us"] - row["tp1_us"], abs=0.2)


def test_bench_tp_table(capsys: pytest.CaptureFixture[str]) -> None:
    """The table: a header, then one line per batch size and mode."""
    row = TpRow(bs=2, rounds=3, check=True, tp1_us=1.5, tp2_us=4.0, added_us=2.5, floor_us=2.0)
    print_table([row], overlap=False, page_size=4)
    lines = capsys.readouterr().out.splitlines()
    assert "normal loop, page 4" in lines[0]
    assert lines[1].split() == ["bs", "check", "TP=1", "TP=2", "added", "floor"]
    assert lines[2].split() == ["2", "on", "1.5", "4.0", "2.5", "2.0"]
