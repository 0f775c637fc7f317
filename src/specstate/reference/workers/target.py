"""The target model of a reference worker: its prefill/extend and its chain verify forwards.

`TargetRunner` owns the target `PagedLlama` or `PagedHybrid` (built at attach, with the engine's
number of KV token slots and, for a hybrid, its state rows) and the engine's `WorkerMemory`. It
reads ``req_to_token`` and writes the target's own KV cache; it never writes a scheduler counter.
Both forwards choose tokens per row with the worker's `TokenSampler`: argmax for greedy rows, the
filtered distribution for the others::

    extend(batch)        tokens at out_cache_loc          -> next token after each row's last
                                                             token, hidden states of all tokens
    verify(S, x0, d)     [x0, d1..dK] at S .. S+K         -> ChainVerdict, hidden [B, D, H]
                                                             (greedy or speculative sampling)

Sampling controls (docs/engine.md, "Sampling controls"), all per row:

* logit controls (penalties, ``min_new_tokens``): the runner keeps a `TokenHistory` (one token
  per KV slot, written idempotently by every forward: the extend's tokens, the chain ``[x0,
  d1..dK]``), and processes the logits of each scored position with the counts of the tokens
  before it — verify row ``j`` sees ``d1 .. dj`` (`TokenCounts.chain`). Every forward writes
  it, so a row's history is complete below its frontier, also for a prefix the prefix cache
  shares (written by the request that computed it, whatever its controls);
* seeds: a seeded sampled row's token at position ``p`` is ``F_p^-1(u(seed, p))``; its chain is
  verified against those tokens (`verify_chain_targets`), so the emitted tokens do not depend
  on the drafts, the batch or the loop, and each follows the target's distribution exactly;
* ``speculative=False`` rows accept exactly ``y_0`` (a sampled one draws it from ``p_0``);
* logprobs of the emitted tokens under the final distribution, when a row asks for them (and
  the top ``K`` alternatives of each position, with ``top_logprobs``);
* grammars (`specstate.grammar.rows`): the extend's sampled token and every verify position are
  masked to what the row's grammar allows there (after the logit controls), verify position
  ``j`` with the grammar after ``d1 .. dj``.

Invariant: the target's KV at positions below a row's frontier holds exactly the target's KV of
that row's settled tokens; verify writes only ``[S, S + D)``, inside the engine's reservation.
"""

from __future__ import annotations

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.sampling import SamplingInfo, seeded_uniforms
from specstate.core.errors import InvalidConfig
from specstate.engine.worker import WorkerMemory
from specstate.grammar.rows import RowMasks
from specstate.memory.recurrent_layout import RecurrentStateSpec
from specstate.reference.hybrid.config import HybridConfig
from specstate.reference.hybrid.lfm2_config import Lfm2ModelConfig
from specstate.reference.model import AttentionBatch, ModelConfig, ModelOutput, PagedLlama
from specstate.reference.workers.history import TokenHistory
from specstate.reference.workers.layout import chain_attention, extend_attention, last_token_rows
from specstate.reference.workers.sampler import (
    TokenCounts,
    TokenSampler,
    contain_logits,
    filtered_probs,
    sample_with_uniforms,
    token_logprobs,
    top_token_logprobs,
)
from specstate.reference.workers.sources import (
    ModelSource,
    SourceConfig,
    SourceModel,
    build_model,
    read_source_config,
    source_label,
)
from specstate.reference.workers.verify import (
    ChainVerdict,
    DraftChain,
    truncate_to_budgets,
    verify_chain_targets,
    verify_sampled_chain,
)

__all__ = ["TargetExtend", "TargetRunner", "TargetVerify"]


