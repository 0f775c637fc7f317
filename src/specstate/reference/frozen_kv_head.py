"""The Frozen-KV MTP assistant: a drafter that owns no KV and reads the target's committed KV.

`FrozenKvAssistant` follows transformers' ``Gemma4AssistantForCausalLM`` driven by
``SinglePositionMultiTokenCandidateGenerator`` (on a Llama-architecture target): every draft
step of a round sits at the constant position ``S`` (the pending bonus), its queries attend to
the KV one target layer (``kv_layer``, the last by default) holds at positions ``[0, S)`` of the
row, and a recurrent state carries the drafts forward::

    x      = pre_projection(cat([target_embed(t), s]))        t: x0, then the previous draft
    x      = x + o_proj(attn(rope_S(q_proj(norm(x))), K_t[0:S], V_t[0:S]))    per layer
    x      = x + mlp(post_attention_layernorm(x))
    h      = norm(x);  logits = lm_head(h);  s' = post_projection(h)

``s`` starts as the target's last hidden state after its final norm at ``S - 1`` (what
transformers' ``hidden_states[-1]`` holds). The assistant writes nothing but its own activations:
no KV, no slot. (transformers' generator also passes the target's KV at ``S`` itself, left over
from the previous verify; here the read stops at the committed frontier ``S``: under overlap the
slots from ``S`` on belong to the round in flight.)

The format on disk is `specstate.reference.frozen_kv_config`'s. Every loading failure is an
`InvalidConfig` naming the file and the field or tensor.

Invariant: a forward reads the target's KV only at the slots of positions ``[0, S)`` of each
row (``S`` = the row's frontier) and writes no KV cache at all.
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    StrPath,
    read_checked_tensors,
    write_safetensors,
)
from specstate.reference.frozen_kv_config import FrozenKvConfig, read_frozen_kv_config
from specstate.reference.model import KvCache, PagedLlama, RMSNorm

__all__ = [
    "CommittedKv",
    "FrozenKvAssistant",
    "FrozenKvStep",
    "load_frozen_kv_assistant",
    "save_frozen_kv_assistant",
]


class _Attention(nn.Module):
    """Query-only attention: the keys and values are the target's."""

    def __init__(self, config: FrozenKvConfig) -> None:
        super().__init__()
        rows = config.num_attention_heads * config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, rows, bias=False)
        self.o_proj = nn.Linear(rows, config.hidden_size, bias=False)


