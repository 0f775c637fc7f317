"""The EAGLE-3 head's checkpoint format: its ``config.json`` and the tensors it must hold.

`Eagle3Config` is the owner of the format SGLang, SpecForge and vLLM write
(``LlamaForCausalLMEagle3``); `specstate.reference.eagle3_head` builds and loads the head::

    config.json        {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
                        "num_hidden_layers": 1, "vocab_size" (the target's), "draft_vocab_size",
                        "hidden_size", "intermediate_size", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta",
                        "target_hidden_size" (optional, default hidden_size),
                        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [l0, l1, l2]}}
    model.safetensors  fc.weight [H, 3 * Ht]; midlayer.{input_layernorm, hidden_norm,
                       post_attention_layernorm}.weight; midlayer.self_attn.{q,k,v}_proj.weight
                       [*, 2H], o_proj; midlayer.mlp.{gate,up,down}_proj.weight; norm.weight;
                       lm_head.weight [draft_vocab, H]; d2t [draft_vocab] int64; t2d [vocab]
                       bool; embed_tokens.weight optional and unused (the target's embedding is
                       shared, as in SGLang)

``eagle_aux_hidden_state_layer_ids`` name the layers whose *outputs* are captured (SGLang's
convention); without them the target's layers ``1, N // 2 - 1, N - 4`` are (SGLang's default,
the inputs of layers ``2, N // 2, N - 3``). Every failure is an `InvalidConfig` naming the file
and the field.
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
    "EAGLE3_ARCHITECTURE",
    "Eagle3Config",
    "parse_eagle3_config",
    "read_eagle3_config",
]

EAGLE3_ARCHITECTURE: Final = "LlamaForCausalLMEagle3"


@attrs.frozen(kw_only=True)
class Eagle3Config:
    """The shape of an EAGLE-3 head; ``dtype`` is the dtype its weights are stored in.

    Invariant: the sizes satisfy `ModelConfig`'s checks for a one-layer model, ``1 <=
    draft_vocab_size <= vocab_size``, and ``aux_layer_ids`` (when given) are three ids >= 0.
    """

    vocab_size: int
    draft_vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    target_hidden_size: int
    aux_layer_ids: tuple[int, int, int] | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    dtype: torch.dtype = torch.float32

    @classmethod
    def for_target(
        cls,
        target: ModelConfig,
        *,
        aux_layer_ids: tuple[int, int, int],
        draft_vocab_size: int | None = None,
    ) -> Eagle3Config:
        """A head shaped like one decoder layer of ``target``."""
        return cls(
            vocab_size=target.vocab_size,
            draft_vocab_size=draft_vocab_size or target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            target_hidden_size=target.hidden_size,
            aux_layer_ids=aux_layer_ids,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            dtype=target.dtype,
        )

    def layer_config(self, dtype: torch.dtype | None = None) -> ModelConfig:
        """The one-layer `ModelConfig` of the head's attention geometry and KV cache."""
        return ModelConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=1,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            max_position_embeddings=self.max_position_embeddings,
            dtype=self.dtype if dtype is None else dtype,
        )

    def feature_layers(self, num_target_layers: int) -> tuple[int, int, int]:
        """The target layers whose outputs the head reads (see the module docstring).

        Raises:
            InvalidConfig: a layer outside ``[0, num_target_layers)``.
        """
        n = num_target_layers
        ids = self.aux_layer_ids or (1, n // 2 - 1, n - 4)
        if any(not 0 <= i < n for i in ids):
            raise InvalidConfig(
                f"EAGLE-3 head reads the outputs of target layers {list(ids)} but the target has "
                f"{n} layers (set eagle_config.eagle_aux_hidden_state_layer_ids)"
            )
        return ids

    def to_json(self) -> dict[str, object]:
        """The ``config.json`` object of this head."""
        raw: dict[str, object] = {
            "architectures": [EAGLE3_ARCHITECTURE],
            "model_type": "llama",
            "num_hidden_layers": 1,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            **attrs.asdict(self, filter=lambda a, _: a.name not in ("dtype", "aux_layer_ids")),
            "dtype": str(self.dtype).removeprefix("torch."),
        }
        if self.aux_layer_ids is not None:
            raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids)}
        return raw

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of ``model.safetensors`` (``embed_tokens.weight`` aside)."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_rows = self.num_attention_heads * self.head_dim
        kv_rows = self.num_key_value_heads * self.head_dim
        layer = "midlayer."
        return {
            "fc.weight": (hidden, 3 * self.target_hidden_size),
            layer + "input_layernorm.weight": (hidden,),
            layer + "hidden_norm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_rows, 2 * hidden),
            layer + "self_attn.k_proj.weight": (kv_rows, 2 * hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, 2 * hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_rows),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
            "norm.weight": (hidden,),
            "lm_head.weight": (self.draft_vocab_size, hidden),
            "d2t": (self.draft_vocab_size,),
            "t2d": (self.vocab_size,),
        }


