"""Test-only: the exact sampling distribution of a tiny HF Llama, and chi-square goodness of fit.

The filter here is written independently of `specstate.reference.workers.filtered_probs`
(a per-row loop in float64), so a statistical test compares the workers with the definition,
not with their own code::

    softmax(logits / T) ─▶ keep ranks < top_k while the mass before the token is < top_p
    (the first token always) ─▶ renormalize

`chi_square` merges cells whose expected count is below 5 and returns the upper tail of the
chi-square distribution (``torch.special.gammaincc``: no scipy needed).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import torch
from transformers import LlamaForCausalLM

MIN_EXPECTED = 5.0


def reference_filter(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> list[float]:
    """The filtered distribution of one row of ``logits`` ``[V]`` (float64, by definition)."""
    probs = torch.softmax(logits.double() / temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: (-probs[t], t))
    kept: list[int] = []
    mass = 0.0
    for rank, token in enumerate(order):
        if rank >= top_k or (rank > 0 and mass >= top_p):
            break
        kept.append(token)
        mass += probs[token]
    out = [0.0] * len(probs)
    for token in kept:
        out[token] = probs[token] / mass
    return out


def exact_next_token(
    hf: LlamaForCausalLM,
    prompt: Sequence[int],
    prefixes: Sequence[Sequence[int]],
    *,
    temperature: float,
    top_k: int,
    top_p: float,
) -> dict[tuple[int, ...], list[float]]:
    """The target's filtered next-token distribution after ``prompt`` + each generated prefix.

    Keys are the generated prefixes (all of one length).
    """
    logits = last_logits(hf, prompt, prefixes)
    return {
        tuple(prefix): reference_filter(row, temperature, top_k, top_p)
        for prefix, row in zip(prefixes, logits, strict=True)
    }


def last_logits(
    hf: LlamaForCausalLM, prompt: Sequence[int], prefixes: Sequence[Sequence[int]]
) -> torch.Tensor:
    """``[len(prefixes), V]``: the target's logits after ``prompt`` + each prefix (one length)."""
    ids = torch.tensor([[*prompt, *prefix] for prefix in prefixes])
    with torch.no_grad():
        logits: torch.Tensor = hf(ids, attention_mask=torch.ones_like(ids)).logits[:, -1]
    return logits


@attrs.frozen
class ChiSquare:
    """A goodness-of-fit result: statistic, degrees of freedom, upper-tail p-value."""

    statistic: float
    dof: int
    p_value: float

    def __add__(self, other: ChiSquare) -> ChiSquare:
        """Pools two independent tests (statistics and degrees of freedom add)."""
        return chi_square_from(self.statistic + other.statistic, self.dof + other.dof)


def chi_square_from(statistic: float, dof: int) -> ChiSquare:
    """The result of ``statistic`` on ``dof`` degrees of freedom."""
    if dof <= 0:
        return ChiSquare(statistic, 0, 1.0)
    tail = torch.special.gammaincc(
        torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(statistic / 2, dtype=torch.float64)
    )
    return ChiSquare(statistic, dof, float(tail))


def chi_square(observed: Counter[int], probs: Sequence[float]) -> ChiSquare:
    """Goodness of fit of ``observed`` token counts to ``probs``, small cells merged.

    A token observed where ``probs`` is 0 is an impossible outcome: p-value 0.
    """
    total = sum(observed.values())
    if any(probs[t] == 0.0 for t in observed if observed[t] > 0):
        return ChiSquare(float("inf"), 1, 0.0)
    cells = sorted(
        ((total * p, observed.get(t, 0)) for t, p in enumerate(probs) if p > 0),
        reverse=True,
    )
    merged: list[tuple[float, int]] = []
    for expected, count in cells:
        if merged and (expected < MIN_EXPECTED or merged[-1][0] < MIN_EXPECTED):
            last_e, last_c = merged.pop()
            merged.append((last_e + expected, last_c + count))
        else:
            merged.append((expected, count))
    if len(merged) > 1 and merged[-1][0] < MIN_EXPECTED:  # the tail is still small
        tail_e, tail_c = merged.pop()
        last_e, last_c = merged.pop()
        merged.append((last_e + tail_e, last_c + tail_c))
    statistic = sum((c - e) ** 2 / e for e, c in merged)
    return chi_square_from(statistic, len(merged) - 1)


def conditional_chi_square(
    samples: Sequence[Sequence[int]],
    position: int,
    exact: dict[tuple[int, ...], list[float]],
    *,
    min_count: int = 20,
) -> ChiSquare:
    """Pooled test of token ``position`` given the tokens before it, over frequent contexts.

    Contexts seen fewer than ``min_count`` times are skipped (a choice made on the condition
    only, so the pooled statistic stays chi-square under the null).
    """
    by_context: dict[tuple[int, ...], Counter[int]] = {}
    for sample in samples:
        by_context.setdefault(tuple(sample[:position]), Counter())[sample[position]] += 1
    pooled = ChiSquare(0.0, 0, 1.0)
    for context, counts in by_context.items():
        if sum(counts.values()) >= min_count:
            pooled = pooled + chi_square(counts, exact[context])
    return pooled
