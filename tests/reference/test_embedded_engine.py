"""The engine on the embedded model: every drafter is lossless against HF generate."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.reference import default_registry, embedded

PROMPTS = ["def add(a, b):\n    return ", "import os\n\n\nclass Config:\n    def "]
NEW = 24


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    """transformers' greedy continuation on the embedded target (float32)."""
    hf = LlamaForCausalLM.from_pretrained(embedded.target_dir(), dtype=torch.float32)
    hf.train(False)
    out = []
    for text in PROMPTS:
        ids = torch.tensor([[embedded.BOS_ID, *embedded.encode(text)]])
        with torch.no_grad():
            full = hf.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=NEW
            )
        out.append(full[0, ids.shape[1] :].tolist())
    return out


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["none", "draft_model", "eagle", "ngram"])
def test_embedded_model_is_lossless(expected: list[list[int]], algorithm: str) -> None:
    """Greedy speculative decoding with overlap emits exactly HF's tokens on the shipped model."""
    options: dict[str, object] = {"target": embedded.target_dir(), "dtype": torch.float32}
    if algorithm != "none":
        options["num_steps"] = 4
    if algorithm == "draft_model":
        options["draft"] = embedded.draft_dir()
    if algorithm == "eagle":
        options["eagle"] = embedded.eagle_dir()
    worker = default_registry().create(algorithm, **options)
    limits = RequestLimits(
        vocab_size=embedded.VOCAB_SIZE, max_context_len=1024, eos_token_ids={embedded.EOS_ID}
    )
    config = EngineConfig(
        overlap=True, page_size=16, kv_tokens=4096, check_invariants=True, check_ownership=True
    )
    prompts = [[embedded.BOS_ID, *embedded.encode(t)] for t in PROMPTS]
    with Engine(worker, limits=limits, config=config) as engine:
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=NEW))
        accept = engine.snapshot().metrics.mean_accept_length
    assert [list(o) for o in outs] == expected
    print(f"{algorithm}: mean accept length {accept:.2f}")
