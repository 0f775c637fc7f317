"""Test-only: a broken dflash port whose post-publish commit runs after the next forward's read.

`MaterializesLate` defers each decode round's materialization of the accepted context until
after the next block draft has read the assistant's KV, as a port that moved the commit off the
forward stream (onto the host, or a side stream without a fence) might. Its tokens stay exact
(drafts only change acceptance); only a commit-order check can see it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.reference.workers.dflash import DFlashWorker
from specstate.reference.workers.verify import DraftChain


class MaterializesLate(DFlashWorker):
    """A broken port: a decode round's materialization runs after the next block draft."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self._late: list[Callable[[], None]] = []

    def _materialize(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        accepted: torch.Tensor | None,
    ) -> None:
        if accepted is None:  # prefill chunks stay in order
            super()._materialize(context, positions, slots, accepted)
            return
        commit = super()._materialize
        self._late.append(lambda: commit(context, positions, slots, accepted))

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        try:
            return super()._propose(batch, start, roots)
        finally:  # the commits of the previous forward, now that this one has read
            late, self._late = self._late, []
            for commit in late:
                commit()
