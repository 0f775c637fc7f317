"""Merge host reports of one side, taken in alternation, into one report for ``bench compare``.

    python benchmarks/merge_reports.py OUT.json RUN1.json RUN2.json ...

Each input is one report (``specstate bench host --json`` or a peer harness, ``--repeats 1``).
Per (page, bs) row the merged report keeps the median of the runs' medians (``total_us``,
``cpu_us``, and where the runs give them ``host_us``, ``handoff_total_us`` and ``device_ops``;
their p90 is the median of the runs' p90s), every run's median in
``total_us_median_per_repeat`` (and ``handoff_us_median_per_repeat``), in the order of the
inputs (the alternations), and the lowest in ``total_us_best_repeat_median``. It refuses runs
whose workload digests differ. Standard library only.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _stat(rows: list[dict[str, Any]], key: str) -> dict[str, float] | None:
    if any(key not in r for r in rows):
        return None
    stats = [s for s in ("median", "p90", "mean") if all(s in r[key] for r in rows)]
    return {s: round(statistics.median(r[key][s] for r in rows), 2) for s in stats}


def merge(reports: list[dict[str, Any]]) -> dict[str, Any]:
    """One report whose rows summarise the same rows of ``reports``."""
    by_key: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for report in reports:
        for row in report["results"]:
            by_key.setdefault((row["page_size"], row["bs"]), []).append(row)
    results = []
    for (page, bs), rows in by_key.items():
        digests = {r.get("workload_digest") for r in rows}
        if len(digests) > 1:
            raise SystemExit(f"P {page} bs {bs}: the runs replayed different draws {digests}")
        medians = [r["total_us"]["median"] for r in rows]
        merged = {
            **rows[0],
            "repeats": len(rows),
            "samples": sum(r["samples"] for r in rows),
            "total_us": _stat(rows, "total_us"),
            "total_us_median_per_repeat": medians,
            "total_us_best_repeat_median": min(medians),
            "loop_s": [s for r in rows for s in r.get("loop_s", [])],
        }
        for key in ("cpu_us", "host_us", "handoff_total_us", "device_ops", "device_moves"):
            stat = _stat(rows, key)
            if stat is not None:
                merged[key] = stat
        if all("handoff_us_median_per_repeat" in r for r in rows):
            merged["handoff_us_median_per_repeat"] = [r["handoff_total_us"]["median"] for r in rows]
        merged["total_us_per_req"] = {k: round(v / bs, 3) for k, v in merged["total_us"].items()}
        results.append(merged)
    config = {**reports[0].get("config", {}), "alternations": len(reports)}
    return {**reports[0], "config": config, "results": results}


def main() -> None:
    out, *inputs = sys.argv[1:]
    if not inputs:
        raise SystemExit("usage: merge_reports.py OUT.json RUN.json [RUN.json ...]")
    reports = [json.loads(Path(p).read_text(encoding="utf-8")) for p in inputs]
    Path(out).write_text(json.dumps(merge(reports), indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
