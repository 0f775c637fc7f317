"""``specstate bench host`` and ``bench compare``: the host report, and two side by side.

``bench host`` runs `specstate.tools.bench_host` and prints its report (a table, or the JSON
a peer's harness prints too); ``bench compare OURS.json PEER.json`` reads two such reports and
prints them row by row as ratios ours / peer, with the settings both ran under and whether
both replayed the same draws. Also the helpers every bench prints through.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs

__all__ = ["fail", "header", "progress", "ratio", "run_compare", "run_host", "times"]

_PARTS: Final = ("reserve", "relay", "settle")
"""The parts of a host iteration, in the order they run (older reports split them)."""


def progress(line: str) -> None:
    """A progress line on stderr."""
    print(line, file=sys.stderr, flush=True)


def fail(bench: str, message: str) -> int:
    """Say why ``bench`` failed on stderr; exit code 2."""
    print(f"specstate bench {bench}: {message}", file=sys.stderr)
    return 2


def header(bench: str) -> dict[str, object]:
    """The fields that open every bench's JSON report."""
    import torch

    from specstate import __version__

    return {"peer": "specstate", "version": __version__, "torch": torch.__version__, "bench": bench}


# -------------------------------------------------------------------- host reports
class _BadReport(ValueError):
    """A file or object that is not a host report."""


@attrs.frozen(kw_only=True)
class _HostRow:
    """One (page size, batch size) row of a host report; medians in µs per iteration."""

    page_size: int
    bs: int
    total: float
    total_p90: float
    parts: Mapping[str, float]  # reserve / relay / settle, for reports that split them
    best_repeat: float
    finished: int | None = None
    digest: str | None = None
    cpu: float | None = None  # median thread CPU time per round, for reports that give it
    per_repeat: tuple[float, ...] = ()  # each run's median (a merged report: each alternation's)
    cohort: str | None = None  # `host_workload.cohort_digest`, for reports that give it
    ops: float | None = None  # median counted tensor operations per round (launch model ops)
    handoff: float | None = None  # median with the output hand-off, for reports that time it
    handoff_per_repeat: tuple[float, ...] = ()


def _number(item: Mapping[str, object], key: str, where: str, stat: str = "median") -> float:
    """``item[key]`` as a number, or ``item[key][stat]`` when it is a ``{median, p90}`` object."""
    value = item.get(key)
    if isinstance(value, Mapping):
        value = value.get(stat)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise _BadReport(f"{where}: {key!r} has no finite {stat}")
    return float(value)


def _whole(item: Mapping[str, object], key: str, where: str) -> int:
    value = _number(item, key, where)
    if value < 1 or value != int(value):
        raise _BadReport(f"{where}: {key!r} is not a positive integer")
    return int(value)


def _host_rows(report: object, source: str) -> dict[tuple[int, int], _HostRow]:
    """The rows of a host report keyed by (page size, batch size), in report order."""
    results = report.get("results") if isinstance(report, Mapping) else None
    if not isinstance(results, list):
        raise _BadReport(f"{source}: not a host report (no 'results' list)")
    rows: dict[tuple[int, int], _HostRow] = {}
    for i, item in enumerate(results):
        where = f"{source}: results[{i}]"
        if not isinstance(item, Mapping):
            raise _BadReport(f"{where} is not an object")
        key = (_whole(item, "page_size", where), _whole(item, "bs", where))
        if key in rows:
            raise _BadReport(f"{where} repeats page_size {key[0]}, bs {key[1]}")
        rows[key] = _HostRow(
            page_size=key[0],
            bs=key[1],
            total=_number(item, "total_us", where),
            total_p90=_number(item, "total_us", where, "p90"),
            parts={
                part: _number(item, f"{part}_us", where) for part in _PARTS if f"{part}_us" in item
            },
            best_repeat=_number(item, "total_us_best_repeat_median", where),
            finished=_optional_int(item.get("finished_requests")),
            digest=_optional_str(item.get("workload_digest")),
            cpu=_number(item, "cpu_us", where) if "cpu_us" in item else None,
            per_repeat=_numbers(item.get("total_us_median_per_repeat")),
            cohort=_optional_str(item.get("cohort_digest")),
            ops=_number(item, "device_ops", where) if "device_ops" in item else None,
            handoff=(
                _number(item, "handoff_total_us", where) if "handoff_total_us" in item else None
            ),
            handoff_per_repeat=_numbers(item.get("handoff_us_median_per_repeat")),
        )
    return rows


def _numbers(value: object) -> tuple[float, ...]:
    """A list of finite numbers, or () for anything else."""
    if not isinstance(value, list):
        return ()
    if not all(
        isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) for v in value
    ):
        return ()
    return tuple(float(v) for v in value)


