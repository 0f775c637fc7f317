"""Tensor parallelism: one engine per rank, every rank deciding the same (docs/scale-out.md).

`RankGroup` joins a rank to its group (``torchrun`` or `spawn_ranks`); `DistributedEngine` is
one rank's engine (rank 0 takes the requests, the others `DistributedEngine.follow`);
`RankAgreement` keeps every batch agreed, and checks it with ``check_agreement``.
"""

from __future__ import annotations

from specstate.distributed.agreement import (
    LeaderDraftPolicy,
    RankAgreement,
    plan_digest,
    result_digest,
)
from specstate.distributed.engine import DistributedEngine
from specstate.distributed.groups import ControlGroup, RankGroup, WorkerGroup
from specstate.distributed.spawn import RankOutcome, free_port, spawn_ranks

__all__ = [
    "ControlGroup",
    "DistributedEngine",
    "LeaderDraftPolicy",
    "RankAgreement",
    "RankGroup",
    "RankOutcome",
    "WorkerGroup",
    "free_port",
    "plan_digest",
    "result_digest",
    "spawn_ranks",
]
