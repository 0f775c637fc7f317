"""Algorithm ``draft_model``: a separate, smaller Llama drafts a chain for the target to verify.

The drafter owns its own KV cache, indexed by the SAME token slots as the target: the draft KV
of position ``p`` of a request lives at ``req_to_token[slot, p]`` in the drafter's cache. So the
engine's reservation covers the drafter too, and a retracted or finished request frees both.
One DECODE round of row ``b`` (``S`` = frontier, ``x0`` = bonus, ``K`` = num_steps)::

    drafter   x0@S -> d1, d1@S+1 -> d2, ..., d(K-1)@S+K-1 -> dK      K 1-token steps
              (argmax, or drawn from the drafter's filtered q_i for a sampled row)
    target    [x0, d1..dK] @ S..S+K -> y0..yK; accept a = m + 1; emit y0..y_m
    publish   S + a
    drafter   extend [x0, d1..dK] @ S..S+K                          (post-verify)
    next      bonus y_m at S + a

With ``topk > 1`` a DECODE round drafts a tree (`specstate.reference.workers.tree`): the drafter
expands the top-k children of the k best nodes per level under a tree mask, the target verifies
the ``num_draft_tokens`` best nodes, the accepted path's target KV is moved to ``S .. S+a-1``
and the drafter re-extends the path ``[x0, p_1 .. p_K]`` at ``S .. S+K`` (post-verify). Sampled
rows verify the tree by recursive rejection sampling.

Invariant: after every forward, the drafter's KV below each row's frontier is the drafter's KV
of that row's settled tokens (EXTEND writes every chunk; the post-verify extend rewrites
``S..S+K``, of which ``S..S+m`` are accepted), so a drafter equal to the target drafts the
target's own greedy tokens.
"""

from __future__ import annotations

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerMemory
from specstate.reference.hybrid.config import HybridConfig
from specstate.reference.hybrid.lfm2_config import Lfm2ModelConfig
from specstate.reference.model import AttentionBatch, KvCache, ModelOutput
from specstate.reference.workers.layout import budget_end, chain_attention
from specstate.reference.workers.round import VerifiedRound
from specstate.reference.workers.sources import (
    ModelSource,
    SourceModel,
    build_model,
    check_same_vocab,
    read_source_config,
)
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.tree import TreeRoundWorker, VerifiedTree
from specstate.reference.workers.tree_draft import tree_capabilities
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = ["DraftModelWorker"]


def _no_rows(device: torch.device) -> torch.Tensor:
    """``logit_rows`` that select nothing: a forward that only writes KV."""
    return torch.zeros(0, dtype=torch.int64, device=device)


class DraftModelWorker(TreeRoundWorker):
    """Chain (or, with ``topk > 1``, tree) drafting with a separate Llama (module docstring).

    Args:
        target: the target checkpoint directory or in-memory `PagedLlama`.
        draft: the drafter, same vocabulary as the target (may be the target itself). A hybrid
            drafter (NemotronH) keeps its states in the engine's state rows, beside the
            target's: its drafting steps and its post-verify extend read and write the rows of
            the positions they absorb, exactly as its KV uses the target's token slots.
        num_steps: K, draft steps per round (a chain verifies D = K + 1 tokens).
        topk: branches per tree node; 1 (the default) drafts a chain.
        num_draft_tokens: D, tree nodes verified per round, root included (default: ``K + 1``
            for a chain, ``K * topk + 1`` for a tree).
        device: where both models live (default: the engine memory's device).
        dtype: parameter and KV dtype of both (default: each checkpoint's).
        seed: seeds the worker's generator for sampled rows (None: not reproducible).

    Raises:
        InvalidConfig: ``num_steps < 1``, ``topk < 1``, ``topk`` above the vocabulary, or a tree
            size `TreeShape` refuses; a vocabulary mismatch (naming both checkpoints and sizes);
            a checkpoint that is not a Llama (the loader's error).
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        draft: ModelSource,
        num_steps: int = 3,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        if num_steps < 1:
            raise InvalidConfig(f"draft_model worker needs num_steps >= 1, got {num_steps}")
        runner = TargetRunner(target, device=device, dtype=dtype)
        check_same_vocab(target, runner.config, draft, read_source_config(draft, dtype=dtype))
        draft_config = read_source_config(draft, dtype=dtype)
        capabilities = tree_capabilities(
            "draft_model", num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens
        )
        if isinstance(draft_config, HybridConfig | Lfm2ModelConfig):  # states in the target's rows
            capabilities = attrs.evolve(
                capabilities, recurrent=draft_config.recurrent_spec(prefix="draft")
            )
        super().__init__(runner, capabilities, seed=seed)
        self._draft_source = draft
        self._dtype = dtype
        self._drafter: SourceModel | None = None

    @property
    def draft_model(self) -> SourceModel:
        """The drafter (after attach)."""
        if self._drafter is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._drafter

    def _draft_kv_caches(self) -> dict[str, KvCache]:
        return {"draft": self.draft_model.kv_cache}

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        return {}  # the drafter keeps only its KV (`kv_caches`)

    def _handoff_drafter(self) -> torch.nn.Module | None:
        return self.draft_model

    def _attach_draft(self, memory: WorkerMemory) -> None:
        self._drafter = build_model(
            self._draft_source,
            num_token_slots=memory.num_token_slots,
            device=self._target.device_for(memory),
            dtype=self._dtype,
            recurrent=memory.recurrent,
        )

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        # Every chunk, so the drafter holds the whole prompt's KV when decoding starts.
        self.draft_model(out.attention, logit_rows=_no_rows(out.next_tokens.device))
        return RelayPayload(bonus_tokens=out.next_tokens)

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        table = self._target.req_to_token
        tokens, steps, end = roots, [], budget_end(batch, start)
        for step in range(batch.draft_steps(self.capabilities.num_steps)):
            chain = chain_attention(
                batch.req_pool_indices, table, start + step, tokens[:, None], end=end
            )
            choice = self._sampler.choose(self.draft_model(chain).logits, batch.sampling_info)
            tokens = choice.tokens
            steps.append(choice)
        return DraftChain.from_steps(steps) if steps else DraftChain(tokens=roots[:, None][:, :0])

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        # The chain steps never wrote dK at S+K: without this extend an all-accept round would
        # leave a hole in the drafter's KV below the new frontier.
        chain = chain_attention(
            verified.batch.req_pool_indices,
            self._target.req_to_token,
            verified.start,
            verified.chain,
            end=budget_end(verified.batch, verified.start),
        )
        self.draft_model(chain, logit_rows=_no_rows(verified.chain.device))
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens)

    def _tree_forward(
        self, attention: AttentionBatch, features: torch.Tensor | None
    ) -> ModelOutput:
        del features  # a plain Llama drafts from tokens alone
        out: ModelOutput = self.draft_model(attention)
        return out

    def _tree_root_features(self, batch: ForwardBatch, start: torch.Tensor) -> None:
        del batch, start

    def _commit_tree(self, verified: VerifiedTree) -> RelayPayload:
        # Rewrites the drafter's KV of the accepted path at S .. S+a-1 (and harmless
        # leftovers up to S+K): the drafting steps never wrote the path's last node.
        attention = verified.path_attention(self._target.req_to_token)
        self.draft_model(attention, logit_rows=_no_rows(verified.start.device))
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens)
