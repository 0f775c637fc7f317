"""The peer harnesses' shared parts: same draws, reports `bench compare` reads, merged runs.

The harnesses themselves run in the peers' environments (SGLang, vLLM), which the test suite
does not have; what they share with specstate is standard library only and is checked here:
the workload they load by file path is specstate's own, a report built by `peer_common.row`
is read by `specstate bench compare` (ratios, CPU ratios, digests), and
`benchmarks/merge_reports.py` keeps the median of the run medians and refuses runs that
replayed different draws.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

from specstate.tools import host_workload
from specstate.tools.cli import main

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def peer_common() -> ModuleType:
    """``benchmarks/peers/peer_common.py``, loaded as a harness loads it."""
    return _load(BENCHMARKS / "peers" / "peer_common.py", "peer_common_under_test")


def _run(
    peer_common: ModuleType, wall: list[float], finished: list[tuple[int, int, int]]
) -> object:
    run = peer_common.Run(samples=wall, cpu=[x * 0.5 for x in wall], finished=finished)
    run.emitted, run.loop_s = 100, 1.0
    return run


def test_the_harnesses_replay_specstates_draws(peer_common: ModuleType) -> None:
    """The workload a harness loads by file path draws exactly what specstate's bench draws."""
    theirs, ours = peer_common.load_workload().Draws(64), host_workload.Draws(64)
    for _ in range(300):
        a, b = theirs.next(), ours.next()
        assert (a.prompt_len, a.length, a.by_eos, a.accepts) == (
            b.prompt_len,
            b.length,
            b.by_eos,
            b.accepts,
        )
    assert peer_common.load_workload().steady_accepts(8, 5) == host_workload.steady_accepts(8, 5)


class _Replay:
    """A stand-in replay: round ``r`` takes ``(r + 1)`` µs of wall and half of it of CPU."""

    def __init__(self, page: int, bs: int) -> None:
        self.finished = [(page, bs, 5)]
        self.emitted = 9
        self.checked = False

    def round(self, r: int) -> tuple[int, int]:
        return 1000 * (r + 1), 500 * (r + 1)

    def check(self) -> None:
        self.checked = True


def test_a_timed_run_keeps_the_measured_rounds_and_checks_the_replay(
    peer_common: ModuleType,
) -> None:
    """`timed_run` (every harness's run) drops the warm-up rounds, keeps wall and CPU time of the
    measured ones in µs, runs the replay's own check and carries what it finished."""
    replay = _Replay(16, 4)
    args = peer_common.parser("test").parse_args(["--warmup", "2", "--iters", "3"])
    run = peer_common.timed_run(replay, args)
    assert run.samples == [3.0, 4.0, 5.0] and run.cpu == [1.5, 2.0, 2.5]
    assert replay.checked and (run.finished, run.emitted) == ([(16, 4, 5)], 9)


def test_a_sweep_times_a_fresh_replay_per_setting_and_repeat(peer_common: ModuleType) -> None:
    """`sweep` (every harness's main loop) builds one replay per (page, bs) and repeat, times
    each, and reports one row per (page, bs) with every repeat in it."""
    built: list[tuple[int, int]] = []

    def replay(page: int, bs: int, args: object) -> _Replay:
        built.append((page, bs))
        return _Replay(page, bs)

    argv = ["--warmup", "1", "--iters", "2", "--repeats", "2"]
    args = peer_common.parser("test").parse_args(
        [*argv, "--page-sizes", "1,16", "--batch-sizes", "4"]
    )
    rows = peer_common.sweep(args, "test", replay, host_workload.digest)
    assert built == [(1, 4), (16, 4), (1, 4), (16, 4)]
    assert [(r["page_size"], r["bs"], r["repeats"], r["samples"]) for r in rows] == [
        (1, 4, 2, 4),
        (16, 4, 2, 4),
    ]
    assert rows[0]["workload_digest"] == host_workload.digest([(1, 4, 5)])


def test_a_peer_report_reads_in_bench_compare(
    peer_common: ModuleType, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench compare` reads a harness report: totals, CPU ratio, settings, same draws."""
    finished = [(3, 0, 7), (5, 2, 11)]
    args = peer_common.parser("test").parse_args(["--batch-sizes", "4", "--page-sizes", "16"])
    peer_row = peer_common.row(
        16, 4, [_run(peer_common, [200.0, 300.0, 400.0], finished)], host_workload.digest
    )
    ours_row = peer_common.row(
        16, 4, [_run(peer_common, [100.0, 150.0, 200.0], finished)], host_workload.digest
    )
    for name, row in (("peer", peer_row), ("ours", ours_row)):
        report = {
            "peer": "sglang" if name == "peer" else "specstate",
            "version": "0",
            "torch": "2.13.0+cpu",
            "config": peer_common.settings(args, True, "test"),
            "results": [row],
        }
        (tmp_path / f"{name}.json").write_text(json.dumps(report))
    assert main(["bench", "compare", str(tmp_path / "ours.json"), str(tmp_path / "peer.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "setting launch_us: ours 5.0, peer 5.0" in lines
    assert "setting workload: ours churn, peer churn" in lines
    row = next(line.split() for line in lines if line.split()[:2] == ["16", "4"])
    assert row == ["16", "4", "300.0", "150.0", "0.50x", "0.50x", "0.50x", "yes"]


def test_merged_reports_keep_the_median_of_the_run_medians(
    peer_common: ModuleType, tmp_path: Path
) -> None:
    """Three runs merge into one row: the median of their medians, each run's median kept."""
    merge = _load(BENCHMARKS / "merge_reports.py", "merge_reports_under_test").merge
    args = peer_common.parser("test").parse_args([])
    reports = []
    for wall in ([100.0, 110.0, 120.0], [300.0, 310.0, 320.0], [110.0, 120.0, 130.0]):
        row = peer_common.row(1, 1, [_run(peer_common, wall, [])], host_workload.digest)
        config = peer_common.settings(args, True, "t")
        reports.append({"peer": "vllm", "config": config, "results": [row]})
    (merged,) = merge(reports)["results"]
    assert merged["total_us"]["median"] == 120.0  # not the mean of the medians (180)
    assert merged["cpu_us"]["median"] == 60.0
    assert merged["total_us_median_per_repeat"] == [110.0, 310.0, 120.0]
    assert merged["total_us_best_repeat_median"] == 110.0
    assert merged["repeats"] == 3
    other = peer_common.row(1, 1, [_run(peer_common, [1.0], [(0, 1, 2)])], host_workload.digest)
    reports.append({"peer": "vllm", "config": {}, "results": [other]})
    with pytest.raises(SystemExit, match="different draws"):
        merge(reports)
