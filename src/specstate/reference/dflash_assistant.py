"""The paged DFlash assistant: one forward denoises a block of tokens over the target's context.

`DFlashAssistant` owns the assistant's parameters and its own paged KV cache, indexed by the SAME
token slots as the target. Its KV at the slot of position ``p`` is the *context* KV of ``p``,
a function of the target's hidden states at ``p`` alone::

    c_p   = output_norm_enc(fc(cat([H_l(p) for l in target_layer_ids])))
    K_p   = rope(k_norm(k_proj(c_p)), p)      V_p = v_proj(c_p)          every assistant layer

``H_l`` is the output of target decoder layer ``l`` (for the target's last layer, after its final
norm: what Hugging Face's ``hidden_states[l + 1]`` holds). `materialize` writes it once the
target has computed ``p`` and the position is accepted. A block draft at frontier ``S``::

    tokens   x0@S, m@S+1, .., m@S+W-1                m = mask_token_id, W = block_size;
                                                     embedded with the target's embeddings
    layer    h = input_layernorm(x); q, k, v of the block (q_norm / k_norm, RoPE at each
             position); the block's K/V written at its own slots [S, S+W); every block token
             attends to the context [0, S) and to the whole block (bidirectional);
             x += o_proj(attention); x += mlp(post_attention_layernorm(x))
    drafts   target_lm_head(norm(x)) of block rows 1 .. W-1: the tokens of S+1 .. S+W-1

The numerics follow Hugging Face's ``MuseGlimmerAssistantModel`` (the assistant of
``generate(..., speculation_type="dflash")``): RMSNorm in float32, default RoPE, QK-norm, SwiGLU,
grouped-query attention. The file format lives in `specstate.reference.dflash_checkpoint`.

Invariant: the assistant reads the target's embedding and LM head (shared, never written) and
writes only its own KV cache: a draft at the block's slots ``[S, S + W)`` (noise, overwritten
by the materialization of the positions later accepted), a materialization at the slots it is
given. Nothing below ``S`` is written by a draft.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.model import (
    AttentionBatch,
    ForwardPlan,
    KvCache,
    ModelConfig,
    PagedLlama,
    RMSNorm,
    paged_attention,
    plan_forward,
)

__all__ = ["DFlashAssistant", "DFlashConfig", "check_fits_target", "rope_tables"]


@attrs.frozen(kw_only=True)
class DFlashConfig:
    """The shape of a DFlash assistant; ``dtype`` is the dtype its weights are stored in.

    Attributes:
        block_size: W, tokens one draft forward denoises (the bonus and ``W - 1`` masks).
        mask_token_id: the token every masked block position carries.
        target_layer_ids: the target decoder layers whose outputs, side by side, form the
            context of each position.

    Invariant: ``block_size >= 2``, ``target_layer_ids`` is not empty and has no negative
    entry, ``mask_token_id`` lies in the vocabulary, and the sizes satisfy `ModelConfig`'s
    checks (`layer_config`, which the constructor calls).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    rms_norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    max_position_embeddings: int = 2048
    dtype: torch.dtype = torch.float32

    def __attrs_post_init__(self) -> None:
        if self.block_size < 2:
            raise InvalidConfig(f"DFlashConfig: block_size must be >= 2, got {self.block_size}")
        if not self.target_layer_ids or min(self.target_layer_ids) < 0:
            raise InvalidConfig(
                f"DFlashConfig: target_layer_ids {list(self.target_layer_ids)} must name one "
                "or more target layers (0-based)"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise InvalidConfig(
                f"DFlashConfig: mask_token_id {self.mask_token_id} outside the vocabulary of "
                f"{self.vocab_size}"
            )
        self.layer_config()

    @property
    def context_size(self) -> int:
        """Width of the concatenated target hidden states: ``len(target_layer_ids) * hidden``."""
        return len(self.target_layer_ids) * self.hidden_size

    def layer_config(self, dtype: torch.dtype | None = None) -> ModelConfig:
        """The `ModelConfig` of the assistant's layers and KV cache."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=True,
            dtype=self.dtype if dtype is None else dtype,
        )

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of the assistant's ``model.safetensors`` (Hugging Face names)."""
        hidden, inter, dim = self.hidden_size, self.intermediate_size, self.head_dim
        q_rows, kv_rows = self.num_attention_heads * dim, self.num_key_value_heads * dim
        shapes: dict[str, tuple[int, ...]] = {
            "encoder.fc.weight": (hidden, self.context_size),
            "encoder.output_norm_enc.weight": (hidden,),
            "norm.weight": (hidden,),
        }
        for i in range(self.num_hidden_layers):
            layer = f"layers.{i}."
            shapes |= {
                layer + "input_layernorm.weight": (hidden,),
                layer + "post_attention_layernorm.weight": (hidden,),
                layer + "self_attn.q_proj.weight": (q_rows, hidden),
                layer + "self_attn.k_proj.weight": (kv_rows, hidden),
                layer + "self_attn.v_proj.weight": (kv_rows, hidden),
                layer + "self_attn.o_proj.weight": (hidden, q_rows),
                layer + "self_attn.q_norm.weight": (dim,),
                layer + "self_attn.k_norm.weight": (dim,),
                layer + "mlp.gate_proj.weight": (inter, hidden),
                layer + "mlp.up_proj.weight": (inter, hidden),
                layer + "mlp.down_proj.weight": (hidden, inter),
            }
        return shapes


def rope_tables(
    positions: torch.Tensor, head_dim: int, theta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Default-RoPE cos / sin ``[T, 1, head_dim]`` (float32) of ``positions`` (HF's layout)."""
    exponents = torch.arange(0, head_dim, 2, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim))
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x`` ``[T, heads, head_dim]`` rotated by the angles (rotate-half layout)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class _ContextEncoder(nn.Module):
    """``fc`` then ``output_norm_enc``: the target's layers side by side -> one hidden vector."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.context_size, config.hidden_size, bias=False)
        self.output_norm_enc = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, context: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.output_norm_enc(self.fc(context))
        return out


class _BlockAttention(nn.Module):
    """QK-normed grouped-query attention whose keys and values also come from the context."""

    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        heads, kv_heads, dim = (
            config.num_attention_heads,
            config.num_key_value_heads,
            config.head_dim,
        )
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, heads * dim, bias=False)
        self.k_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.v_proj = nn.Linear(hidden, kv_heads * dim, bias=False)
        self.o_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.q_norm = RMSNorm(dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(dim, config.rms_norm_eps)
        self.shape = (heads, kv_heads, dim)
        self.layer = layer

    def keys_values(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(K, V)`` ``[T, kv_heads, head_dim]`` of the vectors ``x`` ``[T, hidden]``."""
        _, kv_heads, dim = self.shape
        k = self.k_norm(self.k_proj(x).view(x.shape[0], kv_heads, dim))
        return _rotate(k, cos, sin), self.v_proj(x).view(x.shape[0], kv_heads, dim)

    def forward(
        self,
        x: torch.Tensor,
        plan: ForwardPlan,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KvCache,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        """The block's attention output ``[T, hidden]``; writes its K/V at ``plan``'s slots.

        The block reads its own K/V as computed (``positions``: their KV columns), not
        through the slot table: under a verify budget the positions past it write to the
        padding slot (the row's reservation may end there), whatever the table holds."""
        heads, _, dim = self.shape
        cos, sin = rope
        q = _rotate(self.q_norm(self.q_proj(x).view(x.shape[0], heads, dim)), cos, sin)
        k, v = self.keys_values(x, cos, sin)
        attended = paged_attention(q, k, v, self.layer, plan, cache, new_columns=positions)
        out: torch.Tensor = self.o_proj(attended)
        return out


class _SwiGlu(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _AssistantLayer(nn.Module):
    """Pre-norm residual block: block attention (context keys included), then SwiGLU."""

    def __init__(self, config: DFlashConfig, layer: int) -> None:
        super().__init__()
        self.self_attn = _BlockAttention(config, layer)
        self.mlp = _SwiGlu(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        plan: ForwardPlan,
        rope: tuple[torch.Tensor, torch.Tensor],
        cache: KvCache,
        positions: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), plan, rope, cache, positions)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


def _bidirectional(plan: ForwardPlan, batch: AttentionBatch) -> ForwardPlan:
    """``plan`` with every new token of a row seeing every KV position the row has."""
    kv_lens = (batch.prefix_lens + batch.extend_lens).long()
    cols = torch.arange(plan.kv_slots.shape[1], device=kv_lens.device)
    visible = cols[None, None, :] < kv_lens[:, None, None]
    return attrs.evolve(plan, mask=visible.expand(-1, plan.mask.shape[2], -1)[:, None])


class DFlashAssistant(nn.Module):
    """The paged DFlash assistant (see the module docstring); inference only.

    Args:
        config: the assistant's shape.
        target: the target whose embedding and LM head the assistant shares; the assistant
            computes in the target's dtype on the target's device.
        num_token_slots: KV slots of the assistant's cache (default: the target cache's).

    Raises:
        InvalidConfig: the assistant's hidden or vocabulary size differs from the target's, or
            a target layer it reads is not one of the target's.
    """

    def __init__(
        self, config: DFlashConfig, target: PagedLlama, *, num_token_slots: int | None = None
    ) -> None:
        super().__init__()
        check_fits_target(config, target.config, "DFlashAssistant")
        self.config = config
        self._layer_config = config.layer_config(dtype=target.config.dtype)
        device = target.embed_tokens.weight.device
        with torch.device(device):
            self.encoder = _ContextEncoder(config)
            layers = [_AssistantLayer(config, i) for i in range(config.num_hidden_layers)]
            self.layers = nn.ModuleList(layers)
            self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.to(dtype=target.config.dtype)
        self.requires_grad_(False)
        self._attentions = tuple(layer.self_attn for layer in layers)  # typed, not registered
        # Detached views, not parameters: they share the target's storage and are not saved.
        self._embedding = target.embed_tokens.weight.detach()
        lm_head = target.embed_tokens if target.lm_head is None else target.lm_head
        self._lm_head = lm_head.weight.detach()
        slots = target.kv_cache.num_token_slots if num_token_slots is None else num_token_slots
        self._kv_cache = KvCache.allocate(self._layer_config, num_token_slots=slots, device=device)

    @property
    def kv_cache(self) -> KvCache:
        """The assistant's own KV cache (same slot indexing as the target's)."""
        return self._kv_cache

    def materialize(
        self, context: torch.Tensor, positions: torch.Tensor, out_cache_loc: torch.Tensor
    ) -> None:
        """Write the context K/V of positions ``positions`` ``[T]`` at ``out_cache_loc`` ``[T]``.

        Args:
            context: ``[T, len(target_layer_ids) * hidden]`` the target's hidden states of
                those positions, side by side in ``target_layer_ids`` order.
            positions: the position of each row (its RoPE angle).
            out_cache_loc: the slot each row's K/V goes to (slot 0, the padding slot, for a row
                that must not land anywhere).

        Raises:
            InvalidConfig: ``context`` is not ``[T, context_size]``.
        """
        size = self.config.context_size
        if context.ndim != 2 or context.shape[1] != size or context.shape[0] != positions.numel():
            raise InvalidConfig(
                f"DFlashAssistant: context {tuple(context.shape)} must be "
                f"[{positions.numel()}, {size}]"
            )
        with torch.no_grad():
            encoded = self.encoder(context.to(self._embedding.dtype))
            cos, sin = rope_tables(positions, self.config.head_dim, self.config.rope_theta)
            loc = out_cache_loc.long().reshape(-1)
            for i, attention in enumerate(self._attentions):
                k, v = attention.keys_values(encoded, cos, sin)
                self._kv_cache.write(i, loc, k, v)

    def forward(self, batch: AttentionBatch) -> torch.Tensor:
        """Denoise each row's block; returns the draft logits ``[B, W - 1, vocab]`` (float32).

        ``batch`` holds ``W`` tokens per row (the bonus, then masks) at positions
        ``prefix .. prefix + W - 1``; their K/V are written at ``out_cache_loc``.

        Raises:
            InvalidConfig: the rows hold different numbers of tokens, or the batch is
                inconsistent with the tables.
        """
        return self.draft_logits(self.block_hidden(batch))

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head on `block_hidden`'s states: draft logits (float32)."""
        with torch.no_grad():
            return F.linear(hidden, self._lm_head).float()

    def block_hidden(self, batch: AttentionBatch) -> torch.Tensor:
        """`forward` up to the LM head: the normed hidden states ``[B, W - 1, hidden]`` of
        each row's block rows 1 .. W-1 (what the LM head and a DSpark head read)."""
        num_rows, num_tokens = batch.extend_lens.shape[0], batch.input_ids.shape[0]
        width = num_tokens // max(num_rows, 1)
        if num_rows and (width < 2 or bool((batch.extend_lens != width).any())):
            raise InvalidConfig(
                f"DFlashAssistant: every row must hold one block of >= 2 tokens, got "
                f"extend_lens {batch.extend_lens.tolist()}"
            )
        with torch.no_grad():
            plan = plan_forward(batch, self._layer_config, self._kv_cache.num_token_slots)
            plan = _bidirectional(plan, batch)
            rope = rope_tables(batch.positions, self.config.head_dim, self.config.rope_theta)
            x = F.embedding(batch.input_ids, self._embedding)
            for layer in self.layers:
                x = layer(x, plan, rope, self._kv_cache, batch.positions)
            hidden: torch.Tensor = self.norm(x.view(num_rows, width, -1)[:, 1:])
            return hidden


def check_fits_target(config: DFlashConfig, target: ModelConfig, where: str) -> None:
    """Raise `InvalidConfig` unless the assistant's sizes fit ``target`` and it reads only
    layers the target has."""
    for name in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(config, name), getattr(target, name)
        if ours != theirs:
            raise InvalidConfig(
                f"{where}: DFlash assistant {name} {ours} differs from the target's {theirs}"
            )
    layers = target.num_hidden_layers
    if max(config.target_layer_ids) >= layers:
        raise InvalidConfig(
            f"{where}: DFlash assistant reads target layers {list(config.target_layer_ids)} but "
            f"the target has layers [0, {layers})"
        )
