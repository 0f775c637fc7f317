"""``specstate trace FILE``: read a recorded trace back — summary, one request, Perfetto.

FILE is the JSONL a `specstate.engine.trace.TraceRecorder` wrote (``specstate demo --trace``,
``specstate generate --trace``). Without options it prints a summary:

* requests and how they ended; rounds by mode;
* the prefix cache's hit rate: of the tokens admitted requests had to prefill (prompt plus
  earlier outputs), the share whose KV the cache supplied (from the ``admit`` events);
* the acceptance histogram and mean accept length over every settled verify row (the same
  rows, so the same numbers, as the engine's ``AcceptMetrics``), and per draft position the
  rate at which it was accepted (position k: rows whose accept length is at least k + 1);
* host time and forward time per round, the overlap (the share of the host's schedule and
  settle work that ran while a forward was running: 0 in the normal loop, near 1 when the
  overlap loop hides the host), and the bubbles: forward-stream idle gaps between batches.

``--check`` replays the rounds offline through the relations a trace can show, by name:
``ledger-order`` (``protected <= committed <= allocated`` after each round),
``commit-settlement`` (a settled decode row advanced its request's committed by exactly its
accept length since the request's previous round; a skipped row is not counted), and
``publish`` (a decode row published ``frontier_in + accept``, a prefill row ``frontier_in``);
it prints each violation and exits 1 if there is one.

``--request ID`` prints that request's rounds: mode, the frontier it ran from and published,
its accept length and bonus token, and its three clocks after settlement. ``--perfetto OUT``
writes the Chrome / Perfetto trace-event JSON (open it at ui.perfetto.dev). ``--plot OUT.png``
draws the two tracks' timeline and the acceptance histogram (needs matplotlib: the ``plot``
extra). ``--json`` prints the summary as JSON. Exit code 2, with one line naming the file, the
line and the field, for a file that is not a specstate trace or holds a malformed record (a
missing field, a string where a number belongs: `specstate.tools.trace_schema`), or for
``--plot`` without matplotlib.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any

from specstate.engine.trace import SCHEMA, VERSION, chrome_events
from specstate.tools.trace_schema import TraceFileError, check_record

__all__ = ["add_arguments", "load", "run", "summarize"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``trace`` command's arguments."""
    parser.description = "Summarize a recorded trace, show one request, or export Perfetto."
    parser.add_argument("file", type=Path, help="a trace JSONL (specstate demo/generate --trace)")
    parser.add_argument("--request", metavar="ID", help="that request's rounds, one a line")
    parser.add_argument("--perfetto", type=Path, metavar="OUT", help="write trace-event JSON")
    parser.add_argument("--check", action="store_true", help="replay the invariants offline")
    parser.add_argument("--plot", type=Path, metavar="OUT.png", help="draw timeline + histogram")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")


def load(path: Path) -> list[dict[str, Any]]:
    """The records of a trace file; `TraceFileError` naming the file, line and field otherwise
    (`specstate.tools.trace_schema.check_record`: every field a reader indexes is there)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceFileError(f"{path}: cannot read ({exc})") from None
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            raise TraceFileError(f"{path}:{number}: not JSON") from None
        if not isinstance(record, dict) or "type" not in record:
            raise TraceFileError(f"{path}:{number}: not a trace record")
        check_record(record, f"{path}:{number}")
        records.append(record)
    if not records or records[0].get("schema") != SCHEMA:
        raise TraceFileError(f"{path}: no {SCHEMA} header on line 1")
    if records[0].get("version") != VERSION:
        raise TraceFileError(
            f"{path}: trace version {records[0].get('version')}, this reader knows {VERSION}"
        )
    return records


def _busy(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``(start, end)`` intervals, merged and sorted."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def _total(intervals: list[tuple[float, float]]) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Total length of the overlap of two merged, sorted interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def track_busy(records: list[dict[str, Any]], track: str) -> list[tuple[float, float]]:
    """Merged busy intervals (µs) of ``track``: ``host`` counts schedule and settle work."""
    names = {"schedule", "settle"} if track == "host" else None
    spans = [
        (r["ts_us"], r["ts_us"] + r["dur_us"])
        for r in records
        if r["type"] == "span" and r["track"] == track and (names is None or r["name"] in names)
    ]
    return _busy(spans)


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The summary of the module docstring, as a JSON-ready dict."""
    rounds = [r for r in records if r["type"] == "round"]
    events = [r for r in records if r["type"] == "event"]
    header = records[0]
    histogram: Counter[int] = Counter()
    for r in rounds:
        if r["verify"]:
            rows = r["rows"]
            histogram.update(a for a, s in zip(rows["accept"], rows["settled"], strict=True) if s)
    verifies = sum(histogram.values())
    accepted = sum(a * n for a, n in histogram.items())
    width = int(header.get("worker", {}).get("num_draft_tokens", 1))
    positions = [
        sum(n for a, n in histogram.items() if a >= k + 1) / verifies if verifies else 0.0
        for k in range(1, width)
    ]
    host, forward = track_busy(records, "host"), track_busy(records, "forward")
    both = _intersection(host, forward)
    gaps = [b[0] - a[1] for a, b in itertools.pairwise(forward)]
    ids = {i for r in rounds for i in r["rows"]["id"]}
    admits = [e for e in events if e["event"] == "admit"]
    queried = sum(e.get("fill_tokens", 0) for e in admits)
    hits = sum(e.get("cached_tokens", 0) for e in admits)
    return {
        "requests": len(ids),
        "ended": dict(Counter(e["reason"] for e in events if e["event"] in ("finish", "abort"))),
        "retractions": sum(1 for e in events if e["event"] == "retract"),
        "prefix_cache": {
            "admissions": len(admits),
            "queried_tokens": queried,
            "hit_tokens": hits,
            "hit_rate": hits / queried if queried else 0.0,
        },
        "rounds": dict(Counter(r["mode"] for r in rounds)),
        "num_verifies": verifies,
        "num_accepted_tokens": accepted,
        "mean_accept_length": accepted / verifies if verifies else 0.0,
        "histogram": {str(a): histogram[a] for a in sorted(histogram)},
        "accept_rate_by_position": positions,
        "host_us_per_round": _total(host) / len(rounds) if rounds else 0.0,
        "forward_us_per_round": _total(forward) / len(rounds) if rounds else 0.0,
        "overlap": both / _total(host) if host else 0.0,
        "bubbles": {"count": len(gaps), "total_us": sum(gaps)},
    }