def _aux_ids(raw: Mapping[str, object], path: StrPath) -> tuple[int, int, int] | None:
    eagle = raw.get("eagle_config")
    if eagle is None:
        return None
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, Mapping) else eagle
    if ids is None:
        return None
    if (
        not isinstance(ids, list)
        or len(ids) != 3
        or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids)
    ):
        raise InvalidConfig(
            f"{path}: field 'eagle_config.eagle_aux_hidden_state_layer_ids' must be three layer "
            f"ids >= 0, got {ids!r}"
        )
    return (ids[0], ids[1], ids[2])


def parse_eagle3_config(raw: Mapping[str, object], path: StrPath) -> Eagle3Config:
    """Parses an EAGLE-3 head's ``config.json`` object.

    Raises:
        InvalidConfig: not an EAGLE-3 head, a missing or mistyped field, or inconsistent sizes;
            the message names the file and the field.
    """
    architectures = raw.get("architectures")
    if not isinstance(architectures, list) or EAGLE3_ARCHITECTURE not in architectures:
        raise InvalidConfig(
            f"{path}: field 'architectures' is {architectures!r}; expected "
            f"[{EAGLE3_ARCHITECTURE!r}]"
        )
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    heads = read_int_field(raw, "num_attention_heads", path)
    hidden = read_int_field(raw, "hidden_size", path)
    vocab = read_int_field(raw, "vocab_size", path)
    config = Eagle3Config(
        vocab_size=vocab,
        draft_vocab_size=read_int_field(raw, "draft_vocab_size", path, default=vocab),
        hidden_size=hidden,
        intermediate_size=read_int_field(raw, "intermediate_size", path),
        num_attention_heads=heads,
        num_key_value_heads=read_int_field(raw, "num_key_value_heads", path, default=heads),
        head_dim=read_int_field(raw, "head_dim", path, default=hidden // max(heads, 1)),
        target_hidden_size=read_int_field(raw, "target_hidden_size", path, default=hidden),
        aux_layer_ids=_aux_ids(raw, path),
        rms_norm_eps=read_float_field(raw, "rms_norm_eps", path, default=1e-6),
        rope_theta=read_float_field(raw, "rope_theta", path, default=10000.0),
        max_position_embeddings=read_int_field(raw, "max_position_embeddings", path, default=2048),
        dtype=DTYPES[dtype_name],
    )
    if not 1 <= config.draft_vocab_size <= config.vocab_size:
        raise InvalidConfig(
            f"{path}: field 'draft_vocab_size' is {config.draft_vocab_size}; expected 1 .. "
            f"vocab_size {config.vocab_size}"
        )
    try:
        config.layer_config()
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None
    return config


def read_eagle3_config(directory: StrPath) -> Eagle3Config:
    """Reads ``directory/config.json`` of an EAGLE-3 head (see `parse_eagle3_config`)."""
    raw, path = read_config_json(directory, kind="an EAGLE-3 head")
    return parse_eagle3_config(raw, path)
