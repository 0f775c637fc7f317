"""The host-cost tables of README.md and docs/benchmarks.md, from one run of the comparison.

    python3 benchmarks/host_tables.py OUT_DIR [WORKLOAD ...]

OUT_DIR is what ``benchmarks/run_host_comparison.sh`` wrote: per side and workload, one report
per alternation (``specstate-churn-1.json`` ...) and their merge (``specstate-churn.json``).
Per workload and (page, bs) it prints one Markdown row: each side's median µs per round (the
median of the alternations' run medians) with the range of those run medians, each ratio
specstate / peer as the median of the per-alternation ratios with their range (a range that
crosses 1 reads "parity"), and the tensor operations each side makes per round (median). The
bookkeeping figure and the bookkeeping + output hand-off figure get one table each. Standard
library only.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

SIDES = ("specstate", "sglang", "vllm")
FIGURES = {"total": "total_us_median_per_repeat", "handoff": "handoff_us_median_per_repeat"}


def _runs(out: Path, side: str, workload: str) -> dict[tuple[int, int], dict[str, Any]]:
    """Per (page, bs): the merged row of ``side``, or nothing if the side did not run."""
    path = out / f"{side}-{workload}.json"
    if not path.exists():
        return {}
    report = json.loads(path.read_text(encoding="utf-8"))
    return {(r["page_size"], r["bs"]): r for r in report["results"]}


def _range(values: list[float], digits: int = 0) -> str:
    med = statistics.median(values)
    if digits == 0:
        return f"{med:.0f} [{min(values):.0f}–{max(values):.0f}]"
    return f"{med:.2f} [{min(values):.2f}–{max(values):.2f}]"


def _ratio(ours: list[float], peer: list[float]) -> str:
    if len(ours) != len(peer) or not ours:
        return "–"
    ratios = [a / b for a, b in zip(ours, peer, strict=True)]
    verdict = " parity" if min(ratios) <= 1.0 <= max(ratios) else ""
    return _range(ratios, 2) + verdict


def _ops(row: dict[str, Any] | None) -> str:
    if row is None or "device_ops" not in row:
        return "–"
    return f"{row['device_ops']['median']:g}"


def table(out: Path, workload: str, figure: str) -> list[str]:
    """The Markdown rows of one workload's table of ``figure``."""
    rows = {side: _runs(out, side, workload) for side in SIDES}
    key = FIGURES[figure]
    head = [
        "| P | bs | specstate µs | SGLang µs | vLLM µs | vs SGLang | vs vLLM "
        "| ops: ours / SGLang / vLLM |",
        "|---|---|---|---|---|---|---|---|",
    ]
    lines = []
    for page, bs in sorted(rows["specstate"]):
        ours = rows["specstate"][(page, bs)]
        cells = [str(page), str(bs)]
        medians = {}
        for side in SIDES:
            row = rows[side].get((page, bs))
            runs = None if row is None else row.get(key)
            medians[side] = runs
            if runs:
                cells.append(_range(runs))
            elif side == "vllm" and page % 16:
                cells.append("not a servable vLLM configuration")
            else:
                cells.append("–")
        for peer in ("sglang", "vllm"):
            a, b = medians["specstate"], medians[peer]
            cells.append(_ratio(a, b) if a and b else "–")
        ops = [_ops(ours), _ops(rows["sglang"].get((page, bs))), _ops(rows["vllm"].get((page, bs)))]
        cells.append(" / ".join(ops))
        lines.append("| " + " | ".join(cells) + " |")
    return head + lines


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: host_tables.py OUT_DIR [WORKLOAD ...]")
    out = Path(sys.argv[1])
    for workload in sys.argv[2:] or ["churn", "steady"]:
        for figure in FIGURES:
            what = "bookkeeping" if figure == "total" else "bookkeeping + output hand-off"
            print(f"\n{workload}, {what} (median [range] over the alternations):\n")
            print("\n".join(table(out, workload, figure)))


if __name__ == "__main__":
    main()
