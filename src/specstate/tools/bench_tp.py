"""``specstate bench tp``: what the multi-rank mode adds to a round, against one rank.

Two gloo ranks on this machine (`specstate.distributed.spawn_ranks`) each drive a
`DistributedEngine` over the zero-cost `TimedWaitWorker` (no model, no wait), and rank 0 also
drives a plain `Engine` of the same workload. For each batch size rank 0 alternates blocks of
steady decode rounds between the two engines (one rank, then two ranks, then one, ...), times
each ``step()`` alone and reports the medians::

    submit B -> prefill and first decode (untimed) -> warm-up rounds (untimed)
             -> blocks of ``--block`` rounds, alternating TP = 1 and TP = 2, each step timed

The difference is the host cost of the mode per round: the step's commands (one broadcast on
the command group), the batch's agreement (one all-gather of a status row on the control group)
and, with ``--check``, the plan and result digests (one more all-gather, and hashing the batch's
host arrays). The worker's own collectives (the model's all-reduce) are not in it: they are the
model's cost, not the scheduler's. ``floor`` times the same collectives back to back with no
engine work between them: what the machine's process-to-process latency alone costs.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np

from specstate.core.params import RequestLimits, SamplingParams
from specstate.distributed.engine import DistributedEngine
from specstate.distributed.groups import RankGroup
from specstate.distributed.spawn import spawn_ranks
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.tools.bench_steady import decode_whole, quiet_heap, steady_config
from specstate.tools.timed_worker import TimedWaitWorker

__all__ = ["TpRow", "add_parser", "print_table", "run"]

_PROMPT_LEN: Final = 8
_WARMUP_ROUNDS: Final = 5


@attrs.frozen(kw_only=True)
class TpRow:
    """One batch size: medians in µs per steady decode round."""

    bs: int
    rounds: int
    check: bool
    tp1_us: float
    tp2_us: float
    added_us: float
    floor_us: float
    """The same collectives with no engine work between them: the machine's latency."""