def _optional_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _optional_str(value: object) -> str | None:
    return value if isinstance(value, str) else None


def run_host(args: argparse.Namespace) -> int:
    # NOTE: imported here so that the other benches (and `--version`) never load it. The ignore
    # covers a tree without the module yet; `unused-ignore` keeps mypy quiet once it is there.
    from specstate.tools import bench_host  # type: ignore[attr-defined,unused-ignore]

    settings = bench_host.HostSettings(
        workload=args.workload,
        page_sizes=args.page_sizes,
        batch_sizes=args.batch_sizes,
        iters=args.iters,
        warmup=args.warmup,
        repeats=args.repeats,
        launch_us=args.launch_us,
        mmap_threshold=args.malloc_mmap_threshold,
        trim_threshold=args.malloc_trim_threshold,
        algorithm=args.algorithm,
        launch_model=args.launch_model,
        handoff=args.handoff,
        device=args.device,
    )
    report: dict[str, object] = bench_host.host_benchmark(settings, progress=progress)
    text = json.dumps(report, indent=2)
    if args.output is not None:
        try:
            args.output.write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            return fail("host", f"cannot write {args.output}: {exc}")
    if args.json:
        print(text)
        return 0
    try:
        rows = _host_rows(report, "host_benchmark()")
    except _BadReport as exc:
        return fail("host", str(exc))
    print(f"Engine.step per decode round ({args.workload}), µs (medians unless named)")
    print(f"{'P':>3} {'bs':>5} {'total':>9} {'p90':>9} {'µs/req':>8} {'best rep':>9} "
          f"{'finished':>9}")  # fmt: skip
    for row in rows.values():
        print(
            f"{row.page_size:>3} {row.bs:>5} {row.total:>9.1f} {row.total_p90:>9.1f} "
            f"{row.total / row.bs:>8.2f} {row.best_repeat:>9.1f} {row.finished:>9}"
        )
    return 0


# ------------------------------------------------------------------------ compare
_SETTINGS: Final = (
    "workload",
    "launch_us",
    "launch_model",
    "mmap_threshold",
    "trim_threshold",
    "allocator_set",
)
"""Settings both sides must share; `bench compare` prints them side by side."""


@attrs.frozen(kw_only=True)
class _CompareRow:
    """One (page size, batch size) present in both reports; ratios are ours / peer."""

    page_size: int
    bs: int
    peer_total_us: float
    ours_total_us: float
    ratio_total: float | None
    ratio_best_repeat: float | None
    same_workload: bool | None  # both runs finished the same requests (digests); None: unknown
    ratio_cpu: float | None = None  # of the median CPU times, where both reports give them
    same_cohort: bool | None = None  # the first cohort's finishes agree (`cohort_digest`)
    ratio_runs: tuple[float, ...] = ()  # ours / peer per alternation (run i against run i)
    ours_ops: float | None = None  # median counted tensor operations per round
    peer_ops: float | None = None


@attrs.frozen(kw_only=True)
class _Comparison:
    """Two host reports side by side: who they are, matched rows, unmatched rows."""

    ours: Mapping[str, object]
    peer: Mapping[str, object]
    rows: tuple[_CompareRow, ...]
    missing: tuple[Mapping[str, object], ...]


def _read_report(path: Path) -> tuple[Mapping[str, object], dict[tuple[int, int], _HostRow]]:
    try:
        report = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:  # ValueError: bad UTF-8 or bad JSON
        raise _BadReport(f"{path}: cannot read a JSON report ({exc})") from None
    rows = _host_rows(report, str(path))
    who: dict[str, object] = {k: report.get(k) for k in ("peer", "version", "torch")}
    config = report.get("config")
    config = config if isinstance(config, Mapping) else {}
    who["settings"] = {k: config.get(k) for k in _SETTINGS}
    return who, rows


def ratio(ours: float, peer: float) -> float | None:
    """ours / peer, or None where the peer measured nothing."""
    return round(ours / peer, 4) if peer > 0 else None


def _paired(ours: tuple[float, ...], peer: tuple[float, ...]) -> tuple[float, ...]:
    """ours / peer per alternation, where both reports have the same number of runs."""
    if len(ours) != len(peer) or len(ours) < 2 or not all(p > 0 for p in peer):
        return ()
    return tuple(round(a / b, 4) for a, b in zip(ours, peer, strict=True))


def _figure(row: _HostRow, figure: str) -> tuple[float, float, tuple[float, ...]] | None:
    """The row's (median, best run, per-run medians) of ``figure``; None: not in the report."""
    if figure == "total":
        return row.total, row.best_repeat, row.per_repeat
    if row.handoff is None:
        return None
    runs = row.handoff_per_repeat
    return row.handoff, min(runs) if runs else row.handoff, runs


