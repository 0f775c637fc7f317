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
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Final, TypeVar

from specstate.tools import bench_grammar, bench_recurrent, bench_reports, bench_step, bench_tp
from specstate.tools.bench_reports import fail, header, progress
from specstate.tools.cli_types import count, milliseconds, positive_ints

__all__ = ["add_arguments", "run"]

_T = TypeVar("_T", int, float)

_BATCH_SIZES: Final = (1, 64, 256, 1024)
"""Default batch sizes: the peer workload's."""


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


def _algorithm_option(parser: argparse.ArgumentParser, *, default: str | None) -> None:
    from specstate.tools.draft_shapes import DRAFT_SHAPES

    parser.add_argument(
        "--algorithm",
        choices=tuple(DRAFT_SHAPES),
        default=default,
        help="the drafter family whose capabilities and relay payload the stand-in worker "
        "declares (specstate.tools.draft_shapes)"
        + ("" if default else "; default: a bonus-only relay"),
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
    _list_option(host, "--page-sizes", positive_ints, (1, 16), "KV page sizes")
    _list_option(host, "--batch-sizes", positive_ints, _BATCH_SIZES, "batch sizes")
    host.add_argument("--iters", type=count(1), default=300, help="timed rounds per run (300)")
    host.add_argument("--warmup", type=count(0), default=20, help="untimed rounds per run (20)")
    host.add_argument("--repeats", type=count(1), default=5, help="fresh runs per size (5)")
    host.add_argument(
        "--launch-us",
        type=float,
        default=5.0,
        help="modelled cost of one device-write launch, µs (5; the peer harness takes the same)",
    )
    host.add_argument(
        "--launch-model",
        choices=("stand-ins", "ops"),
        default="stand-ins",
        help="stand-ins: a spin per req_to_token store and relay gather; ops: every tensor "
        "operation counted (an untimed counting replay) and charged one launch, as the peer "
        "harnesses do",
    )
    host.add_argument(
        "--device",
        default="cpu",
        help="the engine's device: cpu (its host path) or cpu:0 (its device path on the CPU: "
        "the result copied, the slot table mirrored, as on a GPU)",
    )
    host.add_argument(
        "--handoff",
        action="store_true",
        help="also time each round with its output hand-off (to AsyncEngine's request streams)",
    )
    host.add_argument(
        "--malloc-mmap-threshold",
        type=count(0),
        default=64 << 20,
        help="glibc M_MMAP_THRESHOLD set at start, bytes (64 MiB)",
    )
    host.add_argument(
        "--malloc-trim-threshold",
        type=count(0),
        default=256 << 20,
        help="glibc M_TRIM_THRESHOLD set at start, bytes (256 MiB)",
    )
    _algorithm_option(host, default="eagle")
    host.add_argument("--json", action="store_true", help="print the JSON report, not a table")
    host.add_argument("--output", type=Path, metavar="FILE", help="also write the JSON report")
    compare = benches.add_parser(
        "compare", help="two host reports side by side", formatter_class=shown
    )
    compare.add_argument("ours", type=Path, metavar="OURS.json", help="bench host --json report")
    compare.add_argument("peer", type=Path, metavar="PEER.json", help="the peer's report")
    compare.add_argument("--json", action="store_true", help="print JSON, not a table")
    compare.add_argument(
        "--figure",
        choices=("total", "handoff"),
        default="total",
        help="total: the round's bookkeeping; handoff: with the output hand-off, where both "
        "reports time it",
    )
    engine = benches.add_parser(
        "engine", help="Engine.step time per steady decode round", formatter_class=shown
    )
    _list_option(engine, "--batch-sizes", positive_ints, _BATCH_SIZES, "batch sizes")
    engine.add_argument("--rounds", type=count(1), default=200, help="timed rounds per size")
    engine.add_argument("--page-size", type=count(1), default=16, help="KV page size")
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
    _algorithm_option(engine, default=None)
    engine.add_argument("--json", action="store_true", help="print JSON, not a table")
    overlap = benches.add_parser(
        "overlap", help="overlap efficiency against a timed device", formatter_class=shown
    )
    _list_option(
        overlap,
        "--device-ms",
        milliseconds,
        (1.0, 2.0, 5.0, 10.0),
        "device milliseconds a forward",
    )
    overlap.add_argument("--batch-size", type=count(1), default=64, help="requests decoding")
    overlap.add_argument("--rounds", type=count(1), default=50, help="timed rounds per run")
    overlap.add_argument("--page-size", type=count(1), default=16, help="KV page size")
    _device_model_option(overlap)
    _accept_option(overlap)
    overlap.add_argument("--json", action="store_true", help="print JSON, not a table")
    from specstate.tools import bench_serve  # its own module; imports nothing heavy

    bench_serve.add_parser(benches)
    bench_recurrent.add_parser(benches)
    bench_grammar.add_arguments(benches)
    _add_prefix_arguments(benches)
    bench_tp.add_parser(benches)
    from specstate.tools import bench_budget

    bench_budget.add_parser(benches)
    from specstate.tools import bench_pd

    bench_pd.add_parser(benches)
    for sub in benches.choices.values():  # the benches of other modules show defaults too
        sub.formatter_class = shown


def _add_prefix_arguments(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    prefix = benches.add_parser("prefix", help="prefix cache work per round; hit rates (--hits)")
    _list_option(prefix, "--page-sizes", positive_ints, (1, 16), "KV page sizes")
    _list_option(prefix, "--concurrency", positive_ints, (16, 64, 256), "concurrent requests")
    prefix.add_argument("--rounds", type=count(1), default=200, help="timed rounds per run")
    prefix.add_argument("--warmup", type=count(0), default=100, help="untimed rounds per run")
    prefix.add_argument("--repeats", type=count(1), default=3, help="fresh runs per size")
    prefix.add_argument("--seed", type=count(0), default=0)
    prefix.add_argument("--peer", type=Path, metavar="PEER.json", help="the peer's report")
    prefix.add_argument("--hits", action="store_true", help="hit rates of a multi-turn workload")
    prefix.add_argument("--json", action="store_true", help="print JSON, not a table")


def run(args: argparse.Namespace) -> int:
    """Run one bench; 0 on success, 2 on a bad or unwritable file."""
    benches: Mapping[str, Callable[[argparse.Namespace], int]] = {
        "host": bench_reports.run_host,
        "compare": bench_reports.run_compare,
        "engine": bench_step.run_engine,
        "overlap": bench_step.run_overlap,
        "serve": _run_serve,
        "recurrent": bench_recurrent.run,
        "grammar": bench_grammar.run,
        "prefix": _run_prefix,
        "tp": bench_tp.run,
        "budget": _run_budget,
        "pd": _run_pd,
    }
    return benches[args.bench](args)


def _run_budget(args: argparse.Namespace) -> int:
    from specstate.tools import bench_budget

    return bench_budget.run(args)


def _run_pd(args: argparse.Namespace) -> int:
    from specstate.tools import bench_pd

    return bench_pd.run(args)


def _run_serve(args: argparse.Namespace) -> int:
    if args.workload == "chat":
        from specstate.tools import bench_serve_chat

        return bench_serve_chat.run_chat(args)
    from specstate.tools import bench_serve

    return bench_serve.run(args)


# ------------------------------------------------------------------------- prefix
def _run_prefix(args: argparse.Namespace) -> int:
    from specstate.tools import bench_prefix, prefix_workload

    if args.hits:
        report = bench_prefix.hit_rates(page_sizes=args.page_sizes, progress=progress)
        if args.json:
            print(json.dumps({**header("prefix-hits"), "results": report}, indent=2))
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
            return fail("prefix", f"{args.peer}: not a prefix report ({exc})")
    results = bench_prefix.prefix_benchmark(
        page_sizes=args.page_sizes,
        concurrency=args.concurrency,
        rounds=args.rounds,
        warmup=args.warmup,
        repeats=args.repeats,
        seed=args.seed,
        progress=progress,
    )
    if args.json:
        config = prefix_workload.config(args.rounds, args.warmup, args.seed)
        print(json.dumps({**header("prefix"), "config": config, "results": results}, indent=2))
        return 0
    print("prefix cache work per round (match + insert + evict), median µs")
    print(f"{'P':>3} {'conc':>5} {'specstate':>10} {'peer':>10} {'ratio':>6}")
    for r in results:
        theirs = peer.get((r["page_size"], r["concurrency"]))
        ratio = bench_reports.ratio(r["us_per_round"], theirs) if theirs is not None else None
        print(
            f"{r['page_size']:>3} {r['concurrency']:>5} {r['us_per_round']:>10.1f} "
            f"{'-' if theirs is None else f'{theirs:.1f}':>10} {bench_reports.times(ratio):>6}"
        )
    return 0
