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


def test_bench_grammar_runs_the_masks_on_threads_when_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--mask-threads`` builds the engine with that many mask threads (the report states
    it); a count below 1 is a usage error before anything runs."""
    argv = ["bench", "grammar", "--batch-sizes", "2", "--rounds", "2", "--repeats", "1"]
    assert main([*argv, "--mask-threads", "2", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["mask_threads"] == 2
    assert report["results"][0]["rows_us"] > 0
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--mask-threads", "0"])
    assert exit_info.value.code == 2 and "'0' is below 1" in capsys.readouterr().err
