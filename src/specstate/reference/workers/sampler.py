"""The random source of one reference worker, and how a row's logits become a distribution.

`TokenSampler` owns the worker's `torch.Generator`; the target and the drafter of a worker draw
from it, in a fixed order, so a run is reproducible for a fixed seed and batch composition.
A row samples when its temperature is above 0; its distribution is the filtered softmax of its
*processed* logits (`TokenCounts.apply`: the penalties and the ``min_new_tokens`` mask, given
the tokens before the scored position)::

    logits ──controls──▶ /T ──▶ softmax ──top-k──▶ keep the k most probable ──top-p──▶ keep the
    smallest most-probable prefix whose mass reaches top_p (the first token always) ──▶
    renormalize

A row whose request has a ``seed`` does not use the generator: its token at position ``p`` is
the inverse CDF of its distribution (vocabulary order) at ``seeded_uniforms(seed, p)``, a pure
function of the seed, the position and the distribution. While a drafter drafts (`drafting`),
`choose` draws its step ``k`` with the uniform of the position it drafts, so a drafter close to
the target proposes the token the target will draw (a coupled draft), and applies the same
controls to the drafter's logits, advancing the counts by each drafted token.

A greedy row (``T == 0``) takes the argmax of its raw logits, exactly as before sampling
existed: `TokenSampler.choose` on an all-greedy batch computes no distribution and draws
nothing, so greedy outputs are bit-identical whether or not a worker has a seed.

Invariant: every token a sampled row draws has positive mass in the distribution returned
with it; ties in the filters are broken by token id (a stable sort), so the filtered
distribution is a pure function of the logits and the row's parameters.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import attrs
import torch
import torch.nn.functional as F

from specstate.batch.sampling import SamplingInfo, apply_logit_controls, seeded_uniforms
from specstate.grammar.rows import GrammarRows, RowMasks

if TYPE_CHECKING:
    from specstate.engine.worker import ParallelGroup

__all__ = [
    "TokenChoice",
    "TokenCounts",
    "TokenSampler",
    "contain_logits",
    "filtered_probs",
    "sample_with_uniforms",
    "token_logprobs",
    "top_token_logprobs",
]


def _per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B]`` viewed to broadcast against ``like`` ``[B, ...]``."""
    return values.to(like.device).view(-1, *([1] * (like.ndim - 1)))


def contain_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``logits`` ``[B, ..., V]`` made safe to choose from, and the ``[B]`` rows that are not.

    Processed logits can leave the finite range: a penalty that overflows the dtype makes a
    logit +inf, an overflow against an overflow makes it NaN, and ``min_new_tokens`` can mask
    every token of a position (-inf). A +inf becomes the dtype's largest finite value (the
    token stays the most likely, as an argmax over +inf would pick it); a row with a NaN, or
    with a scored position where no token is left, is reported and zeroed, so argmax and
    sampling run on every row without a host check and the row alone ends (the caller marks
    it invalid). Rows with finite logits are returned unchanged. New tensor.
    """
    nan = torch.isnan(logits).flatten(1).any(1)
    dead = (logits == float("-inf")).all(-1)
    if dead.dim() > 1:  # several scored positions per row: any one of them
        dead = dead.flatten(1).any(1)
    bad = nan | dead
    top = torch.finfo(logits.dtype).max if logits.is_floating_point() else None
    safe = logits if top is None else logits.clamp(max=top)
    return safe.masked_fill(_per_row(bad, safe), 0.0), bad


def _scaled(logits: torch.Tensor, temperatures: torch.Tensor) -> torch.Tensor:
    """``logits / T`` in float32; a row that overflows is shifted by its maximum first.

    Softmax is invariant to the shift, so the distribution is the same; a tiny temperature then
    gives its exact limit (the most likely tokens) instead of ``inf - inf = NaN``. Rows that do
    not overflow are computed exactly as before (bit for bit).
    """
    scaled = logits.float() / temperatures
    over = torch.isposinf(scaled).any(-1, keepdim=True)
    top = logits.float().amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
    return torch.where(over, (logits.float() - top) / temperatures, scaled)


def filtered_probs(logits: torch.Tensor, sampling: SamplingInfo) -> torch.Tensor:
    """The filtered sampling distribution of every row of ``logits`` ``[B, ..., V]`` (float32).

    Row ``b`` uses ``sampling``'s row ``b``; greedy rows are computed at temperature 1 (their
    distribution is never sampled, only carried along in vectorized code). Every row of finite
    (or -inf masked) logits gets a distribution, whatever its temperature (`_scaled`).
    """
    temperatures = _per_row(sampling.temperatures.float(), logits)
    temperatures = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(_scaled(logits, temperatures), dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    top_k = _per_row(sampling.top_ks.long(), probs)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep = (ranks < top_k) & (mass_before < _per_row(sampling.top_ps.float(), probs))
    keep[..., 0] = True  # NOTE: top_p of float32 rounding never empties a row
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, order, kept)


def sample_with_uniforms(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The inverse CDF of ``probs`` ``[..., V]`` (vocabulary order) at ``uniforms`` ``[...]``.

    The token ``t`` with ``cdf(t - 1) <= u * mass < cdf(t)``: always a token of positive mass.
    """
    cdf = probs.double().cumsum(-1)
    target = uniforms.to(cdf.device, torch.float64)[..., None] * cdf[..., -1:]
    index = torch.searchsorted(cdf.contiguous(), target.contiguous(), right=True).squeeze(-1)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    last = torch.where(probs > 0, ranks, 0).amax(-1)  # rounding never picks a massless tail
    return torch.minimum(index, last)


