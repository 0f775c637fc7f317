"""`specstate bench serve`: every mode runs its clients to the end; only the shape is checked.

No assertion is timed: a short run checks that every request of every mode delivered all its
tokens to its client, and that the report has its fields.
"""

from __future__ import annotations

import json

import pytest

from specstate.tools.cli import main


def test_every_mode_delivers_every_token(capsys: pytest.CaptureFixture[str]) -> None:
    """direct, async and http each deliver requests x max_tokens tokens; losses are reported."""
    argv = ["bench", "serve", "--clients", "4", "--requests", "6", "--max-tokens", "8"]
    assert main([*argv, "--device-ms", "1", "--rounds", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["config"]["clients"] == 4
    results = report["results"]
    assert set(results) == {"direct", "async", "http"}
    for mode, row in results.items():
        assert row["tokens"] == 6 * 8, mode
        assert row["ttft_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"] > 0, mode
        assert "throughput_loss" in row
    assert results["direct"]["throughput_loss"] == 0.0


def test_the_table_and_bad_modes(capsys: pytest.CaptureFixture[str]) -> None:
    """The table names each mode; an unknown mode exits 2."""
    argv = ["bench", "serve", "--clients", "2", "--requests", "2", "--max-tokens", "4"]
    assert main([*argv, "--device-ms", "0", "--rounds", "1", "--modes", "direct,async"]) == 0
    out = capsys.readouterr().out
    assert " direct " in out and " async " in out and " http " not in out
    assert main([*argv, "--modes", "direct,telepathy"]) == 2


def test_the_chat_workload_delivers_every_turn_and_reuses_history(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--workload chat``: with and without speculation, every turn of every conversation
    delivers all its tokens, and the prefix cache supplies part of the prompts (each turn
    repeats the history)."""
    argv = ["bench", "serve", "--workload", "chat", "--clients", "2", "--requests", "3"]
    argv += ["--turns", "3", "--max-tokens", "8", "--device-ms", "1", "--rounds", "1", "--json"]
    assert main(argv) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["workload"] == "chat" and report["config"]["turns"] == 3
    results = report["results"]
    assert set(results) == {"spec", "nospec"}
    for mode, row in results.items():
        assert row["tokens"] == 3 * 3 * 8, mode
        assert 0 < row["cached_share"] < 1, mode
        assert row["ttft_p50_ms"] > 0 and row["itl_p99_ms"] >= row["itl_p50_ms"] > 0, mode
    assert main(["bench", "serve", "--workload", "chat", "--accept", "9"]) == 2
