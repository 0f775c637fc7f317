"""The target model of a reference worker: its prefill/extend and its chain verify forwards.

`TargetRunner` owns the target `PagedLlama` (built at attach, with the engine's number of KV
token slots) and the engine's `WorkerMemory`. It reads ``req_to_token`` and writes the target's
own KV cache; it never writes a scheduler counter. Both forwards choose tokens per row with the
worker's `TokenSampler`: argmax for greedy rows, the filtered distribution for the others::

    extend(batch)        tokens at out_cache_loc          -> next token after each row's last
                                                             token, hidden states of all tokens
    verify(S, x0, d)     [x0, d1..dK] at S .. S+K         -> ChainVerdict, hidden [B, D, H]
                                                             (greedy or speculative sampling)

Invariant: the target's KV at positions below a row's frontier holds exactly the target's KV of
that row's settled tokens; verify writes only ``[S, S + D)``, inside the engine's reservation.
"""

from __future__ import annotations

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.sampling import SamplingInfo
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerMemory
from specstate.reference.model import AttentionBatch, ModelConfig, PagedLlama
from specstate.reference.workers.layout import chain_attention, extend_attention, last_token_rows
from specstate.reference.workers.sampler import TokenSampler, filtered_probs
from specstate.reference.workers.sources import ModelSource, build_model, read_source_config
from specstate.reference.workers.verify import (
    ChainVerdict,
    DraftChain,
    verify_greedy_chain,
    verify_sampled_chain,
)

__all__ = ["TargetExtend", "TargetRunner"]


@attrs.frozen(kw_only=True)
class TargetExtend:
    """What the target's extend forward produced.

    Attributes:
        attention: the `AttentionBatch` it ran (drafters extend over the same tokens).
        next_tokens: ``[B]`` token after each row's last new token (argmax, or sampled).
        hidden_states: ``[T, hidden]`` target features (before the final norm) of every token.
        last_rows: ``[B]`` index of each row's last new token in the packed layout.
        invalid_rows: ``[B]`` bool, True where the row's logits were not finite.
    """

    attention: AttentionBatch
    next_tokens: torch.Tensor
    hidden_states: torch.Tensor
    last_rows: torch.Tensor
    invalid_rows: torch.Tensor


def _mask_non_finite(logits: torch.Tensor) -> torch.Tensor:
    """Rows ``[B]`` of ``logits`` ``[B, ..., V]`` with a non-finite value; those are zeroed.

    Zeroing lets argmax and sampling run on every row without a host check (a NaN would make
    ``multinomial`` raise for the whole batch); the row is reported invalid and its request
    ends with an error instead of emitting a made-up token. No host synchronization.
    """
    finite = torch.isfinite(logits).flatten(1).all(dim=1)
    logits.masked_fill_(~finite.view(-1, *([1] * (logits.dim() - 1))), 0.0)
    return ~finite


class TargetRunner:
    """Owner of the target model and of the engine memory binding of one worker.

    Args:
        source: checkpoint directory or in-memory model (copied at attach).
        device: where the model lives; None means the engine's ``memory.device``.
        dtype: parameter and KV dtype; None keeps the checkpoint's.

    Raises:
        InvalidConfig: ``source`` is not a readable Llama checkpoint (the loader's error).
    """

    def __init__(
        self,
        source: ModelSource,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._source = source
        self._device = device
        self._dtype = dtype
        self.config: ModelConfig = read_source_config(source, dtype=dtype)
        self._model: PagedLlama | None = None
        self._memory: WorkerMemory | None = None

    def attach(self, memory: WorkerMemory) -> None:
        """Build the target with ``memory.num_token_slots`` KV slots and bind ``memory``.

        Raises:
            InvalidConfig: already attached.
        """
        if self._memory is not None:
            raise InvalidConfig("worker is already attached to an engine's memory")
        self._model = build_model(
            self._source,
            num_token_slots=memory.num_token_slots,
            device=self.device_for(memory),
            dtype=self._dtype,
        )
        self._memory = memory

    def device_for(self, memory: WorkerMemory) -> torch.device:
        """Where this worker's models live when attached to ``memory``."""
        return torch.device(self._device) if self._device is not None else memory.device

    @property
    def model(self) -> PagedLlama:
        """The target model (after attach)."""
        if self._model is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._model

    @property
    def memory(self) -> WorkerMemory:
        """The engine memory this worker reads (after attach)."""
        if self._memory is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._memory

    @property
    def req_to_token(self) -> torch.Tensor:
        """The engine's request → token-slot table (read only)."""
        return self.memory.req_to_token

    def extend(self, batch: ForwardBatch, sampler: TokenSampler) -> TargetExtend:
        """Runs the EXTEND / MIXED forward and chooses the token after each row's last one."""
        attention = extend_attention(batch, self.req_to_token)
        last_rows = last_token_rows(attention.extend_lens)
        out = self.model(attention, logit_rows=last_rows)
        invalid = _mask_non_finite(out.logits)
        return TargetExtend(
            attention=attention,
            next_tokens=sampler.choose(out.logits, batch.sampling_info).tokens,
            hidden_states=out.hidden_states,
            last_rows=last_rows,
            invalid_rows=invalid,
        )

    def verify(
        self,
        req_pool_indices: torch.Tensor,
        start: torch.Tensor,
        roots: torch.Tensor,
        drafts: DraftChain,
        *,
        sampling: SamplingInfo,
        sampler: TokenSampler,
    ) -> tuple[ChainVerdict, torch.Tensor, torch.Tensor]:
        """Scores ``[roots, drafts]`` at ``start ..`` and verifies each row per its sampling.

        Returns:
            The verdict, the target's hidden states ``[B, D, hidden]`` of the chain, and the
            ``[B]`` rows whose logits were not finite (verified on zeroed logits; invalid).
        """
        chain = torch.cat([roots[:, None], drafts.tokens], dim=1)
        attention = chain_attention(req_pool_indices, self.req_to_token, start, chain)
        out = self.model(attention)
        num_rows, width = chain.shape
        logits = out.logits.view(num_rows, width, -1)
        invalid = _mask_non_finite(logits)
        verdict = _verify(drafts, logits, sampling, sampler)
        return verdict, out.hidden_states.view(num_rows, width, -1), invalid


def _verify(
    drafts: DraftChain, logits: torch.Tensor, sampling: SamplingInfo, sampler: TokenSampler
) -> ChainVerdict:
    """Greedy rows verify by argmax (bit-identical to an all-greedy batch), the others sample."""
    greedy = verify_greedy_chain(drafts.tokens, logits)
    if sampling.is_all_greedy:
        return greedy
    probs = filtered_probs(logits, sampling)
    sampled = verify_sampled_chain(drafts.tokens, drafts.probs, probs, sampler)
    is_greedy = (sampling.temperatures == 0).to(logits.device)
    return ChainVerdict(
        run_tokens=torch.where(is_greedy[:, None], greedy.run_tokens, sampled.run_tokens),
        accept_lens=torch.where(is_greedy, greedy.accept_lens, sampled.accept_lens),
        bonus_tokens=torch.where(is_greedy, greedy.bonus_tokens, sampled.bonus_tokens),
    )
