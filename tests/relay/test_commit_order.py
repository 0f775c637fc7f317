"""The commit-order ledger: a read of committed state must follow the commit of its source."""

from __future__ import annotations

import pytest
import torch

from specstate.core.errors import RelayError
from specstate.relay.commit_order import CommitOrderLedger

SLOTS = 32


def _table() -> torch.Tensor:
    """Two requests: slot row 1 holds slots 1..10 at positions 0..9, row 2 slots 11..20."""
    table = torch.zeros(3, 16, dtype=torch.int64)
    table[1, :10] = torch.arange(1, 11)
    table[2, :10] = torch.arange(11, 21)
    return table


def _read(ledger: CommitOrderLedger, frontier: list[int]) -> None:
    ledger.check_reads(("a", "b"), _table(), torch.tensor([1, 2]), torch.tensor(frontier))


def test_reads_of_committed_positions_pass() -> None:
    """Every position below the frontier was written and committed: the read passes."""
    ledger = CommitOrderLedger(SLOTS, torch.device("cpu"))
    ledger.wrote_source(torch.arange(1, 21))
    ledger.committed(torch.arange(1, 21))
    _read(ledger, [10, 10])


def test_a_read_before_the_commit_names_request_position_and_slot() -> None:
    """Request b's position 4 was rewritten by a forward whose commit has not run."""
    ledger = CommitOrderLedger(SLOTS, torch.device("cpu"))
    ledger.wrote_source(torch.arange(1, 21))
    ledger.committed(torch.arange(1, 21))
    ledger.wrote_source(torch.tensor([15, 16]))  # the next forward's source, not yet committed
    with pytest.raises(
        RelayError, match=r"request b: .* position 4 \(slot 15\) .* \(source write 2, commit 1\)"
    ):
        _read(ledger, [10, 10])


def test_positions_at_or_past_the_frontier_are_not_read() -> None:
    """Uncommitted slots past each row's frontier do not count: rejected drafts live there."""
    ledger = CommitOrderLedger(SLOTS, torch.device("cpu"))
    ledger.wrote_source(torch.arange(1, 21))
    ledger.committed(torch.tensor([1, 2, 3, 11, 12]))
    _read(ledger, [3, 2])
    with pytest.raises(RelayError, match=r"request a: .* position 3 \(slot 4\)"):
        _read(ledger, [4, 2])


def test_scratch_over_a_commit_makes_it_stale() -> None:
    """A scratch write (a drafter's noise) over a committed slot is caught at the next read."""
    ledger = CommitOrderLedger(SLOTS, torch.device("cpu"))
    ledger.wrote_source(torch.arange(1, 21))
    ledger.committed(torch.arange(1, 21))
    ledger.overwrote(torch.tensor([2]))
    with pytest.raises(RelayError, match=r"request a: .* position 1 \(slot 2\) .* commit -1"):
        _read(ledger, [10, 10])


def test_a_slot_never_written_is_never_committed() -> None:
    """A fresh ledger holds no commit: any read below a frontier fails."""
    ledger = CommitOrderLedger(SLOTS, torch.device("cpu"))
    with pytest.raises(RelayError, match="request a"):
        _read(ledger, [1, 0])
    _read(ledger, [0, 0])  # an empty read is fine
