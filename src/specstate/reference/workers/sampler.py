"""The random source of one reference worker, and how a row's logits become a distribution.

`TokenSampler` owns the worker's `torch.Generator`; the target and the drafter of a worker draw
from it, in a fixed order, so a run is reproducible for a fixed seed and batch composition.
A row samples when its temperature is above 0; its distribution is the filtered softmax::

    logits ──/ T──▶ softmax ──top-k──▶ keep the k most probable ──top-p──▶ keep the smallest
    most-probable prefix whose mass reaches top_p (the first token always) ──▶ renormalize

A greedy row (``T == 0``) takes the argmax of its raw logits, exactly as before sampling
existed: `TokenSampler.choose` on an all-greedy batch computes no distribution and draws
nothing, so greedy outputs are bit-identical whether or not a worker has a seed.

Invariant: every token a sampled row draws has positive mass in the distribution returned
with it; ties in the filters are broken by token id (a stable sort), so the filtered
distribution is a pure function of the logits and the row's parameters.
"""

from __future__ import annotations

import attrs
import torch

from specstate.batch.sampling import SamplingInfo

__all__ = ["TokenChoice", "TokenSampler", "filtered_probs"]


def _per_row(values: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``values`` ``[B]`` viewed to broadcast against ``like`` ``[B, ..., V]``."""
    return values.to(like.device).view(-1, *([1] * (like.ndim - 1)))


def filtered_probs(logits: torch.Tensor, sampling: SamplingInfo) -> torch.Tensor:
    """The filtered sampling distribution of every row of ``logits`` ``[B, ..., V]`` (float32).

    Row ``b`` uses ``sampling``'s row ``b``; greedy rows are computed at temperature 1 (their
    distribution is never sampled, only carried along in vectorized code).
    """
    temperatures = _per_row(sampling.temperatures.float(), logits)
    temperatures = torch.where(temperatures > 0, temperatures, torch.ones_like(temperatures))
    probs = torch.softmax(logits.float() / temperatures, dim=-1)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device)
    top_k = _per_row(sampling.top_ks.long(), probs)
    mass_before = sorted_probs.cumsum(-1) - sorted_probs
    keep = (ranks < top_k) & (mass_before < _per_row(sampling.top_ps.float(), probs))
    keep[..., 0] = True  # NOTE: top_p of float32 rounding never empties a row
    kept = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
    kept = kept / kept.sum(-1, keepdim=True)
    return torch.zeros_like(probs).scatter(-1, order, kept)


@attrs.frozen(kw_only=True)
class TokenChoice:
    """Tokens chosen from a batch of logits.

    Attributes:
        tokens: ``[B]`` int64: the argmax for greedy rows, a sample for the others.
        probs: ``[B, V]`` the filtered distributions the sampled rows drew from (greedy rows
            carry their temperature-1 distribution, never read); None when every row is greedy.
    """

    tokens: torch.Tensor
    probs: torch.Tensor | None


class TokenSampler:
    """Owner of one worker's generator (see the module docstring).

    Args:
        seed: seeds the generator; None draws a fresh, non-reproducible seed at `bind`.
    """

    def __init__(self, seed: int | None) -> None:
        self._seed = seed
        self._generator: torch.Generator | None = None

    @property
    def seed(self) -> int | None:
        """The seed this sampler was configured with."""
        return self._seed

    def bind(self, device: torch.device) -> None:
        """Creates the generator on ``device`` (the worker's), seeded; called at attach."""
        self._generator = self._seeded(device)

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

    def choose(self, logits: torch.Tensor, sampling: SamplingInfo) -> TokenChoice:
        """The next token of every row of ``logits`` ``[B, V]`` under ``sampling``."""
        greedy = logits.argmax(-1)
        if sampling.is_all_greedy:
            return TokenChoice(tokens=greedy, probs=None)
        probs = filtered_probs(logits, sampling)
        sampled = self.sample(probs)
        is_greedy = sampling.temperatures.to(logits.device) == 0
        return TokenChoice(tokens=torch.where(is_greedy, greedy, sampled), probs=probs)
