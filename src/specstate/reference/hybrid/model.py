"""The reference hybrid model: a paged NemotronH whose states live where specstate puts them.

`PagedHybrid` computes transformers' ``NemotronHForCausalLM`` (Mamba2, attention and
squared-ReLU MLP blocks, pre-norm residual) over the same frozen `AttentionBatch` as the
reference Llama, so every forward mode (prefill, chunk, 1-token extend, verify of a chain,
draft steps) is one extend::

    attention block   K/V written at out_cache_loc, read through req_to_token (no RoPE:
                      NemotronH attention has no positional encoding)
    Mamba2 block      start state read from row(slot, prefix_len) (zero state at prefix 0),
                      the state after each token written to row(slot, position + 1)

with ``row`` the `specstate.memory.recurrent.RecurrentLayout` the engine hands the worker. So
a bookkeeping error in the scheduling state — a stale slot, a frontier that selected the wrong
checkpoint, a state not carried over a round — shows up as wrong tokens against transformers.

Tree attention (`TreeAttentionBatch`) is refused when the model has Mamba2 layers: a recurrent
state follows one chain of tokens, not a tree. Inference only; the KV cache and the state
buffers are owned by the model but are not parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.hybrid.config import HybridConfig, LayerKind
from specstate.reference.hybrid.mamba import Mamba2Mixer, StateBuffers, TokenGrid, check_layout
from specstate.reference.hybrid.paged import PagedStateModel
from specstate.reference.model import (
    AttentionBatch,
    ForwardPlan,
    KvCache,
    ModelConfig,
    ModelOutput,
    paged_attention,
    plan_forward,
)

__all__ = ["HybridBlock", "HybridNorm", "PagedHybrid", "attention_geometry"]


def attention_geometry(config: HybridConfig) -> ModelConfig:
    """The attention layers' shape as a `ModelConfig` (for the KV cache and the gather plan)."""
    return ModelConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=max(config.num_attention_layers, 1),
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.layer_norm_epsilon,
        dtype=config.dtype,
    )


class HybridNorm(nn.Module):
    """NemotronH RMSNorm: float32 statistics, the weight multiplied in float32."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * h).to(x.dtype)


class _Attention(nn.Module):
    """Grouped-query attention without positional encoding, over the paged KV cache."""

    def __init__(self, config: HybridConfig, index: int) -> None:
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
        self.shape = (heads, kv_heads, dim)
        self.index = index

    def forward(self, x: torch.Tensor, plan: ForwardPlan, cache: KvCache) -> torch.Tensor:
        heads, kv_heads, dim = self.shape
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, heads, dim)
        k = self.k_proj(x).view(num_tokens, kv_heads, dim)
        v = self.v_proj(x).view(num_tokens, kv_heads, dim)
        projected: torch.Tensor = self.o_proj(paged_attention(q, k, v, self.index, plan, cache))
        return projected


class _Mlp(nn.Module):
    """``down(relu(up(x)) ** 2)``."""

    def __init__(self, config: HybridConfig) -> None:
        super().__init__()
        hidden, inter = config.hidden_size, config.intermediate_size
        self.up_proj = nn.Linear(hidden, inter, bias=config.mlp_bias)
        self.down_proj = nn.Linear(inter, hidden, bias=config.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(torch.square(F.relu(self.up_proj(x))))
        return out


class HybridBlock(nn.Module):
    """One pre-norm residual block, ``x + mixer(norm(x))``, with a mixer of ``kind``."""

    def __init__(self, config: HybridConfig, kind: LayerKind, index: int) -> None:
        super().__init__()
        self.kind = kind
        self.norm = HybridNorm(config.hidden_size, config.layer_norm_epsilon)
        self.mixer: nn.Module
        if kind is LayerKind.MAMBA:
            self.mixer = Mamba2Mixer(config, index)
        elif kind is LayerKind.ATTENTION:
            self.mixer = _Attention(config, index)
        else:
            self.mixer = _Mlp(config)

    def forward(
        self,
        x: torch.Tensor,
        plan: ForwardPlan,
        cache: KvCache,
        grid: TokenGrid | None = None,
        states: StateBuffers | None = None,
    ) -> torch.Tensor:
        """``x + mixer(norm(x))``: attention over ``cache``, a Mamba2 mixer over ``states``
        at ``grid``'s rows.

        Raises:
            InvalidConfig: a Mamba2 block without a grid and state buffers.
        """
        h = self.norm(x)
        out: torch.Tensor
        if self.kind is LayerKind.MAMBA:
            if grid is None or states is None:
                raise InvalidConfig("a Mamba2 block needs its state rows (a grid and buffers)")
            out = self.mixer(h, grid, states)
        elif self.kind is LayerKind.ATTENTION:
            out = self.mixer(h, plan, cache)
        else:
            out = self.mixer(h)
        return x + out


class PagedHybrid(PagedStateModel):
    """A NemotronH causal LM over a paged KV cache and laid-out state rows it owns.

    Parameter names equal Hugging Face's without the ``model.`` prefix. Build the model on its
    final device: ``.to()`` moves neither the KV cache nor the state buffers.

    Args:
        config: the model shape; parameters are created in ``config.dtype``.
        num_token_slots: KV token slots per attention layer, padding slot 0 included.
        layout: where request states sit (required when the model has Mamba2 layers).
        device: where parameters, KV and states live.
    """

    def __init__(
        self,
        config: HybridConfig,
        *,
        num_token_slots: int,
        layout: RecurrentLayout | None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        self.config = config
        self.geometry = attention_geometry(config)
        self.layout = check_layout(config, layout)
        counters = dict.fromkeys(LayerKind, 0)
        blocks: list[HybridBlock] = []
        with torch.device(device):
            self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
            for kind in config.layer_types:
                blocks.append(HybridBlock(config, kind, counters[kind]))
                counters[kind] += 1
            self.layers = nn.ModuleList(blocks)
            self.norm_f = HybridNorm(config.hidden_size, config.layer_norm_epsilon)
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._blocks = tuple(blocks)  # the modules of ``layers``, typed
        self.to(dtype=config.dtype)
        self.requires_grad_(False)
        self.allocate(
            self.geometry, config.recurrent_spec(), num_token_slots=num_token_slots, device=device
        )

    @property
    def blocks(self) -> tuple[HybridBlock, ...]:
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
            x: torch.Tensor = self.embeddings(batch.input_ids)
            for block in self._blocks:
                x = block(x, plan, self._kv_cache, grid, self._states)
            normed = self.norm_f(x if logit_rows is None else x[logit_rows])
            logits = self.lm_head(normed).float()
        return ModelOutput(logits=logits, hidden_states=x)
