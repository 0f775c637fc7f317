"""Algorithm ``dspark``: a DFlash block draft refined by a Markov head, with per-position
confidences that plan the next rounds' verify budgets.

The round is DFLASH's (`specstate.reference.workers.dflash`: the same assistant KV, relay,
materialization after publish and commit-order check); only the drafting of a block changes
(`specstate.reference.dspark_heads`)::

    DECODE at S   assistant block [x0, m, .., m] @ S .. S+W-1 -> h_1 .. h_(W-1)
                  d_i = choose(lm_head(h_i) + markov(t_(i-1), h_i))   i = 1 .. K, in order
                  (t_0 = x0, t_i = d_i: each position sees the draft before it)
                  c_i = sigmoid(w . h_i + w0)                            -> draft_confidences
                  target verify [x0, d1 .. d_b] (b: the row's budget) -> accept a; publish

The result reports ``c_1 .. c_K`` for every row, budget 0 included (the drafts proposed,
verified or not); `specstate.engine.budgets.ConfidenceBudget` takes them from the settled
round only, so under overlap the budget of round N+1 is planned from round N-1's confidences
while round N is in flight.

Invariant: DFLASH's (the heads keep no state across rounds).
"""

from __future__ import annotations

import os

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.reference.dflash_assistant import DFlashAssistant
from specstate.reference.dspark_checkpoint import load_dspark_assistant, read_dspark_config
from specstate.reference.dspark_heads import DSparkHeads
from specstate.reference.model import AttentionBatch, PagedLlama
from specstate.reference.workers.dflash import DFlashWorker
from specstate.reference.workers.round import parameter_digest
from specstate.reference.workers.sources import ModelSource
from specstate.reference.workers.verify import DraftChain

__all__ = ["DSparkWorker"]


class DSparkWorker(DFlashWorker):
    """Block drafting with a DSpark assistant on a Llama target (see the module docstring).

    Args:
        target: the target checkpoint directory or in-memory `PagedLlama`.
        assistant: the DSpark assistant directory (`specstate.reference.dspark_checkpoint`);
            its ``block_size`` W is the draft width.
        num_steps: drafts verified per round, ``1 .. W - 1`` (default ``W - 1``).
        device: where the target and the assistant live (default: the engine memory's device).
        dtype: the target's parameter and KV dtype; the assistant and heads compute in it too.
        seed: seeds the worker's generator for sampled rows (None: not reproducible).
        check_commit_order: as `DFlashWorker`'s.

    Raises:
        InvalidConfig: as `DFlashWorker`, or a directory without valid DSpark head fields.
    """

    ALGORITHM = "dspark"
    REPORTS_CONFIDENCES = True

    def __init__(
        self,
        *,
        target: ModelSource,
        assistant: str | os.PathLike[str],
        num_steps: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
        check_commit_order: bool = False,
    ) -> None:
        read_dspark_config(assistant)  # refuse a DFlash-only directory before the target loads
        super().__init__(
            target=target,
            assistant=assistant,
            num_steps=num_steps,
            device=device,
            dtype=dtype,
            seed=seed,
            check_commit_order=check_commit_order,
        )
        self._heads: DSparkHeads | None = None

    @property
    def heads(self) -> DSparkHeads:
        """The Markov and confidence heads (after attach)."""
        if self._heads is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._heads

    def _drafter_digest(self) -> str:
        # The backbone and the heads: a decode engine must draft with both as the prefill did.
        both = torch.nn.ModuleDict({"assistant": self.assistant, "heads": self.heads})
        return parameter_digest(both)

    def _load_assistant(self, target: PagedLlama, num_token_slots: int) -> DFlashAssistant:
        backbone, self._heads = load_dspark_assistant(
            self._assistant_dir, target, num_token_slots=num_token_slots
        )
        return backbone

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        chain = super()._propose(batch, start, roots)
        if chain.confidences is None:  # no drafts this round: no positions to predict
            empty = torch.zeros(roots.shape[0], 0, dtype=torch.float32, device=roots.device)
            chain = attrs.evolve(chain, confidences=empty)
        return chain

    def _choose_drafts(
        self, batch: ForwardBatch, attention: AttentionBatch, roots: torch.Tensor, num_drafts: int
    ) -> DraftChain:
        hidden = self.assistant.block_hidden(attention)[:, :num_drafts]
        logits = self.assistant.draft_logits(hidden)
        heads, prev, steps = self.heads, roots, []
        for i in range(num_drafts):  # each position's bias reads the draft chosen before it
            biased = logits[:, i] + heads.markov_bias(prev, hidden[:, i])
            step = self._sampler.choose(biased, batch.sampling_info)
            steps.append(step)
            prev = step.tokens
        chain = DraftChain.from_steps(steps)
        return attrs.evolve(chain, confidences=heads.confidences(hidden))