def _print_summary(s: dict[str, Any]) -> None:
    print(f"requests: {s['requests']}  ended: {s['ended']}  retractions: {s['retractions']}")
    print(f"rounds: {s['rounds']}")
    cache = s["prefix_cache"]
    print(
        f"prefix cache: hit rate {cache['hit_rate']:.1%} ({cache['hit_tokens']} of "
        f"{cache['queried_tokens']} prefill tokens, {cache['admissions']} admissions)"
    )
    print(
        f"verifies: {s['num_verifies']}  accepted tokens: {s['num_accepted_tokens']}  "
        f"mean accept length: {s['mean_accept_length']:.4f}"
    )
    print(f"accept histogram: {s['histogram']}")
    rates = ", ".join(f"{k + 1}: {r:.3f}" for k, r in enumerate(s["accept_rate_by_position"]))
    print(f"draft position accepted: {rates or '-'}")
    print(
        f"per round: host {s['host_us_per_round']:.1f} µs, forward "
        f"{s['forward_us_per_round']:.1f} µs; {s['overlap']:.0%} of host work under a forward; "
        f"bubbles {s['bubbles']['count']} totalling {s['bubbles']['total_us'] / 1e3:.1f} ms"
    )


def _print_request(records: list[dict[str, Any]], request_id: str) -> int:
    """That request's rounds and events, in batch order (a submission before its rounds)."""
    lines: list[tuple[int, int, str]] = []  # (batch, 0 submit / 1 round / 2 other event, text)
    for r in records:
        if r["type"] == "round" and request_id in r["rows"]["id"]:
            rows, i = r["rows"], r["rows"]["id"].index(request_id)
            if not rows["settled"][i]:
                text = f"{r['batch']:5d}  {r['mode']:6s}  (skipped: the request had ended)"
            else:
                out = rows["frontier_out"][i] if rows["frontier_out"] is not None else "-"
                text = (
                    f"{r['batch']:5d}  {r['mode']:6s} {rows['frontier_in'][i]:3d} {out:>4} "
                    f"{rows['accept'][i]:7d} {rows['bonus'][i]:6d} {rows['committed'][i]:10d} "
                    f"{rows['allocated'][i]:10d} {rows['protected'][i]:10d} "
                    f"{rows['outputs'][i]:8d}"
                )
            lines.append((r["batch"], 1, text))
        elif r["type"] == "event" and r["id"] == request_id:
            keys = ("prompt_len", "max_new_tokens", "fill_tokens", "cached_tokens")
            extra = "".join(f" {k} {r[k]}" for k in keys if k in r)
            order = 0 if r["event"] == "submit" else 2
            lines.append((r["batch"], order, f"{r['batch']:5d}  {r['event']} {r['reason']}{extra}"))
    if not any(order == 1 for _, order, _ in lines):
        print(f"specstate trace: request {request_id!r} is not in the trace", file=sys.stderr)
        return 2
    print("batch  mode    in  out  accept  bonus  committed  allocated  protected  outputs")
    for _, _, text in sorted(lines, key=lambda x: (x[0], x[1])):
        print(text)
    return 0


