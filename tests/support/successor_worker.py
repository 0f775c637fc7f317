"""Test-only: a drafter whose state at position p depends on token p + 1 (`PrefixSharing.BIGRAM`).

SGLang's EAGLE keeps, at position ``p``'s KV slot, draft KV computed from the target's hidden
state at ``p`` and the token at ``p + 1``. This worker has the same dependency in the smallest
form that changes acceptance: at every KV slot it stores the *successor* of that position's
token (the token at ``p + 1``), written once that token is known (the extend's next input, the
sampled token, a verify's accepted run), and drafts by n-gram lookup over the tokens it
reconstructs from the successors (``tok[q] = succ[slot(q - 1)]``).

A prefix cache that shared position ``p`` without the token ``p + 1`` matching would hand it
another request's successor: drafts, and so accept lengths, would change (the output would
not: the verify is exact). With BIGRAM keys a shared position's successor is always right.

The successor of a chunk's last position is written by the next chunk, except where that
position is the prefix cache's (below ``cache_protected_len``, read from the worker's ledger
view): it is shared, and with BIGRAM keys it already holds the right successor.
"""

from __future__ import annotations

import attrs
import numpy as np
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.engine.worker import WorkerCapabilities, WorkerMemory
from specstate.memory.prefix_cache import PrefixSharing
from specstate.reference.workers.history import TokenHistory
from specstate.reference.workers.round import ChainRoundWorker, VerifiedRound
from specstate.reference.workers.sources import ModelSource
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload


class SuccessorWorker(ChainRoundWorker):
    """Chain drafting from a successor table kept by KV slot (see the module docstring)."""

    def __init__(
        self,
        *,
        target: ModelSource,
        num_steps: int = 3,
        sharing: PrefixSharing = PrefixSharing.BIGRAM,
    ) -> None:
        caps = WorkerCapabilities.chain("successor", num_steps=num_steps, keeps_draft_kv=False)
        runner = TargetRunner(target)
        super().__init__(runner, attrs.evolve(caps, prefix_sharing=sharing), seed=0)
        self._succ: TokenHistory | None = None

    @property
    def successors(self) -> TokenHistory:
        """The successor table (after attach)."""
        assert self._succ is not None
        return self._succ

    def _attach_draft(self, memory: WorkerMemory) -> None:
        self._succ = TokenHistory.by_token_slot(
            memory.num_token_slots, memory.req_to_token, device=memory.device
        )

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        att = out.attention
        ends = torch.cumsum(att.extend_lens, 0)
        starts = ends - att.extend_lens
        # Inside a chunk the successor is the next input; at its end, the sampled token.
        nxt = torch.cat([att.input_ids[1:], att.input_ids[:1]])
        nxt[ends - 1] = out.next_tokens
        self.successors.write_at(att.out_cache_loc, nxt)
        # The position before the chunk learns its successor now, unless the cache owns it.
        slots = att.req_pool_indices.long()
        protected = self._target.memory.ledger.host_protected(slots.numpy())
        before = att.prefix_lens.long()
        own = (before > 0) & (before > torch.from_numpy(np.asarray(protected)))
        if bool(own.any()):
            self.successors.write(slots[own], before[own] - 1, att.input_ids[starts[own]])
        return RelayPayload(bonus_tokens=out.next_tokens)

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        succ = self.successors.read(batch.req_pool_indices)
        rows = torch.cat([torch.full_like(succ[:, :1], -1), succ[:, :-1]], dim=1)
        length = start.long() + 1
        found = TokenHistory._latest_occurrence(rows, length, 1)
        first = found + 1
        steps = torch.arange(batch.draft_steps(self.capabilities.num_steps))[None, :]
        period = (length - first).clamp_min(1)
        index = (first[:, None] + steps % period[:, None]).clamp(0, rows.shape[1] - 1)
        drafts = torch.where((found >= 0)[:, None], rows.gather(1, index), roots[:, None])
        return DraftChain(tokens=drafts)

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        verdict = verified.verdict
        width = verdict.run_tokens.shape[1]
        steps = torch.arange(width)[None, :]
        accepted = steps < verdict.accept_lens[:, None]  # positions S .. S+a-1
        slots = verified.batch.req_pool_indices[:, None].expand(-1, width)
        positions = verified.start[:, None] + steps
        self.successors.write(slots[accepted], positions[accepted], verdict.run_tokens[accepted])
        return RelayPayload(bonus_tokens=verdict.bonus_tokens)
