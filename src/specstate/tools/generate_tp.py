"""``specstate generate --tp N``: the same run, with the model sharded over ``N`` ranks.

Two ways to start the ranks, the same run::

    specstate generate --tp 2 --model DIR ...                     spawns 2 ranks here, waits
    torchrun --nproc-per-node 2 -m specstate.tools.cli generate --tp 2 --model DIR ...

Rank 0 runs the whole command (reads the requests, writes the results, prints the summary)
with a `DistributedEngine` in place of the `Engine`. Before the engine starts it sends its
`EngineConfig` to the other ranks (the command group), which build the same worker from the
same arguments and follow until rank 0 closes. If rank 0 stops before it has an engine (bad
input, a bad checkpoint), it tells them so and they exit at once.

Exit code: rank 0's (0, 1 or 2 as for ``specstate generate``); 2 when a rank failed.

``specstate serve --tp N`` (`specstate.tools.serve_tp`) shares the ranks' part: `rank_main`
(rank 0 runs the command with a `TpLeader`, the others follow) and `follow_leader`.
"""

from __future__ import annotations

import argparse
import math
import os
import pickle
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

import attrs

from specstate.core.errors import InvalidConfig, SpecStateError

if TYPE_CHECKING:
    from specstate.core.params import RequestLimits
    from specstate.distributed.engine import DistributedEngine
    from specstate.distributed.groups import RankGroup
    from specstate.engine.config import EngineConfig
    from specstate.engine.trace import TraceRecorder
    from specstate.engine.worker import WorkerProtocol

__all__ = ["TpLeader", "follow_leader", "leader_engine", "rank_main", "run_tp"]

_NO_RUN = 0
_RUN = 1


@attrs.define
class TpLeader:
    """Rank 0's group while the command runs, and whether the others were told."""

    group: RankGroup
    told: bool = False

    def engine(
        self,
        worker: WorkerProtocol,
        *,
        limits: RequestLimits,
        config: EngineConfig,
        trace: TraceRecorder | None,
    ) -> DistributedEngine:
        """Rank 0's engine (`leader_engine`): ``load_engine`` builds it through the leader."""
        return leader_engine(self, worker, limits=limits, config=config, trace=trace)


def run_tp(args: argparse.Namespace, run_leader: Callable[[argparse.Namespace], int]) -> int:
    """Run ``specstate generate`` as a tensor-parallel group; rank 0 runs ``run_leader``."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:  # torchrun started this rank
        from specstate.distributed.groups import RankGroup

        try:
            group = RankGroup.from_env()
        except SpecStateError as exc:
            print(f"specstate generate: {exc}", file=sys.stderr)
            return 2
        with group:
            code = rank_main(group, args, run_leader, command="generate")
        if group.failure is not None:  # a broken group cannot be torn down: leave at once
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code
    from specstate.distributed.spawn import spawn_ranks

    outcomes = spawn_ranks(
        rank_main,
        (args, run_leader, "generate"),
        world_size=args.tp,
        timeout_s=math.inf,
        threads=args.threads or 1,
    )
    code = 0
    for outcome in outcomes:
        if not outcome.ok:
            print(
                f"specstate generate: rank {outcome.rank}: {outcome.error_type}: {outcome.error}",
                file=sys.stderr,
            )
            code = 2
    leader = outcomes[0].result
    return code or (leader if isinstance(leader, int) else 2)


def rank_main(
    group: RankGroup,
    args: argparse.Namespace,
    run_leader: Callable[[argparse.Namespace], int],
    command: str,
) -> int:
    """One rank of ``specstate COMMAND --tp N``: rank 0 runs ``run_leader`` with a `TpLeader`
    in ``args`` (``tp_leader``); every other rank follows it (`follow_leader`)."""
    if group.world_size != args.tp:
        print(
            f"specstate {command}: --tp {args.tp} but the group has {group.world_size} ranks",
            file=sys.stderr,
        )
        return 2
    if group.is_leader:
        leader = TpLeader(group)
        try:
            return run_leader(argparse.Namespace(**vars(args), tp_leader=leader))
        finally:
            if not leader.told:  # it stopped before its engine: the others stop too
                _send_config(group, None)
    return follow_leader(group, args)


def leader_engine(
    leader: TpLeader,
    worker: WorkerProtocol,
    *,
    limits: RequestLimits,
    config: EngineConfig,
    trace: TraceRecorder | None,
) -> DistributedEngine:
    """Rank 0's engine: the others get ``config`` first, then every rank builds its engine."""
    from specstate.distributed.engine import DistributedEngine

    _send_config(leader.group, config)
    leader.told = True
    return DistributedEngine(worker, group=leader.group, limits=limits, config=config, trace=trace)


def follow_leader(group: RankGroup, args: argparse.Namespace) -> int:
    """A rank above 0: rank 0's config, the same worker (built from the same ``args``), then
    follow until rank 0 closes; 0 (also when rank 0 stopped before it had an engine)."""
    from specstate.distributed.engine import DistributedEngine
    from specstate.tools.generate.workers import build_worker, load_factory

    config = _receive_config(group)
    if config is None:
        return 0
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    factory = build_worker if args.worker is None else load_factory(args.worker)
    worker, limits = factory(args)
    with DistributedEngine(worker, group=group, limits=limits, config=config) as engine:
        engine.follow()
    return 0


def _send_config(group: RankGroup, config: EngineConfig | None) -> None:
    payload = b"" if config is None else pickle.dumps(config)
    group.commands.broadcast_ints([_NO_RUN if config is None else _RUN, len(payload)])
    group.commands.broadcast_bytes_from(0, payload, len(payload))


def _receive_config(group: RankGroup) -> EngineConfig | None:
    from specstate.engine.config import EngineConfig

    kind, size = group.commands.broadcast_ints([0, 0])
    payload = group.commands.broadcast_bytes_from(0, b"", size)
    if kind == _NO_RUN:
        return None
    config = pickle.loads(payload)  # NOTE: from rank 0 of this job, a trusted peer
    if not isinstance(config, EngineConfig):
        raise InvalidConfig(f"rank {group.rank}: rank 0 sent {type(config).__name__}, no config")
    return config
