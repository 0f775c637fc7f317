"""`specstate bench pd`: it runs, reports every algorithm and prompt length, and counts what the
decode engine did not recompute. No test asserts a speed: only the report's content is checked.
"""

from __future__ import annotations

import json

import pytest

from specstate.tools.cli import main


def test_bench_pd_reports_each_algorithm_and_length(capsys: pytest.CaptureFixture[str]) -> None:
    """One row per (algorithm, prompt length); bytes grow with the prompt; a drafter model's
    prefill is avoided, an n-gram's (no drafter model) is not counted."""
    args = ["bench", "pd", "--algorithms", "ngram,eagle", "--prompt-lens", "8,32", "--json"]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == "pd"
    rows = {(r["algorithm"], r["prompt_len"]): r for r in report["results"]}
    assert set(rows) == {("ngram", 8), ("ngram", 32), ("eagle", 8), ("eagle", 32)}
    for (algorithm, length), row in rows.items():
        assert row["prefill_tokens_avoided"] == length
        assert row["drafter_prefill_tokens_avoided"] == (length if algorithm == "eagle" else 0)
        assert row["export_ms"] >= 0 and row["admit_ms"] >= 0 and row["first_decode_token_ms"] > 0
    for algorithm in ("ngram", "eagle"):
        assert rows[(algorithm, 32)]["bytes"] > 3 * rows[(algorithm, 8)]["bytes"]
    assert rows[("eagle", 32)]["bytes"] > rows[("ngram", 32)]["bytes"]  # head KV and features


def test_bench_pd_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json, a table with a header and one line per run."""
    assert main(["bench", "pd", "--algorithms", "none", "--prompt-lens", "8"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["algorithm", "prompt", "bytes"]
    assert lines[1].split()[:2] == ["none", "8"]
