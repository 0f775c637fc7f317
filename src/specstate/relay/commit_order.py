"""A debug record of post-publish commits: a forward may read committed state only after the
commit that produced it ran.

A worker that publishes the frontier and *then* commits state the next round reads (DFLASH's
accepted target hidden states materialized into the drafter's KV, an EAGLE draft-extend) is
correct on a device only if the commit of forward N is ordered on the forward stream before
forward N+1 reads it; the host, already planning N+1 after the publish, must never be what
makes it so. `CommitOrderLedger` checks exactly that, per KV token slot::

    wrote_source(slots)    a forward wrote the state a commit is derived from at these slots
                           (the target's KV and hidden states): source[s] = new write id
    committed(slots)       the commit of those slots ran: commit[s] = source[s]
    overwrote(slots)       scratch landed there (a drafter's noise): commit[s] = none
    check_reads(...)       a forward reads the committed state of every position below each
                           row's frontier: each slot must hold commit[s] == source[s]

A commit that runs after the next forward's read (reordered off the stream, deferred to the
host, forgotten) leaves ``commit[s] != source[s]`` at that read, and `check_reads` raises
`RelayError` naming the request, the position and the slot. The record lives on the worker's
device and costs one gather and one host read per checked forward: a debug tool, off in
production.

Invariant: ``commit[s] == source[s]`` exactly when the committed state at slot ``s`` was derived
from the latest source write at ``s``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from specstate.core.errors import RelayError

__all__ = ["CommitOrderLedger"]

_NONE = -1  # no commit at the slot since its last overwrite


class CommitOrderLedger:
    """Per-slot write ids of a source and of the commit derived from it (module docstring).

    Args:
        num_token_slots: KV token slots (slot 0, the padding slot, is never checked).
        device: where the record lives (the worker's device).
    """

    def __init__(self, num_token_slots: int, device: torch.device) -> None:
        self._source = torch.zeros(num_token_slots, dtype=torch.int64, device=device)
        self._commit = torch.full((num_token_slots,), _NONE, dtype=torch.int64, device=device)
        self._writes = 0

    def wrote_source(self, slots: torch.Tensor) -> None:
        """A forward wrote the source state at ``slots`` (any shape; duplicates allowed)."""
        self._writes += 1
        index = slots.reshape(-1).long().to(self._source.device)
        self._source.index_fill_(0, index, self._writes)

    def committed(self, slots: torch.Tensor) -> None:
        """The commit derived from the latest source write at ``slots`` has run."""
        index = slots.reshape(-1).long().to(self._source.device)
        self._commit.index_copy_(0, index, self._source.index_select(0, index))

    def overwrote(self, slots: torch.Tensor) -> None:
        """Scratch state landed at ``slots``: they hold no commit until the next one."""
        index = slots.reshape(-1).long().to(self._commit.device)
        self._commit.index_fill_(0, index, _NONE)

    def check_reads(
        self,
        request_ids: Sequence[str],
        req_to_token: torch.Tensor,
        req_pool_indices: torch.Tensor,
        frontier: torch.Tensor,
    ) -> None:
        """Every position below ``frontier[b]`` of row ``b`` holds its commit.

        Raises:
            RelayError: a read of a slot whose commit has not run (or was overwritten), naming
                the first such request, position and slot and both write ids.
        """
        device = self._source.device
        width = int(frontier.max()) if frontier.numel() else 0
        if width == 0:
            return
        rows = req_to_token[req_pool_indices.long().to(req_to_token.device), :width]
        slots = rows.long().to(device)
        cols = torch.arange(width, device=device)[None, :]
        read = cols < frontier.long().to(device)[:, None]
        stale = read & (self._commit[slots] != self._source[slots])
        if not bool(stale.any()):
            return
        row, position = (int(i) for i in stale.nonzero()[0])
        slot = int(slots[row, position])
        raise RelayError(
            f"request {request_ids[row]}: a forward reads the committed state of position "
            f"{position} (slot {slot}) before the post-publish commit of the forward that wrote "
            f"its source ran (source write {int(self._source[slot])}, commit "
            f"{int(self._commit[slot])}); order the commit on the forward stream before the next "
            "forward"
        )
