"""The sparse MLP of an Ernie 4.5 MoE layer: a top-k softmax router over SwiGLU experts.

`MoeBlock` owns the router, the routed experts and the shared experts of one decoder layer;
`MoeConfig` says which layers are sparse. The computation follows Hugging Face's
``Ernie4_5_MoeSparseMoeBlock`` (router in float32, the correction bias only steering the choice)::

    p        = softmax(x @ gate.weight^T)                          [T, E]  float32
    chosen   = topk(p + e_score_correction_bias, k)                 the k experts of each token
    w        = p[chosen] / max(sum(p[chosen]), norm_min)            renormalized weights
    out      = sum_i w_i * expert_(chosen_i)(x) + shared(x)       expert: down(silu(gate x)*up x)

Parameter names equal the Hugging Face checkpoint's (``gate.weight``,
``moe_statics.e_score_correction_bias``, ``experts.{e}.{gate,up,down}_proj.weight``,
``shared_experts.{gate,up,down}_proj.weight``), so a checkpoint maps onto it name for name.

Invariant: the block is a pure function of its input rows (each token is routed on its own), so
a token's output does not depend on the batch it rides in. With ``reduce`` (tensor parallelism:
this rank holds a slice of every expert's width) the expert outputs are partial sums, reduced
over the ranks before the shared experts' (also partial) output is added and reduced with them.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from specstate.core.errors import InvalidConfig

__all__ = ["MoeBlock", "MoeConfig"]


@attrs.frozen(kw_only=True)
class MoeConfig:
    """Which layers are sparse and how they route (HF ``Ernie4_5_MoeConfig``'s ``moe_*`` fields).

    Attributes:
        num_experts: routed experts per sparse layer (``moe_num_experts``).
        top_k: experts each token is routed to (``moe_k``).
        intermediate_size: the width of one expert (``moe_intermediate_size``).
        num_shared_experts: always-on experts, fused into one MLP of ``num_shared_experts *
            intermediate_size`` (``moe_num_shared_experts``; 0: none).
        first_layer: the first layer index that may be sparse (``moe_layer_start_index``).
        last_layer: the last one, inclusive (``moe_layer_end_index``).
        interval: layer ``i`` is sparse when ``(i + 1) % interval == 0`` (``moe_layer_interval``).
        norm_min: the floor of the renormalizing sum (``moe_norm_min``).

    Invariant: ``1 <= top_k <= num_experts``, ``intermediate_size >= 1``, ``interval >= 1``.
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    num_shared_experts: int = 0
    first_layer: int = 0
    last_layer: int
    interval: int = 1
    norm_min: float = 1e-12

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise InvalidConfig(
                f"MoeConfig: top_k ({self.top_k}) must lie in [1, num_experts {self.num_experts}]"
            )
        if self.intermediate_size < 1 or self.interval < 1 or self.num_shared_experts < 0:
            raise InvalidConfig(
                f"MoeConfig: intermediate_size ({self.intermediate_size}) and interval "
                f"({self.interval}) must be >= 1, num_shared_experts "
                f"({self.num_shared_experts}) >= 0"
            )

    def is_sparse(self, layer: int) -> bool:
        """Whether decoder layer ``layer`` has a `MoeBlock` (else a dense MLP)."""
        return (layer + 1) % self.interval == 0 and self.first_layer <= layer <= self.last_layer


class _Expert(nn.Module):
    """One SwiGLU expert: ``down(silu(gate(x)) * up(x))``."""

    def __init__(self, hidden: int, width: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.up_proj = nn.Linear(hidden, width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
        return out


class _Statics(nn.Module):
    """Holds the router's correction bias under the checkpoint's name."""

    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.e_score_correction_bias = nn.Parameter(torch.zeros(1, num_experts))


class MoeBlock(nn.Module):
    """A sparse MLP (see the module docstring); ``width`` is this rank's share of each expert.

    Args:
        config: the routing.
        hidden: the model width.
        width: each routed expert's width on this rank (``config.intermediate_size`` without
            tensor parallelism).
        reduce: sums a partial output over the tensor-parallel ranks (None: one rank).
    """

    def __init__(
        self,
        config: MoeConfig,
        hidden: int,
        *,
        width: int,
        reduce: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.gate = nn.Linear(hidden, config.num_experts, bias=False)
        self.moe_statics = _Statics(config.num_experts)
        self.experts = nn.ModuleList(_Expert(hidden, width) for _ in range(config.num_experts))
        shared = width * config.num_shared_experts
        self.shared_experts = _Expert(hidden, shared) if shared else None
        self._reduce = reduce

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(chosen [T, k] int64, weights [T, k] in x's dtype)`` of every token of ``x``."""
        probs = F.softmax(F.linear(x.float(), self.gate.weight.float()), dim=-1)
        bias = self.moe_statics.e_score_correction_bias.float().reshape(-1)
        chosen = torch.topk(probs + bias, self.config.top_k, dim=-1).indices
        weights = probs.gather(-1, chosen)
        weights = weights / weights.sum(-1, keepdim=True).clamp_min(self.config.norm_min)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        out = torch.zeros_like(x)
        for index, expert in enumerate(self.experts):
            # NOTE: every expert runs on every token (a reference model, not a fast one); a
            # token's weight for an expert it was not routed to is 0.
            weight = torch.where(chosen == index, weights, 0).sum(-1, keepdim=True)
            out = out + expert(x) * weight
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self._reduce is not None:
            out = self._reduce(out)
        return out
