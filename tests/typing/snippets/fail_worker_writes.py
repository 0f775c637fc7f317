"""A worker adapter that writes counters it does not own: every marked line must fail mypy."""

import torch

from specstate import WorkerLedgerView


def adapter_step(ledger: WorkerLedgerView, slots: torch.Tensor, accept: torch.Tensor) -> None:
    ledger.advance_committed(slots, accept)  # E: attr-defined
    ledger.grow_allocated(slots, accept)  # E: attr-defined
    ledger.close_slot(1)  # E: attr-defined
    ledger.commit_extend(slots, accept)  # E: attr-defined
    ledger.committed(slots)  # reading is fine
