"""A reference LFM2 model: short convolutions and attention over paged KV and laid-out states.

`PagedLfm2` computes transformers' ``Lfm2ForCausalLM`` over the same frozen `AttentionBatch` as
the reference Llama and NemotronH, so every forward mode (prefill, chunk, 1-token extend,
verify of a chain, draft steps) is one extend. Each block is ``x + op(norm(x))`` then
``x + ffn(norm(x))``, with ``op`` one of::

    attention     q/k per-head RMSNorm, RoPE; K/V written at out_cache_loc, read through
                  req_to_token (`specstate.reference.model.paged_attention`)
    short conv    in_proj(x) -> B | C | x;  y = C * causal_conv(B * x);  out_proj(y)
                  conv state: the last conv_kernel - 1 inputs (B * x) per channel, read from
                  row(slot, prefix_len) (zero at prefix 0), written after each token to
                  row(slot, position + 1)

and ``ffn`` SwiGLU (``w2(silu(w1 x) * w3 x)``). The state rows are the ones
`specstate.memory.recurrent.RecurrentLayout` assigns, so a bookkeeping error in the scheduling
state — a stale slot, a checkpoint selected for the wrong accept length — shows up as wrong
tokens against transformers.

Invariant: a forward reads only the start row of each batch row and writes only the rows of
the positions it absorbs; tree batches are refused when the model has convolution layers.
Inference only; the KV cache and the state buffers are owned by the model, not parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.hybrid.lfm2_config import Lfm2LayerKind, Lfm2ModelConfig
from specstate.reference.hybrid.mamba import StateBuffers, TokenGrid, causal_conv
from specstate.reference.hybrid.paged import PagedStateModel
from specstate.reference.model import (
    AttentionBatch,
    ForwardPlan,
    KvCache,
    ModelConfig,
    ModelOutput,
    RMSNorm,
    paged_attention,
    plan_forward,
)

__all__ = ["Lfm2Block", "PagedLfm2", "ShortConv"]


def _geometry(config: Lfm2ModelConfig) -> ModelConfig:
    """The attention layers' shape as a `ModelConfig` (the KV cache, the plan and its RoPE)."""
    return ModelConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=max(config.num_attention_layers, 1),
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.norm_eps,
        rope_theta=config.rope_theta,
        dtype=config.dtype,
    )


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on ``x`` ``[T, heads, head_dim]`` (rotate-half layout, as transformers)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


class _Attention(nn.Module):
    """Grouped-query attention with per-head q/k RMSNorm and RoPE, over the paged KV cache."""

    def __init__(self, config: Lfm2ModelConfig, index: int) -> None:
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
        self.out_proj = nn.Linear(heads * dim, hidden, bias=False)
        self.q_layernorm = RMSNorm(dim, config.norm_eps)
        self.k_layernorm = RMSNorm(dim, config.norm_eps)
        self.shape = (heads, kv_heads, dim)
        self.index = index

    def forward(self, x: torch.Tensor, plan: ForwardPlan, cache: KvCache) -> torch.Tensor:
        heads, kv_heads, dim = self.shape
        num_tokens = x.shape[0]
        q = self.q_layernorm(self.q_proj(x).view(num_tokens, heads, dim))
        k = self.k_layernorm(self.k_proj(x).view(num_tokens, kv_heads, dim))
        v = self.v_proj(x).view(num_tokens, kv_heads, dim)
        q, k = _rotate(q, plan.cos, plan.sin), _rotate(k, plan.cos, plan.sin)
        out: torch.Tensor = self.out_proj(paged_attention(q, k, v, self.index, plan, cache))
        return out


