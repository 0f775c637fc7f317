"""`specstate bench`: argument parsing, host dispatch, compare, and the engine / overlap runs.

No test asserts a speed: the timed benches run a few rounds and only their shape is checked.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from specstate import InvalidConfig
from specstate.tools.bench_host import HostSettings
from specstate.tools.cli import main
from specstate.tools.timed_worker import TimedWaitWorker

Row = tuple[int, int, float, float, float, float, float]
"""page_size, bs, total, reserve, relay, settle, best repeat (µs medians)."""


def _report(peer: str, rows: Sequence[Row]) -> dict[str, object]:
    results = [
        {
            "page_size": p,
            "bs": bs,
            "reserve_us": {"median": reserve, "p90": reserve * 1.5},
            "relay_us": {"median": relay, "p90": relay * 1.5},
            "settle_us": {"median": settle, "p90": settle * 1.5},
            "total_us": {"median": total, "p90": total * 1.5},
            "total_us_per_req": {"median": total / bs, "p90": total * 1.5 / bs},
            "total_us_median_per_repeat": [best, total],
            "total_us_best_repeat_median": best,
            "finished_requests": 3,
            "workload_digest": "d-same" if bs == 1 else f"d-{peer}",
            **({"cpu_us": {"median": total * 0.8, "p90": total}} if bs == 1 else {}),
        }
        for p, bs, total, reserve, relay, settle, best in rows
    ]
    config = {"workload": "churn", "launch_us": 5.0 if peer == "specstate" else 4.0}
    return {
        "peer": peer, "version": "9.9", "torch": "2.13.0+cpu", "config": config, "results": results
    }  # fmt: skip


OURS = _report(
    "specstate",
    [
        (1, 1, 100.0, 20.0, 60.0, 20.0, 81.0),
        (1, 64, 400.0, 100.0, 100.0, 200.0, 360.0),
        (16, 1, 50.0, 10.0, 20.0, 20.0, 45.0),
    ],
)
PEER = _report(
    "sglang",
    [
        (1, 1, 200.0, 100.0, 50.0, 50.0, 180.0),
        (1, 64, 400.0, 0.0, 200.0, 200.0, 400.0),  # a zero part: its ratio is n/a
        (16, 64, 600.0, 400.0, 100.0, 100.0, 590.0),
    ],
)


@pytest.fixture
def reports(tmp_path: Path) -> tuple[Path, Path]:
    """OURS and PEER written as JSON files."""
    ours, peer = tmp_path / "ours.json", tmp_path / "peer.json"
    ours.write_text(json.dumps(OURS))
    peer.write_text(json.dumps(PEER))
    return ours, peer


def test_compare_json_ratios_and_missing_rows(
    reports: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """Rows match by (page, bs); each ratio is ours / peer; digests say if the draws agree."""
    assert main(["bench", "compare", *map(str, reports), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ours"]["peer"] == "specstate" and out["peer"]["peer"] == "sglang"
    first, second = out["rows"]
    assert (first["page_size"], first["bs"]) == (1, 1)
    assert (first["ours_total_us"], first["peer_total_us"]) == (100.0, 200.0)
    assert [first["ratio_total"], first["ratio_best_repeat"]] == [0.5, 0.45]
    assert first["same_workload"] is True
    assert first["ratio_cpu"] == 0.5 and second["ratio_cpu"] is None  # CPU times where given
    assert (second["bs"], second["ratio_total"], second["same_workload"]) == (64, 1.0, False)
    assert second["ratio_best_repeat"] == 0.9
    assert out["missing"] == [
        {"page_size": 16, "bs": 1, "only_in": "ours"},
        {"page_size": 16, "bs": 64, "only_in": "peer"},
    ]


def test_compare_table(reports: tuple[Path, Path], capsys: pytest.CaptureFixture[str]) -> None:
    """The table shows the settings, both totals and the ratios per row, then unmatched rows."""
    assert main(["bench", "compare", *map(str, reports)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "ours: specstate 9.9 (torch 2.13.0+cpu)"
    assert "setting workload: ours churn, peer churn" in lines
    assert "setting launch_us: ours 5.0, peer 4.0   <- differs" in lines
    row = next(line.split() for line in lines if line.split()[:2] == ["1", "1"])
    assert row[:8] == ["1", "1", "200.0", "100.0", "0.50x", "0.45x", "0.50x", "yes"]
    assert row[8:] == ["unknown", "0.45-0.50", "(ours)", "-/-"]  # no cohort digest, no op count
    row = next(line.split() for line in lines if line.split()[:2] == ["1", "64"])
    assert row[6:8] == ["n/a", "NO"]
    assert "missing: P 16 bs 1 is only in ours" in lines
    assert "missing: P 16 bs 64 is only in peer" in lines


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read a JSON report"),
        ("{not json", "cannot read a JSON report"),
        ('{"peer": "x"}', "not a host report"),
        ('{"results": [1]}', "results[0] is not an object"),
        ('{"results": [{"page_size": 1, "bs": 1}]}', "'total_us' has no finite median"),
        ('{"results": [{"page_size": 1.5, "bs": 1}]}', "'page_size' is not a positive integer"),
        (json.dumps(_report("x", [(1, 1, 1, 1, 1, 1, 1)] * 2)), "repeats page_size 1, bs 1"),
    ],
)
def test_compare_bad_file_exits_2(
    tmp_path: Path,
    reports: tuple[Path, Path],
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    message: str,
) -> None:
    """A missing, unparsable or misshapen report: exit 2, the file and the fault on stderr."""
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_text(content)
    assert main(["bench", "compare", str(reports[0]), str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"specstate bench compare: {bad}")
    assert message in captured.err


@pytest.mark.parametrize(
    "argv",
    [
        ["engine", "--batch-sizes", "0"],
        ["engine", "--batch-sizes", "abc"],
        ["engine", "--batch-sizes", "1,,4"],
        ["engine", "--batch-sizes", "4,4"],
        ["engine", "--rounds", "0"],
        ["host", "--page-sizes", "1.5"],
        ["host", "--warmup", "-1"],
        ["overlap", "--device-ms", "-1"],
        ["overlap", "--device-ms", "nan"],
    ],
)
def test_bad_list_is_an_argparse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    """A bad number or comma list is rejected by argparse (exit 2) naming the option."""
    with pytest.raises(SystemExit) as exc:
        main(["bench", *argv])
    assert exc.value.code == 2
    assert f"argument {argv[1]}: {argv[2]!r}" in capsys.readouterr().err


def _fake_host(calls: list[dict[str, object]]) -> Callable[..., dict[str, object]]:
    def host_benchmark(
        settings: HostSettings, progress: Callable[[str], None] | None = None
    ) -> dict[str, object]:
        calls.append(
            {"page_sizes": settings.page_sizes, "batch_sizes": settings.batch_sizes}
            | {"iters": settings.iters, "warmup": settings.warmup, "repeats": settings.repeats}
            | {"workload": settings.workload}
        )
        if progress is not None:
            progress("fake: measuring")
        return OURS

    return host_benchmark


def test_host_dispatch_table_and_output_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench host` passes the parsed options on, prints one row per config, writes --output."""
    calls: list[dict[str, object]] = []
    monkeypatch.setattr("specstate.tools.bench_host.host_benchmark", _fake_host(calls))
    out_file = tmp_path / "ours.json"
    argv = ["bench", "host", "--page-sizes", "1,16", "--batch-sizes", "1,64", "--iters", "7"]
    assert main([*argv, "--warmup", "0", "--repeats", "2", "--output", str(out_file)]) == 0
    assert calls == [
        {"page_sizes": (1, 16), "batch_sizes": (1, 64), "iters": 7, "warmup": 0, "repeats": 2}
        | {"workload": "churn"}
    ]
    captured = capsys.readouterr()
    assert "fake: measuring" in captured.err and "fake" not in captured.out
    rows = [line.split() for line in captured.out.splitlines()[2:]]
    assert rows[1] == ["1", "64", "400.0", "600.0", "6.25", "360.0", "3"]
    assert len(rows) == 3
    assert json.loads(out_file.read_text()) == OURS


