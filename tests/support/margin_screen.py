"""Test-only: greedy prompts whose top-2 logit margin is wide at every step (for TP oracles).

A sharded matmul sums in another order than the whole one (about 4e-6 apart in float32), so a
tensor-parallel greedy token equals a single device's only where the top two logits are further
apart than that. `screen` runs Hugging Face ``generate()`` with the scores recorded and keeps
the prompts whose smallest top-2 margin exceeds ``margin``.
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from hf_oracle import greedy_scores
from transformers import LlamaForCausalLM

MARGIN = 1e-3


def greedy_with_margin(
    hf: LlamaForCausalLM, prompt: tuple[int, ...], max_new_tokens: int
) -> tuple[list[int], float]:
    """HF's greedy tokens of ``prompt`` and the smallest top-2 logit margin on the way."""
    tokens, scores = greedy_scores(hf, prompt, max_new_tokens)
    return tokens, min(float(s[0].topk(2).values.diff().abs()) for s in scores)


def screen(
    hf: LlamaForCausalLM,
    lengths: Iterable[int],
    *,
    vocab_size: int,
    max_new_tokens: int,
    keep: int,
    seed: int = 26,
    margin: float = MARGIN,
) -> dict[tuple[int, ...], list[int]]:
    """``keep`` random prompts (of the given lengths, in turn) that pass the margin screen."""
    gen = random.Random(seed)
    kept: dict[tuple[int, ...], list[int]] = {}
    for length in lengths:
        prompt = tuple(gen.randrange(vocab_size) for _ in range(length))
        tokens, smallest = greedy_with_margin(hf, prompt, max_new_tokens)
        if smallest > margin:
            kept[prompt] = tokens
        if len(kept) == keep:
            return kept
    raise AssertionError(f"only {len(kept)} of {keep} prompts pass the margin screen")
