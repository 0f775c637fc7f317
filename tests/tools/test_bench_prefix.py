"""`specstate bench prefix`: the same workload as the peer harness, and the report's shape.

No test asserts a speed: the runs are a few rounds and only their shape is checked.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from specstate.tools import prefix_workload
from specstate.tools.bench_prefix import run_rounds
from specstate.tools.cli import main
from specstate.tools.prefix_workload import config, make_workload

PEER = Path(__file__).resolve().parents[2] / "benchmarks" / "peers" / "sglang_radix_bench.py"


def _peer_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("sglang_radix_bench", PEER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # imports nothing beyond the standard library
    return module


@pytest.mark.parametrize("concurrency", [4, 64])
def test_the_workload_is_the_peer_harness_workload(concurrency: int) -> None:
    """The peer harness loads specstate's workload module by file path: both sides replay
    exactly the same requests, churn and budget, and echo the same workload settings."""
    peer = _peer_module()
    ours = Path(prefix_workload.__file__).read_text(encoding="utf-8")
    assert Path(peer.workload.__file__).read_text(encoding="utf-8") == ours
    theirs = peer.make_workload(concurrency=concurrency, rounds=30, seed=3)
    assert make_workload(concurrency=concurrency, rounds=30, seed=3) == theirs
    assert peer.workload.config(30, 5, 3) == config(30, 5, 3)


@pytest.mark.parametrize("page_size", [1, 16])
def test_the_replay_hits_shares_and_evicts(page_size: int) -> None:
    """The replay finds shared prefixes, holds a consistent tree, and evicts to its budget."""
    times, cache = run_rounds(page_size, 32, rounds=30, warmup=10)
    snap = cache.snapshot()
    assert len(times) == 30 and snap.num_evicted_pages > 0 and snap.num_nodes > 8
    assert cache.problems() == []


def test_bench_prefix_prints_a_table_beside_a_peer_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--peer reads the harness's JSON and prints ours, theirs and the ratio."""
    peer = tmp_path / "peer.json"
    rows = [{"page_size": 16, "concurrency": 8, "us_per_round": 1000.0, "runs": [1000.0]}]
    peer.write_text(json.dumps({"peer": "sglang", "results": rows}), encoding="utf-8")
    argv = ["bench", "prefix", "--page-sizes", "16", "--concurrency", "8", "--rounds", "5"]
    assert main([*argv, "--warmup", "2", "--repeats", "1", "--peer", str(peer)]) == 0
    line = capsys.readouterr().out.splitlines()[-1].split()
    assert line[:2] == ["16", "8"] and float(line[3]) == 1000.0 and line[4].endswith("x")
    assert main([*argv, "--warmup", "2", "--repeats", "1", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["bench"] == "prefix" and report["results"][0]["concurrency"] == 8
    peer.write_text("{}", encoding="utf-8")
    assert main([*argv, "--peer", str(peer)]) == 2
