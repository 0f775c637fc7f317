"""Hugging Face Ernie 4.5 MoE checkpoints: the owner of that ``config.json`` dialect.

Ernie 4.5 MoE (``model_type`` ``ernie4_5_moe``) is a Llama with interleaved RoPE and, in some
layers, a sparse MLP (`specstate.reference.moe`); it is the attention-only mixture-of-experts
target whose multi-token-prediction layers (``num_mtp_layers``, `specstate.reference.mtp`)
transformers' ``generate(use_mtp=True)`` drafts with. This module maps its config onto a
`ModelConfig` and back and names the tensors of its sparse layers; `specstate.reference.checkpoint`
reads and writes the files::

    config.json   model_type "ernie4_5_moe", use_bias false, hidden_act "silu",
                  moe_num_experts, moe_k, moe_intermediate_size, moe_num_shared_experts,
                  moe_layer_start_index, moe_layer_end_index (-1: the last layer),
                  moe_layer_interval, moe_norm_min, num_mtp_layers (optional)
    a sparse layer's MLP tensors (instead of mlp.{gate,up,down}_proj.weight):
                  mlp.gate.weight [E, H]   mlp.moe_statics.e_score_correction_bias [1, E]
                  mlp.experts.{e}.{gate,up}_proj.weight [I, H]   .down_proj.weight [H, I]
                  mlp.shared_experts.{gate,up}_proj.weight [S*I, H]   .down_proj.weight [H, S*I]

Every failure is an `InvalidConfig` naming the file and the field.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Final

from specstate.core.errors import InvalidConfig
from specstate.reference.model import ModelConfig
from specstate.reference.moe import MoeConfig

__all__ = [
    "ERNIE_MOE_MODEL_TYPE",
    "ernie_config_fields",
    "moe_mlp_shapes",
    "read_moe_config",
    "read_num_mtp_layers",
]

ERNIE_MOE_MODEL_TYPE: Final = "ernie4_5_moe"

StrPath = str | os.PathLike[str]


def _int(raw: Mapping[str, object], key: str, path: StrPath, default: int | None = None) -> int:
    value = raw.get(key, default)
    if value is None:
        value = default
    if value is None:
        raise InvalidConfig(f"{path}: missing field '{key}'")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(f"{path}: field '{key}' must be an integer, got {value!r}")
    return value


def read_moe_config(raw: Mapping[str, object], path: StrPath) -> MoeConfig:
    """The sparse layers of an Ernie 4.5 MoE ``config.json`` object.

    Raises:
        InvalidConfig: a missing or mistyped ``moe_*`` field, projection biases, or
            inconsistent sizes; the message names the file and the field.
    """
    if raw.get("use_bias", False) is not False:
        raise InvalidConfig(
            f"{path}: field 'use_bias' is {raw['use_bias']!r}; biases are unsupported"
        )
    layers = _int(raw, "num_hidden_layers", path)
    end = _int(raw, "moe_layer_end_index", path, default=-1)
    norm_min = raw.get("moe_norm_min", 1e-12)
    if isinstance(norm_min, bool) or not isinstance(norm_min, int | float):
        raise InvalidConfig(f"{path}: field 'moe_norm_min' must be a number, got {norm_min!r}")
    try:
        return MoeConfig(
            num_experts=_int(raw, "moe_num_experts", path, default=64),
            top_k=_int(raw, "moe_k", path, default=6),
            intermediate_size=_int(raw, "moe_intermediate_size", path, default=1536),
            num_shared_experts=_int(raw, "moe_num_shared_experts", path, default=2),
            first_layer=_int(raw, "moe_layer_start_index", path, default=1),
            last_layer=layers - 1 if end == -1 else end,
            interval=_int(raw, "moe_layer_interval", path, default=1),
            norm_min=float(norm_min),
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None


def read_num_mtp_layers(raw: Mapping[str, object], path: StrPath) -> int:
    """The MTP layers a ``config.json`` object declares (``num_mtp_layers`` or its alias
    ``num_nextn_predict_layers``); 0 when it declares none.

    Raises:
        InvalidConfig: the field is not a non-negative integer.
    """
    key = "num_mtp_layers" if raw.get("num_mtp_layers") is not None else "num_nextn_predict_layers"
    count = _int(raw, key, path, default=0)
    if count < 0:
        raise InvalidConfig(f"{path}: field '{key}' must be >= 0, got {count}")
    return count


def ernie_config_fields(config: ModelConfig, *, num_mtp_layers: int = 0) -> dict[str, object]:
    """The Ernie-specific ``config.json`` fields of ``config`` (which must have ``moe``).

    Raises:
        InvalidConfig: ``config`` has no sparse layers or uses rotate-half RoPE.
    """
    moe = config.moe
    if moe is None or not config.rope_interleaved:
        raise InvalidConfig("an Ernie 4.5 MoE config needs moe and interleaved RoPE")
    fields: dict[str, object] = {
        "architectures": ["Ernie4_5_MoeForCausalLM"],
        "model_type": ERNIE_MOE_MODEL_TYPE,
        "use_bias": False,
        "moe_num_experts": moe.num_experts,
        "moe_k": moe.top_k,
        "moe_intermediate_size": moe.intermediate_size,
        "moe_num_shared_experts": moe.num_shared_experts,
        "moe_layer_start_index": moe.first_layer,
        "moe_layer_end_index": moe.last_layer,
        "moe_layer_interval": moe.interval,
        "moe_norm_min": moe.norm_min,
    }
    if num_mtp_layers:
        fields["num_mtp_layers"] = num_mtp_layers
    return fields


def moe_mlp_shapes(prefix: str, config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Tensor name -> shape of one sparse layer's MLP, names under ``prefix`` (``...mlp.``).

    Raises:
        InvalidConfig: ``config`` has no sparse layers.
    """
    moe = config.moe
    if moe is None:
        raise InvalidConfig("moe_mlp_shapes: the config has no sparse layers")
    hidden, width, experts = config.hidden_size, moe.intermediate_size, moe.num_experts
    shapes: dict[str, tuple[int, ...]] = {
        prefix + "gate.weight": (experts, hidden),
        prefix + "moe_statics.e_score_correction_bias": (1, experts),
    }
    for e in range(experts):
        shapes |= {
            f"{prefix}experts.{e}.gate_proj.weight": (width, hidden),
            f"{prefix}experts.{e}.up_proj.weight": (width, hidden),
            f"{prefix}experts.{e}.down_proj.weight": (hidden, width),
        }
    shared = width * moe.num_shared_experts
    if shared:
        shapes |= {
            prefix + "shared_experts.gate_proj.weight": (shared, hidden),
            prefix + "shared_experts.up_proj.weight": (shared, hidden),
            prefix + "shared_experts.down_proj.weight": (hidden, shared),
        }
    return shapes
