"""``specstate bench engine`` and ``bench overlap``: `Engine.step` per steady decode round.

``bench engine`` times each `Engine.step` of a steady decode round with a zero-cost worker, in
both loops; ``bench overlap`` runs a timed-wait device (`specstate.tools.timed_worker`) and
reports how close the overlap loop comes to max(host, device) per round. A run, for a batch of
B requests::

    submit B -> prefill (untimed) -> first decode of all B -> 3 decode rounds (untimed)
             -> N decode rounds, each `Engine.step` timed alone; no request finishes in them
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Sequence
from typing import Final

import attrs

from specstate.tools.bench_reports import header, progress
from specstate.tools.bench_steady import decode_whole, quiet_heap, steady_config

__all__ = ["run_engine", "run_overlap"]

_PROMPT_LEN: Final = 8
"""Prompt tokens of every request of ``bench engine`` / ``bench overlap``."""
_WARMUP_DECODE_ROUNDS: Final = 3
"""Untimed decode rounds between the first full decode and the timed window."""


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
    family: str | None = None,
) -> list[float]:
    """Wall time of each of ``rounds`` steady decode steps of ``batch_size`` requests.

    Raises:
        RuntimeError: the batch never decoded whole, or a request finished in the window
            (the sizing below is meant to prevent both).
    """
    from specstate import Engine, RequestLimits, SamplingParams
    from specstate.tools.timed_worker import TimedWaitWorker

    worker = TimedWaitWorker(
        device_seconds=device_seconds,
        asynchronous=asynchronous,
        accept_rates=accept_rates,
        family=family,
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
            family=args.algorithm,
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


def run_engine(args: argparse.Namespace) -> int:
    rows = []
    for bs in args.batch_sizes:
        progress(f"bench engine: bs {bs}, {args.rounds} timed rounds")
        rows.append(_engine_row(args, bs))
    if args.json:
        config = {
            "page_size": args.page_size,
            "overlap": "both" if args.both_loops else args.overlap,
            "device_model": args.device_model,
            "prompt_len": _PROMPT_LEN,
            "algorithm": args.algorithm or "timed_wait",
        }
        report = {**header("engine"), "config": config, "results": [attrs.asdict(r) for r in rows]}
        print(json.dumps(report, indent=2))
        return 0
    worker = f"{args.device_model} zero-cost {args.algorithm or 'timed_wait'} worker"
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


def run_overlap(args: argparse.Namespace) -> int:
    rows = []
    for ms in args.device_ms:
        progress(
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
            **header("overlap"),
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
