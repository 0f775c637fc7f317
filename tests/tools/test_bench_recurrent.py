"""`specstate bench recurrent`: it runs, reports every batch size, and refuses bad sizes.

No test asserts a speed: a few rounds run and only the report's shape is checked.
"""

from __future__ import annotations

import json

import pytest

from specstate.tools.cli import main


def test_bench_recurrent_reports_each_batch_size(capsys: pytest.CaptureFixture[str]) -> None:
    """The JSON report has one row per batch size with the commit and both step medians."""
    code = main(
        ["bench", "recurrent", "--batch-sizes", "1,4", "--rounds", "5", "--repeats", "1", "--json"]
    )
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == "recurrent"
    rows = report["results"]
    assert [r["bs"] for r in rows] == [1, 4]
    assert all(r["commit_us"] > 0 and r["step_us"] > 0 and r["step_stateless_us"] > 0 for r in rows)


def test_bench_recurrent_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json, a table with a header and one line per batch size."""
    assert (
        main(["bench", "recurrent", "--batch-sizes", "2", "--rounds", "3", "--repeats", "1"]) == 0
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[1].split() == ["bs", "commit", "step", "stateless"]
    assert lines[2].split()[0] == "2"


def test_bench_recurrent_refuses_a_zero_size(capsys: pytest.CaptureFixture[str]) -> None:
    """A batch size below 1 is an argument error (exit 2), naming the value."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", "recurrent", "--batch-sizes", "0"])
    assert exc.value.code == 2
    assert "'0' is below 1" in capsys.readouterr().err
