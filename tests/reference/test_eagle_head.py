"""EagleHead: save/load round trip, paged forward against a dense torch reference, file errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specstate.core.errors import InvalidConfig
from specstate.reference.eagle_head import (
    EagleHead,
    EagleHeadConfig,
    load_eagle_head,
    save_eagle_head,
)
from specstate.reference.model import AttentionBatch, ModelConfig, PagedLlama

NUM_SLOTS = 256
TARGET = ModelConfig(
    vocab_size=80,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=12,
    rms_norm_eps=1e-5,
    rope_theta=5000.0,
)


def make_target(tie: bool = False) -> PagedLlama:
    """A seeded random target (tied or not)."""
    torch.manual_seed(0)
    return PagedLlama(attrs.evolve(TARGET, tie_word_embeddings=tie), num_token_slots=NUM_SLOTS)


def make_head(target: PagedLlama) -> EagleHead:
    """A seeded random head with perturbed norms."""
    torch.manual_seed(1)
    head = EagleHead(EagleHeadConfig.for_target(target.config, intermediate_size=40), target)
    with torch.no_grad():
        for name, param in head.named_parameters():
            if name.endswith("norm.weight"):
                param.add_(0.3 * torch.randn_like(param))
    return head


def rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Plain RMSNorm."""
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def rope(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``x`` ``[T, heads, dim]`` at positions 0..T-1."""
    dim = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.arange(x.shape[0]).float()[:, None] * inv[None, :]
    emb = torch.cat([angles, angles], -1)[:, None, :]
    rotated = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * emb.cos() + rotated * emb.sin()


def dense_head(
    weights: dict[str, torch.Tensor], target: PagedLlama, tokens: list[int], feats: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The head's math over one whole sequence, written from the spec with plain torch ops."""
    c, w = TARGET, {k.removeprefix("layers.0."): v for k, v in weights.items()}
    eps, heads, kv_heads, dim = c.rms_norm_eps, c.num_attention_heads, c.num_key_value_heads, 12
    n = len(tokens)
    embed = target.embed_tokens.weight
    lm_head = embed if target.lm_head is None else target.lm_head.weight
    x = torch.cat([embed[tokens], feats], -1) @ w["fc.weight"].T
    h = rms(x, w["input_layernorm.weight"], eps)
    q = rope((h @ w["self_attn.q_proj.weight"].T).view(n, heads, dim), c.rope_theta)
    k = rope((h @ w["self_attn.k_proj.weight"].T).view(n, kv_heads, dim), c.rope_theta)
    v = (h @ w["self_attn.v_proj.weight"].T).view(n, kv_heads, dim)
    k, v = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (k, v))
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
    attn = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * dim)
    x = x + attn @ w["self_attn.o_proj.weight"].T
    h = rms(x, w["post_attention_layernorm.weight"], eps)
    gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
    x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    return rms(x, w["norm.weight"], eps) @ lm_head.T, x