def plot(records: list[dict[str, Any]], out: Path, *, rounds: int = 4) -> None:
    """Draw about ``rounds`` steady decode rounds on both tracks, and the acceptance histogram.

    Raises:
        ImportError: matplotlib is not installed.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    spans = [r for r in records if r["type"] == "span"]
    decode = sorted(r["batch"] for r in records if r["type"] == "round" and r["mode"] == "decode")
    first = decode[min(2, len(decode) - 1)] if decode else 0  # past the first, warm-up rounds
    start = min((s["ts_us"] for s in spans if s["batch"] >= first), default=0.0)
    summary = summarize(records)
    per_round = summary["forward_us_per_round"] + summary["host_us_per_round"]
    window_ms = max(rounds * per_round / 1e3, 1.0)
    colors = {
        "schedule": "tab:blue",
        "wait": "lightgrey",
        "settle": "tab:green",
        "resolve": "tab:purple",
        "forward": "tab:orange",
        "post": "tab:red",
        "failed": "black",
    }
    fig, (timeline, hist) = plt.subplots(
        2, 1, figsize=(10, 5.5), gridspec_kw={"height_ratios": [1, 1.2]}
    )
    for row, track in enumerate(("forward", "host")):
        for name, color in colors.items():
            bars = [
                ((s["ts_us"] - start) / 1e3, s["dur_us"] / 1e3)
                for s in spans
                if s["track"] == track and s["name"] == name
                and 0 <= s["ts_us"] - start <= window_ms * 1e3
            ]  # fmt: skip
            if bars:
                timeline.broken_barh(bars, (row - 0.35, 0.7), color=color, label=name)
    timeline.set_yticks([0, 1], ["forward stream", "host"])
    timeline.set_xlim(0, window_ms)
    timeline.set_xlabel(f"ms from decode round {first}")
    timeline.legend(ncol=7, fontsize=7, loc="upper center", bbox_to_anchor=(0.5, 1.25))
    lengths = [int(k) for k in summary["histogram"]]
    hist.bar(lengths, list(summary["histogram"].values()), color="tab:orange")
    hist.set_xlabel("accept length (tokens per verify, bonus included)")
    hist.set_ylabel("verifies")
    hist.set_title(f"mean accept length {summary['mean_accept_length']:.2f}", fontsize=9)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def check(records: list[dict[str, Any]]) -> list[str]:
    """Violations of the offline relations of the module docstring, in round order."""
    problems: list[str] = []
    last: dict[tuple[str, int], int] = {}  # (request, incarnation) -> committed after a round
    for r in records:
        if r["type"] != "round":
            continue
        rows, batch = r["rows"], r["batch"]
        out = rows["frontier_out"]
        for i, rid in enumerate(rows["id"]):
            if not rows["settled"][i]:
                continue
            key = (rid, rows["incarnation"][i])
            committed, accept = rows["committed"][i], rows["accept"][i]
            where = f"request {rid}, batch {batch}"
            if not rows["protected"][i] <= committed <= rows["allocated"][i]:
                problems.append(
                    f"[ledger-order] {where}: protected {rows['protected'][i]}, committed "
                    f"{committed}, allocated {rows['allocated'][i]}"
                )
            if r["verify"] and key in last and committed - last[key] != accept:
                problems.append(
                    f"[commit-settlement] {where}: committed moved {last[key]} -> {committed}, "
                    f"accept length {accept}"
                )
            if out is not None:
                want = rows["frontier_in"][i] + (accept if r["verify"] else 0)
                if out[i] != want:
                    problems.append(
                        f"[publish] {where}: published {out[i]}, expected {want} "
                        f"(frontier {rows['frontier_in'][i]}, accept {accept})"
                    )
            last[key] = committed
    return problems


def run(args: argparse.Namespace) -> int:
    """Run the command; 0 on success, 2 on a bad file or an unknown request."""
    try:
        records = load(args.file)
    except TraceFileError as exc:
        print(f"specstate trace: {exc}", file=sys.stderr)
        return 2
    if args.perfetto is not None:
        events = chrome_events(records, name=str(args.file.name))
        args.perfetto.write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
        print(
            f"specstate trace: wrote {args.perfetto} (open it at ui.perfetto.dev)", file=sys.stderr
        )
    if args.plot is not None:
        try:
            plot(records, args.plot)
        except ImportError:
            print(
                "specstate trace: --plot needs matplotlib (pip install 'specstate[plot]')",
                file=sys.stderr,
            )
            return 2
        print(f"specstate trace: wrote {args.plot}", file=sys.stderr)
    if args.request is not None:
        return _print_request(records, args.request)
    if args.check:
        problems = check(records)
        for line in problems:
            print(line)
        rounds = sum(1 for r in records if r["type"] == "round")
        print(f"{len(problems)} violations in {rounds} rounds")
        return 1 if problems else 0
    summary = summarize(records)
    if args.json:
        print(json.dumps(summary))
    else:
        _print_summary(summary)
    return 0
