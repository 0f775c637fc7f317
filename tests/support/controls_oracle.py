"""Test-only: the sampling controls as Hugging Face ``generate()`` runs them, and by definition.

* `hf_greedy` — transformers' greedy continuation with its own ``repetition_penalty`` and
  ``min_new_tokens`` processors, the OpenAI frequency / presence penalties as a custom
  `LogitsProcessor` (transformers has none), EOS stopping, and the log-probability of every
  emitted token from ``output_scores`` (the processed scores);
* `exact_controlled` — the target's next-token distribution with the controls applied by
  definition in float64 (a Python loop over the tokens, independent of the workers' code),
  then the sampling filter of `sampling_oracle.reference_filter`;
* `cut_at_stop_sequences` — a continuation cut after the first complete stop sequence.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import attrs
import torch
from hf_oracle import greedy_scored
from sampling_oracle import last_logits, reference_filter
from transformers import LlamaForCausalLM, LogitsProcessor, LogitsProcessorList


@attrs.frozen(kw_only=True)
class Controls:
    """The logit controls of one request (the `SamplingParams` fields of the same names)."""

    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0


class OpenAIPenalties(LogitsProcessor):
    """``logit[t] -= frequency * count(t) + presence * (count(t) > 0)`` over generated tokens.

    Subtracts in the engine's order (the frequency term, then the presence term) so that the
    float32 rounding is the same.
    """

    def __init__(self, prompt_len: int, frequency: float, presence: float) -> None:
        self._prompt_len = prompt_len
        self._frequency = frequency
        self._presence = presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        out = scores.clone()
        for row in range(input_ids.shape[0]):
            for token, count in Counter(input_ids[row, self._prompt_len :].tolist()).items():
                out[row, token] = out[row, token] - self._frequency * float(count)
                out[row, token] = out[row, token] - self._presence
        return out  # type: ignore[return-value]


def hf_greedy(
    model: LlamaForCausalLM,
    prompt: Sequence[int],
    max_new_tokens: int,
    *,
    controls: Controls = Controls(),
    eos: Sequence[int] = (),
) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens under ``controls`` and their log-probabilities.

    ``eos`` are the ids that stop generation (and that ``min_new_tokens`` masks).
    """
    processors = LogitsProcessorList()
    if controls.frequency_penalty or controls.presence_penalty:
        processors.append(
            OpenAIPenalties(len(prompt), controls.frequency_penalty, controls.presence_penalty)
        )
    return greedy_scored(
        model,
        prompt,
        max_new_tokens,
        eos_token_id=list(eos) or None,
        repetition_penalty=controls.repetition_penalty,
        min_new_tokens=controls.min_new_tokens or None,
        logits_processor=processors,
    )


def controlled_logits(
    logits: torch.Tensor,
    prompt: Sequence[int],
    generated: Sequence[int],
    controls: Controls,
    stop_ids: Sequence[int],
) -> torch.Tensor:
    """One row of raw ``logits`` ``[V]`` after the controls, by definition (float64)."""
    out = logits.double().clone()
    for token in set(prompt) | set(generated):
        value = float(out[token])
        penalty = controls.repetition_penalty
        out[token] = value * penalty if value < 0 else value / penalty
    for token, count in Counter(generated).items():
        out[token] -= controls.frequency_penalty * count + controls.presence_penalty
    if len(generated) < controls.min_new_tokens:
        for token in stop_ids:
            out[token] = -math.inf
    return out


def exact_controlled(
    hf: LlamaForCausalLM,
    prompt: Sequence[int],
    prefixes: Sequence[Sequence[int]],
    *,
    controls: Controls,
    stop_ids: Sequence[int] = (),
    temperature: float,
    top_k: int,
    top_p: float,
) -> dict[tuple[int, ...], list[float]]:
    """The filtered next-token distribution after ``prompt`` + each prefix, controls applied.

    Keys are the generated prefixes (all of one length).
    """
    logits = last_logits(hf, prompt, prefixes)
    return {
        tuple(prefix): reference_filter(
            controlled_logits(row, prompt, prefix, controls, stop_ids), temperature, top_k, top_p
        )
        for prefix, row in zip(prefixes, logits, strict=True)
    }


def cut_at_stop_sequences(
    tokens: Sequence[int], sequences: Sequence[Sequence[int]], *, min_new_tokens: int = 0
) -> tuple[list[int], int]:
    """``tokens`` up to and including the first complete stop sequence, and its index (-1).

    A sequence counts only when its last token is output ``min_new_tokens`` (0-based) or later.
    """
    for end in range(len(tokens)):
        if end < min_new_tokens:
            continue
        for index, seq in enumerate(sequences):
            n = len(seq)
            if n <= end + 1 and tuple(tokens[end + 1 - n : end + 1]) == tuple(seq):
                return list(tokens[: end + 1]), index
    return list(tokens), -1


def run_bounds(accept_lengths: Sequence[int]) -> list[int]:
    """The output index each settled round ends at (exclusive): prefill's token, then runs."""
    bounds = [1]
    for a in accept_lengths:
        bounds.append(bounds[-1] + a)
    return bounds


def round_of(index: int, bounds: Sequence[int]) -> int:
    """The round (0 = the prefill) that settled output ``index``."""
    return next(r for r, end in enumerate(bounds) if index < end)
