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
from typing import Any

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
    """A stand-in replay: round ``r`` takes ``(r + 1)`` µs of wall and half of it of CPU, and
    with the hand-off 1 µs more; it makes ``r`` tensor operations (one a move) while timed."""

    def __init__(self, page: int, bs: int, counter: object = None) -> None:
        self.finished = [(page, bs, 5)]
        self.emitted = 9
        self.checked = False
        self.counter = counter

    def round(self, r: int) -> tuple[int, int, int, int]:
        if self.counter is not None:
            import torch

            self.counter.enabled = True  # type: ignore[attr-defined]
            for _ in range(r - 1):
                torch.ones(2).add_(1)  # one counted operation (ones: one more, once)
            if r:
                torch.ones(2).to("cpu")  # a move that is a no-op here: counted
            self.counter.enabled = False  # type: ignore[attr-defined]
            torch.ones(2).add_(1)  # untimed: not counted
        return 1000 * (r + 1), 500 * (r + 1), 1000 * (r + 2), 0

    def check(self) -> None:
        self.checked = True


def test_a_timed_run_keeps_the_measured_rounds_and_checks_the_replay(
    peer_common: ModuleType,
) -> None:
    """`timed_run` (every harness's run) drops the warm-up rounds, keeps wall and CPU time of the
    measured ones in µs, runs the replay's own check and carries what it finished."""
    made: list[_Replay] = []

    def make() -> _Replay:
        made.append(_Replay(16, 4))
        return made[-1]

    args = peer_common.parser("test").parse_args(["--warmup", "2", "--iters", "3"])
    run = peer_common.timed_run(make, args)
    assert run.samples == [3.0, 4.0, 5.0] and run.cpu == [1.5, 2.0, 2.5]
    assert run.handoff == [4.0, 5.0, 6.0] and run.ops == [0, 0, 0]
    assert len(made) == 2 and all(r.checked for r in made)  # the counting replay, the timed one
    assert (run.finished, run.emitted) == ([(16, 4, 5)], 9)


def test_every_counted_operation_is_charged_one_launch(peer_common: ModuleType) -> None:
    """The counting replay counts each round's tensor operations (only while the replay says
    it times), and the timed replay's figures are charged ``--launch-us`` for each."""

    def make() -> _Replay:
        return _Replay(16, 4, peer_common.COUNTER)

    argv = ["--warmup", "1", "--iters", "3", "--launch-us", "10"]
    run = peer_common.timed_run(make, peer_common.parser("test").parse_args(argv))
    # round r: r ``ones`` (a fill: counted) + r - 1 ``add_`` + 1 move
    assert run.ops == [2, 4, 6] and run.moves == [1, 1, 1]
    assert run.host == [2.0, 3.0, 4.0]
    assert run.samples == [22.0, 43.0, 64.0]  # + 10 µs a counted operation
    row = peer_common.row(16, 4, [run], host_workload.digest)
    assert row["device_ops"]["median"] == 4 and row["host_us"]["median"] == 3.0
    assert row["handoff_total_us"]["median"] == 44.0


def test_a_sweep_times_a_fresh_replay_per_setting_and_repeat(peer_common: ModuleType) -> None:
    """`sweep` (every harness's main loop) builds one replay per (page, bs) and repeat, times
    each, and reports one row per (page, bs) with every repeat in it."""
    built: list[tuple[int, int]] = []

    def replay(page: int, bs: int, args: object) -> _Replay:
        built.append((page, bs))
        return _Replay(page, bs)

    # each run builds two replays of its (page, bs): the counting one, then the timed one

    argv = ["--warmup", "1", "--iters", "2", "--repeats", "2"]
    args = peer_common.parser("test").parse_args(
        [*argv, "--page-sizes", "1,16", "--batch-sizes", "4"]
    )
    rows = peer_common.sweep(args, "test", replay, host_workload.digest)
    assert built == [(1, 4), (1, 4), (16, 4), (16, 4)] * 2
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
    assert row == ["16", "4", "300.0", "150.0", "0.50x", "0.50x", "0.50x", "yes", "yes", "-/-"]


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


def test_the_docs_tables_give_ranges_over_alternations(
    peer_common: ModuleType, tmp_path: Path
) -> None:
    """`benchmarks/host_tables.py` turns merged reports into the docs' rows: each side's median
    [lowest–highest] run median, each ratio's median [range] over the paired alternations
    (parity where the range crosses 1), the op counts, and vLLM's page-1 rows labelled."""
    merge = _load(BENCHMARKS / "merge_reports.py", "merge_reports_under_test").merge
    tables = _load(BENCHMARKS / "host_tables.py", "host_tables_under_test")
    args = peer_common.parser("test").parse_args([])
    walls = {"specstate": [90.0, 110.0, 100.0], "sglang": [100.0, 100.0, 100.0]}
    for side, runs in walls.items():
        reports = []
        for wall in runs:
            run: Any = _run(peer_common, [wall], [])
            run.ops, run.moves, run.host, run.handoff = [7], [1], [wall], [wall * 2]
            row = peer_common.row(1, 8, [run], host_workload.digest)
            reports.append({"peer": side, "config": peer_common.settings(args, True, "t"),
                            "results": [row]})  # fmt: skip
        merged = merge(reports)
        (merged_row,) = merged["results"]
        assert merged_row["handoff_us_median_per_repeat"] == [w * 2 for w in runs]
        assert merged_row["device_ops"]["median"] == 7
        (tmp_path / f"{side}-churn.json").write_text(json.dumps(merged))
    (line,) = tables.table(tmp_path, "churn", "total")[2:]
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells == [
        "1", "8", "100 [90–110]", "100 [100–100]", "not a servable vLLM configuration",
        "1.00 [0.90–1.10] parity", "–", "7 / 7 / –",
    ]  # fmt: skip
