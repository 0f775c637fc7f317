"""The tensor-parallel Llama: two gloo ranks on a CPU compute the whole model's outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest
import torch
from hf_oracle import make_checkpoint

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import load_paged_llama, save_paged_llama
from specstate.reference.model import ModelConfig, PagedLlama, shard_config
from specstate.reference.tensor_parallel import shard_state

# A sharded matmul sums in another order: about 4e-6 apart in float32 on these sizes.
ATOL = 1e-4


@pytest.fixture(scope="module")
def ranks(tp_healthy: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Both ranks' forwards of every extend shape on the whole and the sharded model."""
    return [rank["sharded"] for rank in tp_healthy]


def test_the_shards_compute_the_whole_model(ranks: list[dict[str, Any]]) -> None:
    """Prefill, chunk, decode, verify and tree forwards: logits and features within float noise."""
    for outcome in ranks:
        assert outcome["logit_diff"] < ATOL
        assert outcome["hidden_diff"] < ATOL
        assert outcome["copy_diff"] == 0.0  # an in-memory source shards the same way


def test_every_rank_holds_the_same_bits(ranks: list[dict[str, Any]]) -> None:
    """The ordered all-reduce makes every rank's logits and features identical, not just close."""
    first, second = (rank["outputs"] for rank in ranks)
    assert len(first) == len(second) == 10
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_a_rank_holds_its_share_of_the_heads(ranks: list[dict[str, Any]]) -> None:
    """Half the query rows and half the KV heads per rank (4 heads, 2 KV heads, head_dim 8)."""
    for outcome in ranks:
        assert outcome["q_rows"] == 2 * 8
        assert outcome["kv_heads"] == 1
        assert "tensor-parallel shard" in outcome["refusals"][0]


def test_shard_config_refuses_an_uneven_split() -> None:
    """Heads, KV heads and the MLP must divide by the group size; the message names the field."""
    config = ModelConfig(
        vocab_size=11,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
    )
    assert shard_config(config, 2).num_key_value_heads == 1
    assert shard_config(config, 1) is config
    with pytest.raises(InvalidConfig, match=r"num_key_value_heads \(2\) is not divisible by .* 4"):
        shard_config(config, 4)
    with pytest.raises(InvalidConfig, match=r"intermediate_size \(31\)"):
        shard_config(attrs.evolve(config, intermediate_size=31), 2)


def test_shard_state_slices_columns_and_rows(tmp_path: Path) -> None:
    """Column-parallel weights keep output rows, row-parallel ones input columns, others whole."""
    make_checkpoint(tmp_path, layers=1)
    model = load_paged_llama(tmp_path, num_token_slots=4)
    state = model.state_dict()
    second = shard_state(state, model.config, rank=1, world_size=2)
    assert torch.equal(
        second["layers.0.self_attn.q_proj.weight"], state["layers.0.self_attn.q_proj.weight"][16:]
    )
    assert torch.equal(
        second["layers.0.self_attn.k_proj.weight"], state["layers.0.self_attn.k_proj.weight"][8:]
    )
    assert torch.equal(
        second["layers.0.self_attn.o_proj.weight"],
        state["layers.0.self_attn.o_proj.weight"][:, 16:],
    )
    assert torch.equal(
        second["layers.0.mlp.down_proj.weight"], state["layers.0.mlp.down_proj.weight"][:, 32:]
    )
    assert second["embed_tokens.weight"] is state["embed_tokens.weight"]
    with pytest.raises(InvalidConfig, match=r"rank 2 is outside \[0, 2\)"):
        shard_state(state, model.config, rank=2, world_size=2)  # fmt: skip


def test_a_shard_is_not_saved(tmp_path: Path) -> None:
    """Saving one rank's shard as a checkpoint is refused (it is not the model)."""

    class _Two:
        rank, world_size = 0, 2

        def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor

        def broadcast(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor

    make_checkpoint(tmp_path / "ckpt", layers=1)
    config = load_paged_llama(tmp_path / "ckpt", num_token_slots=4).config
    shard = PagedLlama(config, num_token_slots=4, parallel=_Two())
    with pytest.raises(InvalidConfig, match="tensor-parallel shard"):
        save_paged_llama(shard, tmp_path / "out")