def test_host_json(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench host --json` prints exactly the report host_benchmark returned, with defaults."""
    calls: list[dict[str, object]] = []
    monkeypatch.setattr("specstate.tools.bench_host.host_benchmark", _fake_host(calls))
    assert main(["bench", "host", "--json", "--steady"]) == 0
    assert json.loads(capsys.readouterr().out) == OURS
    assert calls == [
        {"page_sizes": (1, 16), "batch_sizes": (1, 64, 256, 1024)}
        | {"iters": 300, "warmup": 20, "repeats": 5, "workload": "steady"}
    ]


def test_host_benchmark_takes_the_settings_the_cli_passes() -> None:
    """The measuring module offers host_benchmark(settings, progress=...)."""
    from specstate.tools import bench_host

    params = inspect.signature(bench_host.host_benchmark).parameters
    assert list(params) == ["settings", "progress"]


@pytest.mark.parametrize("loop", ["--overlap", "--no-overlap"])
def test_engine_bench_reports_each_batch_size(
    loop: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench engine --json` times steady decode rounds and reports positive µs per size."""
    argv = ["bench", "engine", "--batch-sizes", "1,4", "--rounds", "5", loop, "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["overlap"] is (loop == "--overlap")
    assert [r["bs"] for r in out["results"]] == [1, 4]
    for row in out["results"]:
        assert row["rounds"] == 5
        assert 0 < row["step_us"]["median"] <= row["step_us"]["p90"]
        assert row["step_us_per_req"] > 0


@pytest.mark.parametrize("algorithm", ["mtp", "eagle3", "frozen_kv_mtp", "dflash", "dspark", "uno"])
def test_engine_bench_runs_with_each_drafter_family(
    algorithm: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """`bench engine --algorithm`: the stand-in has the family's shape; rounds are timed."""
    argv = ["bench", "engine", "--batch-sizes", "1,4", "--rounds", "5", "--algorithm", algorithm]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["algorithm"] == algorithm
    assert all(row["step_us"]["median"] > 0 for row in out["results"])


def test_engine_bench_table(capsys: pytest.CaptureFixture[str]) -> None:
    """Without --json, one table row per batch size."""
    assert main(["bench", "engine", "--batch-sizes", "2", "--rounds", "3", "--page-size", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "(overlap loop, page 1)" in lines[0]
    assert [line.split()[0] for line in lines[2:]] == ["2"]


def test_overlap_bench_efficiency(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench overlap --json` reports the three round times and an efficiency in (0, 2]."""
    argv = ["bench", "overlap", "--device-ms", "2", "--batch-size", "4", "--rounds", "5"]
    assert main([*argv, "--json"]) == 0
    (row,) = json.loads(capsys.readouterr().out)["results"]
    assert row["device_us"] == 2000.0
    assert all(row[k] > 0 for k in ("host_us", "normal_us", "overlap_us", "gain", "ideal_gain"))
    assert isinstance(row["efficiency"], float) and 0 < row["efficiency"] <= 2
    assert row["efficiency"] == pytest.approx(
        max(row["host_us"], row["device_us"]) / row["overlap_us"], rel=1e-3
    )


@pytest.mark.parametrize(
    ("seconds", "steps", "accept", "match"),
    [
        (-0.001, 3, 2, "device_seconds must be >= 0"),
        (float("nan"), 3, 2, "device_seconds must be >= 0"),
        (0.0, 0, 1, "num_steps must be >= 1"),
        (0.0, 3, 5, r"accept must be in \[1, 4\], got 5"),
        (0.0, 3, 0, r"accept must be in \[1, 4\], got 0"),
    ],
)
def test_timed_wait_worker_rejects_bad_settings(
    seconds: float, steps: int, accept: int, match: str
) -> None:
    """The shipped worker refuses a negative wait, no draft step, or an accept outside [1, D]."""
    with pytest.raises(InvalidConfig, match=match):
        TimedWaitWorker(device_seconds=seconds, num_steps=steps, accept=accept)


@pytest.mark.parametrize("bench", ["host", "compare", "engine", "overlap"])
def test_every_bench_option_shows_its_default(
    bench: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """--help of each bench shows the default of every option that has one, and a help line
    for every option."""
    import argparse

    from specstate.tools.cli import _parser

    parser = _parser("bench")
    with pytest.raises(SystemExit):
        main(["bench", bench, "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    benches = next(
        a for a in sub.choices["bench"]._actions if isinstance(a, argparse._SubParsersAction)
    )
    for action in benches.choices[bench]._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        assert action.help, f"{bench} {action.dest} has no help"
        if action.option_strings and action.default not in (None, False):
            assert "(default: " in " ".join(action.help.split()) or (
                f"(default: {action.default})" in shown
            ), f"{bench} {action.option_strings[0]}: its default is not shown"


def test_engine_bench_both_loops(capsys: pytest.CaptureFixture[str]) -> None:
    """`--both-loops` times both loops, alternated, and reports overlap / normal medians."""
    argv = ["bench", "engine", "--batch-sizes", "2", "--rounds", "3", "--both-loops", "--json"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["overlap"] == "both" and out["config"]["device_model"] == "async"
    (row,) = out["results"]
    assert row["rounds"] == 9  # three alternations of three rounds
    overlap, normal = row["step_us"]["median"], row["normal_step_us"]["median"]
    assert overlap > 0 and normal > 0
    assert row["overlap_vs_normal"] == pytest.approx(overlap / normal, rel=1e-2)
    assert main(["bench", "engine", "--batch-sizes", "2", "--rounds", "3", "--both-loops"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "the two loops alternated" in lines[0]
    assert lines[2].split()[0] == "2" and lines[2].endswith("x")


def _ranged(peer: str, runs: list[float], handoff: list[float] | None) -> dict[str, object]:
    """A one-row report (page 16, bs 8) whose alternations had these run medians."""
    ordered = sorted(runs)
    row: dict[str, object] = {
        "page_size": 16,
        "bs": 8,
        "total_us": {"median": ordered[len(runs) // 2], "p90": max(runs)},
        "total_us_median_per_repeat": runs,
        "total_us_best_repeat_median": min(runs),
        "workload_digest": f"all-{peer}",
        "cohort_digest": "first",
        "device_ops": {"median": 7.0 if peer == "specstate" else 30.0, "p90": 9},
    }
    if handoff is not None:
        row["handoff_total_us"] = {"median": sorted(handoff)[len(handoff) // 2], "p90": 0}
        row["handoff_us_median_per_repeat"] = handoff
    return {"peer": peer, "version": "1", "torch": "t", "config": {}, "results": [row]}


def test_compare_ranges_a_ratio_over_the_alternations_and_calls_a_crossing_parity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each alternation's run medians are paired: the ratios' lowest-highest is printed, and a
    range that crosses 1 reads parity; the first cohort and the op counts are shown."""
    ours, peer = tmp_path / "ours.json", tmp_path / "peer.json"
    ours.write_text(json.dumps(_ranged("specstate", [90.0, 110.0, 100.0], [150.0, 160.0, 155.0])))
    peer.write_text(json.dumps(_ranged("sglang", [100.0, 100.0, 100.0], [300.0, 310.0, 320.0])))
    assert main(["bench", "compare", str(ours), str(peer)]) == 0
    lines = capsys.readouterr().out.splitlines()
    row = next(line.split() for line in lines if line.split()[:2] == ["16", "8"])
    assert row[7:] == ["NO", "yes", "0.90-1.10", "(parity)", "7/30"]
    assert main(["bench", "compare", "--figure", "handoff", str(ours), str(peer), "--json"]) == 0
    (compared,) = json.loads(capsys.readouterr().out)["rows"]
    assert compared["ours_total_us"] == 155.0 and compared["peer_total_us"] == 310.0
    assert compared["ratio_runs"] == [0.5, 0.5161, 0.4844]
    assert (compared["ours_ops"], compared["peer_ops"], compared["same_cohort"]) == (7, 30, True)


def test_compare_handoff_leaves_out_a_report_without_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--figure handoff`` against a report that does not time the hand-off: that row is
    reported missing, not compared with the bookkeeping figure."""
    ours, peer = tmp_path / "ours.json", tmp_path / "peer.json"
    ours.write_text(json.dumps(_ranged("specstate", [90.0, 110.0], [150.0, 160.0])))
    peer.write_text(json.dumps(_ranged("vllm", [100.0, 100.0], None)))
    assert main(["bench", "compare", "--figure", "handoff", str(ours), str(peer), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["rows"] == [] and out["missing"] == [{"page_size": 16, "bs": 8, "only_in": "ours"}]
