"""Tensor parallelism of the reference Llama: which slice of every weight one rank holds.

The split is Megatron's: a column-parallel projection keeps the output rows of this rank's
heads (or MLP columns), the row-parallel projection after it keeps the matching input columns,
and its partial output is summed over the ranks (`ParallelGroup.all_reduce`) before the residual
add. With ``N`` ranks, ``H`` heads, ``KV`` KV heads, ``d = head_dim`` and MLP width ``I``,
rank ``r`` holds::

    q_proj                 column-parallel   rows [r·H/N·d,  (r+1)·H/N·d)
    k_proj, v_proj         column-parallel   rows [r·KV/N·d, (r+1)·KV/N·d)
    o_proj                 row-parallel      cols [r·H/N·d,  (r+1)·H/N·d)     then all-reduce
    gate_proj, up_proj     column-parallel   rows [r·I/N,    (r+1)·I/N)
    down_proj              row-parallel      cols [r·I/N,    (r+1)·I/N)       then all-reduce
    embed_tokens, norms,   replicated
    lm_head
    a sparse layer (MoE):  the router replicated; every expert's and the shared experts'
                           gate/up column-parallel and down row-parallel by their widths
                           (``I_e / N``, ``S · I_e / N``); one all-reduce of their sum

Query head ``h`` reads KV head ``h // (H/KV)`` as without parallelism: both splits are
contiguous and ``H/N`` is a multiple of ``H/KV``, so a rank's query heads read only its own KV
heads. The LM head is replicated, not vocabulary-parallel: every rank computes the full logits
from the same hidden states, and an EAGLE head keeps sharing the target's embedding and LM head.

Invariant: `shard_state` of a full state dict, loaded into ``PagedLlama(config, parallel=g)`` on
every rank of ``g``, computes the model of ``config`` (up to float summation order).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

import torch

from specstate.core.errors import InvalidConfig
from specstate.reference.model import ModelConfig, shard_config

__all__ = ["shard_state"]

_COLUMN: Final = {
    "self_attn.q_proj.weight": "heads",
    "self_attn.k_proj.weight": "kv_heads",
    "self_attn.v_proj.weight": "kv_heads",
    "mlp.gate_proj.weight": "mlp",
    "mlp.up_proj.weight": "mlp",
    "mlp.experts.*.gate_proj.weight": "expert",
    "mlp.experts.*.up_proj.weight": "expert",
    "mlp.shared_experts.gate_proj.weight": "shared",
    "mlp.shared_experts.up_proj.weight": "shared",
}
"""Column-parallel weights (``[out, in]``): this rank's output rows, by what they split
(an expert's index is ``*``)."""
_ROW: Final = {
    "self_attn.o_proj.weight": "heads",
    "mlp.down_proj.weight": "mlp",
    "mlp.experts.*.down_proj.weight": "expert",
    "mlp.shared_experts.down_proj.weight": "shared",
}
"""Row-parallel weights: this rank's input columns."""
_EXPERT: Final = re.compile(r"experts\.\d+\.")


def _widths(local: ModelConfig) -> dict[str, int]:
    """Rows (or columns) one rank holds of each kind of split."""
    expert = 0 if local.moe is None else local.moe.intermediate_size
    return {
        "heads": local.num_attention_heads * local.head_dim,
        "kv_heads": local.num_key_value_heads * local.head_dim,
        "mlp": local.intermediate_size,
        "expert": expert,
        "shared": expert * (0 if local.moe is None else local.moe.num_shared_experts),
    }


def shard_state(
    state: Mapping[str, torch.Tensor], config: ModelConfig, *, rank: int, world_size: int
) -> dict[str, torch.Tensor]:
    """Rank ``rank``'s slice of a full `PagedLlama` state dict (parameter names, no ``model.``).

    Tensors that are not split are returned as they are (replicated); split ones are
    contiguous copies, so the full tensors can be freed.

    Raises:
        InvalidConfig: ``rank`` is outside ``[0, world_size)``, or a split size is not divisible
            by ``world_size`` (`shard_config`).
    """
    if not 0 <= rank < world_size:
        raise InvalidConfig(f"tensor-parallel rank {rank} is outside [0, {world_size})")
    widths = _widths(shard_config(config, world_size))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        suffix = name.split(".", 2)[-1] if name.startswith("layers.") else ""
        suffix = _EXPERT.sub("experts.*.", suffix)
        if suffix in _COLUMN:
            width = widths[_COLUMN[suffix]]
            out[name] = tensor[rank * width : (rank + 1) * width].contiguous()
        elif suffix in _ROW:
            width = widths[_ROW[suffix]]
            out[name] = tensor[:, rank * width : (rank + 1) * width].contiguous()
        else:
            out[name] = tensor
    return out
