"""Start the ranks of a tensor-parallel group as processes on this machine, bounded in time.

`spawn_ranks` is what ``torchrun --nproc-per-node N`` does, for tests, the conformance kit and
``specstate bench tp``: it picks a free port, starts ``N`` processes (the ``spawn`` start method:
fresh interpreters, no inherited threads), joins each to a `RankGroup`, runs
``program(group, *args)`` and hands back every rank's outcome. A rank that raises reports its
error instead; ranks still running after ``timeout_s`` are killed and reported as timed out, so
a hang fails the caller instead of wedging it.

Invariant: when `spawn_ranks` returns, every process it started has exited.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any, Final

import attrs

from specstate.core.errors import InvalidConfig

__all__ = ["RankOutcome", "free_port", "spawn_ranks"]

_GRACE_S: Final = 5.0


@attrs.frozen(kw_only=True)
class RankOutcome:
    """What one spawned rank did.

    Attributes:
        rank: the rank.
        result: ``program``'s return value (None if it raised or timed out).
        error_type: the class name of what it raised (``"Timeout"`` if it was killed).
        error: the message of what it raised.
        traceback: the formatted traceback of what it raised.
        seconds: wall time from the spawn to the outcome.
    """

    rank: int
    result: Any = None
    error_type: str | None = None
    error: str = ""
    traceback: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        """True when ``program`` returned."""
        return self.error_type is None


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _rank_main(
    rank: int,
    world_size: int,
    port: int,
    device: str,
    group_timeout_s: float,
    program: Callable[..., object],
    args: tuple[object, ...],
    results: multiprocessing.Queue[bytes],
    threads: int,
) -> None:
    """One spawned rank: join the group, run the program, report, exit without teardown."""
    import torch

    from specstate.distributed.groups import RankGroup

    torch.set_num_threads(threads)
    report: tuple[int, object, str | None, str, str]
    try:
        group = RankGroup.init(
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            device=device,
            timeout_s=group_timeout_s,
        )
        report = (rank, program(group, *args), None, "", "")
    except BaseException as exc:  # reported to the parent, which decides
        report = (rank, None, type(exc).__name__, str(exc), traceback.format_exc())
    # NOTE: pickled here, not by the queue: the queue would share tensors through file
    # descriptors that vanish when this process exits before the parent reads them.
    try:
        payload = pickle.dumps(report)
    except Exception as exc:
        payload = pickle.dumps((rank, None, type(exc).__name__, f"unpicklable: {exc}", ""))
    results.put(payload)
    results.close()
    results.join_thread()
    sys.stdout.flush()
    sys.stderr.flush()
    # NOTE: no process-group teardown: after a failure it may block on a dead peer, and a
    # wedged forward thread must not keep the process alive.
    os._exit(0)


def spawn_ranks(
    program: Callable[..., object],
    args: Sequence[object] = (),
    *,
    world_size: int = 2,
    timeout_s: float = 300.0,
    group_timeout_s: float = 60.0,
    device: str = "cpu",
    threads: int = 1,
) -> list[RankOutcome]:
    """Run ``program(group, *args)`` on ``world_size`` fresh ranks; every rank's outcome.

    Args:
        program: a module-level function (the ranks import it by name).
        args: its further arguments (picklable).
        world_size: ranks to start.
        timeout_s: the most wall time for all of them; later ranks are killed.
        group_timeout_s: the worker group's collective timeout (`RankGroup`).
        device: ``cpu``, or ``cuda`` (rank ``r`` on ``cuda:r``).
        threads: torch intra-op threads per rank.

    Raises:
        InvalidConfig: ``world_size < 1``.
    """
    if world_size < 1:
        raise InvalidConfig(f"spawn_ranks: world_size must be >= 1, got {world_size}")
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[bytes] = context.Queue()
    port = free_port()
    started = time.monotonic()
    processes = []
    for rank in range(world_size):
        where = f"cuda:{rank}" if device == "cuda" else device
        proc = context.Process(
            target=_rank_main,
            args=(rank, world_size, port, where, group_timeout_s, program, tuple(args), results,
                  threads),
            name=f"specstate-rank-{rank}",
            daemon=True,
        )  # fmt: skip
        proc.start()
        processes.append(proc)
    outcomes: dict[int, RankOutcome] = {}
    deadline = started + timeout_s
    while len(outcomes) < world_size:
        try:
            payload = results.get(timeout=max(0.05, min(1.0, deadline - time.monotonic())))
        except queue.Empty:
            if time.monotonic() >= deadline:
                break
            if not any(p.is_alive() for p in processes) and results.empty():
                break  # a rank died without reporting
            continue
        rank, result, error_type, error, trace = pickle.loads(payload)
        outcomes[rank] = RankOutcome(
            rank=rank,
            result=result,
            error_type=error_type,
            error=error,
            traceback=trace,
            seconds=time.monotonic() - started,
        )
    killed = _reap(processes)
    for rank in range(world_size):
        if rank not in outcomes:
            outcomes[rank] = RankOutcome(
                rank=rank,
                error_type="Timeout" if rank in killed else "Exited",
                error=(
                    f"rank {rank} reported nothing within {timeout_s:g} s (killed)"
                    if rank in killed
                    else f"rank {rank} exited with code {processes[rank].exitcode} unreported"
                ),
                seconds=time.monotonic() - started,
            )
    return [outcomes[r] for r in range(world_size)]


def _reap(processes: Sequence[multiprocessing.process.BaseProcess]) -> set[int]:
    """Wait briefly for every process, then kill what is left; the ranks killed."""
    for proc in processes:
        proc.join(_GRACE_S)
    killed = set()
    for rank, proc in enumerate(processes):
        if proc.is_alive():
            killed.add(rank)
            with contextlib.suppress(OSError):
                proc.kill()
            proc.join(_GRACE_S)
    return killed