@attrs.frozen(kw_only=True)
class TargetExtend:
    """What the target's extend forward produced.

    Attributes:
        attention: the `AttentionBatch` it ran (drafters extend over the same tokens).
        next_tokens: ``[B]`` token after each row's last new token (argmax, or sampled).
        hidden_states: ``[T, hidden]`` target features (before the final norm) of every token.
        last_rows: ``[B]`` index of each row's last new token in the packed layout.
        invalid_rows: ``[B]`` bool, True where the row's logits were not finite (raw, or after
            the logit controls: `contain_logits`).
        logprobs: ``[B]`` log-probability of each next token, when the batch asks for them.
        top_logprobs: ``([B, K], [B, K])`` the top tokens and their log-probabilities, when
            the batch asks for ``top_logprobs`` (`top_token_logprobs`).
    """

    attention: AttentionBatch
    next_tokens: torch.Tensor
    hidden_states: torch.Tensor
    last_rows: torch.Tensor
    invalid_rows: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


@attrs.frozen(kw_only=True)
class TargetVerify:
    """What the target's verify forward produced.

    Attributes:
        verdict: the accepted runs.
        hidden_states: ``[B, D, hidden]`` target features of the chain.
        invalid_rows: ``[B]`` rows whose logits were not finite, raw or after the logit
            controls (verified on zeroed logits).
        logprobs: ``[B, D]`` log-probability of each run token, when the batch asks for them.
        top_logprobs: ``([B, D, K], [B, D, K])`` the top tokens of each run position and
            their log-probabilities, when the batch asks for ``top_logprobs``.
    """

    verdict: ChainVerdict
    hidden_states: torch.Tensor
    invalid_rows: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


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
        feature_layers: the decoder layers whose outputs, side by side, are the features every
            forward returns (``hidden_states``; an EAGLE-3 head's auxiliary hidden states);
            None: the last layer's output. A Llama target only.

    Raises:
        InvalidConfig: ``source`` is not a readable Llama checkpoint (the loader's error), or
            ``feature_layers`` names a layer the target lacks or is set for a hybrid target.
    """

    def __init__(
        self,
        source: ModelSource,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        feature_layers: tuple[int, ...] | None = None,
    ) -> None:
        self._source = source
        self._device = device
        self._dtype = dtype
        self._feature_layers = feature_layers
        self.config: SourceConfig = read_source_config(source, dtype=dtype)
        if feature_layers is not None:
            config = self.config
            layers = config.num_hidden_layers if isinstance(config, ModelConfig) else 0
            if not layers or any(not 0 <= i < layers for i in feature_layers):
                raise InvalidConfig(
                    f"target {source_label(source)}: feature layers {list(feature_layers)} need a "
                    f"Llama target with layers [0, {layers})"
                )
        self._model: SourceModel | None = None
        self._memory: WorkerMemory | None = None
        self._history: TokenHistory | None = None

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
            recurrent=memory.recurrent,
            parallel=memory.parallel,
        )
        self._memory = memory
        self._history = TokenHistory.by_token_slot(
            memory.num_token_slots, memory.req_to_token, device=self.device_for(memory)
        )

    def device_for(self, memory: WorkerMemory) -> torch.device:
        """Where this worker's models live when attached to ``memory``."""
        return torch.device(self._device) if self._device is not None else memory.device

    @property
    def model(self) -> PagedLlama:
        """The target model (after attach), for algorithms that need a Llama target.

        Raises:
            InvalidConfig: not attached, or the target is a hybrid (`network` runs either).
        """
        model = self.network
        if not isinstance(model, PagedLlama):
            raise InvalidConfig(
                f"the target is a hybrid model ({type(model).__name__}), not a PagedLlama"
            )
        return model

    def forward(
        self, attention: AttentionBatch, *, logit_rows: torch.Tensor | None = None
    ) -> ModelOutput:
        """The target's forward over ``attention``; ``hidden_states`` are the features."""
        network = self.network
        if self._feature_layers is None:
            out: ModelOutput = network(attention, logit_rows=logit_rows)
            return out
        features: ModelOutput = self.model(
            attention, logit_rows=logit_rows, feature_layers=self._feature_layers
        )
        return features

    @property
    def network(self) -> SourceModel:
        """The target model that runs the forwards (after attach): a Llama or a hybrid."""
        if self._model is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._model

    @property
    def recurrent(self) -> RecurrentStateSpec | None:
        """The target's recurrent state (None for a Llama, or a hybrid without Mamba2 layers)."""
        config = self.config
        if isinstance(config, HybridConfig | Lfm2ModelConfig):
            return config.recurrent_spec()
        return None

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

    def write_tokens(
        self, slots: torch.Tensor, positions: torch.Tensor, tokens: torch.Tensor
    ) -> None:
        """Stores ``tokens[i]`` at position ``positions[i]`` of slot ``slots[i]`` (history)."""
        self.history.write(slots, positions, tokens)

    @property
    def history(self) -> TokenHistory:
        """The tokens by KV slot (after attach)."""
        if self._history is None:
            raise InvalidConfig("worker is not attached: call attach(memory) first")
        return self._history

    def counts_at(
        self, slots: torch.Tensor, last: torch.Tensor, sampling: SamplingInfo
    ) -> TokenCounts | None:
        """The token state scoring position ``last + 1`` of each row; None without controls."""
        if not sampling.has_logit_controls:
            return None
        rows = self.history.read(slots)
        return TokenCounts.from_history(rows, last, sampling.prompt_lens, self.config.vocab_size)

    def begin_round(
        self, slots: torch.Tensor, start: torch.Tensor, roots: torch.Tensor, sampling: SamplingInfo
    ) -> TokenCounts | None:
        """Record the bonus ``x0`` at ``S`` and return the state at ``S`` (None: no controls)."""
        self.write_tokens(slots, start, roots)
        if not sampling.has_logit_controls:
            return None
        return self.counts_at(slots, start, sampling)

    def extend(self, batch: ForwardBatch, sampler: TokenSampler) -> TargetExtend:
        """Runs the EXTEND / MIXED forward and chooses the token after each row's last one."""
        attention = extend_attention(batch, self.req_to_token)
        last_rows = last_token_rows(attention.extend_lens)
        out = self.forward(attention, logit_rows=last_rows)
        invalid = _mask_non_finite(out.logits)
        sampling = batch.sampling_info
        last = attention.positions.index_select(0, last_rows)
        self.history.write_at(attention.out_cache_loc, attention.input_ids)
        counts = self.counts_at(attention.req_pool_indices, last, sampling)
        grammar = batch.grammar  # the masks of each row's sampled token, if it has a grammar
        masks = None if grammar is None else grammar.sample_masks()
        choice = sampler.choose(out.logits, sampling, positions=last + 1, counts=counts, mask=masks)
        if grammar is not None:
            grammar.accept_sampled(choice.tokens)
        if choice.invalid is not None:  # the controls left a row nothing to choose from
            invalid = invalid | choice.invalid
        logprobs = top = None
        if sampling.logprobs:
            processed = out.logits if choice.logits is None else choice.logits
            logprobs = token_logprobs(processed, choice.probs, sampling, choice.tokens)
            if sampling.top_logprobs:
                top = top_token_logprobs(processed, choice.probs, sampling, sampling.top_logprobs)
        return TargetExtend(
            attention=attention,
            next_tokens=choice.tokens,
            hidden_states=out.hidden_states,
            last_rows=last_rows,
            invalid_rows=invalid,
            logprobs=logprobs,
            top_logprobs=top,
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
        out = self.verify_chain(
            req_pool_indices, start, roots, drafts, sampling=sampling, sampler=sampler
        )
        return out.verdict, out.hidden_states, out.invalid_rows

    def verify_chain(
        self,
        req_pool_indices: torch.Tensor,
        start: torch.Tensor,
        roots: torch.Tensor,
        drafts: DraftChain,
        *,
        sampling: SamplingInfo,
        sampler: TokenSampler,
        counts: TokenCounts | None = None,
        grammar_masks: RowMasks | None = None,
        budgets: torch.Tensor | None = None,
    ) -> TargetVerify:
        """`verify`, with the run's logprobs; ``counts``: the state at ``S`` if already built
        (`begin_round`), else it is built here when the batch has logit controls;
        ``grammar_masks``: the grammar bitmask of every chain position (after the controls);
        ``budgets``: each row's verify budget (``ForwardBatch.verify_budgets``): it verifies
        only its first ``b`` drafts and writes no KV past ``S + b`` (the rest go to the
        padding slot)."""
        chain = torch.cat([roots[:, None], drafts.tokens], dim=1)
        end = None if budgets is None else start + budgets.to(start.device) + 1
        attention = chain_attention(req_pool_indices, self.req_to_token, start, chain, end=end)
        out = self.forward(attention)
        num_rows, width = chain.shape
        logits = out.logits.view(num_rows, width, -1)
        invalid = _mask_non_finite(logits)
        self.history.write_at(attention.out_cache_loc, attention.input_ids)
        if sampling.has_logit_controls and counts is None:
            counts = self.counts_at(req_pool_indices, start, sampling)
        if counts is not None:  # position j sees x0 and d1 .. dj
            logits, unusable = contain_logits(counts.chain(drafts.tokens).apply(logits, sampling))
            invalid = invalid | unusable
        if grammar_masks is not None:  # position j: the grammar after d1 .. dj
            logits = grammar_masks.apply(logits)
        verdict, probs = _verify(drafts, logits, sampling, sampler, start, budgets)
        logprobs = top = None
        if sampling.logprobs:
            logprobs = token_logprobs(logits, probs, sampling, verdict.run_tokens)
            if sampling.top_logprobs:
                top = top_token_logprobs(logits, probs, sampling, sampling.top_logprobs)
        return TargetVerify(
            verdict=verdict,
            hidden_states=out.hidden_states.view(num_rows, width, -1),
            invalid_rows=invalid,
            logprobs=logprobs,
            top_logprobs=top,
        )


def _verify(
    drafts: DraftChain,
    logits: torch.Tensor,
    sampling: SamplingInfo,
    sampler: TokenSampler,
    start: torch.Tensor,
    budgets: torch.Tensor | None = None,
) -> tuple[ChainVerdict, torch.Tensor | None]:
    """The verdict of every row, and the filtered distributions (None: all greedy).

    Greedy rows verify by argmax (bit-identical to an all-greedy batch); seeded sampled rows
    against their seeded draws; other sampled rows by speculative sampling. A row that does not
    speculate accepts exactly ``y_0`` (drawn from ``p_0`` when it samples without a seed); a row
    with a verify budget ``b`` verifies only its first ``b`` drafts (`truncate_to_budgets`).
    """
    speculative = sampling.speculative
    targets = logits.argmax(-1)
    if sampling.is_all_greedy:
        return verify_chain_targets(drafts.tokens, targets, speculative, budgets), None
    probs = filtered_probs(logits, sampling)
    fixed_rows = (sampling.temperatures == 0).to(logits.device)
    if sampling.seeds is not None:
        steps = torch.arange(targets.shape[1], device=targets.device)[None, :]
        uniforms = seeded_uniforms(sampling.seeds, start.long()[:, None] + 1 + steps)
        seeded = (sampling.seeds.to(logits.device) >= 0) & ~fixed_rows
        targets = torch.where(seeded[:, None], sample_with_uniforms(probs, uniforms), targets)
        fixed_rows = fixed_rows | seeded
    fixed = verify_chain_targets(drafts.tokens, targets, speculative, budgets)
    sampled = verify_sampled_chain(drafts.tokens, drafts.probs, probs, sampler)
    if budgets is not None:
        sampled = truncate_to_budgets(sampled, probs, budgets, sampler)
    if speculative is not None:  # a single token drawn from p_0 itself, not the residual
        single = ~speculative.to(logits.device)
        first = sampler.sample(probs[:, 0])
        only_first = torch.cat([first[:, None], torch.zeros_like(sampled.run_tokens[:, 1:])], 1)
        sampled = ChainVerdict(
            run_tokens=torch.where(single[:, None], only_first, sampled.run_tokens),
            accept_lens=torch.where(single, 1, sampled.accept_lens),
            bonus_tokens=torch.where(single, first, sampled.bonus_tokens),
        )
    verdict = ChainVerdict(
        run_tokens=torch.where(fixed_rows[:, None], fixed.run_tokens, sampled.run_tokens),
        accept_lens=torch.where(fixed_rows, fixed.accept_lens, sampled.accept_lens),
        bonus_tokens=torch.where(fixed_rows, fixed.bonus_tokens, sampled.bonus_tokens),
    )
    return verdict, probs
