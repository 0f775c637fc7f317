"""Each owner calling its own mutators type-checks cleanly."""

from typing import assert_type

import torch

from specstate import WorkerLedgerView
from specstate.internals import (
    KvLedger,
    KvLedgerSnapshot,
    OwnershipChecker,
    ResultProcessorLedgerView,
    Role,
)


def settle(view: ResultProcessorLedgerView, slots: torch.Tensor, accept: torch.Tensor) -> None:
    view.advance_committed(slots, accept)


def read(view: WorkerLedgerView, slots: torch.Tensor) -> int:
    assert_type(view.snapshot(1), KvLedgerSnapshot)
    return int(view.committed(slots).sum())


def compose() -> None:
    checker = OwnershipChecker(enabled=True)
    views = KvLedger(4, 16, checker=checker).views()
    with checker.acting(Role.ALLOCATOR):
        views.allocator.open_slot(1, "r1")
        views.allocator.grow_allocated(torch.tensor([1]), torch.tensor([8]))
    with checker.acting(Role.SCHEDULER):
        views.scheduler.commit_extend(torch.tensor([1]), torch.tensor([3]))
    settle(views.result_processor, torch.tensor([1]), torch.tensor([2]))
    read(views.worker, torch.tensor([1]))
