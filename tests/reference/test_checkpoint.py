"""Hugging Face checkpoint loading and saving for PagedLlama, and the errors for bad ones."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    INDEX_FILE,
    WEIGHTS_FILE,
    from_hf_config,
    load_paged_llama,
    read_model_config,
    save_paged_llama,
    to_hf_config,
)
from specstate.reference.model import AttentionBatch, ModelConfig, PagedLlama

ATOL = 1e-4
IDS = [3, 17, 42, 5, 99, 0, 64, 8]
Raw = dict[str, object]


def make_hf(path: Path, *, sharded: bool = False, **overrides: Any) -> LlamaForCausalLM:
    """Saves a random tiny HF Llama (GQA, head_dim 24) to ``path``, in 20 KB shards if asked."""
    fields: dict[str, Any] = {
        "vocab_size": 101,
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 24,
        "max_position_embeddings": 64,
        "initializer_range": 0.1,
        "rope_theta": 1000.0,
    }
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**(fields | overrides)))
    hf.train(False)
    if sharded:
        hf.save_pretrained(path, max_shard_size="20KB")
    else:
        hf.save_pretrained(path)
    return hf


def hf_logits(hf: LlamaForCausalLM) -> torch.Tensor:
    """HF's logits for ``IDS`` ``[len(IDS), vocab]``."""
    with torch.no_grad():
        logits: torch.Tensor = hf(torch.tensor([IDS])).logits[0].float()
    return logits


def prefill_logits(model: PagedLlama) -> torch.Tensor:
    """Our logits for ``IDS`` as one prefill through request row 1 at slots 1..n."""
    n = len(IDS)
    table = torch.zeros(2, 16, dtype=torch.int64)
    table[1, :n] = torch.arange(1, n + 1)
    batch = AttentionBatch(
        input_ids=torch.tensor(IDS),
        positions=torch.arange(n),
        out_cache_loc=table[1, :n],
        req_pool_indices=torch.tensor([1]),
        req_to_token=table,
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([n]),
    )
    out = model(batch)
    logits: torch.Tensor = out.logits
    return logits


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b|."""
    return float((a - b).abs().max())


def edit_config(path: Path, change: Callable[[Raw], object]) -> None:
    """Rewrites ``path/config.json`` after applying ``change`` to its object."""
    raw = json.loads((path / "config.json").read_text())
    change(raw)
    (path / "config.json").write_text(json.dumps(raw))


def edit_tensors(path: Path, change: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Rewrites ``path/model.safetensors`` after applying ``change`` to its tensors."""
    tensors = load_file(path / WEIGHTS_FILE)
    change(tensors)
    save_file(tensors, path / WEIGHTS_FILE, metadata={"format": "pt"})


def test_read_model_config_parses_transformers_5_config(tmp_path: Path) -> None:
    """rope_parameters, dtype, an explicit head_dim and token ids are read from a v5 config."""
    make_hf(tmp_path, rope_theta=500000.0, tie_word_embeddings=True)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    config = read_model_config(tmp_path)
    assert config == ModelConfig(
        vocab_size=101,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=24,
        rms_norm_eps=1e-6,
        rope_theta=500000.0,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_ids=(2,),
        dtype=torch.float32,
    )


def test_from_hf_config_reads_transformers_4_dialect() -> None:
    """rope_theta, rope_scaling null, torch_dtype and a missing head_dim parse (4.x configs)."""
    raw: Raw = {
        "model_type": "llama",
        "vocab_size": 10,
        "hidden_size": 16,
        "intermediate_size": 8,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "rope_theta": 250.0,
        "rope_scaling": None,
        "torch_dtype": "bfloat16",
        "eos_token_id": [7, 9],
    }
    config = from_hf_config(raw, "x/config.json")
    assert (config.head_dim, config.num_key_value_heads, config.rope_theta) == (8, 2, 250.0)
    assert (config.dtype, config.eos_token_ids, config.bos_token_id) == (
        torch.bfloat16,
        (7, 9),
        None,
    )
    assert from_hf_config(to_hf_config(config), "y") == config


@pytest.mark.parametrize("layout", ["single", "sharded"])
def test_loaded_model_matches_hf(tmp_path: Path, layout: str) -> None:
    """Single-file and sharded (index + shards) checkpoints load to HF's logits."""
    path = tmp_path / layout
    hf = make_hf(path, sharded=layout == "sharded")
    assert (path / (WEIGHTS_FILE if layout == "single" else INDEX_FILE)).is_file()
    model = load_paged_llama(path, num_token_slots=32)
    assert max_diff(prefill_logits(model), hf_logits(hf)) <= ATOL


def test_dtype_override_casts_weights_and_cache(tmp_path: Path) -> None:
    """dtype= overrides the config dtype for parameters and the KV cache; logits stay float32."""
    hf = make_hf(tmp_path)
    model = load_paged_llama(tmp_path, num_token_slots=32, dtype=torch.bfloat16)
    assert model.config.dtype == torch.bfloat16
    assert model.embed_tokens.weight.dtype == torch.bfloat16
    logits = prefill_logits(model)
    assert logits.dtype == torch.float32
    assert max_diff(logits, hf_logits(hf)) < 0.1  # bfloat16 rounding, not a bookkeeping error


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_saved_checkpoint_loads_in_transformers(tmp_path: Path, tied: bool) -> None:
    """save_paged_llama writes a checkpoint LlamaForCausalLM loads with identical logits."""
    hf = make_hf(tmp_path / "src", tie_word_embeddings=tied)
    model = load_paged_llama(tmp_path / "src", num_token_slots=32)
    save_paged_llama(model, tmp_path / "out")
    assert ("lm_head.weight" in load_file(tmp_path / "out" / WEIGHTS_FILE)) is not tied
    reloaded_hf: LlamaForCausalLM = LlamaForCausalLM.from_pretrained(tmp_path / "out")
    assert max_diff(hf_logits(reloaded_hf), hf_logits(hf)) <= ATOL
    reloaded = load_paged_llama(tmp_path / "out", num_token_slots=32)
    assert reloaded.config == model.config
    assert max_diff(prefill_logits(reloaded), hf_logits(hf)) <= ATOL