def _compare(ours_path: Path, peer_path: Path, figure: str = "total") -> _Comparison:
    ours, ours_rows = _read_report(ours_path)
    peer, peer_rows = _read_report(peer_path)
    rows, missing = [], []
    for key in sorted(ours_rows.keys() | peer_rows.keys()):
        a, b = ours_rows.get(key), peer_rows.get(key)
        if a is None or b is None:
            only_in = "peer" if a is None else "ours"
            missing.append({"page_size": key[0], "bs": key[1], "only_in": only_in})
            continue
        fa, fb = _figure(a, figure), _figure(b, figure)
        if fa is None or fb is None:
            only_in = "peer" if fa is None else "ours"
            missing.append({"page_size": key[0], "bs": key[1], "only_in": only_in})
            continue
        same = None if a.digest is None or b.digest is None else a.digest == b.digest
        cohort = None if a.cohort is None or b.cohort is None else a.cohort == b.cohort
        cpu = None if a.cpu is None or b.cpu is None or figure != "total" else ratio(a.cpu, b.cpu)
        rows.append(
            _CompareRow(
                page_size=key[0],
                bs=key[1],
                peer_total_us=fb[0],
                ours_total_us=fa[0],
                ratio_total=ratio(fa[0], fb[0]),
                ratio_best_repeat=ratio(fa[1], fb[1]),
                same_workload=same,
                ratio_cpu=cpu,
                same_cohort=cohort,
                ratio_runs=_paired(fa[2], fb[2]),
                ours_ops=a.ops,
                peer_ops=b.ops,
            )
        )
    return _Comparison(ours=ours, peer=peer, rows=tuple(rows), missing=tuple(missing))


def times(value: float | None) -> str:
    """A ratio as ``0.42x``, or ``n/a``."""
    return "n/a" if value is None else f"{value:.2f}x"


def _verdict(runs: tuple[float, ...]) -> str:
    """A ratio's range over alternations, and parity where it crosses 1."""
    if not runs:
        return ""
    low, high = min(runs), max(runs)
    side = "parity" if low <= 1.0 <= high else ("ours" if high < 1.0 else "peer")
    return f"{low:.2f}-{high:.2f} ({side})"


def _ops(value: float | None) -> str:
    return "-" if value is None else f"{value:g}"


def run_compare(args: argparse.Namespace) -> int:
    try:
        result = _compare(args.ours, args.peer, getattr(args, "figure", "total"))
    except _BadReport as exc:
        return fail("compare", str(exc))
    if args.json:
        print(json.dumps(attrs.asdict(result), indent=2))
        return 0
    for side, who in (("ours", result.ours), ("peer", result.peer)):
        print(f"{side}: {who['peer']} {who['version']} (torch {who['torch']})")
    settings = {
        side: who["settings"] for side, who in (("ours", result.ours), ("peer", result.peer))
    }
    for key in _SETTINGS:
        a, b = (settings[side].get(key) for side in ("ours", "peer"))  # type: ignore[attr-defined]
        flag = "" if a == b else "   <- differs"
        print(f"setting {key}: ours {a}, peer {b}{flag}")
    figure = getattr(args, "figure", "total")
    what = "bookkeeping + output hand-off" if figure == "handoff" else "the round"
    print(f"median µs per round ({what}); ratios are ours / peer, below 1 means ours is faster")
    print(
        "(cpu: of the thread's CPU time per round, which other tenants of a machine disturb less)"
    )
    print(
        "(runs: the ratio of each alternation's run medians, lowest-highest; a range that "
        "crosses 1 is parity; first cohort: the requests running from round one finished alike; "
        "ops: counted tensor operations per round, ours/peer)"
    )
    print(f"{'P':>3} {'bs':>5} {'peer µs':>9} {'ours µs':>9} {'ratio':>7} {'best rep':>9} "
          f"{'cpu':>7} {'same draws':>10} {'1st cohort':>10} {'runs':>24} {'ops':>9}")  # fmt: skip
    for r in result.rows:
        same = {None: "unknown", True: "yes", False: "NO"}[r.same_workload]
        cohort = {None: "unknown", True: "yes", False: "NO"}[r.same_cohort]
        print(
            f"{r.page_size:>3} {r.bs:>5} {r.peer_total_us:>9.1f} {r.ours_total_us:>9.1f} "
            f"{times(r.ratio_total):>7} {times(r.ratio_best_repeat):>9} "
            f"{times(r.ratio_cpu):>7} {same:>10} {cohort:>10} {_verdict(r.ratio_runs):>24} "
            f"{_ops(r.ours_ops) + '/' + _ops(r.peer_ops):>9}"
        )
    for m in result.missing:
        print(f"missing: P {m['page_size']} bs {m['bs']} is only in {m['only_in']}")
    return 0