def add_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``bench tp`` to the ``bench`` subcommands."""
    tp = benches.add_parser("tp", help="the per-round host cost of the multi-rank mode (2 ranks)")
    tp.add_argument("--batch-sizes", default="1,256,1024", help="comma-separated batch sizes")
    tp.add_argument("--rounds", type=int, default=200, help="timed rounds per engine and size")
    tp.add_argument("--block", type=int, default=10, help="rounds per alternation block")
    tp.add_argument("--page-size", type=int, default=16)
    tp.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    tp.add_argument(
        "--check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure with checking mode (digests) on, off, or (default) both",
    )
    tp.add_argument("--json", action="store_true", help="print JSON, not a table")


def run(args: argparse.Namespace) -> int:
    """Spawn the two ranks, measure, print; 2 when a rank failed."""
    sizes = tuple(int(x) for x in str(args.batch_sizes).split(","))
    checks = (False, True) if args.check is None else (args.check,)
    outcomes = spawn_ranks(
        _bench_rank,
        (sizes, checks, args.rounds, args.block, args.page_size, args.overlap),
        world_size=2,
        timeout_s=3600,
    )
    for outcome in outcomes:
        if not outcome.ok:
            print(f"specstate bench tp: rank {outcome.rank}: {outcome.error}", flush=True)
            return 2
    rows: list[TpRow] = outcomes[0].result
    if args.json:
        config = {"page_size": args.page_size, "overlap": args.overlap, "block": args.block}
        report = {"bench": "tp", "config": config, "results": [attrs.asdict(r) for r in rows]}
        print(json.dumps(report, indent=2))
        return 0
    print_table(rows, overlap=args.overlap, page_size=args.page_size)
    return 0


def print_table(rows: Sequence[TpRow], *, overlap: bool, page_size: int) -> None:
    """The rows as a table on stdout."""
    loop = "overlap" if overlap else "normal"
    print(f"Engine.step per steady decode round, µs, median ({loop} loop, page {page_size})")
    print(f"{'bs':>5} {'check':>6} {'TP=1':>9} {'TP=2':>9} {'added':>9} {'floor':>9}")
    for r in rows:
        check = "on" if r.check else "off"
        print(
            f"{r.bs:>5} {check:>6} {r.tp1_us:>9.1f} {r.tp2_us:>9.1f} {r.added_us:>9.1f} "
            f"{r.floor_us:>9.1f}"
        )


def _bench_rank(
    group: RankGroup,
    sizes: Sequence[int],
    checks: Sequence[bool],
    rounds: int,
    block: int,
    page_size: int,
    overlap: bool,
) -> list[TpRow]:
    """One rank: for every size and check mode, rank 0 alternates the two engines."""
    rows = []
    for bs in sizes:
        for check in checks:
            floor = _floor(group, rounds, check)
            config, limits, params = _workload(bs, rounds, page_size, overlap)
            worker = TimedWaitWorker(device_seconds=0.0)
            with DistributedEngine(
                worker, group=group, limits=limits, config=config, check_agreement=check
            ) as tp:
                if not tp.is_leader:
                    tp.follow()
                    continue
                tp1, tp2 = _alternate(tp, bs, rounds, block, config, limits, params)
            rows.append(
                TpRow(
                    bs=bs,
                    rounds=rounds,
                    check=check,
                    tp1_us=round(tp1 * 1e6, 1),
                    tp2_us=round(tp2 * 1e6, 1),
                    added_us=round((tp2 - tp1) * 1e6, 1),
                    floor_us=round(floor * 1e6, 1),
                )
            )
    return rows


def _floor(group: RankGroup, rounds: int, check: bool) -> float:
    """Median (s) of one round's collectives alone: a step's command broadcast and status
    all-gather (and, checking, the plan all-gather), with nothing between them."""
    status = np.zeros(9, dtype=np.int64)
    digest = np.zeros(4, dtype=np.int64)
    samples = []
    gc.collect()  # the previous size's engines are garbage now: not inside the window
    gc.freeze()
    try:
        for _ in range(rounds):
            start = time.perf_counter()
            group.commands.broadcast_ints([1, 0])
            if check:
                group.control.all_gather_ints(digest)
            group.control.all_gather_ints(status)
            samples.append(time.perf_counter() - start)
    finally:
        gc.unfreeze()
    return statistics.median(samples)


def _workload(
    bs: int, rounds: int, page_size: int, overlap: bool
) -> tuple[EngineConfig, RequestLimits, SamplingParams]:
    """The config, limits and sampling of ``bs`` requests that outlast every timed round."""
    probe = TimedWaitWorker(device_seconds=0.0)
    max_new = probe.accept * (2 * rounds + _WARMUP_ROUNDS + 16)
    context = _PROMPT_LEN + max_new
    config = steady_config(
        probe.capabilities,
        batch_size=bs,
        context=context,
        prompt_len=_PROMPT_LEN,
        page_size=page_size,
        overlap=overlap,
    )
    limits = RequestLimits(vocab_size=32, max_context_len=context)
    return config, limits, SamplingParams(max_new_tokens=max_new, ignore_eos=True)


def _alternate(
    tp: DistributedEngine,
    bs: int,
    rounds: int,
    block: int,
    config: EngineConfig,
    limits: RequestLimits,
    params: SamplingParams,
) -> tuple[float, float]:
    """Medians (s) of TP = 1 and TP = 2 steady rounds, timed in alternating blocks."""
    samples: dict[int, list[float]] = {1: [], 2: []}
    with Engine(TimedWaitWorker(device_seconds=0.0), limits=limits, config=config) as one:
        engines: dict[int, Engine] = {1: one, 2: tp}
        for engine in engines.values():
            for i in range(bs):
                engine.submit(f"bench-{i}", range(1, _PROMPT_LEN + 1), params)
            decode_whole(engine, bs)
            for _ in range(_WARMUP_ROUNDS):
                engine.step()
        with quiet_heap():
            for _ in range(max(1, rounds // block)):
                for label, engine in engines.items():
                    for _ in range(block):
                        start = time.perf_counter()
                        engine.step()
                        samples[label].append(time.perf_counter() - start)
        for engine in engines.values():  # the workload must not have finished in the window
            for i in range(bs):
                if engine.request(f"bench-{i}").is_finished:
                    raise RuntimeError(f"bs {bs}: a request finished inside the timed window")
    return statistics.median(samples[1]), statistics.median(samples[2])
