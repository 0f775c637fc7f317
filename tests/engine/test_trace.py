"""Traces: the recorded rounds reconcile exactly with the engine, and the timeline is valid.

* Per request, the accept lengths of its settled verify rows in the trace are exactly
  ``Req.accept_lengths``; over the run, the trace's histogram, verify count and accepted tokens
  are exactly the engine's `AcceptMetrics` (partially agreeing drafters, so every accept length
  occurs; a small pool, so retractions happen and are recorded; aborts too).
* The Chrome / Perfetto export is well formed: known phases, non-negative durations, spans of
  one track nested or disjoint, every flow arrow from a publish to a later resolve.
* From the file alone: the host and forward tracks overlap in the overlap loop and never in the
  normal loop (a timed-wait device keeps the forward busy).
* ``specstate trace`` reads it back (summary, one request, Perfetto); a foreign file exits 2.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from engine_driver import run_checked
from spec_checkpoints import (
    MIXED_PROMPTS,
    SpecCheckpoints,
)

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.trace import TraceRecorder, chrome_events
from specstate.tools.cli import main
from specstate.tools.timed_worker import TimedWaitWorker
from specstate.tools.trace import summarize, track_busy

PHASES = {"M", "X", "i", "s", "f", "C"}


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


def _traced_run(ckpt: SpecCheckpoints, overlap: bool) -> tuple[Engine, TraceRecorder, list[Any]]:
    trace = TraceRecorder()
    config = EngineConfig(
        overlap=overlap,
        page_size=4,
        kv_tokens=96,
        chunked_prefill=4,
        mixed_chunk=True,
        check_invariants=True,
        check_ownership=True,
    )
    engine = Engine(
        ckpt.worker("eagle", agreeing=False),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=config,
        trace=trace,
    )
    params = SamplingParams(max_new_tokens=20)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    engine.step()
    engine.step()
    engine.abort("r1")
    run_checked(engine, max_steps=400)
    engine.close()
    return engine, trace, reqs


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_trace_reconciles_exactly_with_the_engine(ckpt: SpecCheckpoints, overlap: bool) -> None:
    """Per request and in total, the trace's acceptance is the engine's."""
    engine, trace, reqs = _traced_run(ckpt, overlap)
    records = list(trace.records())
    per_request: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for r in records:
        if r["type"] == "round" and r["verify"]:
            rows = r["rows"]
            for rid, a, settled in zip(rows["id"], rows["accept"], rows["settled"], strict=True):
                if settled:
                    per_request[rid].append(a)
    for req in reqs:
        assert per_request[req.request_id] == list(req.accept_lengths), req.request_id
    summary = summarize(records)
    metrics = engine.results.metrics()
    assert summary["num_verifies"] == metrics.num_verifies > 0
    assert summary["num_accepted_tokens"] == metrics.num_accepted_tokens
    assert {int(k): v for k, v in summary["histogram"].items()} == dict(metrics.histogram)
    assert summary["mean_accept_length"] == metrics.mean_accept_length
    max_accept = engine.worker.capabilities.max_accept
    assert any(1 < int(k) < max_accept for k in summary["histogram"])  # partial acceptance
    events = Counter((e["event"], e["reason"]) for e in records if e["type"] == "event")
    assert events[("abort", "abort")] == 1
    assert events[("retract", "")] == summary["retractions"] > 0
    assert events[("finish", "length")] == len(reqs) - 1
    header = records[0]
    assert header["schema"] == "specstate-trace" and header["version"] == 1
    assert header["worker"]["algorithm"] == "eagle" and header["config"]["overlap"] is overlap


def _check_trace_events(events: list[dict[str, Any]]) -> None:
    """The trace-event format: phases, durations, nesting per track, matched flows."""
    assert {e["ph"] for e in events} <= PHASES
    by_track: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for e in events:
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
            by_track.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for spans in by_track.values():
        spans.sort()
        stack: list[float] = []
        for start, end in spans:
            while stack and stack[-1] <= start + 1e-6:  # float µs: touching is disjoint
                stack.pop()
            assert not stack or end <= stack[-1] + 1e-6, "spans of one track cross"
            stack.append(end)
    starts = {e["id"]: e["ts"] for e in events if e["ph"] == "s"}
    ends = {e["id"]: e["ts"] for e in events if e["ph"] == "f"}
    assert starts.keys() == ends.keys() and starts
    assert all(ends[i] >= starts[i] for i in starts)


def _timed_trace(overlap: bool) -> list[dict[str, Any]]:
    trace = TraceRecorder()
    engine = Engine(
        TimedWaitWorker(device_seconds=0.003),
        limits=RequestLimits(vocab_size=32, max_context_len=256),
        config=EngineConfig(overlap=overlap, kv_tokens=2048),
        trace=trace,
    )
    for i in range(4):
        engine.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=24, ignore_eos=True))
    run_checked(engine, max_steps=200)
    engine.close()
    return list(trace.records())


def test_the_timeline_overlaps_only_in_the_overlap_loop(tmp_path: Path) -> None:
    """Asserted from the written files: host and forward busy at once only under overlap."""
    for overlap in (False, True):
        records = _timed_trace(overlap)
        path = tmp_path / f"{overlap}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
        out = tmp_path / f"{overlap}.perfetto.json"
        assert main(["trace", str(path), "--perfetto", str(out), "--json"]) == 0
        events = json.loads(out.read_text())["traceEvents"]
        _check_trace_events(events)
        host = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X" and e["tid"] == 1
                and e["name"] in ("schedule", "settle")]  # fmt: skip
        forward = [(e["ts"], e["ts"] + e["dur"]) for e in events if e["ph"] == "X"
                   and e["tid"] == 2]  # fmt: skip
        both = sum(max(0.0, min(h1, f1) - max(h0, f0)) for h0, h1 in host for f0, f1 in forward)
        if overlap:
            assert both > 0.0
        else:
            assert both == 0.0
        assert track_busy(records, "forward")  # the forward track is recorded in both loops


def test_the_trace_command_reads_a_recorded_file(
    ckpt: SpecCheckpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Summary JSON equals the engine's metrics; --request shows its rounds; bad file: 2."""
    engine, trace, reqs = _traced_run(ckpt, True)
    path = tmp_path / "t.jsonl"
    trace.write_jsonl(path)
    capsys.readouterr()
    assert main(["trace", str(path), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["mean_accept_length"] == engine.results.metrics().mean_accept_length
    assert main(["trace", str(path), "--request", "r0"]) == 0
    shown = capsys.readouterr().out.splitlines()
    settled = [line for line in shown if " decode " in line and "skipped" not in line]
    assert len(settled) == len(reqs[0].accept_lengths)
    assert main(["trace", str(path), "--request", "nobody"]) == 2
    (tmp_path / "foreign.jsonl").write_text('{"type": "header", "schema": "other"}\n')
    assert main(["trace", str(tmp_path / "foreign.jsonl")]) == 2
    assert "no specstate-trace header" in capsys.readouterr().err
    events = chrome_events(list(trace.records()))
    _check_trace_events(events)


def test_plot_draws_the_timeline_and_the_histogram(
    ckpt: SpecCheckpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--plot writes a PNG (matplotlib is a test dependency) and --perfetto its JSON; each
    says on stderr which file it wrote."""
    _, trace, _ = _traced_run(ckpt, True)
    path, png, timeline = tmp_path / "t.jsonl", tmp_path / "t.png", tmp_path / "t.json"
    trace.write_jsonl(path)
    capsys.readouterr()
    assert main(["trace", str(path), "--plot", str(png), "--perfetto", str(timeline)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "traceEvents" in json.loads(timeline.read_text())
    err = capsys.readouterr().err
    assert f"specstate trace: wrote {png}\n" in err
    assert f"specstate trace: wrote {timeline} (open it at ui.perfetto.dev)" in err


def test_trace_check_replays_the_invariants_offline(
    ckpt: SpecCheckpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A recorded run checks clean; a doctored commit or frontier is named, exit 1."""
    _, trace, _ = _traced_run(ckpt, True)
    records = list(trace.records())
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["trace", str(path), "--check"]) == 0
    assert capsys.readouterr().out.startswith("0 violations")
    decode = [r for r in records if r["type"] == "round" and r["verify"]]
    late = decode[len(decode) // 2]["rows"]
    i = late["settled"].index(True)
    late["committed"][i] += 1  # a commit the accept length does not explain
    late["frontier_out"][i] += 3  # and a frontier it does not explain
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["trace", str(path), "--check"]) == 1
    out = capsys.readouterr().out
    assert "[commit-settlement] request" in out and "[publish] request" in out
