"""Each role's view has only its own mutators: cross-role writes must fail mypy."""

import torch

from specstate.internals import AllocatorLedgerView, ResultProcessorLedgerView, SchedulerLedgerView


def scheduler(view: SchedulerLedgerView, slots: torch.Tensor, n: torch.Tensor) -> None:
    view.advance_committed(slots, n)  # E: attr-defined
    view.grow_allocated(slots, n)  # E: attr-defined


def allocator(view: AllocatorLedgerView, slots: torch.Tensor, n: torch.Tensor) -> None:
    view.advance_committed(slots, n)  # E: attr-defined
    view.set_protected(1, 0)  # E: attr-defined


def result_processor(view: ResultProcessorLedgerView, slots: torch.Tensor, n: torch.Tensor) -> None:
    view.grow_allocated(slots, n)  # E: attr-defined
    view.open_slot(1, "r")  # E: attr-defined
