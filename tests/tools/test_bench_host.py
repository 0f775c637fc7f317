"""`specstate bench host` replays the peer workload and checks the engine after every run."""

from __future__ import annotations

import pytest

from specstate.tools.bench_host import accept_lengths, host_benchmark, prompt_lengths


def test_the_workload_is_the_peer_harness_workload() -> None:
    """Prompt and accept lengths follow the documented seeds and draw order."""
    assert prompt_lengths(8) == [1693, 1002, 339, 115, 285, 1965, 1752, 1292]
    assert sum(prompt_lengths(64)) == 62_100
    assert [int(a[0]) for a in accept_lengths(1, 5)] == [2, 1, 4, 4, 2]
    assert [a.tolist() for a in accept_lengths(4, 2)] == [[2, 1, 4, 4], [2, 4, 2, 4]]


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_small_run_reports_every_part_and_keeps_the_invariants(page_size: int) -> None:
    """A tiny replay returns the peer-shaped report; its untimed checks passed."""
    report = host_benchmark(
        page_sizes=(page_size,), batch_sizes=(1, 3), iters=6, warmup=2, repeats=2
    )
    assert report["peer"] == "specstate"
    results = report["results"]
    assert isinstance(results, list) and [(r["page_size"], r["bs"]) for r in results] == [
        (page_size, 1),
        (page_size, 3),
    ]
    for row in results:
        assert row["samples"] == 12
        for part in ("reserve_us", "relay_us", "settle_us", "total_us"):
            assert 0 < row[part]["median"] <= row[part]["p90"]
        assert len(row["total_us_median_per_repeat"]) == 2
        assert row["total_us_best_repeat_median"] == min(row["total_us_median_per_repeat"])
