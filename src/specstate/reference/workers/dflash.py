"""Algorithm ``dflash``: a block-diffusion assistant drafts a whole block in one forward.

The assistant (`specstate.reference.dflash_assistant`) denoises the bonus plus ``W - 1`` mask
tokens at once, attending to a context built from several target layers' hidden states. The
context of position ``p`` lives in the assistant's KV at ``p``'s token slot (like the target's
KV), so what crosses the round is that KV, reserved and freed with the request's slots; the
relay payload carries only the bonus. One round of row ``b`` (``S`` = frontier, ``W`` = block)::

    EXTEND chunk [P0, P1)   target extend (tapped layers -> context of P0 .. P1-1); publish;
                            materialize the chunk's context into the assistant's KV
    DECODE at S             assistant block [x0, m, .., m] @ S .. S+W-1 -> d1 .. d(W-1) (its
                            block K/V is scratch at the block's slots, those up to S+b
                            under a verify budget b); target verify
                            [x0, d1 .. dK] @ S .. S+K (tapped) -> accept a; publish S + a
                            materialize the context of the accepted S .. S+a-1 (selected on the
                            device by the accept length; rejected rows write the padding slot)
    next round              reads the assistant's KV below S + a: ordered after the
                            materialization by the forward stream, not by the host

So DFLASH publishes after accept and commits after publish: the host plans round N+1 while
round N's materialization is still on the forward stream. With ``check_commit_order`` the worker
records each materialization in a `CommitOrderLedger` and checks every block draft's reads
against it: a materialization reordered after the next forward's read raises `RelayError`.

The drafts equal ``transformers``' DFlash generation (``generate(..., assistant_model=A,
speculation_type="dflash")``) on the same target and assistant, round for round.

Invariant: after every forward, the assistant's KV at the slot of every position below a row's
frontier is the context KV of that position, computed from the target's hidden states of the
row's settled tokens; a function of tokens ``[0, p]``, so prefixes are shared by token.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import ClassVar

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerCapabilities, WorkerMemory
from specstate.reference.dflash_assistant import DFlashAssistant, DFlashConfig, check_fits_target
from specstate.reference.dflash_checkpoint import load_dflash_assistant, read_dflash_config
from specstate.reference.layer_tap import LayerTap
from specstate.reference.model import AttentionBatch, ModelConfig, PagedLlama
from specstate.reference.workers.layout import budget_end, chain_attention
from specstate.reference.workers.round import ChainRoundWorker, VerifiedRound
from specstate.reference.workers.sources import ModelSource, source_label
from specstate.reference.workers.target import TargetExtend, TargetRunner
from specstate.reference.workers.verify import DraftChain
from specstate.relay.commit_order import CommitOrderLedger
from specstate.relay.future_map import RelayPayload

__all__ = ["DFlashWorker"]


class DFlashWorker(ChainRoundWorker):
    """Block drafting with a DFlash assistant on a Llama target (see the module docstring).

    Args:
        target: the target checkpoint directory or in-memory `PagedLlama`.
        assistant: the assistant directory (Hugging Face ``muse_glimmer_assistant`` format,
            `specstate.reference.dflash_checkpoint`); its ``block_size`` W is the draft width.
        num_steps: drafts verified per round, ``1 .. W - 1`` (default ``W - 1``: the whole
            block); the assistant always denoises the whole block.
        device: where the target and the assistant live (default: the engine memory's device).
        dtype: the target's parameter and KV dtype; the assistant computes in it too.
        seed: seeds the worker's generator for sampled rows (None: not reproducible).
        check_commit_order: check every block draft's reads against the materializations
            (`CommitOrderLedger`; one host read per round, for tests and debugging).

    Attributes:
        observer: if set, called with every `VerifiedRound` after its materialization (tests).

    Raises:
        InvalidConfig: a hybrid target, ``num_steps`` outside ``[1, W - 1]``, an assistant that
            does not fit the target (naming both files), or a bad assistant config.

    A subclass (`specstate.reference.workers.dspark`) changes the registry name
    (``ALGORITHM``), whether it reports confidences (``REPORTS_CONFIDENCES``), how the
    assistant loads (`_load_assistant`) and how a block's drafts are
    chosen from it (`_choose_drafts`).
    """

    ALGORITHM: ClassVar[str] = "dflash"
    REPORTS_CONFIDENCES: ClassVar[bool] = False
    """Whether the worker reports ``draft_confidences`` (`WorkerCapabilities`)."""

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
        runner = TargetRunner(target, device=device, dtype=dtype)
        if not isinstance(runner.config, ModelConfig):
            raise InvalidConfig(
                f"{self.ALGORITHM} worker needs a Llama target; {source_label(target)} is a "
                "hybrid model"
            )
        config = read_dflash_config(assistant)
        where = f"{os.fspath(assistant)} with target {source_label(target)}"
        check_fits_target(config, runner.config, where)
        block = config.block_size
        steps = block - 1 if num_steps is None else num_steps
        if not 1 <= steps <= block - 1:
            raise InvalidConfig(
                f"{self.ALGORITHM} worker: num_steps {steps} outside [1, {block - 1}] (the "
                "assistant's "
                f"block_size {block} holds the bonus and {block - 1} masks)"
            )
        chain = WorkerCapabilities.chain(self.ALGORITHM, num_steps=steps, keeps_draft_kv=True)
        # The reservation covers the whole block: a draft writes its scratch K/V at [S, S+W).
        caps = attrs.evolve(
            chain, num_draft_tokens=block, reports_draft_confidences=self.REPORTS_CONFIDENCES
        )
        super().__init__(runner, caps, seed=seed)
        self._assistant_dir = assistant
        self._config: DFlashConfig = config
        self._check_order = check_commit_order
        self._assistant: DFlashAssistant | None = None
        self._tap: LayerTap | None = None
        self._ledger: CommitOrderLedger | None = None
        self.observer: Callable[[VerifiedRound], None] | None = None

    @property
    def assistant(self) -> DFlashAssistant:
        """The DFlash assistant (after attach)."""
        if self._assistant is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._assistant

    @property
    def _taps(self) -> LayerTap:
        if self._tap is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._tap

    def _attach_draft(self, memory: WorkerMemory) -> None:
        if memory.parallel is not None and memory.parallel.world_size > 1:
            raise InvalidConfig(f"{self.ALGORITHM} worker: tensor parallelism is not supported")
        target = self._target.model
        self._assistant = self._load_assistant(target, memory.num_token_slots)
        self._tap = LayerTap(target, self._config.target_layer_ids)
        if self._check_order:
            device = self._target.device_for(memory)
            self._ledger = CommitOrderLedger(memory.num_token_slots, device)

    def _draft_handoff_buffers(self) -> dict[str, torch.Tensor]:
        # The materialized context KV of every committed position, at its token slot.
        return {f"assistant.{n}": b for n, b in self.assistant.kv_cache.buffers().items()}

    def _handoff_drafter(self) -> torch.nn.Module | None:
        return self._assistant

    def _imported(self, slots: torch.Tensor) -> None:
        if self._ledger is not None:  # the imported context is committed, as a prefill's
            self._ledger.wrote_source(slots)
            self._ledger.committed(slots)

    def _load_assistant(self, target: PagedLlama, num_token_slots: int) -> DFlashAssistant:
        """The assistant of ``self._assistant_dir`` for ``target`` (at attach)."""
        return load_dflash_assistant(self._assistant_dir, target, num_token_slots=num_token_slots)

    def _draft_prefill(self, batch: ForwardBatch, out: TargetExtend) -> RelayPayload:
        attention = out.attention  # every chunk token is settled: all of them materialize
        if self._ledger is not None:
            self._ledger.wrote_source(attention.out_cache_loc)
        self._materialize(self._taps.take(), attention.positions, attention.out_cache_loc, None)
        return RelayPayload(bonus_tokens=out.next_tokens)

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        num_drafts = batch.draft_steps(self.capabilities.num_steps)
        if num_drafts == 0:
            return DraftChain(tokens=roots[:, None][:, :0])
        table = self._target.req_to_token
        if self._ledger is not None:
            self._ledger.check_reads(batch.request_ids, table, batch.req_pool_indices, start)
        width = self._config.block_size
        block = roots[:, None].repeat(1, width)
        block[:, 1:] = self._config.mask_token_id  # a fresh tensor: the worker's own
        # Under a verify budget b the block's positions past S + b write to the padding slot
        # (the row's reservation may end there); the block reads its own K/V regardless.
        end = budget_end(batch, start)
        attention = chain_attention(batch.req_pool_indices, table, start, block, end=end)
        chain = self._choose_drafts(batch, attention, roots, num_drafts)
        if self._ledger is not None:
            self._ledger.overwrote(attention.out_cache_loc)
        return chain

    def _choose_drafts(
        self, batch: ForwardBatch, attention: AttentionBatch, roots: torch.Tensor, num_drafts: int
    ) -> DraftChain:
        """Run the assistant on the block ``attention`` and choose the first ``num_drafts``
        drafts after ``roots`` (inside `TokenSampler.drafting`)."""
        del roots  # a DFlash block's positions do not read the tokens drafted before them
        logits = self.assistant(attention)
        # One choice per drafted position, in order: inside `TokenSampler.drafting` each sees
        # the controls, seeds and grammar of the position it drafts.
        steps = [self._sampler.choose(logits[:, i], batch.sampling_info) for i in range(num_drafts)]
        return DraftChain.from_steps(steps)

    def _commit_round(self, verified: VerifiedRound) -> RelayPayload:
        # After publish: the frontier is known; this forward's remaining work stays on the
        # stream, and the next round's draft reads what it writes.
        batch, chain = verified.batch, verified.chain
        attention = chain_attention(
            batch.req_pool_indices,
            self._target.req_to_token,
            verified.start,
            chain,
            end=budget_end(batch, verified.start),  # the verify wrote nothing past it
        )
        if self._ledger is not None:  # the verify wrote the target's KV and hidden states
            self._ledger.wrote_source(attention.out_cache_loc)
        steps = torch.arange(chain.shape[1], device=chain.device)[None, :]
        accepted = (steps < verified.verdict.accept_lens[:, None]).reshape(-1)
        self._materialize(self._taps.take(), attention.positions, attention.out_cache_loc, accepted)
        if self.observer is not None:
            self.observer(verified)
        return RelayPayload(bonus_tokens=verified.verdict.bonus_tokens)

    def _materialize(
        self,
        context: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        accepted: torch.Tensor | None,
    ) -> None:
        """The post-publish commit: write the context KV of the ``accepted`` rows (None: all)
        at their slots; the others go to the padding slot (no host read decides which)."""
        kept = slots if accepted is None else torch.where(accepted.to(slots.device), slots, 0)
        self.assistant.materialize(context, positions, kept)
        if self._ledger is not None:
            self._ledger.committed(kept)
