"""Tensor parallelism: one engine per rank, every rank deciding the same (docs/scale-out.md)."""

from __future__ import annotations

from specstate.distributed.groups import ControlGroup, RankGroup, WorkerGroup
from specstate.distributed.spawn import RankOutcome, free_port, spawn_ranks

__all__ = [
    "ControlGroup",
    "RankGroup",
    "RankOutcome",
    "WorkerGroup",
    "free_port",
    "spawn_ranks",
]
