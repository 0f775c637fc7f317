"""`specstate demo` runs the main job on the embedded model and reports that every check held."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from specstate.tools.cli import main


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["eagle", "draft_model"])
def test_demo_runs_lossless_and_clean(algorithm: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A short demo exits 0, says the runs agree and the KV was released."""
    argv = ["demo", "--algorithm", algorithm, "--requests", "3", "--max-new-tokens", "12"]
    assert main([*argv, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "lossless (all runs emit identical tokens): yes" in out
    assert "KV fully released: yes" in out
    assert "mean accept" in out


@pytest.mark.slow
def test_demo_writes_a_trace_and_a_timeline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--perfetto: the overlap run's host and forward tracks overlap, the normal run's never;
    --trace: `specstate trace` reproduces the demo's mean accept length."""
    trace, timeline = tmp_path / "t.jsonl", tmp_path / "p.json"
    argv = ["demo", "--requests", "3", "--max-new-tokens", "24", "--quiet"]
    assert main([*argv, "--trace", str(trace), "--perfetto", str(timeline)]) == 0
    out = capsys.readouterr().out
    shown = re.search(r"spec\+overlap: .* mean accept (\d+\.\d\d)", out)
    assert shown is not None, out
    assert main(["trace", str(trace), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert f"{summary['mean_accept_length']:.2f}" == shown.group(1)
    events = json.loads(timeline.read_text())["traceEvents"]
    overlap = {}
    for pid in (1, 2):
        spans = [e for e in events if e["ph"] == "X" and e["pid"] == pid]
        host = [(e["ts"], e["ts"] + e["dur"]) for e in spans
                if e["tid"] == 1 and e["name"] in ("schedule", "settle")]  # fmt: skip
        forward = [(e["ts"], e["ts"] + e["dur"]) for e in spans if e["tid"] == 2]
        assert host and forward
        overlap[pid] = sum(
            max(0.0, min(h1, f1) - max(h0, f0)) for h0, h1 in host for f0, f1 in forward
        )
    assert overlap[1] == 0.0 < overlap[2]


def test_demo_threads_reach_torch(capsys: pytest.CaptureFixture[str]) -> None:
    """--threads N sets torch's intra-op threads for the runs (and the header says so)."""
    import torch

    before = torch.get_num_threads()
    argv = ["demo", "--algorithm", "ngram", "--requests", "1", "--max-new-tokens", "2"]
    try:
        assert main([*argv, "--threads", "2", "--quiet"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert "page size 16, 2 torch thread(s)," in capsys.readouterr().out


def test_progress_waits_for_a_verify_and_the_sample_is_labelled(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No 'accept 0.00' while only prefills ran (it says '-' then), and the sample completion
    says it comes from the tiny embedded model."""
    argv = ["demo", "--algorithm", "ngram", "--requests", "8", "--max-new-tokens", "8"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    progress = [line for line in out.splitlines() if "] step" in line]
    assert progress and not any("accept 0.00" in line for line in progress)
    assert any(line.endswith("accept -") for line in progress)
    assert "sample completion by the embedded model (a 2.4M-parameter byte-level Llama" in out
