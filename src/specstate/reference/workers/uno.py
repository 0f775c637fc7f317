"""Algorithm ``uno``: the target drafts its own block through a draft-only LoRA adapter.

There is no drafter model. The *diffusion pathway* is the target's weights plus a LoRA adapter
(`specstate.reference.lora`); the *plain pathway* is the target alone. One scheduler-level
DECODE of row ``b`` (``S`` = frontier, ``x0`` = bonus, ``K`` = num_steps) runs two target
forwards::

    pass 1 (draft)    [x0, n_1 .. n_(K-1)] @ S .. S+K-1, causal; the adapter applies to the
                      noise rows n_i only, and only of rows routed to it; the bonus row is
                      plain, so its logits are the target's own distribution at S
                      root r = chosen from the bonus row (the first output token)
                      drafts d_i = chosen from noise row i (its marginal)     i = 1 .. K-1
    pass 2 (verify)   plain target over [x0, r, d_1 .. d_(K-1)] @ S .. S+K; accept a run of
                      a tokens (the root is the target's own token: a >= 2 for a routed row)
    publish           S + a, right after acceptance: nothing is committed after it

Pass 1's noise rows write LoRA-shaped K/V into the target's cache at ``S+1 .. S+K-1``; pass 2
rewrites ``S .. S+K`` before anything reads them, so nothing the adapter touched survives the
round. The relay carries the bonus only (tokens and lengths). The noise rows hold
``noise_token_id``, or tokens drawn uniformly from the vocabulary with the worker's generator.

Routing: a row is routed to the adapter when the request speculates
(``SamplingParams.speculative``); a row that is not routed rides pass 1 without the adapter and
accepts one token per round, the target's own: it decodes plainly and exactly. A worker
without an adapter drafts nothing: every round is one plain target forward of the bonus.

With ``topk > 1`` the round drafts a tree instead (`specstate.reference.workers.tree`): pass 1
runs once, tree level ``l`` takes the ``topk`` best tokens of pass 1's row ``l - 1`` for every
expanded node (a marginal does not depend on the node's parent), and the existing tree
verification checks the ``num_draft_tokens`` best nodes. Trees serve no grammar: the engine
refuses a grammar request on a worker without ``supports_grammar``.

Invariant: a forward outside pass 1 never sees the adapter (its hooks exist only inside
`LoraAdapter.applied`); the target's KV below a row's frontier is the plain target's KV of its
settled tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerMemory
from specstate.reference.lora import LoraAdapter, read_lora_config
from specstate.reference.model import AttentionBatch, ModelConfig, ModelOutput
from specstate.reference.workers.layout import budget_end, chain_attention, decode_roots
from specstate.reference.workers.round import VerifiedRound, tensor_digest
from specstate.reference.workers.sources import ModelSource, source_label
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.tree import TreeRoundWorker, VerifiedTree
from specstate.reference.workers.tree_draft import tree_capabilities
from specstate.reference.workers.verify import DraftChain
from specstate.relay.future_map import RelayPayload

__all__ = ["UnoWorker"]


class UnoWorker(TreeRoundWorker):
    """Self-drafting through a draft-only LoRA adapter (see the module docstring).

    Args:
        target: the target checkpoint directory or in-memory `PagedLlama`.
        adapter: a PEFT LoRA adapter directory for the target, or None (a chain worker then
            decodes plainly, one token per round; a tree needs one).
        num_steps: K, tokens a round proposes past the bonus: the root and ``K - 1`` drafts.
        topk: 1 (the default) verifies the linear chain; above 1, a tree of the ``topk`` best
            tokens of every position's marginal.
        num_draft_tokens: tree nodes verified per round (trees only).
        noise_token_id: the token of every noise row; None draws them uniformly with the
            worker's generator.
        device: where the target lives (default: the engine memory's device).
        dtype: the target's parameter and KV dtype.
        seed: seeds the worker's generator (sampled rows and noise).

    Attributes:
        chain_observer: if set, called with every chain round's `VerifiedRound` (tests); a tree
            round calls ``observer`` (`TreeRoundWorker`).

    Raises:
        InvalidConfig: a hybrid target, ``num_steps < 1``, a tree size `TreeShape` refuses,
            a ``noise_token_id`` outside the vocabulary, or a bad adapter config.
    """

    def __init__(
        self,
        *,
        target: ModelSource,
        adapter: str | os.PathLike[str] | None = None,
        num_steps: int = 4,
        topk: int = 1,
        num_draft_tokens: int | None = None,
        noise_token_id: int | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        seed: int | None = None,
    ) -> None:
        runner = TargetRunner(target, device=device, dtype=dtype)
        if not isinstance(runner.config, ModelConfig):
            raise InvalidConfig(
                f"uno worker needs a Llama target; {source_label(target)} is a hybrid model"
            )
        vocab = runner.config.vocab_size
        if noise_token_id is not None and not 0 <= noise_token_id < vocab:
            raise InvalidConfig(
                f"uno worker: noise_token_id {noise_token_id} outside the vocabulary of {vocab}"
            )
        if adapter is not None:
            read_lora_config(adapter)  # a bad adapter fails before an engine is built
        elif topk > 1:
            raise InvalidConfig(f"uno worker: a tree (topk {topk}) drafts through an adapter")
        capabilities = tree_capabilities(
            "uno", num_steps=num_steps, topk=topk, num_draft_tokens=num_draft_tokens
        )
        super().__init__(runner, capabilities, seed=seed)
        self._adapter_dir = adapter
        self._noise = noise_token_id
        self._adapter: LoraAdapter | None = None
        self._marginals: torch.Tensor | None = None  # a tree round's pass-1 logits
        self._level = 0
        self.chain_observer: Callable[[VerifiedRound], None] | None = None

    @property
    def adapter(self) -> LoraAdapter | None:
        """The LoRA adapter (after attach), or None when the worker has none."""
        return self._adapter

    def _attach_draft(self, memory: WorkerMemory) -> None:
        if memory.parallel is not None and memory.parallel.world_size > 1:
            raise InvalidConfig("uno worker: tensor parallelism is not supported")
        if self._adapter_dir is not None:
            self._adapter = LoraAdapter.load(self._adapter_dir, self._target.model)

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        # No drafter state: the drafter is the target itself (its KV and history cross), and
        # nothing the adapter writes survives a round. The relay carries the bonus only.
        return {}

    def _drafter_digest(self) -> str:
        # The adapter's matrices and scale, and the noise rows' token (it shapes the drafts).
        adapter = self._adapter
        if adapter is None:
            return ""
        noise = torch.tensor(-1 if self._noise is None else self._noise, dtype=torch.int64)
        return tensor_digest([*adapter.named_tensors(), ("noise_token_id", noise)])

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        return RelayPayload(bonus_tokens=out.next_tokens)

    def _draft_pass(
        self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor, width: int
    ) -> torch.Tensor:
        """Pass 1 over ``[x0, n_1 .. n_(width-1)]`` at ``S ..``: logits ``[B, width, V]``."""
        num_rows = roots.shape[0]
        if self._noise is None:
            vocab = self._target.config.vocab_size
            noise = torch.randint(
                0,
                vocab,
                (num_rows, width - 1),
                generator=self._sampler.generator,
                device=roots.device,
            )
        else:
            noise = roots.new_full((num_rows, width - 1), self._noise)
        tokens = torch.cat([roots[:, None], noise], dim=1)
        # Under a verify budget b the rows past S + b write the padding slot (the row's
        # reservation may end there); pass 1 is causal, so the drafts a row verifies do not
        # read them.
        attention = chain_attention(
            batch.req_pool_indices,
            self._target.req_to_token,
            start,
            tokens,
            end=budget_end(batch, start),
        )
        model = self._target.model
        with self._routing(batch, width):
            out: ModelOutput = model(attention)
        return out.logits.view(num_rows, width, -1)

    def _routing(self, batch: ForwardBatch, width: int) -> AbstractContextManager[None]:
        """The adapter applied to the noise rows of the routed rows (nothing without one)."""
        adapter = self._adapter
        if adapter is None or width < 2:  # the bonus row alone is never adapted
            return nullcontext()
        speculative = batch.sampling_info.speculative
        routed = torch.ones(batch.batch_size, dtype=torch.bool, device=batch.seq_lens.device)
        if speculative is not None:
            routed = speculative.to(routed.device).bool()
        noise_rows = torch.arange(width, device=routed.device)[None, :] >= 1
        return adapter.applied((routed[:, None] & noise_rows).reshape(-1))

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        width = batch.draft_steps(self.capabilities.num_steps)
        if width == 0 or self._adapter is None:  # no adapter: a plain decode step
            return DraftChain(tokens=roots[:, None][:, :0])
        logits = self._draft_pass(batch, start, roots, width)
        # Step 0 is the root (the bonus row: the target's own distribution), then the drafts;
        # inside `TokenSampler.drafting` each sees its position's controls, seed and grammar.
        steps = [self._sampler.choose(logits[:, i], batch.sampling_info) for i in range(width)]
        return DraftChain.from_steps(steps)

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        if self.chain_observer is not None:
            self.chain_observer(verified)
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens)

    def _tree_root_features(self, batch: ForwardBatch, start: torch.Tensor) -> None:
        # A tree round's pass 1 runs here, once, before the tree grows from its marginals.
        _, roots = decode_roots(batch)
        self._marginals = self._draft_pass(batch, start, roots, self.capabilities.num_steps)
        self._level = 0

    def _tree_forward(
        self, attention: AttentionBatch, features: torch.Tensor | None
    ) -> ModelOutput:
        del features  # a marginal depends on the position alone, not on the node's parent
        marginals = self._marginals
        if marginals is None:
            raise InvalidConfig("uno tree round: the tree grew before pass 1 ran")
        level, self._level = self._level, self._level + 1
        logits = marginals[:, level].repeat_interleave(attention.extend_lens.long(), dim=0)
        hidden = logits.new_zeros(logits.shape[0], self._target.config.hidden_size)
        return ModelOutput(logits=logits, hidden_states=hidden)

    def _commit_tree(self, verified: VerifiedTree) -> RelayPayload:
        self._marginals = None
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens)
