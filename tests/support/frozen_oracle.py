"""Test-only: Frozen-KV MTP assistants derived from a tiny Llama, and an unpaged recomputation.

The reference model cannot serve a Gemma 4 target (sliding and global layers, per-layer
embeddings, shared KV), so transformers' ``Gemma4AssistantForCausalLM`` cannot be the oracle;
`dense_frozen_drafts` is: a round's drafts recomputed from scratch with plain torch ops over the
target's committed KV as transformers' own Llama computes it (its cache after a forward over the
committed tokens) and its normed last hidden state, with none of specstate's modules.

A random assistant almost never agrees with its target, so the assistants here are *derived*:
its layer is the target's last layer reading the target's own KV, its projection adds the
token's embedding and the recurrent state (so both steer the drafts), its norm and LM head are
the target's; Gaussian noise on top makes the agreement partial.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from spec_checkpoints import perturb
from transformers import LlamaForCausalLM

from specstate.reference.frozen_kv_config import FrozenKvConfig, read_frozen_kv_config
from specstate.reference.frozen_kv_head import FrozenKvAssistant
from specstate.reference.model import DecoderLayer, PagedLlama


def derived_assistant(
    target: PagedLlama, *, state_weight: float = 1.0, noise: float = 0.05, seed: int = 21
) -> FrozenKvAssistant:
    """An assistant that partly agrees with ``target`` (see the module docstring)."""
    assistant = FrozenKvAssistant(FrozenKvConfig.for_target(target.config), target)
    last = target.layers[-1]
    assert isinstance(last, DecoderLayer)
    hidden = target.config.hidden_size
    lm_head = target.embed_tokens.weight if target.lm_head is None else target.lm_head.weight
    layer: Any = assistant.layers[0]
    with torch.no_grad():
        eye = torch.eye(hidden)
        assistant.pre_projection.weight.copy_(torch.cat([eye, state_weight * eye], dim=1))
        layer.input_layernorm.load_state_dict(last.input_layernorm.state_dict())
        layer.self_attn.q_proj.load_state_dict(last.self_attn.q_proj.state_dict())
        layer.self_attn.o_proj.load_state_dict(last.self_attn.o_proj.state_dict())
        layer.post_attention_layernorm.load_state_dict(last.post_attention_layernorm.state_dict())
        layer.mlp.load_state_dict(last.mlp.state_dict())
        assistant.norm.load_state_dict(target.norm.state_dict())
        assistant.lm_head.weight.copy_(lm_head)
        assistant.post_projection.weight.copy_(eye)
    perturb(assistant, noise, seed=seed)
    return assistant


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rotate(q: torch.Tensor, position: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of ``q`` ``[heads, dim]`` at ``position``."""
    dim = q.shape[-1]
    angles = position / theta ** (torch.arange(0, dim, 2).float() / dim)
    emb = torch.cat([angles, angles])
    rotated = torch.cat([-q[..., dim // 2 :], q[..., : dim // 2]], -1)
    return q * emb.cos() + rotated * emb.sin()


def dense_frozen_drafts(
    assistant_dir: Path, hf: LlamaForCausalLM, tokens: Sequence[int], num_steps: int
) -> list[int]:
    """The greedy drafts of the round whose pending bonus is ``tokens[-1]`` at
    ``S = len(tokens) - 1``: the target's KV of its last layer over ``tokens[:S]`` and its normed
    hidden state at ``S - 1`` (transformers), then the assistant's steps written out."""
    config = read_frozen_kv_config(assistant_dir)
    w = load_file(assistant_dir / "model.safetensors")
    start = len(tokens) - 1
    eps, heads, kv, dim = (
        config.rms_norm_eps,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.head_dim,
    )
    layer = hf.config.num_hidden_layers - 1 if config.kv_layer is None else config.kv_layer
    with torch.no_grad():
        out = hf(torch.tensor([list(tokens[:start])]), use_cache=True, output_hidden_states=True)
        keys = out.past_key_values.layers[layer].keys[0].repeat_interleave(heads // kv, 0)
        values = out.past_key_values.layers[layer].values[0].repeat_interleave(heads // kv, 0)
        state = out.hidden_states[-1][0, -1]
        embed = hf.model.embed_tokens.weight
        token, drafts = tokens[-1], []
        for _ in range(num_steps):
            x = w["pre_projection.weight"] @ torch.cat([embed[token], state])
            for i in range(config.num_hidden_layers):
                p = f"layers.{i}."
                q = w[p + "self_attn.q_proj.weight"] @ _rms(x, w[p + "input_layernorm.weight"], eps)
                q = _rotate(q.view(heads, dim), start, config.rope_theta)
                scores = torch.einsum("hd,hkd->hk", q, keys) / dim**0.5
                attn = torch.einsum("hk,hkd->hd", scores.softmax(-1), values).reshape(-1)
                x = x + w[p + "self_attn.o_proj.weight"] @ attn
                h = _rms(x, w[p + "post_attention_layernorm.weight"], eps)
                gate, up = w[p + "mlp.gate_proj.weight"] @ h, w[p + "mlp.up_proj.weight"] @ h
                x = x + w[p + "mlp.down_proj.weight"] @ (F.silu(gate) * up)
            h = _rms(x, w["norm.weight"], eps)
            token = int((w["lm_head.weight"] @ h).argmax())
            drafts.append(token)
            state = w["post_projection.weight"] @ h
    return drafts
