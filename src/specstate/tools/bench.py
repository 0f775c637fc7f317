"""``specstate bench``: the engine's host time per round, alone and beside a peer's numbers.

Subcommands:

* ``bench host``: `Engine.step` of one speculative decode round, whole, on a churned (default)
  or steady workload (`specstate.tools.host_workload`); its JSON report has the shape a
  peer's report has (the peers' harnesses live in the repository's ``benchmarks/peers``).
* ``bench compare OURS.json PEER.json``: two such reports side by side, as ratios ours / peer,
  with the settings both ran under.
* ``bench engine``: `Engine.step` wall time per steady decode round with a zero-cost worker.
* ``bench overlap``: how close the overlap loop comes to max(host, device) per round against
  a timed-wait device (`specstate.tools.timed_worker.TimedWaitWorker`).
* ``bench serve``: concurrent clients through `AsyncEngine` and over HTTP against the engine
  driven directly (`specstate.tools.bench_serve`).
* ``bench recurrent``: the host cost of committing a hybrid worker's recurrent states per round
  (`specstate.tools.bench_recurrent`).
* ``bench prefix``: the prefix cache's match + insert + evict per scheduler round on a
  shared-prefix workload (`specstate.tools.bench_prefix`), beside a peer's report (``--peer``);
  ``--hits`` instead serves a multi-turn workload on the embedded model with every algorithm
  and reports hit rates and first-round acceptance on cached prefixes.
* ``bench tp``: the per-round host cost of the multi-rank mode against one rank
  (`specstate.tools.bench_tp`).

Results go to stdout (a table, or one JSON object with ``--json``); progress goes to stderr.
A round of ``bench engine`` / ``bench overlap``, for a batch of B requests::

    submit B -> prefill (untimed) -> first decode of all B -> 3 decode rounds (untimed)
             -> N decode rounds, each `Engine.step` timed alone; no request finishes in them
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, TypeVar

import attrs
import torch

from specstate.tools import bench_grammar, bench_recurrent, bench_tp
from specstate.tools.bench_steady import decode_whole, quiet_heap, steady_config

__all__ = ["add_arguments", "run"]

_T = TypeVar("_T", int, float)

_PROMPT_LEN: Final = 8
"""Prompt tokens of every request of ``bench engine`` / ``bench overlap``."""
_WARMUP_DECODE_ROUNDS: Final = 3
"""Untimed decode rounds between the first full decode and the timed window."""
_BATCH_SIZES: Final = (1, 64, 256, 1024)
"""Default batch sizes: the peer workload's."""
_PARTS: Final = ("reserve", "relay", "settle")
"""The parts of a host iteration, in the order they run."""


# ---------------------------------------------------------------- argument types
def _comma_list(text: str, convert: Callable[[str], _T], minimum: _T) -> tuple[_T, ...]:
    try:
        values = tuple(convert(item) for item in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of numbers"
        ) from None
    if not all(minimum <= v < math.inf for v in values):
        raise argparse.ArgumentTypeError(f"{text!r}: every item must be at least {minimum}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{text!r} names an item twice")
    return values


def _positive_ints(text: str) -> tuple[int, ...]:
    return _comma_list(text, int, 1)


def _milliseconds(text: str) -> tuple[float, ...]:
    return _comma_list(text, float, 0.0)


def _count(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is below {minimum}")
        return value

    return parse


def _list_option(
    parser: argparse.ArgumentParser,
    flag: str,
    parse: Callable[[str], Sequence[float]],
    default: Sequence[float],
    what: str,
) -> None:
    shown = ",".join(f"{v:g}" for v in default)
    parser.add_argument(
        flag, type=parse, default=default, metavar="LIST", help=f"{what} (default: {shown})"
    )


def _accept_rates(text: str) -> tuple[float, ...]:
    """Synthetic acceptance: one probability per draft position of the timed worker (3)."""
    try:
        rates = tuple(float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of numbers") from None
    if len(rates) != 3 or not all(0.0 <= r <= 1.0 for r in rates):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give 3 probabilities in [0, 1], one per draft position"
        )
    return rates


def _accept_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--accept-rates",
        type=_accept_rates,
        default=None,
        metavar="P1,P2,P3",
        help="synthetic acceptance: draft k is accepted with probability Pk given the ones "
        "before it (default: every row accepts 2 tokens a round)",
    )


