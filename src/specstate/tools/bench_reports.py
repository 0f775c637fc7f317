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
        )
    return rows


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
_SETTINGS: Final = ("workload", "launch_us", "mmap_threshold", "trim_threshold", "allocator_set")
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


def _compare(ours_path: Path, peer_path: Path) -> _Comparison:
    ours, ours_rows = _read_report(ours_path)
    peer, peer_rows = _read_report(peer_path)
    rows, missing = [], []
    for key in sorted(ours_rows.keys() | peer_rows.keys()):
        a, b = ours_rows.get(key), peer_rows.get(key)
        if a is None or b is None:
            only_in = "peer" if a is None else "ours"
            missing.append({"page_size": key[0], "bs": key[1], "only_in": only_in})
            continue
        same = None if a.digest is None or b.digest is None else a.digest == b.digest
        rows.append(
            _CompareRow(
                page_size=key[0],
                bs=key[1],
                peer_total_us=b.total,
                ours_total_us=a.total,
                ratio_total=ratio(a.total, b.total),
                ratio_best_repeat=ratio(a.best_repeat, b.best_repeat),
                same_workload=same,
                ratio_cpu=None if a.cpu is None or b.cpu is None else ratio(a.cpu, b.cpu),
            )
        )
    return _Comparison(ours=ours, peer=peer, rows=tuple(rows), missing=tuple(missing))


def times(value: float | None) -> str:
    """A ratio as ``0.42x``, or ``n/a``."""
    return "n/a" if value is None else f"{value:.2f}x"


def run_compare(args: argparse.Namespace) -> int:
    try:
        result = _compare(args.ours, args.peer)
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
    print("median µs per round; ratios are ours / peer, below 1 means ours is faster")
    print(
        "(cpu: of the thread's CPU time per round, which other tenants of a machine disturb less)"
    )
    print(f"{'P':>3} {'bs':>5} {'peer µs':>9} {'ours µs':>9} {'ratio':>7} {'best rep':>9} "
          f"{'cpu':>7} {'same draws':>10}")  # fmt: skip
    for r in result.rows:
        same = {None: "unknown", True: "yes", False: "NO"}[r.same_workload]
        print(
            f"{r.page_size:>3} {r.bs:>5} {r.peer_total_us:>9.1f} {r.ours_total_us:>9.1f} "
            f"{times(r.ratio_total):>7} {times(r.ratio_best_repeat):>9} "
            f"{times(r.ratio_cpu):>7} {same:>10}"
        )
    for m in result.missing:
        print(f"missing: P {m['page_size']} bs {m['bs']} is only in {m['only_in']}")
    return 0
