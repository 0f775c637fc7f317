"""What every peer harness shares with ``specstate bench host``: draws, settings, the report.

A peer harness runs in the peer's own virtual environment, where specstate is not installed, so
it loads the workload module (`specstate.tools.host_workload`, standard library only) and the
op counter (`specstate.tools.host_ops`, torch only) by file path from this repository: both
sides replay exactly the same requests, accept lengths and finishes, `digest` and
`cohort_digest` fingerprint what each side did, and both count their tensor operations alike.

The launch model is the one ``specstate bench host --launch-model ops`` states: each run is
first replayed untimed under `COUNTER`, which counts every round's tensor operations (a fused
kernel that a harness replaces by a CPU stand-in counts as one), then replayed again, timed; a
round's figure is its measured host time plus ``--launch-us`` per counted operation. glibc's
allocator thresholds are set with ``mallopt`` at start, the same defaults as specstate's bench.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import functools
import gc
import importlib.util
import math
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Protocol

REPO = Path(__file__).resolve().parents[2]
WORKLOAD_PATH = REPO / "src" / "specstate" / "tools" / "host_workload.py"
PREFIX_WORKLOAD_PATH = REPO / "src" / "specstate" / "tools" / "prefix_workload.py"
OPS_PATH = REPO / "src" / "specstate" / "tools" / "host_ops.py"
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3


def load_workload(path: Path = WORKLOAD_PATH, name: str = "specstate_host_workload") -> ModuleType:
    """specstate's workload module (the host workload unless ``path`` names another), loaded
    by file path (no specstate install needed)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load the workload from {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


WORKLOAD: Any = load_workload()
"""The host workload (every harness's draws)."""


def json_stdout() -> Any:
    """Keep file descriptor 1 for the one JSON report; everything else printed goes to stderr."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    return out


def parser(description: str) -> argparse.ArgumentParser:
    """The options every harness takes, with ``specstate bench host``'s defaults."""
    p = argparse.ArgumentParser(description=description)
    group = p.add_mutually_exclusive_group()
    group.add_argument("--churn", dest="workload", action="store_const", const="churn")
    group.add_argument("--steady", dest="workload", action="store_const", const="steady")
    p.set_defaults(workload="churn")
    p.add_argument("--page-sizes", default="1,16")
    p.add_argument("--batch-sizes", default="1,64,256,1024")
    p.add_argument("--iters", type=int, default=300, help="timed rounds per run")
    p.add_argument("--warmup", type=int, default=20, help="untimed rounds per run")
    p.add_argument("--repeats", type=int, default=5, help="fresh runs per size")
    p.add_argument(
        "--launch-us", type=float, default=5.0, help="one modelled launch per tensor op, µs"
    )
    p.add_argument("--malloc-mmap-threshold", type=int, default=64 << 20)
    p.add_argument("--malloc-trim-threshold", type=int, default=256 << 20)
    return p


def ints(text: str) -> tuple[int, ...]:
    """A comma-separated list of integers."""
    return tuple(int(x) for x in text.split(","))


def set_allocator(mmap_threshold: int, trim_threshold: int) -> bool:
    """glibc's mmap and trim thresholds, as ``specstate bench host`` sets them."""
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c")).mallopt
    except (OSError, AttributeError, TypeError):
        return False
    ok = mallopt(M_MMAP_THRESHOLD, mmap_threshold) == 1
    return bool(ok and mallopt(M_TRIM_THRESHOLD, trim_threshold) == 1)


COUNTER: Any = load_workload(OPS_PATH, "specstate_host_ops").OpCounter()
"""Counts the tensor operations of a round during a run's counting replay (`count_run`); a
harness sets ``COUNTER.enabled`` around the parts of a round it times, and runs its kernel
stand-ins through ``COUNTER.kernel``."""


class Excluded:
    """Time spent inside a timed region that is not the harness's to count (ns)."""

    def __init__(self) -> None:
        self.ns = self.cpu_ns = 0

    def reset(self) -> None:
        """Start a new timed region."""
        self.ns = self.cpu_ns = 0

    def run(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call ``fn``; its wall and CPU time are added to `ns` and `cpu_ns`."""
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            self.cpu_ns += time.thread_time_ns() - c0
            self.ns += time.perf_counter_ns() - t0


@dataclass
class Run:
    """One fresh run of one (page, bs): per-round samples in µs and what it did.

    ``samples`` and ``cpu`` are the charged figures (measured + one launch per counted
    operation); ``host`` the measured wall time alone; ``handoff`` the charged figure with the
    output hand-off in place of the minimal read, for a harness that times one."""

    samples: list[float] = field(default_factory=list)  # wall clock, launches charged
    cpu: list[float] = field(default_factory=list)  # the thread's CPU time, launches charged
    host: list[float] = field(default_factory=list)  # wall clock, no launches
    handoff: list[float] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)  # counted tensor operations per round
    moves: list[int] = field(default_factory=list)  # of which host-device moves
    finished: list[tuple[int, int, int]] = field(default_factory=list)
    emitted: int = 0
    loop_s: float = 0.0


class Replay(Protocol):
    """A harness's replay of one (page, bs): its rounds, and a check of what it did."""

    finished: list[tuple[int, int, int]]
    emitted: int

    def round(self, r: int) -> tuple[int, ...]:
        """Run round ``r``; its timed wall and CPU nanoseconds, and for a harness that times
        an output hand-off, the wall and CPU nanoseconds of the round with it."""
        ...

    def check(self) -> None:
        """Raise if the replay did not do what the draws say."""
        ...


def count_run(replay: Replay, args: argparse.Namespace) -> list[tuple[int, int]]:
    """Replay every round of ``replay`` untimed under `COUNTER`; its operations per round,
    and the host-device moves among them."""
    counts = []
    with COUNTER:
        for r in range(args.warmup + args.iters):
            replay.round(r)
            counts.append(COUNTER.take())
    COUNTER.enabled = False
    replay.check()
    return counts


def timed_run(make: Callable[[], Replay], args: argparse.Namespace) -> Run:
    """One `Run`: a counting replay (`count_run`), then a fresh replay of ``args.warmup``
    untimed and ``args.iters`` timed rounds (the collector frozen), then its check."""
    ops = count_run(make(), args)
    replay = make()
    launch_ns = int(args.launch_us * 1e3)
    run = Run()
    gc.collect()
    gc.freeze()
    start = time.perf_counter()
    for r in range(args.warmup + args.iters):
        sample = replay.round(r)
        if r < args.warmup:
            continue
        charge = ops[r][0] * launch_ns
        run.ops.append(ops[r][0])
        run.moves.append(ops[r][1])
        run.host.append(sample[0] / 1e3)
        run.samples.append((sample[0] + charge) / 1e3)
        run.cpu.append((sample[1] + charge) / 1e3)
        if len(sample) > 2:
            run.handoff.append((sample[2] + charge) / 1e3)
    run.loop_s = time.perf_counter() - start
    gc.unfreeze()
    replay.check()
    run.finished, run.emitted = replay.finished, replay.emitted
    return run


def sweep(
    args: argparse.Namespace,
    name: str,
    replay: Callable[[int, int, argparse.Namespace], Replay],
    digest: Any,
) -> list[dict[str, object]]:
    """``args.repeats`` alternations over every (page, bs) of ``args``, fresh replays
    ``replay(page, bs, args)`` timed by `timed_run` each time (progress on stderr); the
    report's rows."""
    pages, sizes = ints(args.page_sizes), ints(args.batch_sizes)
    runs: dict[tuple[int, int], list[Run]] = {}
    for rep in range(args.repeats):
        for page in pages:
            for bs in sizes:
                print(
                    f"{name}: repeat {rep + 1}/{args.repeats}, page {page}, bs {bs}",
                    file=sys.stderr,
                    flush=True,
                )
                make = functools.partial(replay, page, bs, args)
                runs.setdefault((page, bs), []).append(timed_run(make, args))
    return [row(page, bs, done, digest) for (page, bs), done in runs.items()]


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median and nearest-rank p90, as ``specstate bench host`` computes them."""
    ordered = sorted(values)
    n = len(ordered)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    p90 = ordered[max(1, math.ceil(0.9 * n)) - 1]
    return {"median": round(median, 2), "p90": round(p90, 2)}


def row(page: int, bs: int, runs: list[Run], digest: Any) -> dict[str, object]:
    """One (page, bs) entry of the report, in ``specstate bench host``'s shape."""
    pooled = [x for run in runs for x in run.samples]
    per_repeat = [stats(run.samples)["median"] for run in runs]
    total = stats(pooled)
    first = runs[0]
    out: dict[str, object] = {
        "page_size": page,
        "bs": bs,
        "repeats": len(runs),
        "samples": len(pooled),
        "total_us": total,
        "total_us_per_req": {k: round(v / bs, 3) for k, v in total.items()},
        "total_us_median_per_repeat": per_repeat,
        "total_us_best_repeat_median": min(per_repeat),
        "cpu_us": stats([x for run in runs for x in run.cpu]),
        "finished_requests": len(first.finished),
        "emitted_tokens": first.emitted,
        "workload_digest": digest(first.finished),
        "cohort_digest": WORKLOAD.cohort_digest(first.finished, bs),
        "loop_s": [round(run.loop_s, 2) for run in runs],
    }
    if all(run.ops for run in runs):
        ops = [x for run in runs for x in run.ops]
        out["device_ops"] = {**stats(ops), "mean": round(sum(ops) / len(ops), 2)}
        moves = [x for run in runs for x in run.moves]
        out["device_moves"] = {**stats(moves), "mean": round(sum(moves) / len(moves), 2)}
        out["host_us"] = stats([x for run in runs for x in run.host])
    if all(run.handoff for run in runs):
        out["handoff_total_us"] = stats([x for run in runs for x in run.handoff])
        out["handoff_us_median_per_repeat"] = [stats(run.handoff)["median"] for run in runs]
    return out


def settings(args: argparse.Namespace, allocator_set: bool, timed: str) -> dict[str, object]:
    """The report's ``config``: the keys ``specstate bench compare`` prints side by side."""
    return {
        "workload": args.workload,
        "page_sizes": list(ints(args.page_sizes)),
        "batch_sizes": list(ints(args.batch_sizes)),
        "iters": args.iters,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "launch_us": args.launch_us,
        "launch_model": "ops",
        "mmap_threshold": args.malloc_mmap_threshold,
        "trim_threshold": args.malloc_trim_threshold,
        "allocator_set": allocator_set,
        "algorithm": "eagle chain, 3 steps, 4 draft tokens (L = 4, R = 8)",
        "timed": timed,
        "torch_threads": 1,
        "python": platform.python_version(),
        "machine": f"{platform.machine()}, {os.cpu_count()} logical CPUs",
    }
