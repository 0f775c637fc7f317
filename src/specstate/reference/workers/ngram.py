"""Algorithm ``ngram``: draft by looking the trailing n-gram up in the request's own tokens.

No draft model and no draft KV. The worker owns a slot-indexed token history shaped like the
engine's ``req_to_token`` table (``[max_requests + 1, row_width]``); position ``p`` of a request
holds its token at ``p``. Writes are idempotent, so a replayed or overlapped write is harmless::

    EXTEND          history[slot, prefix .. prefix+n) = the chunk's tokens
    DECODE start    history[slot, S] = x0 (the bonus)
    lookup          trailing n-gram h[S-n+1 .. S] (n = max_ngram .. 1); the most recent earlier
                    occurrence starting at i; drafts continue it: h[i+n], h[i+n+1], ... repeating
                    with period S+1-(i+n) when they run past S (so "abcab" drafts "c a b ...")
                    no occurrence: the bonus repeated
    after verify    history[slot, S+1 .. S+m] = d1..dm (the accepted drafts)

The drafts are deterministic, so a sampled row verifies them with a one-hot ``q``: ``d_i`` is
accepted with probability ``p(d_i)``, and a rejection resamples from ``p`` without ``d_i``.

Invariant: positions below a row's frontier hold the row's settled tokens, except those a prefix
cache supplied without an extend (never written here). A stale position only weakens drafts:
the verify emits the target's own tokens whatever the drafts are.
"""

from __future__ import annotations

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import ParallelGroup, WorkerCapabilities, WorkerMemory
from specstate.reference.workers.round import ChainRoundWorker, VerifiedRound
from specstate.reference.workers.sources import ModelSource
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = ["NgramWorker", "TokenHistory"]


class TokenHistory:
    """Owner of the n-gram worker's token rows (see the module docstring).

    Args:
        num_rows: request slots, padding row 0 included.
        row_width: positions per row (the engine's ``req_to_token`` width).
        device: where the rows live.
    """

    def __init__(self, num_rows: int, row_width: int, *, device: torch.device) -> None:
        self._tokens = torch.zeros(num_rows, row_width, dtype=torch.int64, device=device)

    def write(self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor) -> None:
        """Stores ``tokens[i]`` at ``(slots[i], positions[i])`` (any matching shapes)."""
        self._tokens.index_put_((slots.long(), positions.long()), tokens.long())

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        """A copy of the rows of ``slots`` ``[B, row_width]``."""
        return self._tokens.index_select(0, slots.long())

    def propose(
        self, slots: torch.Tensor, start: torch.Tensor, *, num_tokens: int, max_ngram: int
    ) -> torch.Tensor:
        """Drafts ``[B, num_tokens]`` following the trailing n-gram that ends at ``start``."""
        rows = self.read(slots)
        length = start.long() + 1  # tokens known per row, the bonus at `start` included
        best = torch.full_like(length, -1)
        chosen_n = torch.zeros_like(length)
        for n in range(max_ngram, 0, -1):
            found = self._latest_occurrence(rows, length, n)
            take = (best < 0) & (found >= 0)
            best = torch.where(take, found, best)
            chosen_n = torch.where(take, n, chosen_n)
        first = best + chosen_n  # the token after the occurrence
        period = (length - first).clamp_min(1)
        steps = torch.arange(num_tokens, device=rows.device)[None, :]
        index = (first[:, None] + steps % period[:, None]).clamp(0, rows.shape[1] - 1)
        drafts = rows.gather(1, index)
        bonus = rows.gather(1, start.long()[:, None]).expand_as(drafts)
        return torch.where((best >= 0)[:, None], drafts, bonus)

    @staticmethod
    def _latest_occurrence(rows: torch.Tensor, length: torch.Tensor, n: int) -> torch.Tensor:
        """Start of the latest n-gram equal to each row's last ``n`` tokens, ending before them.

        Returns ``-1`` where there is none (or the row is shorter than ``n + 1``).
        """
        width = rows.shape[1]
        if width < n + 1:
            return torch.full_like(length, -1)
        offsets = torch.arange(n, device=rows.device)[None, :]
        suffix = rows.gather(1, (length[:, None] - n + offsets).clamp_min(0))
        windows = rows.unfold(1, n, 1)  # [B, width - n + 1, n]
        equal = (windows == suffix[:, None, :]).all(-1)
        starts = torch.arange(windows.shape[1], device=rows.device)[None, :]
        earlier = starts <= (length - n - 1)[:, None]  # the occurrence ends before the suffix
        return torch.where(equal & earlier, starts, -1).max(dim=1).values


class NgramWorker(ChainRoundWorker):
    """Chain drafting by prompt/output lookup (see the module docstring).

    Args:
        target: checkpoint directory or in-memory `PagedLlama`.
        num_steps: K, draft tokens per round (D = K + 1 tokens are verified).
        max_ngram: the longest trailing n-gram looked up (then shorter ones, down to 1).
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
        self._history: TokenHistory | None = None
        self._parallel: ParallelGroup | None = None

    @property
    def history(self) -> TokenHistory:
        """The token history (after attach)."""
        if self._history is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._history

    def _attach_draft(self, memory: WorkerMemory) -> None:
        num_rows, row_width = memory.req_to_token.shape
        device = self._target.device_for(memory)
        self._history = TokenHistory(num_rows, row_width, device=device)
        self._parallel = memory.parallel

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        attention = out.attention
        slots = torch.repeat_interleave(attention.req_pool_indices, attention.extend_lens)
        self.history.write(slots, attention.positions, attention.input_ids)
        return RelayPayload(bonus_tokens=out.next_tokens)

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        self.history.write(batch.req_pool_indices, start, roots)
        drafts = self.history.propose(
            batch.req_pool_indices,
            start,
            num_tokens=batch.draft_steps(self.capabilities.num_steps),
            max_ngram=self._max_ngram,
        )
        if self._parallel is not None:  # a host decision: made once, on rank 0
            drafts = self._parallel.broadcast(drafts)
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
