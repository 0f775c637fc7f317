"""The shape of an LFM2 (short-convolution + attention) model, and its ``config.json`` form.

`Lfm2ModelConfig` describes Liquid AI's LFM2 causal LM (transformers' ``lfm2``): a stack of
pre-norm residual blocks, each an operator (grouped-query attention with RoPE and per-head
q/k RMSNorm, or a gated short convolution) followed by a SwiGLU feed-forward::

    layer_types   "full_attention"          "conv"
    our kind      Lfm2LayerKind.ATTENTION   Lfm2LayerKind.CONV

`from_hf_lfm2_config` converts the ``config.json`` object (resolving transformers'
``block_auto_adjust_ff_dim`` sizing of the feed-forward); `Lfm2ModelConfig.recurrent_spec` is
the state a worker declares for it: per short-convolution layer, its last ``conv_kernel - 1``
inputs per channel.

Invariant: every size is >= 1, ``conv_kernel >= 2``, the hidden size divides into the heads,
the heads divide by the KV heads and the head size is even (RoPE rotates halves).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from typing import Final

import attrs
import torch

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import (
    RecurrentGroupSpec,
    RecurrentStateSpec,
    StateTensorSpec,
)
from specstate.reference.checkpoint import DTYPES, StrPath, read_float_field, read_int_field

__all__ = [
    "Lfm2LayerKind",
    "Lfm2ModelConfig",
    "from_hf_lfm2_config",
    "is_lfm2_config",
    "to_hf_lfm2_config",
]

LFM2_MODEL_TYPE: Final = "lfm2"
LFM2_ARCHITECTURE: Final = "Lfm2ForCausalLM"

_SIZES: Final = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
)


class Lfm2LayerKind(enum.Enum):
    """The operator of one LFM2 block. Member order carries no meaning."""

    ATTENTION = "full_attention"
    CONV = "conv"


@attrs.frozen(kw_only=True)
class Lfm2ModelConfig:
    """An LFM2-architecture model (see the module docstring).

    Attributes:
        layer_types: the operator of every block, in order.
        intermediate_size: the feed-forward width the weights have (already adjusted).
        conv_kernel: the short convolution's length (transformers' ``conv_L_cache``).
        conv_bias: biases on the short convolution and its in/out projections.
        tie_word_embeddings: ``lm_head`` shares the embedding matrix.
        dtype: parameters, KV and convolution states.
    """

    vocab_size: int
    hidden_size: int
    layer_types: tuple[Lfm2LayerKind, ...]
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    conv_kernel: int = 3
    conv_bias: bool = False
    norm_eps: float = 1e-5
    rope_theta: float = 1e6
    tie_word_embeddings: bool = True
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def __attrs_post_init__(self) -> None:
        for name in _SIZES:
            if getattr(self, name) < 1:
                raise InvalidConfig(
                    f"Lfm2ModelConfig: {name} must be >= 1, got {getattr(self, name)}"
                )
        if self.conv_kernel < 2 or not self.layer_types:
            raise InvalidConfig(
                f"Lfm2ModelConfig: need conv_kernel >= 2 and a layer, got {self.conv_kernel}, "
                f"{len(self.layer_types)} layers"
            )
        heads = self.num_attention_heads
        if self.hidden_size % heads or heads % self.num_key_value_heads or self.head_dim % 2:
            raise InvalidConfig(
                f"Lfm2ModelConfig: hidden_size {self.hidden_size} must divide into "
                f"num_attention_heads {heads} of even size, and those by num_key_value_heads "
                f"{self.num_key_value_heads}"
            )

    @property
    def head_dim(self) -> int:
        """Size of one attention head (``hidden_size // num_attention_heads``)."""
        return self.hidden_size // self.num_attention_heads

    @property
    def num_hidden_layers(self) -> int:
        """Blocks in the stack."""
        return len(self.layer_types)

    @property
    def num_conv_layers(self) -> int:
        """Blocks holding a short convolution (each keeps a recurrent state)."""
        return sum(1 for k in self.layer_types if k is Lfm2LayerKind.CONV)

    @property
    def num_attention_layers(self) -> int:
        """Blocks holding attention (each keeps KV)."""
        return sum(1 for k in self.layer_types if k is Lfm2LayerKind.ATTENTION)

    def recurrent_spec(self, prefix: str = "target") -> RecurrentStateSpec | None:
        """The state rows a worker running this model declares (None: no convolution layer)."""
        if not self.num_conv_layers:
            return None
        conv = StateTensorSpec(
            name="conv", shape=(self.hidden_size, self.conv_kernel - 1), dtype=self.dtype
        )
        group = RecurrentGroupSpec(
            name=f"{prefix}.short_conv", num_layers=self.num_conv_layers, tensors=(conv,)
        )
        return RecurrentStateSpec(groups=(group,))


def is_lfm2_config(raw: Mapping[str, object]) -> bool:
    """True when a ``config.json`` object describes an LFM2 model."""
    architectures = raw.get("architectures")
    return raw.get("model_type") == LFM2_MODEL_TYPE or (
        isinstance(architectures, list) and LFM2_ARCHITECTURE in architectures
    )


def _layer_types(raw: Mapping[str, object], path: StrPath) -> tuple[Lfm2LayerKind, ...]:
    value = raw.get("layer_types")
    indices = raw.get("full_attn_idxs")
    if value is None and isinstance(indices, list):
        attn = set(indices)
        count = read_int_field(raw, "num_hidden_layers", path)
        value = ["full_attention" if i in attn else "conv" for i in range(count)]
    if not isinstance(value, list) or not value:
        raise InvalidConfig(f"{path}: field 'layer_types' must be a non-empty list")
    kinds = {k.value: k for k in Lfm2LayerKind}
    unknown = sorted({str(v) for v in value if v not in kinds})
    if unknown:
        raise InvalidConfig(
            f"{path}: field 'layer_types' has unsupported layers {unknown} "
            f"(supported: {sorted(kinds)})"
        )
    return tuple(kinds[str(v)] for v in value)


def _ff_dim(raw: Mapping[str, object], path: StrPath) -> int:
    """The feed-forward width transformers' ``Lfm2MLP`` builds from the config."""
    size = read_int_field(raw, "block_ff_dim", path, default=0) or read_int_field(
        raw, "intermediate_size", path
    )
    if raw.get("block_auto_adjust_ff_dim", True) is not True:
        return size
    size = int(2 * size / 3)
    multiplier = raw.get("block_ffn_dim_multiplier", 1.0)
    if multiplier is not None:
        if isinstance(multiplier, bool) or not isinstance(multiplier, int | float):
            raise InvalidConfig(f"{path}: field 'block_ffn_dim_multiplier' must be a number")
        size = int(multiplier * size)
        multiple = read_int_field(raw, "block_multiple_of", path, default=256)
        size = multiple * math.ceil(size / multiple)
    return size


def _rope_theta(raw: Mapping[str, object], path: StrPath) -> float:
    rope = raw.get("rope_parameters")
    if rope is None:
        return read_float_field(raw, "rope_theta", path, default=1e6)
    if not isinstance(rope, Mapping) or rope.get("rope_type", "default") != "default":
        raise InvalidConfig(f"{path}: field 'rope_parameters' must be default RoPE, got {rope!r}")
    return read_float_field(rope, "rope_theta", path, default=1e6)


def _token_ids(raw: Mapping[str, object], key: str, path: StrPath) -> tuple[int, ...]:
    value = raw.get(key)
    items = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise InvalidConfig(f"{path}: field '{key}' must be null, an id or a list of ids")
    return tuple(items)


def from_hf_lfm2_config(raw: Mapping[str, object], path: StrPath) -> Lfm2ModelConfig:
    """Parse a transformers ``lfm2`` ``config.json`` object.

    Raises:
        InvalidConfig: not an LFM2 config, an unsupported feature (a RoPE scaling, an
            unknown layer type, an explicit ``head_dim`` other than hidden over heads), or a
            missing or mistyped field; the message names the file and field.
    """
    if not is_lfm2_config(raw):
        raise InvalidConfig(
            f"{path}: field 'model_type' is {raw.get('model_type')!r}; expected 'lfm2'"
        )
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    heads = read_int_field(raw, "num_attention_heads", path)
    hidden = read_int_field(raw, "hidden_size", path)
    if raw.get("head_dim") not in (None, hidden // heads):
        raise InvalidConfig(f"{path}: field 'head_dim' must be hidden_size // num_attention_heads")
    bos = _token_ids(raw, "bos_token_id", path)
    try:
        return Lfm2ModelConfig(
            vocab_size=read_int_field(raw, "vocab_size", path),
            hidden_size=hidden,
            layer_types=_layer_types(raw, path),
            num_attention_heads=heads,
            num_key_value_heads=read_int_field(raw, "num_key_value_heads", path, default=heads),
            intermediate_size=_ff_dim(raw, path),
            conv_kernel=read_int_field(raw, "conv_L_cache", path, default=3),
            conv_bias=raw.get("conv_bias", False) is True,
            norm_eps=read_float_field(raw, "norm_eps", path, default=1e-5),
            rope_theta=_rope_theta(raw, path),
            tie_word_embeddings=raw.get("tie_word_embeddings", raw.get("tie_embedding", True))
            is True,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=_token_ids(raw, "eos_token_id", path),
            dtype=DTYPES[dtype_name],
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None


def to_hf_lfm2_config(config: Lfm2ModelConfig) -> dict[str, object]:
    """A transformers ``lfm2`` ``config.json`` object that `from_hf_lfm2_config` reads back
    as ``config`` (the feed-forward width is written as it is, with no automatic sizing)."""
    eos = list(config.eos_token_ids)
    return {
        "architectures": [LFM2_ARCHITECTURE],
        "model_type": LFM2_MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "block_auto_adjust_ff_dim": False,
        "num_hidden_layers": len(config.layer_types),
        "layer_types": [kind.value for kind in config.layer_types],
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "conv_L_cache": config.conv_kernel,
        "conv_bias": config.conv_bias,
        "norm_eps": config.norm_eps,
        "rope_theta": config.rope_theta,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": eos[0] if len(eos) == 1 else (eos or None),
        "pad_token_id": None,
        "dtype": str(config.dtype).removeprefix("torch."),
    }
