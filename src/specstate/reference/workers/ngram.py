"""Algorithm ``ngram``: draft by looking the trailing n-gram up in the request's own tokens.

No draft model and no draft KV. The worker owns a `TokenHistory`: one token per KV slot, read
through ``req_to_token`` (so a prefix the prefix cache shares brings its tokens along). Writes
are idempotent, so a replayed or overlapped write is harmless::

    EXTEND          the chunk's tokens at its out_cache_loc
    DECODE start    x0 (the bonus) at position S
    lookup          `TokenHistory.propose`: the trailing n-gram, its latest earlier occurrence,
                    the tokens that followed it (the bonus repeated when there is none; with
                    draft_without_match=False and no row matching, no drafts this round)
    after verify    d1..dm (the accepted drafts) at S+1 .. S+m

The drafts are deterministic, so a sampled row verifies them with a one-hot ``q``: ``d_i`` is
accepted with probability ``p(d_i)``, and a rejection resamples from ``p`` without ``d_i``.

Invariant: every position below a row's frontier holds the row's settled token (written by the
row's own forwards, or by the request whose committed prefix the cache shares).
"""

from __future__ import annotations

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import ParallelGroup, WorkerCapabilities, WorkerMemory
from specstate.reference.workers.history import TokenHistory
from specstate.reference.workers.round import ChainRoundWorker, VerifiedRound
from specstate.reference.workers.sources import ModelSource
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = ["NgramWorker"]


class NgramWorker(ChainRoundWorker):
    """Chain drafting by prompt/output lookup (see the module docstring).

    Args:
        target: checkpoint directory or in-memory `PagedLlama`.
        num_steps: K, draft tokens per round (D = K + 1 tokens are verified).
        max_ngram: the longest trailing n-gram looked up (then shorter ones, down to 1).
        draft_without_match: with False, a round in which no row's trailing n-gram occurred
            earlier drafts nothing (a plain decode step, as n-gram proposers in serving engines
            do); True (the default) drafts the bonus repeated instead.
        device: where the model and history live (default: the engine memory's device).
        dtype: parameter and KV dtype (default: the checkpoint's).
        seed: seeds the worker's generator for sampled rows (None: not reproducible).

    Raises:
        InvalidConfig: ``num_steps < 1`` or ``max_ngram < 1``; the loader's error.
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        num_steps: int = 3,
        max_ngram: int = 3,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        draft_without_match: bool = True,
    ) -> None:
        if num_steps < 1 or max_ngram < 1:
            raise InvalidConfig(
                f"ngram worker needs num_steps >= 1 and max_ngram >= 1, got {num_steps}, "
                f"{max_ngram}"
            )
        capabilities = WorkerCapabilities.chain("ngram", num_steps=num_steps, keeps_draft_kv=False)
        runner = TargetRunner(target, device=device, dtype=dtype)
        super().__init__(runner, capabilities, seed=seed)
        self._max_ngram = max_ngram
        self._draft_without_match = draft_without_match
        self._history: TokenHistory | None = None
        self._parallel: ParallelGroup | None = None

    @property
    def history(self) -> TokenHistory:
        """The token history (after attach)."""
        if self._history is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._history

    def _attach_draft(self, memory: WorkerMemory) -> None:
        device = self._target.device_for(memory)
        self._history = TokenHistory.by_token_slot(
            memory.num_token_slots, memory.req_to_token, device=device
        )
        self._parallel = memory.parallel

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        return {"ngram.history": self.history.slot_tokens}

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        attention = out.attention
        self.history.write_at(attention.out_cache_loc, attention.input_ids)
        return RelayPayload(bonus_tokens=out.next_tokens)

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        self.history.write(batch.req_pool_indices, start, roots)
        drafts, matched = self.history.propose_matched(
            batch.req_pool_indices,
            start,
            num_tokens=batch.draft_steps(self.capabilities.num_steps),
            max_ngram=self._max_ngram,
        )
        if self._parallel is not None:  # host decisions: made once, on rank 0
            drafts = self._parallel.broadcast(drafts)
            matched = self._parallel.broadcast(matched.to(torch.int64)).bool()
        if not self._draft_without_match and not bool(matched.any()):  # a host read
            return DraftChain(tokens=drafts[:, :0])  # nothing to propose: a plain decode step
        return DraftChain(tokens=drafts)

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        drafts = verified.chain[:, 1:]
        num_steps = drafts.shape[1]
        steps = torch.arange(num_steps, device=drafts.device)[None, :]
        accepted = steps < verified.verdict.last_accepted[:, None]  # d1..dm, below S + a
        slots = verified.batch.req_pool_indices[:, None].expand_as(drafts)
        positions = verified.start[:, None] + 1 + steps
        self.history.write(slots[accepted], positions[accepted], drafts[accepted])
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens)
