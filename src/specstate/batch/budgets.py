"""Per-row verify budgets of one decode round: how many drafts each row may verify.

A round usually verifies the same width for every row. A verify-budget policy (the engine's
`specstate.engine.budgets`) may plan a budget per row instead, from settled history only: row
``i`` verifies at most ``budgets[i]`` of its drafts, so its accepted run is at most
``budgets[i] + 1`` tokens (the bonus included), and the worker writes no KV past its frontier
``+ budgets[i] + 1``, so the reservation of a row planned short covers less. A row at budget 0
decodes one plain token (its drafter is still extended over that token, so its state is fresh
when its budget returns).

Invariant: ``0 <= budgets[i] <= the round's width`` for every row; ``device`` and ``host`` hold
the same values.
"""

from __future__ import annotations

import attrs
import torch

from specstate.memory.host_arrays import IntArray

__all__ = ["VerifyBudgets"]


@attrs.frozen(eq=False)
class VerifyBudgets:
    """The rows' budgets, on the batch's device (what the worker reads) and on the host (what
    the engine checks and reserves by).

    Attributes:
        device: ``[B]`` int64 on the batch's device.
        host: ``[B]`` int64 host array of the same values.
    """

    device: torch.Tensor
    host: IntArray

    @classmethod
    def of(cls, host: IntArray, device: torch.device) -> VerifyBudgets:
        """Budgets ``host``, copied once to ``device`` (at scheduling, not at launch)."""
        return cls(torch.from_numpy(host).to(device), host)
