"""``specstate serve --tp N``: the same server, with the model sharded over ``N`` ranks.

Two ways to start the ranks, the same server::

    specstate serve --tp 2 [...]          this process is rank 0 and serves; it starts ranks
                                          1 .. N-1 here (fresh interpreters) and waits for them
    torchrun --nproc-per-node 2 -m specstate.tools.cli serve --tp 2 [...]

Rank 0 is the front door: it runs ``specstate serve`` as one rank does, with a
`DistributedEngine` for its `Engine` (`specstate.tools.generate_tp.leader_engine` sends its
`EngineConfig` to the others first), so every request, step and abort of the server reaches
every rank, every batch is agreed on (`specstate.distributed.RankAgreement`), and the tokens are
those of ``specstate generate --tp N``. Every other rank builds the same worker from the same
arguments and follows rank 0's steps (`specstate.tools.generate_tp.follow_leader`) until rank
0's engine closes, which the server's shutdown does.

Stopping: only rank 0 decides. The other ranks ignore SIGINT and SIGTERM (a Ctrl-C in a terminal
reaches the whole process group): rank 0's shutdown (Ctrl-C or SIGTERM to it, as for one rank)
aborts what runs, closes the engine and so releases them. If rank 0 dies instead, its
connections close and the others' next collective fails at once: they exit. A server may idle
for long, so a follower waits for rank 0's next step up to `IDLE_TIMEOUT_S`, not the hour of
``generate``.

Exit code: rank 0's (0 after a clean shutdown, 2 for bad options); 2 when another rank failed.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import signal
import socket
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Final

from specstate.core.errors import SpecStateError

if TYPE_CHECKING:
    from specstate.distributed.groups import RankGroup

__all__ = ["IDLE_TIMEOUT_S", "run_serve_tp"]

IDLE_TIMEOUT_S: Final = 365 * 24 * 3600.0
"""How long a follower of a server waits for rank 0's next step: a year (an idle server is
normal; a dead rank 0 is noticed at once by its closed connections)."""
_REAP_S: Final = 60.0
"""How long rank 0 waits for a follower to exit once its engine closed, before killing it."""

_Leader = Callable[[argparse.Namespace], int]


def run_serve_tp(args: argparse.Namespace, run_leader: _Leader) -> int:
    """Serve as a tensor-parallel group (module docstring); rank 0 runs ``run_leader``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun started this rank
        return _run_under_torchrun(args, run_leader)
    return _run_spawned(args, run_leader)


def _run_under_torchrun(args: argparse.Namespace, run_leader: _Leader) -> int:
    """This process is one rank of torchrun's group."""
    from specstate.distributed.groups import RankGroup
    from specstate.tools.generate_tp import rank_main

    try:
        group = RankGroup.from_env(idle_timeout_s=IDLE_TIMEOUT_S)
    except SpecStateError as exc:
        print(f"specstate serve: {exc}", file=sys.stderr)
        return 2
    if not group.is_leader:
        _ignore_stop_signals()
    with group:
        code = rank_main(group, args, run_leader, "serve")
    return _leave(group, code)


def _run_spawned(args: argparse.Namespace, run_leader: _Leader) -> int:
    """This process is rank 0 and starts the others; the exit code once every rank ended."""
    from specstate.distributed.groups import RankGroup
    from specstate.distributed.spawn import free_port
    from specstate.tools.generate_tp import rank_main

    busy = _port_in_use(args.host, args.port)
    if busy is not None:  # before any rank starts: uvicorn would fail with every rank up
        print(
            f"specstate serve: cannot listen on {args.host}:{args.port} ({busy})", file=sys.stderr
        )
        return 2
    args.threads = args.threads or 1  # as `generate --tp`: one torch thread a rank by default
    port = free_port()
    followers = _start_followers(args, port)
    group: RankGroup | None = None
    try:
        # NOTE: after SIGTERM, uvicorn re-raises the signal once the server shut down, so this
        # process may end inside run_leader, reaping nothing: the engine's close released the
        # followers already, and they exit by themselves.
        group = RankGroup.init(rank=0, world_size=args.tp, init_method=f"tcp://127.0.0.1:{port}")
        with group:
            code = rank_main(group, args, run_leader, "serve")
    except (SpecStateError, RuntimeError) as exc:  # the group could not form
        print(f"specstate serve: rank 0: {type(exc).__name__}: {exc}", file=sys.stderr)
        code = 2
    finally:
        failed = _reap(followers)
    for rank, exitcode in failed:
        print(f"specstate serve: rank {rank} exited with code {exitcode}", file=sys.stderr)
    code = 2 if failed else code
    return code if group is None else _leave(group, code)


def _leave(group: RankGroup, code: int) -> int:
    """``code``; but a broken group cannot be torn down: then leave the process at once."""
    if group.failure is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _port_in_use(host: str, port: int) -> str | None:
    """Why ``host:port`` cannot be listened on now, or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


@contextlib.contextmanager
def _stop_signals_ignored() -> Iterator[None]:
    """SIGINT and SIGTERM ignored for the block: processes started in it inherit that."""
    kept = {s: signal.signal(s, signal.SIG_IGN) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in kept.items():
            signal.signal(s, handler)


def _ignore_stop_signals() -> None:
    """A follower stops when rank 0 closes, not on a signal meant for rank 0."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def _start_followers(
    args: argparse.Namespace, port: int
) -> list[multiprocessing.process.BaseProcess]:
    """Ranks 1 .. N-1 as fresh interpreters (``spawn``) joining rank 0 at ``port``."""
    context = multiprocessing.get_context("spawn")
    followers: list[multiprocessing.process.BaseProcess] = []
    with _stop_signals_ignored():  # inherited from the first instruction on
        for rank in range(1, args.tp):
            proc = context.Process(
                target=_follower_main,
                args=(rank, args.tp, port, args),
                name=f"specstate-serve-rank-{rank}",
                daemon=True,
            )
            proc.start()
            followers.append(proc)
    return followers


def _follower_main(rank: int, world_size: int, port: int, args: argparse.Namespace) -> None:
    """A spawned follower: join rank 0, follow it until it closes, exit with the outcome."""
    import torch

    from specstate.distributed.groups import RankGroup
    from specstate.tools.generate_tp import follow_leader

    _ignore_stop_signals()
    torch.set_num_threads(args.threads)
    code = 2
    try:
        group = RankGroup.init(
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            idle_timeout_s=IDLE_TIMEOUT_S,
        )
        with group:
            code = follow_leader(group, args)
    except BaseException as exc:  # its last word, on the terminal rank 0 serves from
        print(f"specstate serve: rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr)
        if not isinstance(exc, SpecStateError):  # a bug, not a rank failure: where it was
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NOTE: no interpreter teardown: a broken group may block it


def _reap(
    followers: Sequence[multiprocessing.process.BaseProcess],
) -> list[tuple[int, int | None]]:
    """Wait for every follower (killing one still there after `_REAP_S`); those that failed."""
    failed = []
    for rank, proc in enumerate(followers, start=1):
        proc.join(_REAP_S)
        if proc.is_alive():
            with contextlib.suppress(OSError):
                proc.kill()
            proc.join(_REAP_S)
        if proc.exitcode != 0:
            failed.append((rank, proc.exitcode))
    return failed