def token_logprobs(
    processed: torch.Tensor,
    probs: torch.Tensor | None,
    sampling: SamplingInfo,
    tokens: torch.Tensor,
) -> torch.Tensor:
    """``[B, ...]`` log-probability of ``tokens`` under each row's final distribution (float32).

    Greedy rows: ``log_softmax`` of the processed logits (temperature 1, no filter); sampled
    rows: the log of their filtered distribution ``probs``.
    """
    index = tokens.long()[..., None]
    greedy = torch.log_softmax(processed.float(), dim=-1).gather(-1, index).squeeze(-1)
    if probs is None or sampling.is_all_greedy:
        return greedy
    sampled = probs.gather(-1, index).squeeze(-1).log()
    is_greedy = _per_row(sampling.temperatures == 0, greedy)
    return torch.where(is_greedy, greedy, sampled)


def top_token_logprobs(
    processed: torch.Tensor,
    probs: torch.Tensor | None,
    sampling: SamplingInfo,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens ``[B, ..., k]`` (int64) of each row's final distribution
    and their log-probabilities (float32), most likely first, ties by token id.

    The distribution is `token_logprobs`': greedy rows ``log_softmax`` of the processed logits,
    sampled rows the log of their filtered ``probs`` (a filtered-out token is ``-inf``).
    """
    dist = torch.log_softmax(processed.float(), dim=-1)
    if probs is not None and not sampling.is_all_greedy:
        is_greedy = _per_row(sampling.temperatures == 0, dist)
        dist = torch.where(is_greedy, dist, probs.log())
    values, ids = dist.sort(dim=-1, descending=True, stable=True)
    return ids[..., :k], values[..., :k]


@attrs.frozen(kw_only=True)
class TokenCounts:
    """The token state a scored position sees: what `apply_logit_controls` needs.

    One state per scored position (``[B, V]`` for one position per row, ``[B, D, V]`` for a
    chain). Built from a worker's token history (`from_history`), then extended by drafts.

    Attributes:
        seen: ``[B, ..., V]`` float occurrences in prompt + output before the position.
        output: ``[B, ..., V]`` float occurrences in the output before the position.
        num_outputs: ``[B, ...]`` int64 outputs before the position.
    """

    seen: torch.Tensor
    output: torch.Tensor
    num_outputs: torch.Tensor

    @classmethod
    def from_history(
        cls,
        rows: torch.Tensor,
        last: torch.Tensor,
        prompt_lens: torch.Tensor | None,
        vocab_size: int,
    ) -> TokenCounts:
        """The state that scores position ``last + 1`` of each row.

        Args:
            rows: ``[B, W]`` token history: position ``p`` of row ``b`` at ``rows[b, p]``
                (positions past ``last`` are ignored).
            last: ``[B]`` the last known position of each row.
            prompt_lens: ``[B]`` where each row's outputs begin; None: at 0.
            vocab_size: V.
        """
        positions = torch.arange(rows.shape[1], device=rows.device)[None, :]
        last = last.long()[:, None]
        known = positions <= last
        prompt = (
            torch.zeros_like(last) if prompt_lens is None else prompt_lens.long()[:, None]
        ).to(rows.device)
        is_output = known & (positions >= prompt)
        zeros = torch.zeros(rows.shape[0], vocab_size, dtype=torch.float32, device=rows.device)
        index = rows.long().clamp(0, vocab_size - 1)
        return cls(
            seen=zeros.scatter_add(1, index, known.float()),
            output=zeros.scatter_add(1, index, is_output.float()),
            num_outputs=(last + 1 - prompt).squeeze(1),
        )

    def advance(self, tokens: torch.Tensor) -> TokenCounts:
        """The state one position later, ``tokens`` ``[B]`` (outputs) appended."""
        one = F.one_hot(tokens.long(), self.seen.shape[-1]).to(self.seen.dtype)
        return TokenCounts(
            seen=self.seen + one, output=self.output + one, num_outputs=self.num_outputs + 1
        )

    def chain(self, drafts: torch.Tensor) -> TokenCounts:
        """``[B, K+1, V]`` states of a chain: position ``j`` sees drafts ``d1 .. dj`` too."""
        one = F.one_hot(drafts.long(), self.seen.shape[-1]).to(self.seen.dtype)
        none = torch.zeros_like(self.seen)[:, None]
        cumulative = torch.cat([none, one.cumsum(1)], dim=1)
        steps = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None, :]
        return TokenCounts(
            seen=self.seen[:, None] + cumulative,
            output=self.output[:, None] + cumulative,
            num_outputs=self.num_outputs[:, None] + steps,
        )

    def apply(self, logits: torch.Tensor, sampling: SamplingInfo) -> torch.Tensor:
        """``logits`` after the penalties and the ``min_new_tokens`` mask (a new tensor)."""
        return apply_logit_controls(
            logits,
            sampling,
            seen=self.seen,
            output_counts=self.output,
            num_outputs=self.num_outputs,
        )


@attrs.define
class _Drafting:
    """A drafter's round in progress: where its next token sits and the counts it sees."""

    start: torch.Tensor
    counts: TokenCounts | None
    grammar: GrammarRows | None = None
    step: int = 0


@attrs.frozen(kw_only=True)
class TokenChoice:
    """Tokens chosen from a batch of logits.

    Attributes:
        tokens: ``[B]`` int64: the argmax for greedy rows, a sample for the others.
        probs: ``[B, V]`` the filtered distributions the sampled rows drew from (greedy rows
            carry their temperature-1 distribution, never read); None when every row is greedy.
        logits: ``[B, V]`` the processed logits the tokens were chosen from (the raw ones when
            no row has a logit control).
        invalid: ``[B]`` bool, rows whose processed logits left nothing to choose from
            (`contain_logits`); their token is meaningless. None: not computed.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None
    logits: torch.Tensor | None = None
    invalid: torch.Tensor | None = None


class TokenSampler:
    """Owner of one worker's generator (see the module docstring).

    Args:
        seed: seeds the generator; None draws a fresh, non-reproducible seed at `bind`.
    """

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._generator: torch.Generator | None = None
        self._drafting: _Drafting | None = None

    @property
    def seed(self) -> int | None:
        """The seed this sampler was configured with."""
        return self._seed

    def bind(self, device: torch.device, parallel: ParallelGroup | None = None) -> None:
        """Creates the generator on ``device`` (the worker's), seeded; called at attach.

        With ``parallel`` every rank seeds with rank 0's seed (its configured one, or the fresh
        one it drew), so the ranks' generators draw the same numbers in lock step.
        """
        self._generator = self._seeded(device)
        if parallel is not None:
            seed = torch.tensor([self._generator.initial_seed() & (2**63 - 1)], dtype=torch.int64)
            agreed = parallel.broadcast(seed.to(device))
            self._generator.manual_seed(int(agreed.item()))

    @property
    def generator(self) -> torch.Generator:
        """The generator; a sampler never bound (used directly, in tests) binds to the CPU."""
        if self._generator is None:
            self._generator = self._seeded(torch.device("cpu"))
        return self._generator

    def _seeded(self, device: torch.device) -> torch.Generator:
        generator = torch.Generator(device=device)
        if self._seed is None:
            generator.seed()
        else:
            generator.manual_seed(self._seed)
        return generator

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per distribution of ``probs`` ``[..., V]`` (rows sum to 1): ``[...]``."""
        flat = probs.reshape(-1, probs.shape[-1])
        drawn = torch.multinomial(flat, 1, generator=self.generator)
        return drawn.view(probs.shape[:-1])

    def uniform(self, shape: tuple[int, ...], device: torch.device) -> torch.Tensor:
        """Independent uniforms in ``[0, 1)`` of ``shape`` (float32)."""
        return torch.rand(shape, generator=self.generator, device=device)

    @contextmanager
    def drafting(
        self,
        start: torch.Tensor,
        sampling: SamplingInfo,
        counts: TokenCounts | None,
        grammar: GrammarRows | None = None,
    ) -> Iterator[None]:
        """Inside it, `choose` call ``k`` (0-based) drafts position ``start + k + 1``.

        Seeded rows draw with that position's uniform; ``counts`` (the state at ``start``) are
        applied to the drafter's logits and advanced by each drafted token; ``grammar`` masks
        each draft step (`GrammarRows.draft_masks`) and is given each draft
        (`GrammarRows.push_drafts`), so drafts are grammatical. Without seeds, counts and a
        grammar nothing changes (greedy drafting stays bit-identical).
        """
        if sampling.seeds is None and counts is None and grammar is None:
            yield
            return
        self._drafting = _Drafting(start=start, counts=counts, grammar=grammar)
        try:
            yield
        finally:
            self._drafting = None

    def choose(
        self,
        logits: torch.Tensor,
        sampling: SamplingInfo,
        *,
        positions: torch.Tensor | None = None,
        counts: TokenCounts | None = None,
        mask: RowMasks | None = None,
    ) -> TokenChoice:
        """The next token of every row of ``logits`` ``[B, V]`` under ``sampling``.

        Args:
            logits: raw logits of the scored position of each row.
            sampling: the batch's sampling state.
            positions: ``[B]`` the position each token will occupy (seeded rows draw from it);
                None inside `drafting` takes the drafted position.
            counts: the state the position sees (`TokenCounts`), for the logit controls; None
                inside `drafting` takes the drafting state.
            mask: grammar bitmasks of the scored position (applied after the controls); inside
                `drafting` the grammar's draft masks.
        """
        drafting = self._drafting
        if drafting is not None and positions is None and counts is None:
            positions = drafting.start + drafting.step + 1
            counts = drafting.counts
            if drafting.grammar is not None:
                mask = drafting.grammar.draft_masks()
        processed = logits if counts is None else counts.apply(logits, sampling)
        # Contain what the controls did first; a grammar's dead end (every token masked) is the
        # grammar's to report (`GrammarError` at settlement), not an invalid row.
        processed, invalid = contain_logits(processed)
        if mask is not None:
            processed = mask.apply(processed)
        greedy = processed.argmax(-1)
        if sampling.is_all_greedy:
            tokens, probs = greedy, None
        else:
            probs = filtered_probs(processed, sampling)
            sampled = self.sample(probs)
            if sampling.seeds is not None and positions is not None:
                uniforms = seeded_uniforms(sampling.seeds, positions.long())
                seeded = sample_with_uniforms(probs, uniforms)
                sampled = torch.where(sampling.seeds.to(logits.device) >= 0, seeded, sampled)
            is_greedy = sampling.temperatures.to(logits.device) == 0
            tokens = torch.where(is_greedy, greedy, sampled)
        if drafting is not None:
            drafting.step += 1
            if drafting.counts is not None:
                drafting.counts = drafting.counts.advance(tokens)
            if drafting.grammar is not None:
                drafting.grammar.push_drafts(tokens)
        return TokenChoice(tokens=tokens, probs=probs, logits=processed, invalid=invalid)