class _Mlp(nn.Module):
    def __init__(self, config: FrozenKvConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Layer(nn.Module):
    def __init__(self, config: FrozenKvConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = _Attention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = _Mlp(config)


@attrs.frozen(kw_only=True)
class FrozenKvStep:
    """What one draft step produced for every row.

    Attributes:
        logits: ``[B, vocab]`` float32 logits of the next draft.
        state: ``[B, backbone_hidden]`` the recurrent state the next step starts from.
    """

    logits: torch.Tensor
    state: torch.Tensor


@attrs.frozen(kw_only=True)
class CommittedKv:
    """The target KV one round of the assistant reads: positions ``[0, S)`` of every row.

    Attributes:
        keys: ``[B, heads, W, d]`` (grouped-query heads expanded), ``W = max(S)``.
        values: the same for values.
        visible: ``[B, 1, 1, W]`` True at positions below the row's ``S``.
        slots: ``[B, W]`` the token slots read (0 past ``S``: never looked at).
    """

    keys: torch.Tensor
    values: torch.Tensor
    visible: torch.Tensor
    slots: torch.Tensor


class FrozenKvAssistant(nn.Module):
    """The assistant (see the module docstring); inference only.

    Args:
        config: its shape.
        target: the target whose embedding it reads tokens through and whose KV it attends to.

    Raises:
        InvalidConfig: the assistant does not fit the target (`FrozenKvConfig.source_layer`).
    """

    def __init__(self, config: FrozenKvConfig, target: PagedLlama) -> None:
        super().__init__()
        self.config = config
        self.kv_layer = config.source_layer(target.config)
        device = target.embed_tokens.weight.device
        hidden = config.hidden_size
        with torch.device(device):
            self.pre_projection = nn.Linear(2 * config.backbone_hidden_size, hidden, bias=False)
            layers = [_Layer(config) for _ in range(config.num_hidden_layers)]
            self.layers = nn.ModuleList(layers)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            self.lm_head = nn.Linear(hidden, config.vocab_size, bias=False)
            self.post_projection = nn.Linear(hidden, config.backbone_hidden_size, bias=False)
        self.to(dtype=target.config.dtype)
        self.requires_grad_(False)
        self._blocks = layers  # the same modules, typed (a list attribute registers nothing)
        self._embedding = target.embed_tokens.weight.detach()  # shared, never written
        self._target_cache: KvCache = target.kv_cache
        self._rope = (target.config.rope_theta, target.config.rope_interleaved)

    def read_committed(
        self, req_pool_indices: torch.Tensor, req_to_token: torch.Tensor, frontier: torch.Tensor
    ) -> CommittedKv:
        """The target's KV (layer ``kv_layer``) at positions ``[0, S)`` of every row."""
        width = max(int(frontier.max()) if frontier.numel() else 0, 1)
        cols = torch.arange(width, device=req_to_token.device)
        rows = req_to_token[req_pool_indices.long().to(req_to_token.device), :width].long()
        visible = cols[None, :] < frontier.long().to(cols.device)[:, None]
        slots = torch.where(visible, rows, 0)
        keys, values = self._target_cache.gather(self.kv_layer, slots.to(self._target_cache.device))
        group = self.config.num_attention_heads // self.config.num_key_value_heads
        return CommittedKv(
            keys=keys.repeat_interleave(group, dim=2).transpose(1, 2),
            values=values.repeat_interleave(group, dim=2).transpose(1, 2),
            visible=visible[:, None, None, :].to(keys.device),
            slots=slots,
        )

    def step(
        self,
        tokens: torch.Tensor,
        state: torch.Tensor,
        position: torch.Tensor,
        committed: CommittedKv,
    ) -> FrozenKvStep:
        """One draft step of every row: tokens ``[B]`` and states ``[B, Hb]`` at positions
        ``[B]`` (the row's ``S``) over ``committed`` (`read_committed`)."""
        heads, dim = self.config.num_attention_heads, self.config.head_dim
        with torch.no_grad():
            x = self.pre_projection(
                torch.cat(
                    [F.embedding(tokens, self._embedding), state.to(self._embedding.dtype)], -1
                )
            )
            cos, sin = self._angles(position)
            for layer in self._blocks:
                q = layer.self_attn.q_proj(layer.input_layernorm(x)).view(-1, heads, 1, dim)
                q = self._rotate(q, cos, sin)
                # NOTE: an empty row (S = 0, never sent: a decode has a prefix) would be NaN.
                out = F.scaled_dot_product_attention(
                    q, committed.keys, committed.values, committed.visible
                )
                x = x + layer.self_attn.o_proj(out.reshape(-1, heads * dim))
                x = x + layer.mlp(layer.post_attention_layernorm(x))
            h = self.norm(x)
            return FrozenKvStep(logits=self.lm_head(h).float(), state=self.post_projection(h))

    def _angles(self, position: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        theta, interleaved = self._rope
        dim = self.config.head_dim
        inv = 1.0 / theta ** (torch.arange(0, dim, 2, device=position.device).float() / dim)
        freqs = position.float()[:, None] * inv[None, :]
        emb = freqs.repeat_interleave(2, -1) if interleaved else torch.cat([freqs, freqs], -1)
        return emb.cos()[:, None, None, :], emb.sin()[:, None, None, :]

    def _rotate(self, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """The target's RoPE layout (its keys are stored rotated the same way)."""
        if self._rope[1]:
            pairs = torch.stack((-q[..., 1::2], q[..., 0::2]), dim=-1).flatten(-2)
            return (q.float() * cos + pairs.float() * sin).to(q.dtype)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos.to(q.dtype) + rotated * sin.to(q.dtype)


def _read_tensors(path: Path, config: FrozenKvConfig) -> dict[str, torch.Tensor]:
    return read_checked_tensors(path, config.expected_shapes(), kind="the Frozen-KV MTP assistant")


def load_frozen_kv_assistant(directory: StrPath, target: PagedLlama) -> FrozenKvAssistant:
    """Loads the assistant in ``directory`` for ``target``.

    Raises:
        InvalidConfig: a bad config, an assistant that does not fit the target, a missing file,
            or a missing, misshapen or unexpected tensor; the message names the file.
    """
    root = Path(directory)
    config = read_frozen_kv_config(root)
    try:
        config.source_layer(target.config)
        tensors = _read_tensors(root / WEIGHTS_FILE, config)
    except InvalidConfig as error:
        raise InvalidConfig(f"{root / CONFIG_FILE}: {error}") from None
    except SafetensorError as error:
        raise InvalidConfig(f"{root}: unreadable safetensors weights ({error})") from None
    assistant = FrozenKvAssistant(config, target)
    assistant.load_state_dict(tensors, strict=True)
    return assistant


def save_frozen_kv_assistant(assistant: FrozenKvAssistant, directory: StrPath) -> None:
    """Writes ``config.json`` and ``model.safetensors`` of ``assistant`` (created if needed)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    raw = attrs.evolve(assistant.config, dtype=assistant.lm_head.weight.dtype).to_json()
    (root / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    tensors = {n: t.detach().to("cpu").contiguous() for n, t in assistant.state_dict().items()}
    write_safetensors(tensors, root / WEIGHTS_FILE)
