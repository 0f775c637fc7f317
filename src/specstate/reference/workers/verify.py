"""Chain verification: which drafted tokens the target accepts, and the run a round emits.

The verify forward scores the chain ``[x0, d1, ..., dK]`` at positions ``S .. S+K``; row ``j`` of
its logits is the target's distribution of the token at ``S + j + 1``. Greedy verification
(lossless: the emitted tokens are exactly the target's own greedy tokens)::

    y_j = argmax logits[j]                       j = 0 .. K
    m   = largest m with d_i == y_(i-1) for all i <= m
    run = y_0 .. y_m      accept_len a = m + 1   (1 <= a <= D = K + 1)
    bonus = y_m           the root of the next round, at position S + a

Invariant: the run is a prefix of the target's greedy continuation, so its tokens are correct
whatever the drafter proposed; only the acceptance length depends on draft quality.
"""

from __future__ import annotations

import attrs
import torch

from specstate.core.errors import InvalidConfig

__all__ = ["ChainVerdict", "verify_greedy_chain"]


@attrs.frozen(kw_only=True)
class ChainVerdict:
    """The outcome of verifying one chain per row.

    Attributes:
        run_tokens: ``[B, D]`` int64; row ``b``'s emitted run is ``run_tokens[b, :accept_lens[b]]``
            (entries past the run are the target's tokens after a rejection, never emitted).
        accept_lens: ``[B]`` int64, bonus included, in ``[1, D]``.
        bonus_tokens: ``[B]`` int64, the last token of each run.
    """

    run_tokens: torch.Tensor
    accept_lens: torch.Tensor
    bonus_tokens: torch.Tensor

    @property
    def last_accepted(self) -> torch.Tensor:
        """``[B]`` index ``m = accept_len - 1`` of the last accepted chain position."""
        return self.accept_lens - 1


def verify_greedy_chain(drafts: torch.Tensor, logits: torch.Tensor) -> ChainVerdict:
    """Greedy verification of ``drafts`` ``[B, K]`` against verify ``logits`` ``[B, K+1, V]``.

    Raises:
        InvalidConfig: the shapes disagree.
    """
    num_rows, num_steps = drafts.shape
    if logits.ndim != 3 or tuple(logits.shape[:2]) != (num_rows, num_steps + 1):
        raise InvalidConfig(
            f"verify logits {tuple(logits.shape)} do not fit {num_rows} chains of"
            f" {num_steps} drafts"
        )
    targets = logits.argmax(-1)
    matched = (drafts == targets[:, :num_steps]).long()
    accept_lens = matched.cumprod(1).sum(1) + 1  # the first mismatch ends the run
    bonus = targets.gather(1, (accept_lens - 1)[:, None]).squeeze(1)
    return ChainVerdict(run_tokens=targets, accept_lens=accept_lens, bonus_tokens=bonus)
