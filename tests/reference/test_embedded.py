"""The embedded default checkpoints: present, loadable by both loaders, and in the agreed format."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import LlamaForCausalLM

from specstate.reference.checkpoint import load_paged_llama, read_model_config
from specstate.reference.embedded import (
    BOS_ID,
    EOS_ID,
    VOCAB_SIZE,
    decode,
    draft_dir,
    eagle_dir,
    encode,
    target_dir,
)
from specstate.reference.model import AttentionBatch, PagedLlama

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef main():\n    "
EAGLE_CONFIG_KEYS = {
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "dtype",
}


def prompt_ids() -> torch.Tensor:
    """The code prompt as model input, BOS first (as in training)."""
    return torch.tensor([BOS_ID, *encode(PROMPT)])


def prefill_logits(model: PagedLlama, ids: torch.Tensor) -> torch.Tensor:
    """Logits ``[T, vocab]`` of one sequence prefilled into slots ``1..T``."""
    n = ids.numel()
    table = torch.zeros(2, n, dtype=torch.int64)
    table[1] = torch.arange(1, n + 1)
    batch = AttentionBatch(
        input_ids=ids,
        positions=torch.arange(n),
        out_cache_loc=table[1],
        req_pool_indices=torch.tensor([1]),
        req_to_token=table,
        prefix_lens=torch.tensor([0]),
        extend_lens=torch.tensor([n]),
    )
    logits: torch.Tensor = model(batch).logits
    return logits


@pytest.mark.parametrize(
    "locate", [target_dir, draft_dir, eagle_dir], ids=["target", "draft", "eagle"]
)
def test_checkpoint_dirs_hold_config_and_weights(locate: Callable[[], Path]) -> None:
    """Each shipped directory has config.json and model.safetensors inside the package."""
    directory = locate()
    assert (directory / "config.json").is_file()
    assert (directory / "model.safetensors").is_file()
    assert directory.parent.name == "embedded"


@pytest.mark.parametrize("locate", [target_dir, draft_dir], ids=["target", "draft"])
def test_llamas_use_the_byte_vocabulary(locate: Callable[[], Path]) -> None:
    """Target and draft share the byte vocabulary and its BOS/EOS ids."""
    config = read_model_config(locate())
    assert config.vocab_size == VOCAB_SIZE
    assert config.bos_token_id == BOS_ID
    assert config.eos_token_ids == (EOS_ID,)


def test_draft_is_one_layer_and_loads() -> None:
    """The drafter is a 1-layer Llama that load_paged_llama builds in float32."""
    draft = load_paged_llama(draft_dir(), num_token_slots=64, dtype=torch.float32)
    assert draft.config.num_hidden_layers == 1
    logits = prefill_logits(draft, prompt_ids())
    assert logits.shape == (prompt_ids().numel(), VOCAB_SIZE)
    assert bool(torch.isfinite(logits).all())


def test_target_logits_match_transformers() -> None:
    """transformers and load_paged_llama compute the same target logits on a code prompt."""
    ids = prompt_ids()
    paged = load_paged_llama(target_dir(), num_token_slots=ids.numel() + 1, dtype=torch.float32)
    hf = LlamaForCausalLM.from_pretrained(target_dir(), dtype=torch.float32)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0].float()
    torch.testing.assert_close(prefill_logits(paged, ids), expected, atol=1e-4, rtol=1e-4)


def test_eagle_format_is_exact() -> None:
    """The EAGLE head's config keys and tensor names/shapes are exactly the agreed format."""
    raw = json.loads((eagle_dir() / "config.json").read_text(encoding="utf-8"))
    assert set(raw) == EAGLE_CONFIG_KEYS
    assert raw["model_type"] == "specstate_eagle"
    target = read_model_config(target_dir())
    assert raw["hidden_size"] == target.hidden_size
    assert raw["vocab_size"] == target.vocab_size
    hidden, inter = raw["hidden_size"], raw["intermediate_size"]
    q_rows = raw["num_attention_heads"] * raw["head_dim"]
    kv_rows = raw["num_key_value_heads"] * raw["head_dim"]
    expected = {
        "fc.weight": (hidden, 2 * hidden),
        "layers.0.input_layernorm.weight": (hidden,),
        "layers.0.self_attn.q_proj.weight": (q_rows, hidden),
        "layers.0.self_attn.k_proj.weight": (kv_rows, hidden),
        "layers.0.self_attn.v_proj.weight": (kv_rows, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, q_rows),
        "layers.0.post_attention_layernorm.weight": (hidden,),
        "layers.0.mlp.gate_proj.weight": (inter, hidden),
        "layers.0.mlp.up_proj.weight": (inter, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,),
    }
    with safe_open(str(eagle_dir() / "model.safetensors"), framework="pt") as handle:
        shapes = {name: tuple(handle.get_slice(name).get_shape()) for name in handle.keys()}  # noqa: SIM118
        dtypes = {str(handle.get_tensor(name).dtype) for name in shapes}
    assert shapes == expected
    assert dtypes == {f"torch.{raw['dtype']}"}


def test_encode_decode_round_trip() -> None:
    """Text survives encode/decode; special ids are dropped and invalid bytes replaced."""
    text = "x = 'héllo' # ✓\n"
    ids = encode(text)
    assert all(0 <= i < 256 for i in ids)
    assert decode(ids) == text
    assert decode([BOS_ID, *ids, EOS_ID]) == text
    assert decode([0xFF, ord("a")]) == "\ufffda"


def test_target_continues_code_with_printable_text() -> None:
    """The target's greedy continuation of a code prompt is mostly printable ASCII (sanity)."""
    ids = prompt_ids()
    target = load_paged_llama(target_dir(), num_token_slots=ids.numel() + 33, dtype=torch.float32)
    for _ in range(32):
        next_id = int(prefill_logits(target, ids)[-1].argmax())
        ids = torch.cat([ids, torch.tensor([next_id])])
    continuation = ids[-32:].tolist()
    printable = sum(1 for i in continuation if 32 <= i < 127 or i in (9, 10))
    assert printable >= 28, decode(continuation)
