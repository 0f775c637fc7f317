"""Test-only: tiny random Hugging Face Llama checkpoints and greedy generate() as the oracle."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import GenerationMixin, LlamaConfig, LlamaForCausalLM


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """One torch intra-op thread inside the block (a module fixture builds before the per-test
    `one_torch_thread` fixture applies; tiny models on shared cores spin-wait with more)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def make_checkpoint(
    directory: Path, *, seed: int = 0, vocab_size: int = 97, hidden: int = 32, layers: int = 2
) -> LlamaForCausalLM:
    """Save a random tiny Llama to ``directory`` (safetensors) and return it."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        initializer_range=0.2,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    model = LlamaForCausalLM(config)
    model.train(False)
    model.save_pretrained(directory)
    return model


def greedy_scores(
    model: GenerationMixin, prompt: Sequence[int], max_new_tokens: int, **generate: Any
) -> tuple[list[int], tuple[torch.Tensor, ...]]:
    """transformers' greedy tokens of ``prompt`` and the processed scores of every step, with
    more ``generate()`` options (stop ids, penalties, logits processors), for any causal LM (a
    Llama, a NemotronH hybrid)."""
    ids = torch.tensor([list(prompt)])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
            **generate,
        )
    return [int(t) for t in out.sequences[0, len(prompt) :]], tuple(out.scores)


def greedy(model: GenerationMixin, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation of ``prompt`` (the lossless oracle)."""
    return greedy_scores(model, prompt, max_new_tokens)[0]


def greedy_scored(
    model: GenerationMixin, prompt: Sequence[int], max_new_tokens: int, **generate: Any
) -> tuple[list[int], list[float]]:
    """`greedy_scores`' tokens and the log-probability of every token under the processed
    scores."""
    tokens, scores = greedy_scores(model, prompt, max_new_tokens, **generate)
    logprobs = [
        float(torch.log_softmax(score[0].float(), dim=-1)[token])
        for score, token in zip(scores, tokens, strict=True)
    ]
    return tokens, logprobs