class ShortConv(nn.Module):
    """One gated short convolution; ``index`` is its place among the convolution layers."""

    def __init__(self, config: Lfm2ModelConfig, index: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.conv = nn.Conv1d(
            hidden, hidden, kernel_size=config.conv_kernel, groups=hidden, bias=config.conv_bias
        )
        self.in_proj = nn.Linear(hidden, 3 * hidden, bias=config.conv_bias)
        self.out_proj = nn.Linear(hidden, hidden, bias=config.conv_bias)
        self.index = index

    def forward(self, x: torch.Tensor, grid: TokenGrid, states: StateBuffers) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``; reads start states, writes checkpoints."""
        b, c, h = self.in_proj(x).chunk(3, dim=-1)
        (start,) = states.read(self.index, grid.start_rows)
        # A row with prefix 0 starts from the zero state, whatever its row holds (even NaN).
        start = torch.where(grid.fresh, 0.0, start)
        conv, after = causal_conv(grid.pad(b * h), start, self.conv.weight, self.conv.bias)
        if grid.width:
            mask = grid.write_mask
            states.write(self.index, grid.write_rows[mask], after[mask])
        out: torch.Tensor = self.out_proj(c * grid.unpad(conv))
        return out


class _SwiGlu(nn.Module):
    """``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, config: Lfm2ModelConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.w1 = nn.Linear(hidden, inter, bias=False)
        self.w3 = nn.Linear(hidden, inter, bias=False)
        self.w2 = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Lfm2Block(nn.Module):
    """``x + op(operator_norm(x))``, then ``+ feed_forward(ffn_norm(.))``; ``op`` of ``kind``.

    The operator is the attribute transformers names it: ``self_attn`` or ``conv``.
    """

    def __init__(self, config: Lfm2ModelConfig, kind: Lfm2LayerKind, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.operator_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.norm_eps)
        self.feed_forward = _SwiGlu(config)
        if kind is Lfm2LayerKind.ATTENTION:
            self.self_attn = _Attention(config, index)
        else:
            self.conv = ShortConv(config, index)

    def forward(
        self,
        x: torch.Tensor,
        plan: ForwardPlan,
        cache: KvCache,
        grid: TokenGrid | None,
        states: StateBuffers | None,
    ) -> torch.Tensor:
        """The block's output ``[T, hidden]``."""
        h = self.operator_norm(x)
        if self.kind is Lfm2LayerKind.ATTENTION:
            x = x + self.self_attn(h, plan, cache)
        elif grid is None or states is None:  # unreachable: checked at construction
            raise InvalidConfig("a short-convolution layer without state buffers")
        else:
            x = x + self.conv(h, grid, states)
        out: torch.Tensor = x + self.feed_forward(self.ffn_norm(x))
        return out


class PagedLfm2(PagedStateModel):
    """An LFM2 causal LM over a paged KV cache and laid-out state rows it owns.

    Parameter names equal Hugging Face's without the ``model.`` prefix (``lm_head.weight`` is
    the embedding when ``tie_word_embeddings``). Build the model on its final device: ``.to()``
    moves neither the KV cache nor the state buffers.

    Args:
        config: the model shape; parameters are created in ``config.dtype``.
        num_token_slots: KV token slots per attention layer, padding slot 0 included.
        layout: where request states sit (required when the model has convolution layers).
        device: where parameters, KV and states live.
    """

    def __init__(
        self,
        config: Lfm2ModelConfig,
        *,
        num_token_slots: int,
        layout: RecurrentLayout | None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        spec = config.recurrent_spec()
        if spec is not None and layout is None:
            raise InvalidConfig(
                f"a model with {config.num_conv_layers} short-convolution layers needs a "
                "recurrent state layout (WorkerMemory.recurrent)"
            )
        self.config = config
        self.geometry = _geometry(config)
        self.layout = layout if spec is not None else None
        counters = dict.fromkeys(Lfm2LayerKind, 0)
        blocks: list[Lfm2Block] = []
        with torch.device(device):
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
            for kind in config.layer_types:
                blocks.append(Lfm2Block(config, kind, counters[kind]))
                counters[kind] += 1
            self.layers = nn.ModuleList(blocks)
            self.embedding_norm = RMSNorm(config.hidden_size, config.norm_eps)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self._blocks = tuple(blocks)  # the modules of ``layers``, typed
        self.to(dtype=config.dtype)
        self.requires_grad_(False)
        self.allocate(self.geometry, spec, num_token_slots=num_token_slots, device=device)

    @property
    def blocks(self) -> tuple[Lfm2Block, ...]:
        """The blocks in order (the modules of ``layers``)."""
        return self._blocks

    def forward(
        self, batch: AttentionBatch, *, logit_rows: torch.Tensor | None = None
    ) -> ModelOutput:
        """One extend forward: writes KV and states, returns logits and hidden states.

        Raises:
            InvalidConfig: the batch is inconsistent, or a tree batch for a model with state.
        """
        grid = self.token_grid(batch)
        with torch.no_grad():
            plan = plan_forward(batch, self.geometry, self._kv_cache.num_token_slots)
            x: torch.Tensor = self.embed_tokens(batch.input_ids)
            for block in self._blocks:
                x = block(x, plan, self._kv_cache, grid, self._states)
            normed = self.embedding_norm(x if logit_rows is None else x[logit_rows])
            logits = self.lm_head(normed).float()
        return ModelOutput(logits=logits, hidden_states=x)