def test_rotary_inv_freq_buffers_are_ignored(tmp_path: Path) -> None:
    """Old checkpoints' rotary_emb.inv_freq buffers load (HF ignores them too)."""
    make_hf(tmp_path)
    extra = "model.layers.0.self_attn.rotary_emb.inv_freq"
    edit_tensors(tmp_path, lambda t: t.update({extra: torch.ones(12)}))
    assert load_paged_llama(tmp_path, num_token_slots=8).config.head_dim == 24


def test_missing_config_json_is_named(tmp_path: Path) -> None:
    """A directory without config.json raises InvalidConfig naming the file."""
    with pytest.raises(InvalidConfig, match=r"config\.json: missing config\.json"):
        load_paged_llama(tmp_path, num_token_slots=8)


def _set(key: str, value: object) -> Callable[[Raw], None]:
    """A config edit that sets ``key``."""
    return lambda raw: raw.update({key: value})


def _drop(key: str) -> Callable[[Raw], object]:
    """A config edit that removes ``key``."""
    return lambda raw: raw.pop(key)


def _gpt2(raw: Raw) -> None:
    """Turns the config into a GPT-2 one."""
    raw.update({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]})


BAD_CONFIGS = {
    "gpt2": (_gpt2, r"config\.json: field 'model_type' is 'gpt2'"),
    "missing_vocab": (_drop("vocab_size"), r"config\.json: missing field 'vocab_size'"),
    "float_layers": (_set("num_hidden_layers", 2.5), r"'num_hidden_layers' must be an integer"),
    "kv_heads": (_set("num_key_value_heads", 3), r"config\.json: .*not divisible by num_key_v"),
    "odd_head_dim": (_set("head_dim", 25), r"config\.json: .*head_dim must be even"),
    "llama3_rope": (
        _set("rope_parameters", {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}),
        r"config\.json: field 'rope_parameters' has rope_type 'llama3'",
    ),
    "per_layer_rope": (
        _set("rope_parameters", {"full_attention": {"rope_type": "default"}}),
        r"config\.json: field 'rope_parameters' has unsupported entries \['full_attention'\]",
    ),
    "bias": (_set("attention_bias", True), r"config\.json: field 'attention_bias' is True"),
    "act": (_set("hidden_act", "gelu"), r"config\.json: field 'hidden_act' is 'gelu'"),
    "dtype": (_set("dtype", "int8"), r"config\.json: field 'dtype' is 'int8'"),
}


@pytest.mark.parametrize(("edit", "match"), BAD_CONFIGS.values(), ids=list(BAD_CONFIGS))
def test_bad_config_is_named(tmp_path: Path, edit: Callable[[Raw], object], match: str) -> None:
    """A non-Llama or unsupported config.json raises InvalidConfig naming file and field."""
    make_hf(tmp_path)
    edit_config(tmp_path, edit)
    with pytest.raises(InvalidConfig, match=match):
        load_paged_llama(tmp_path, num_token_slots=8)


BAD_TENSORS = {
    "missing": (
        lambda t: t.pop("model.layers.1.mlp.up_proj.weight"),
        r"model\.safetensors: missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'",
    ),
    "untied_without_lm_head": (
        lambda t: t.pop("lm_head.weight"),
        r"model\.safetensors: missing tensor 'lm_head\.weight'",
    ),
    "shape": (
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(24, 32)}),
        r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' has shape"
        r" \(24, 32\), expected \(48, 32\)",
    ),
    "extra": (
        lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(96)}),
        r"model\.safetensors: unexpected tensor 'model\.layers\.0\.self_attn\.q_proj\.bias'",
    ),
}


@pytest.mark.parametrize(("edit", "match"), BAD_TENSORS.values(), ids=list(BAD_TENSORS))
def test_bad_tensors_are_named(
    tmp_path: Path, edit: Callable[[dict[str, torch.Tensor]], object], match: str
) -> None:
    """A missing, misshapen or unexpected tensor raises InvalidConfig naming file and tensor."""
    make_hf(tmp_path)
    edit_tensors(tmp_path, edit)
    with pytest.raises(InvalidConfig, match=match):
        load_paged_llama(tmp_path, num_token_slots=8)


def test_missing_weights_and_shards_are_named(tmp_path: Path) -> None:
    """No weights file, or an index naming an absent shard, raises InvalidConfig."""
    make_hf(tmp_path / "sharded", sharded=True)
    shards = sorted((tmp_path / "sharded").glob("model-*.safetensors"))
    assert len(shards) > 1
    shards[-1].unlink()
    with pytest.raises(InvalidConfig, match=rf"{INDEX_FILE}: shard {shards[-1].name} is missing"):
        load_paged_llama(tmp_path / "sharded", num_token_slots=8)
    (tmp_path / "sharded" / INDEX_FILE).unlink()
    with pytest.raises(InvalidConfig, match=r"neither model\.safetensors nor model\.safetensors"):
        load_paged_llama(tmp_path / "sharded", num_token_slots=8)