def paged_extend(
    head: EagleHead, table: torch.Tensor, row: int, prefix: int, tokens: list[int], f: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One extend of ``tokens`` of request row ``row`` after ``prefix`` tokens."""
    n = len(tokens)
    batch = AttentionBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(prefix, prefix + n),
        out_cache_loc=table[row, prefix : prefix + n],
        req_pool_indices=torch.tensor([row]),
        req_to_token=table,
        prefix_lens=torch.tensor([prefix]),
        extend_lens=torch.tensor([n]),
    )
    out = head(batch, f)
    return out.logits, out.hidden_states


@pytest.mark.parametrize("tie", [False, True], ids=["lm_head", "tied"])
def test_saved_head_loads_and_matches_dense_reference(tmp_path: Path, tie: bool) -> None:
    """Save → load keeps every tensor; a chunked paged extend equals the dense computation."""
    target = make_target(tie)
    save_eagle_head(make_head(target), tmp_path)
    weights = load_file(str(tmp_path / "model.safetensors"))
    head = load_eagle_head(tmp_path, target)
    for name, tensor in head.state_dict().items():
        torch.testing.assert_close(tensor, weights[name], atol=0, rtol=0)
    torch.manual_seed(2)
    tokens = torch.randint(0, TARGET.vocab_size, (11,)).tolist()
    feats = torch.randn(11, TARGET.hidden_size)
    feats[0] = 0.0  # f_(-1) is zero at position 0
    table = torch.zeros(3, 16, dtype=torch.int64)
    table[2] = torch.randperm(NUM_SLOTS - 1)[:16] + 1  # scattered slots
    first = paged_extend(head, table, 2, 0, tokens[:7], feats[:7])
    second = paged_extend(head, table, 2, 7, tokens[7:], feats[7:])
    logits, hidden = dense_head(weights, target, tokens, feats)
    torch.testing.assert_close(torch.cat([first[0], second[0]]), logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(torch.cat([first[1], second[1]]), hidden, atol=1e-4, rtol=1e-4)


def test_config_file_holds_exactly_the_shared_format(tmp_path: Path) -> None:
    """config.json carries the agreed fields; the weights file holds the 11 head tensors only."""
    save_eagle_head(make_head(make_target()), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    assert raw == {
        "model_type": "specstate_eagle",
        "vocab_size": 80,
        "hidden_size": 32,
        "intermediate_size": 40,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 12,
        "rms_norm_eps": 1e-5,
        "rope_theta": 5000.0,
        "max_position_embeddings": 2048,
        "dtype": "float32",
    }
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert "fc.weight" in names and "norm.weight" in names and len(names) == 11
    assert not any("embed" in n or "lm_head" in n for n in names)


def rewrite_tensors(path: Path, change: dict[str, torch.Tensor | None]) -> None:
    """Replaces (None: deletes) tensors of a saved head."""
    tensors = load_file(str(path))
    for name, tensor in change.items():
        if tensor is None:
            del tensors[name]
        else:
            tensors[name] = tensor
    save_file(tensors, str(path))


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"norm.weight": None}, r"model.safetensors: missing tensor 'norm.weight'"),
        ({"embed_tokens.weight": torch.zeros(80, 32)}, r"unexpected tensor 'embed_tokens.weight'"),
        (
            {"fc.weight": torch.zeros(32, 32)},
            r"tensor 'fc.weight' has shape \(32, 32\), expected \(32, 64\)",
        ),
    ],
)
def test_bad_weights_name_file_and_tensor(
    tmp_path: Path, change: dict[str, torch.Tensor | None], match: str
) -> None:
    """A missing, extra or misshapen tensor raises InvalidConfig naming file and tensor."""
    target = make_target()
    save_eagle_head(make_head(target), tmp_path)
    rewrite_tensors(tmp_path / "model.safetensors", change)
    with pytest.raises(InvalidConfig, match=match):
        load_eagle_head(tmp_path, target)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"model_type": "llama"}, r"config.json: field 'model_type' is 'llama'"),
        ({"hidden_size": 48}, r"config.json: EAGLE head hidden_size 48 differs .* 32"),
        ({"vocab_size": 81}, r"config.json: EAGLE head vocab_size 81 differs .* 80"),
        ({"head_dim": "12"}, r"config.json: field 'head_dim' must be an integer"),
        ({"dtype": "int8"}, r"config.json: field 'dtype' is 'int8'"),
    ],
)
def test_bad_config_names_file_and_field(
    tmp_path: Path, change: dict[str, object], match: str
) -> None:
    """A wrong model_type, size, type or dtype raises InvalidConfig naming the file."""
    target = make_target()
    save_eagle_head(make_head(target), tmp_path)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(json.loads(path.read_text()) | change))
    with pytest.raises(InvalidConfig, match=match):
        load_eagle_head(tmp_path, target)


def test_missing_directory_and_bad_features_raise(tmp_path: Path) -> None:
    """No config.json, or features of the wrong shape, raise InvalidConfig."""
    target = make_target()
    with pytest.raises(InvalidConfig, match=r"missing config.json"):
        load_eagle_head(tmp_path / "nowhere", target)
    head = make_head(target)
    table = torch.arange(1, 9)[None, :].repeat(2, 1)
    with pytest.raises(InvalidConfig, match=r"features \(3, 31\) must be \[3, 32\]"):
        paged_extend(head, table, 1, 0, [1, 2, 3], torch.zeros(3, 31))
