"""What a worker returns for one forward: frozen, owned by the scheduler once returned.

`GenerationBatchResult` carries the accepted tokens of every row in a flat tensor with the
*stride of the forward that produced it* (adaptive speculation may change the worker's width
before the result is settled, so the result processor slices with ``stride``, never with the
worker's current width), the accept length of each row (bonus included), the next device
frontier, the relay payload for the next round, tensors to keep alive, and the event that marks
the device-to-host copy done.

Invariant: ``next_token_ids.numel() == batch_size * stride`` and
``1 <= accept_lens[row] <= stride`` for every row of a decode result.
"""

from __future__ import annotations

import attrs
import torch

from specstate.core.errors import InvalidConfig
from specstate.relay.future_map import RelayPayload
from specstate.relay.streams import Event

__all__ = ["GenerationBatchResult"]


@attrs.frozen(kw_only=True)
class GenerationBatchResult:
    """The outcome of one forward, as the worker hands it to the scheduler.

    Attributes:
        next_token_ids: flat ``[batch_size * stride]`` tokens; row ``i``'s accepted run is
            ``next_token_ids[i * stride : i * stride + accept_lens[i]]``.
        accept_lens: ``[batch_size]`` accepted tokens per row, bonus included (non-spec: 1).
        stride: tokens per row in ``next_token_ids`` for the forward that produced it.
        new_seq_lens: ``[batch_size]`` next device frontier (extend: ``seq_lens``; decode:
            ``seq_lens + accept_lens``). May be None only when the worker handed the frontier
            to ``on_publish`` in this forward; otherwise the batch fails with
            `WorkerResultError`.
        next_draft_input: the relay payload of the next round. Required (the None default
            exists only so that its absence is reported as `WorkerResultError` naming the
            rule): its ``bonus_tokens`` ``[batch_size]`` are the next round's input tokens.
        keep_alive_refs: objects the scheduler pins for two iterations (device lifetime).
        copy_done: recorded after the device-to-host copy of the result; None when synchronous.
        invalid_rows: ``[batch_size]`` bool, True for a row the worker could not compute (the
            reference workers: non-finite target logits). Such a row's request ends with
            `FinishReason.ERROR`; its tokens are ignored (its accept length and frontier must
            still be well formed). None: every row is valid.
        logprobs: flat ``[batch_size * stride]`` floating point, aligned with
            ``next_token_ids``: the log-probability of each accepted token under the target's
            final (processed) distribution. Required when a row of the batch asks for logprobs
            (``batch.sampling_info.logprobs``), else None; entries past a run are ignored.
        top_logprob_ids: ``[batch_size * stride, K]`` integer, aligned with
            ``next_token_ids``: the ``K`` most likely tokens at each position under the same
            final distribution as ``logprobs``, most likely first (ties by token id), ``K``
            the batch's ``sampling_info.top_logprobs``. Required with
            ``top_logprob_values`` when that is above 0, else None.
        top_logprob_values: ``[batch_size * stride, K]`` floating point, their
            log-probabilities.
        verified_lens: ``[batch_size]`` int, the drafts each row of a decode round verified,
            at most its budget (``ForwardBatch.verify_budgets``, else the round's width): a
            row accepts at most ``verified_lens[i] + 1`` tokens. None: every row verified its
            budget (the round's width without budgets).
        draft_confidences: ``[batch_size, stride - 1]`` floating point in ``[0, 1]``: the
            worker's predicted probability that each draft position of the row is accepted,
            given the ones before it (a confidence head; `ConfidenceBudget` plans the next
            rounds' budgets from them). None: the worker predicts none.
    """

    next_token_ids: torch.Tensor
    accept_lens: torch.Tensor
    stride: int
    new_seq_lens: torch.Tensor | None = None
    next_draft_input: RelayPayload | None = None
    keep_alive_refs: tuple[object, ...] = ()
    copy_done: Event | None = None
    invalid_rows: torch.Tensor | None = None
    logprobs: torch.Tensor | None = None
    top_logprob_ids: torch.Tensor | None = None
    top_logprob_values: torch.Tensor | None = None
    verified_lens: torch.Tensor | None = None
    draft_confidences: torch.Tensor | None = None

    def __attrs_post_init__(self) -> None:
        bs = self.accept_lens.numel()
        if self.stride < 1 or self.next_token_ids.numel() != bs * self.stride:
            raise InvalidConfig(
                f"result of {bs} rows with stride {self.stride} needs {bs * self.stride} "
                f"tokens, got {self.next_token_ids.numel()}"
            )

    @property
    def batch_size(self) -> int:
        """Number of rows."""
        return self.accept_lens.numel()

    @property
    def num_correct_drafts(self) -> int:
        """Accepted draft tokens: accepted tokens minus one bonus per row (host sync)."""
        return int(self.accept_lens.sum()) - self.batch_size

    def wait_copied(self, timeout: float | None = None) -> bool:
        """Block the host until the device-to-host copy of this result is done.

        With ``timeout`` (seconds), give up after it; the return value says whether the copy
        is done (always True without a timeout).
        """
        if self.copy_done is None:
            return True
        if timeout is None:
            self.copy_done.synchronize()
            return True
        return self.copy_done.synchronize_within(timeout)