def _device_model_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--device-model",
        choices=("async", "blocking"),
        default="async",
        help="async: the worker declares itself asynchronous, its forward is "
        "enqueued and the result's copy event completes after the device time, as on a GPU; "
        "blocking: the forward sleeps on the forward stream's thread",
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` command's arguments: one subcommand per measurement."""
    parser.description = "Measure the engine's host time per round; compare with a peer."
    benches = parser.add_subparsers(dest="bench", metavar="BENCH", required=True)
    shown = parser.formatter_class  # every bench's --help shows its defaults, as the command's
    host = benches.add_parser(
        "host", help="Engine.step per decode round (peer format)", formatter_class=shown
    )
    workload = host.add_mutually_exclusive_group()
    workload.add_argument(
        "--churn",
        dest="workload",
        action="store_const",
        const="churn",
        default="churn",
        help="requests finish and join every round (the default)",
    )
    workload.add_argument(
        "--steady", dest="workload", action="store_const", const="steady", help="nobody finishes"
    )
    _list_option(host, "--page-sizes", _positive_ints, (1, 16), "KV page sizes")
    _list_option(host, "--batch-sizes", _positive_ints, _BATCH_SIZES, "batch sizes")
    host.add_argument("--iters", type=_count(1), default=300, help="timed rounds per run (300)")
    host.add_argument("--warmup", type=_count(0), default=20, help="untimed rounds per run (20)")
    host.add_argument("--repeats", type=_count(1), default=5, help="fresh runs per size (5)")
    host.add_argument(
        "--launch-us",
        type=float,
        default=5.0,
        help="modelled cost of one device-write launch, µs (5; the peer harness takes the same)",
    )
    host.add_argument(
        "--malloc-mmap-threshold",
        type=_count(0),
        default=64 << 20,
        help="glibc M_MMAP_THRESHOLD set at start, bytes (64 MiB)",
    )
    host.add_argument(
        "--malloc-trim-threshold",
        type=_count(0),
        default=256 << 20,
        help="glibc M_TRIM_THRESHOLD set at start, bytes (256 MiB)",
    )
    host.add_argument("--json", action="store_true", help="print the JSON report, not a table")
    host.add_argument("--output", type=Path, metavar="FILE", help="also write the JSON report")
    compare = benches.add_parser(
        "compare", help="two host reports side by side", formatter_class=shown
    )
    compare.add_argument("ours", type=Path, metavar="OURS.json", help="bench host --json report")
    compare.add_argument("peer", type=Path, metavar="PEER.json", help="the peer's report")
    compare.add_argument("--json", action="store_true", help="print JSON, not a table")
    engine = benches.add_parser(
        "engine", help="Engine.step time per steady decode round", formatter_class=shown
    )
    _list_option(engine, "--batch-sizes", _positive_ints, _BATCH_SIZES, "batch sizes")
    engine.add_argument("--rounds", type=_count(1), default=200, help="timed rounds per size")
    engine.add_argument("--page-size", type=_count(1), default=16, help="KV page size")
    engine.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the overlap loop (--no-overlap: the normal loop)",
    )
    engine.add_argument(
        "--both-loops",
        action="store_true",
        help="time the overlap and the normal loop, alternately, and print their ratio",
    )
    _device_model_option(engine)
    _accept_option(engine)
    engine.add_argument("--json", action="store_true", help="print JSON, not a table")
    overlap = benches.add_parser(
        "overlap", help="overlap efficiency against a timed device", formatter_class=shown
    )
    _list_option(
        overlap,
        "--device-ms",
        _milliseconds,
        (1.0, 2.0, 5.0, 10.0),
        "device milliseconds a forward",
    )
    overlap.add_argument("--batch-size", type=_count(1), default=64, help="requests decoding")
    overlap.add_argument("--rounds", type=_count(1), default=50, help="timed rounds per run")
    overlap.add_argument("--page-size", type=_count(1), default=16, help="KV page size")
    _device_model_option(overlap)
    _accept_option(overlap)
    overlap.add_argument("--json", action="store_true", help="print JSON, not a table")
    from specstate.tools import bench_serve  # its own module; imports nothing heavy

    bench_serve.add_parser(benches)
    bench_recurrent.add_parser(benches)
    bench_grammar.add_arguments(benches)
    _add_prefix_arguments(benches)
    bench_tp.add_parser(benches)
    for sub in benches.choices.values():  # the benches of other modules show defaults too
        sub.formatter_class = shown


def _add_prefix_arguments(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prefix = benches.add_parser("prefix", help="prefix cache work per round; hit rates (--hits)")
    _list_option(prefix, "--page-sizes", _positive_ints, (1, 16), "KV page sizes")
    _list_option(prefix, "--concurrency", _positive_ints, (16, 64, 256), "concurrent requests")
    prefix.add_argument("--rounds", type=_count(1), default=200, help="timed rounds per run")
    prefix.add_argument("--warmup", type=_count(0), default=100, help="untimed rounds per run")
    prefix.add_argument("--repeats", type=_count(1), default=3, help="fresh runs per size")
    prefix.add_argument("--seed", type=_count(0), default=0)
    prefix.add_argument("--peer", type=Path, metavar="PEER.json", help="the peer's report")
    prefix.add_argument("--hits", action="store_true", help="hit rates of a multi-turn workload")
    prefix.add_argument("--json", action="store_true", help="print JSON, not a table")


def run(args: argparse.Namespace) -> int:
    """Run one bench; 0 on success, 2 on a bad or unwritable file."""
    benches: Mapping[str, Callable[[argparse.Namespace], int]] = {
        "host": _run_host,
        "compare": _run_compare,
        "engine": _run_engine,
        "overlap": _run_overlap,
        "serve": _run_serve,
        "recurrent": bench_recurrent.run,
        "grammar": bench_grammar.run,
        "prefix": _run_prefix,
        "tp": bench_tp.run,
    }
    return benches[args.bench](args)


def _run_serve(args: argparse.Namespace) -> int:
    from specstate.tools import bench_serve

    return bench_serve.run(args)


def _progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _fail(bench: str, message: str) -> int:
    print(f"specstate bench {bench}: {message}", file=sys.stderr)
    return 2


def _header(bench: str) -> dict[str, object]:
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


def _run_host(args: argparse.Namespace) -> int:
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
    )
    report: dict[str, object] = bench_host.host_benchmark(settings, progress=_progress)
    text = json.dumps(report, indent=2)
    if args.output is not None:
        try:
            args.output.write_text(text + "\n", encoding="utf-8")
        except OSError as exc:
            return _fail("host", f"cannot write {args.output}: {exc}")
    if args.json:
        print(text)
        return 0
    try:
        rows = _host_rows(report, "host_benchmark()")
    except _BadReport as exc:
        return _fail("host", str(exc))
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


def _ratio(ours: float, peer: float) -> float | None:
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
                ratio_total=_ratio(a.total, b.total),
                ratio_best_repeat=_ratio(a.best_repeat, b.best_repeat),
                same_workload=same,
                ratio_cpu=None if a.cpu is None or b.cpu is None else _ratio(a.cpu, b.cpu),
            )
        )
    return _Comparison(ours=ours, peer=peer, rows=tuple(rows), missing=tuple(missing))


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _run_compare(args: argparse.Namespace) -> int:
    try:
        result = _compare(args.ours, args.peer)
    except _BadReport as exc:
        return _fail("compare", str(exc))
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
            f"{_times(r.ratio_total):>7} {_times(r.ratio_best_repeat):>9} "
            f"{_times(r.ratio_cpu):>7} {same:>10}"
        )
    for m in result.missing:
        print(f"missing: P {m['page_size']} bs {m['bs']} is only in {m['only_in']}")
    return 0


# ------------------------------------------------------------------ engine rounds
@attrs.frozen
class _Stat:
    """Median and nearest-rank p90 of a sample, in µs."""

    median: float
    p90: float

    @classmethod
    def of(cls, seconds: Sequence[float]) -> _Stat:
        ordered = sorted(seconds)
        p90 = ordered[max(0, math.ceil(0.9 * len(ordered)) - 1)]
        return cls(round(statistics.median(ordered) * 1e6, 2), round(p90 * 1e6, 2))


def _decode_step_seconds(
    batch_size: int,
    *,
    rounds: int,
    page_size: int,
    overlap: bool,
    device_seconds: float,
    asynchronous: bool = False,
    accept_rates: Sequence[float] | None = None,
) -> list[float]:
    """Wall time of each of ``rounds`` steady decode steps of ``batch_size`` requests.

    Raises:
        RuntimeError: the batch never decoded whole, or a request finished in the window
            (the sizing below is meant to prevent both).
    """
    from specstate import Engine, RequestLimits, SamplingParams
    from specstate.tools.timed_worker import TimedWaitWorker

    worker = TimedWaitWorker(
        device_seconds=device_seconds, asynchronous=asynchronous, accept_rates=accept_rates
    )
    # Every round before and in the window, plus slack for the overlap loop's lookahead.
    max_new = worker.accept * (rounds + _WARMUP_DECODE_ROUNDS + 8)
    context = _PROMPT_LEN + max_new
    config = steady_config(
        worker.capabilities,
        batch_size=batch_size,
        context=context,
        prompt_len=_PROMPT_LEN,
        page_size=page_size,
        overlap=overlap,
    )
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    prompt = range(1, _PROMPT_LEN + 1)
    with Engine(
        worker, limits=RequestLimits(vocab_size=32, max_context_len=context), config=config
    ) as engine:
        reqs = [engine.submit(f"bench-{i}", prompt, params) for i in range(batch_size)]
        decode_whole(engine, batch_size)
        for _ in range(_WARMUP_DECODE_ROUNDS):
            engine.step()
        samples = []
        with quiet_heap():
            for _ in range(rounds):
                start = time.perf_counter()
                engine.step()
                samples.append(time.perf_counter() - start)
        if any(r.is_finished for r in reqs):
            raise RuntimeError(f"bs {batch_size}: a request finished inside the timed window")
    return samples


@attrs.frozen(kw_only=True)
class _EngineRow:
    """`Engine.step` time per steady decode round for one batch size.

    With ``--both-loops``: ``step_us`` is the overlap loop's, ``normal_step_us`` the normal
    loop's (runs alternated) and ``overlap_vs_normal`` the ratio of their medians.
    """

    bs: int
    rounds: int
    step_us: _Stat
    step_us_per_req: float
    normal_step_us: _Stat | None = None
    overlap_vs_normal: float | None = None


_LOOP_ALTERNATIONS: Final = 3
"""``--both-loops``: runs of each loop per batch size, alternated; samples pooled."""


def _engine_row(args: argparse.Namespace, bs: int) -> _EngineRow:
    def seconds(overlap: bool) -> list[float]:
        return _decode_step_seconds(
            bs,
            rounds=args.rounds,
            page_size=args.page_size,
            overlap=overlap,
            device_seconds=0.0,
            asynchronous=args.device_model == "async",
            accept_rates=args.accept_rates,
        )

    if not args.both_loops:
        step = _Stat.of(seconds(args.overlap))
        return _EngineRow(
            bs=bs, rounds=args.rounds, step_us=step, step_us_per_req=round(step.median / bs, 3)
        )
    runs: dict[bool, list[float]] = {True: [], False: []}
    for _ in range(_LOOP_ALTERNATIONS):
        for overlap in (True, False):
            runs[overlap] += seconds(overlap)
    step, normal = _Stat.of(runs[True]), _Stat.of(runs[False])
    return _EngineRow(
        bs=bs,
        rounds=len(runs[True]),
        step_us=step,
        step_us_per_req=round(step.median / bs, 3),
        normal_step_us=normal,
        overlap_vs_normal=round(step.median / normal.median, 3),
    )


def _run_engine(args: argparse.Namespace) -> int:
    rows = []
    for bs in args.batch_sizes:
        _progress(f"bench engine: bs {bs}, {args.rounds} timed rounds")
        rows.append(_engine_row(args, bs))
    if args.json:
        config = {
            "page_size": args.page_size,
            "overlap": "both" if args.both_loops else args.overlap,
            "device_model": args.device_model,
            "prompt_len": _PROMPT_LEN,
        }
        report = {**_header("engine"), "config": config, "results": [attrs.asdict(r) for r in rows]}
        print(json.dumps(report, indent=2))
        return 0
    worker = f"{args.device_model} zero-cost worker"
    if args.both_loops:
        print(
            f"Engine.step per steady decode round, µs (page {args.page_size}, {worker}; "
            "the two loops alternated)"
        )
        print(f"{'bs':>5} {'overlap':>10} {'p90':>10} {'normal':>10} {'p90':>10} {'ratio':>7}")
        for r in rows:
            o, n = r.step_us, r.normal_step_us
            assert n is not None
            print(
                f"{r.bs:>5} {o.median:>10.1f} {o.p90:>10.1f} {n.median:>10.1f} {n.p90:>10.1f} "
                f"{r.overlap_vs_normal:>6.2f}x"
            )
        return 0
    loop = "overlap" if args.overlap else "normal"
    print(f"Engine.step per steady decode round, µs ({loop} loop, page {args.page_size}); {worker}")
    print(f"{'bs':>5} {'median':>10} {'p90':>10} {'µs/req':>8}")
    for r in rows:
        step = r.step_us
        print(f"{r.bs:>5} {step.median:>10.1f} {step.p90:>10.1f} {r.step_us_per_req:>8.3f}")
    return 0


# ------------------------------------------------------------------------ overlap
@attrs.frozen(kw_only=True)
class _OverlapRow:
    """One device time: medians per round in µs, and what overlap achieved.

    ``efficiency = max(host, device) / overlap`` (1 is a perfect overlap);
    ``gain = normal / overlap`` (measured); ``ideal_gain = (host + device) / max(host, device)``.
    """

    device_us: float
    host_us: float
    normal_us: float
    overlap_us: float
    efficiency: float
    gain: float
    ideal_gain: float


def _overlap_row(args: argparse.Namespace, device_ms: float) -> _OverlapRow:
    d = device_ms * 1e-3

    def median_round(overlap: bool, device_seconds: float) -> float:
        return statistics.median(
            _decode_step_seconds(
                args.batch_size,
                rounds=args.rounds,
                page_size=args.page_size,
                overlap=overlap,
                device_seconds=device_seconds,
                asynchronous=args.device_model == "async",
                accept_rates=args.accept_rates,
            )
        )

    host = median_round(True, 0.0)  # the host's own time per round: no device wait
    with_overlap = median_round(True, d)
    normal = median_round(False, d)
    bound = max(host, d)
    return _OverlapRow(
        device_us=round(d * 1e6, 2),
        host_us=round(host * 1e6, 2),
        normal_us=round(normal * 1e6, 2),
        overlap_us=round(with_overlap * 1e6, 2),
        efficiency=round(bound / with_overlap, 4),
        gain=round(normal / with_overlap, 4),
        ideal_gain=round((host + d) / bound, 4),
    )


def _run_overlap(args: argparse.Namespace) -> int:
    rows = []
    for ms in args.device_ms:
        _progress(
            f"bench overlap: device {ms:g} ms, bs {args.batch_size}, 3 runs of {args.rounds} rounds"
        )
        rows.append(_overlap_row(args, ms))
    if args.json:
        config = {
            "batch_size": args.batch_size,
            "page_size": args.page_size,
            "rounds": args.rounds,
            "device_model": args.device_model,
        }
        report = {
            **_header("overlap"),
            "config": config,
            "results": [attrs.asdict(r) for r in rows],
        }
        print(json.dumps(report, indent=2))
        return 0
    print(
        f"per-round medians, µs, bs {args.batch_size}, {args.device_model} device; "
        "efficiency = max(host, device) / overlap"
    )
    print(f"{'device':>9} {'host':>9} {'normal':>9} {'overlap':>9} {'efficiency':>10} "
          f"{'gain':>6} {'ideal':>6}")  # fmt: skip
    for r in rows:
        print(
            f"{r.device_us:>9.1f} {r.host_us:>9.1f} {r.normal_us:>9.1f} {r.overlap_us:>9.1f} "
            f"{r.efficiency:>10.2f} {r.gain:>5.2f}x {r.ideal_gain:>5.2f}x"
        )
    return 0


# ------------------------------------------------------------------------- prefix
def _run_prefix(args: argparse.Namespace) -> int:
    from specstate.tools import bench_prefix

    if args.hits:
        report = bench_prefix.hit_rates(page_sizes=args.page_sizes, progress=_progress)
        if args.json:
            print(json.dumps({**_header("prefix-hits"), "results": report}, indent=2))
        else:
            bench_prefix.print_hit_rates(report)
        return 0
    peer: dict[tuple[int, int], float] = {}
    if args.peer is not None:
        try:
            loaded = json.loads(args.peer.read_text(encoding="utf-8"))
            peer = {
                (r["page_size"], r["concurrency"]): r["us_per_round"] for r in loaded["results"]
            }
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return _fail("prefix", f"{args.peer}: not a prefix report ({exc})")
    results = bench_prefix.prefix_benchmark(
        page_sizes=args.page_sizes,
        concurrency=args.concurrency,
        rounds=args.rounds,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        progress=_progress,
    )
    if args.json:
        config = bench_prefix.config(args.rounds, args.warmup, args.seed)
        print(json.dumps({**_header("prefix"), "config": config, "results": results}, indent=2))
        return 0
    print("prefix cache work per round (match + insert + evict), median µs")
    print(f"{'P':>3} {'conc':>5} {'specstate':>10} {'peer':>10} {'ratio':>6}")
    for r in results:
        theirs = peer.get((r["page_size"], r["concurrency"]))
        ratio = _ratio(r["us_per_round"], theirs) if theirs is not None else None
        print(
            f"{r['page_size']:>3} {r['concurrency']:>5} {r['us_per_round']:>10.1f} "
            f"{'-' if theirs is None else f'{theirs:.1f}':>10} {_times(ratio):>6}"
        )
    return 0
