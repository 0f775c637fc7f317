"""The Frozen-KV MTP assistant's checkpoint format: its ``config.json`` and its tensors.

`FrozenKvConfig` owns the format (this project's: the shape of Gemma 4's assistant on a
Llama-architecture target); `specstate.reference.frozen_kv_head` builds and loads the assistant::

    config.json        {"model_type": "specstate_frozen_kv_mtp", "vocab_size", "hidden_size",
                        "backbone_hidden_size", "intermediate_size", "num_hidden_layers",
                        "num_attention_heads", "num_key_value_heads", "head_dim",
                        "rms_norm_eps", "rope_theta", "kv_layer" (null: the target's last),
                        "dtype"}
    model.safetensors  pre_projection.weight [H, 2 * Hb]; post_projection.weight [Hb, H];
                       layers.{i}.{input_layernorm, post_attention_layernorm}.weight;
                       layers.{i}.self_attn.{q_proj [heads * d, H], o_proj [H, heads * d]};
                       layers.{i}.mlp.{gate,up,down}_proj.weight; norm.weight;
                       lm_head.weight [vocab, H]

Every failure is an `InvalidConfig` naming the file and the field.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

import attrs
import torch

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    DTYPES,
    StrPath,
    read_config_json,
    read_float_field,
    read_int_field,
)
from specstate.reference.model import ModelConfig

__all__ = [
    "FROZEN_KV_MODEL_TYPE",
    "FrozenKvConfig",
    "parse_frozen_kv_config",
    "read_frozen_kv_config",
]

FROZEN_KV_MODEL_TYPE: Final = "specstate_frozen_kv_mtp"


@attrs.frozen(kw_only=True)
class FrozenKvConfig:
    """The shape of an assistant; ``dtype`` is the dtype its weights are stored in.

    Invariant: every size is >= 1 and ``num_attention_heads % num_key_value_heads == 0``.
    """

    vocab_size: int
    hidden_size: int
    backbone_hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    kv_layer: int | None = None
    dtype: torch.dtype = torch.float32

    def __attrs_post_init__(self) -> None:
        sizes = attrs.asdict(self, filter=lambda a, v: isinstance(v, int) and a.name != "kv_layer")
        small = {k: v for k, v in sizes.items() if v < 1}
        if small or self.num_attention_heads % self.num_key_value_heads:
            raise InvalidConfig(
                f"FrozenKvConfig: sizes must be >= 1 {small or ''} and num_attention_heads "
                f"({self.num_attention_heads}) divisible by num_key_value_heads "
                f"({self.num_key_value_heads})"
            )

    @classmethod
    def for_target(cls, target: ModelConfig, *, num_hidden_layers: int = 1) -> FrozenKvConfig:
        """An assistant shaped like ``target``'s decoder layers, reading its last layer's KV."""
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            backbone_hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            dtype=target.dtype,
        )

    def source_layer(self, target: ModelConfig) -> int:
        """The target layer whose KV the assistant reads.

        Raises:
            InvalidConfig: the layer is outside the target, or its KV geometry (heads, head
                dim) or the target's width or vocabulary differ from the assistant's.
        """
        layer = target.num_hidden_layers - 1 if self.kv_layer is None else self.kv_layer
        if not 0 <= layer < target.num_hidden_layers:
            raise InvalidConfig(
                f"Frozen-KV assistant reads the KV of target layer {layer}; the target has "
                f"{target.num_hidden_layers} layers"
            )
        checks = (
            ("num_key_value_heads", self.num_key_value_heads, target.num_key_value_heads),
            ("head_dim", self.head_dim, target.head_dim),
            ("backbone_hidden_size", self.backbone_hidden_size, target.hidden_size),
            ("vocab_size", self.vocab_size, target.vocab_size),
        )
        for name, ours, theirs in checks:
            if ours != theirs:
                raise InvalidConfig(
                    f"Frozen-KV assistant {name} {ours} differs from the target's {theirs}"
                )
        return layer

    def to_json(self) -> dict[str, object]:
        """The ``config.json`` object of this assistant."""
        fields = attrs.asdict(self, filter=lambda a, _: a.name != "dtype")
        dtype = str(self.dtype).removeprefix("torch.")
        return {"model_type": FROZEN_KV_MODEL_TYPE, **fields, "dtype": dtype}

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of ``model.safetensors``."""
        hidden, inter, q_rows = (
            self.hidden_size,
            self.intermediate_size,
            self.num_attention_heads * self.head_dim,
        )
        shapes: dict[str, tuple[int, ...]] = {
            "pre_projection.weight": (hidden, 2 * self.backbone_hidden_size),
            "post_projection.weight": (self.backbone_hidden_size, hidden),
            "norm.weight": (hidden,),
            "lm_head.weight": (self.vocab_size, hidden),
        }
        for i in range(self.num_hidden_layers):
            layer = f"layers.{i}."
            shapes |= {
                layer + "input_layernorm.weight": (hidden,),
                layer + "post_attention_layernorm.weight": (hidden,),
                layer + "self_attn.q_proj.weight": (q_rows, hidden),
                layer + "self_attn.o_proj.weight": (hidden, q_rows),
                layer + "mlp.gate_proj.weight": (inter, hidden),
                layer + "mlp.up_proj.weight": (inter, hidden),
                layer + "mlp.down_proj.weight": (hidden, inter),
            }
        return shapes


def parse_frozen_kv_config(raw: Mapping[str, object], path: StrPath) -> FrozenKvConfig:
    """Parses an assistant's ``config.json`` object.

    Raises:
        InvalidConfig: the wrong ``model_type``, a missing or mistyped field, or inconsistent
            sizes; the message names the file and the field.
    """
    if raw.get("model_type") != FROZEN_KV_MODEL_TYPE:
        raise InvalidConfig(
            f"{path}: field 'model_type' is {raw.get('model_type')!r}; "
            f"expected {FROZEN_KV_MODEL_TYPE!r}"
        )
    dtype_name = raw.get("dtype") or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    kv_layer = raw.get("kv_layer")
    sizes = {
        key: read_int_field(raw, key, path)
        for key in (
            "vocab_size",
            "hidden_size",
            "backbone_hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    }
    try:
        return FrozenKvConfig(
            **sizes,
            rms_norm_eps=read_float_field(raw, "rms_norm_eps", path, default=1e-6),
            rope_theta=read_float_field(raw, "rope_theta", path, default=10000.0),
            kv_layer=None if kv_layer is None else read_int_field(raw, "kv_layer", path),
            dtype=DTYPES[dtype_name],
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None


def read_frozen_kv_config(directory: StrPath) -> FrozenKvConfig:
    """Reads ``directory/config.json`` of an assistant (see `parse_frozen_kv_config`)."""
    raw, path = read_config_json(directory, kind="a Frozen-KV MTP assistant")
    return parse_frozen_kv_config(raw, path)
