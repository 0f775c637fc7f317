"""Ernie 4.5 MoE targets: the paged model equals transformers', and the checkpoint round-trips."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from mtp_oracle import make_mtp_target
from transformers import Ernie4_5_MoeForCausalLM

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import load_paged_llama, read_model_config, save_paged_llama
from specstate.reference.model import AttentionBatch, PagedLlama
from specstate.reference.moe import MoeBlock, MoeConfig

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38]


def logits_of(model: PagedLlama, ids: list[int], split: int) -> torch.Tensor:
    """The paged model's logits of ``ids``, prefilled in two chunks at ``split``."""
    table = torch.zeros(2, 64, dtype=torch.int64)
    table[1, : len(ids)] = torch.randperm(60)[: len(ids)] + 2  # scattered slots
    out = []
    for lo, hi in ((0, split), (split, len(ids))):
        if lo == hi:
            continue
        batch = AttentionBatch(
            input_ids=torch.tensor(ids[lo:hi]),
            positions=torch.arange(lo, hi),
            out_cache_loc=table[1, lo:hi],
            req_pool_indices=torch.tensor([1]),
            req_to_token=table,
            prefix_lens=torch.tensor([lo]),
            extend_lens=torch.tensor([hi - lo]),
        )
        out.append(model(batch).logits)
    return torch.cat(out)


@pytest.fixture(scope="module")
def ernie(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Ernie4_5_MoeForCausalLM]:
    """A two-layer Ernie MoE target (layer 0 sparse; router bias set) with one MTP layer."""
    root = tmp_path_factory.mktemp("ernie")
    return root, make_mtp_target(root, num_mtp_layers=1, layers=2)


def test_paged_ernie_matches_transformers(ernie: tuple[Path, Ernie4_5_MoeForCausalLM]) -> None:
    """Interleaved RoPE, sparse layers and tied embeddings: logits equal HF's, chunked or not."""
    root, hf = ernie
    model = load_paged_llama(root, num_token_slots=64)
    assert model.config.moe is not None and model.config.rope_interleaved
    assert isinstance(model.layers[0].mlp, MoeBlock)
    with torch.no_grad():
        want = hf(torch.tensor([PROMPT])).logits[0]
    for split in (len(PROMPT), 4):
        assert torch.allclose(logits_of(model, PROMPT, split), want, atol=1e-4)


def test_router_bias_steers_the_choice(ernie: tuple[Path, Ernie4_5_MoeForCausalLM]) -> None:
    """The correction bias picks the experts (changing it changes the output), not the weights."""
    root, _ = ernie
    model = load_paged_llama(root, num_token_slots=64)
    block = model.layers[0].mlp
    assert isinstance(block, MoeBlock)
    x = torch.randn(5, model.config.hidden_size)
    before = block(x)
    with torch.no_grad():
        block.moe_statics.e_score_correction_bias.fill_(0.0)
        block.moe_statics.e_score_correction_bias[0, 0] = 10.0  # expert 0 always chosen
    chosen, weights = block.route(x)
    assert bool((chosen == 0).any(dim=1).all())
    assert torch.allclose(weights.sum(-1), torch.ones(5))
    assert not torch.allclose(block(x), before)


def test_saved_ernie_checkpoint_loads_in_transformers(
    ernie: tuple[Path, Ernie4_5_MoeForCausalLM], tmp_path: Path
) -> None:
    """`save_paged_llama` of an Ernie model writes what transformers loads to the same logits."""
    root, hf = ernie
    save_paged_llama(load_paged_llama(root, num_token_slots=4), tmp_path)
    again = Ernie4_5_MoeForCausalLM.from_pretrained(tmp_path)
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        assert torch.allclose(again(ids).logits, hf(ids).logits, atol=1e-5)
    assert read_model_config(tmp_path) == read_model_config(root)


def test_biased_ernie_config_is_refused(
    ernie: tuple[Path, Ernie4_5_MoeForCausalLM], tmp_path: Path
) -> None:
    """``use_bias: true`` would compute wrong silently: refused, naming the file and field."""
    root, _ = ernie
    raw = json.loads((root / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**raw, "use_bias": True}))
    with pytest.raises(InvalidConfig, match=r"config\.json: field 'use_bias' is True"):
        read_model_config(tmp_path)


def test_moe_config_bounds_are_checked() -> None:
    """top_k outside [1, num_experts] is refused with the numbers."""
    with pytest.raises(InvalidConfig, match=r"top_k \(5\) must lie in \[1, num_experts 4\]"):
        MoeConfig(num_experts=4, top_k=5, intermediate_size=8, last_layer=0)
    moe = MoeConfig(num_experts=4, top_k=2, intermediate_size=8, first_layer=1, last_layer=3)
    assert [moe.is_sparse(i) for i in range(5)] == [False, True, True, True, False]
