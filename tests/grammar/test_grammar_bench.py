"""`specstate bench grammar` runs: a row per batch size, grammar rows costing more than none."""

from __future__ import annotations

import json

import pytest

from specstate.tools.cli import main


def test_bench_grammar_reports_each_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON report has one row per size with the plain and grammar medians and the parts."""
    argv = ["bench", "grammar", "--batch-sizes", "1,3", "--rounds", "2", "--repeats", "1"]
    assert main([*argv, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == "grammar" and report["config"]["num_steps"] == 3
    rows = report["results"]
    assert [r["bs"] for r in rows] == [1, 3]
    for row in rows:
        assert row["rounds"] == 2
        assert row["rows_us"] > 0 and row["table_us"] > 0 and row["plain_us"] > 0
        assert row["per_row_us"] == pytest.approx(
            (row["rows_us"] + row["table_us"]) / row["bs"], abs=0.01
        )
