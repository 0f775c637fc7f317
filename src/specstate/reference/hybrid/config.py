"""The shape of a hybrid (Mamba2 + attention) model, and its Hugging Face ``config.json`` form.

`HybridConfig` describes a NemotronH-architecture causal LM (transformers' ``nemotron_h``): a
stack of pre-norm residual blocks, each holding one mixer — a Mamba2 layer, a grouped-query
attention layer without positional encoding, or a squared-ReLU MLP::

    layers_block_type   "linear_attention"  "full_attention"  "mlp"   ("moe" is refused)
    pattern character          M                  *            -
    our layer kind          LayerKind.MAMBA  LayerKind.ATTENTION  LayerKind.MLP

`from_hf_config` / `to_hf_config` convert the ``config.json`` object; `HybridConfig.recurrent_spec`
is the state a worker declares for it (`specstate.memory.recurrent`).

Invariant: every size is >= 1, attention heads divide by KV heads, the Mamba2 heads divide by
its groups, and ``mamba_num_heads * mamba_head_dim`` divides by the groups (the gated norm is
per group).
"""

from __future__ import annotations

import enum
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

__all__ = ["HybridConfig", "LayerKind", "from_hf_config", "is_hybrid_config", "to_hf_config"]

MODEL_TYPE: Final = "nemotron_h"
ARCHITECTURE: Final = "NemotronHForCausalLM"


_SIZES: Final = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "mamba_num_heads",
    "mamba_head_dim",
    "n_groups",
    "ssm_state_size",
)
"""The sizes a `HybridConfig` refuses below 1."""


class LayerKind(enum.Enum):
    """The mixer of one block. Member order carries no meaning."""

    MAMBA = "linear_attention"
    ATTENTION = "full_attention"
    MLP = "mlp"


@attrs.frozen(kw_only=True)
class HybridConfig:
    """A NemotronH-architecture model (see the module docstring).

    Attributes:
        layer_types: the mixer of every block, in order.
        time_step_min: the lower clamp of ``softplus(dt + dt_bias)`` (transformers clamps in
            its chunked scan; its one-token step does not — the two agree unless the clamp
            binds).
        dtype: parameters, KV and convolution states; the SSM state is always float32.

    ``lm_head`` is always its own matrix: transformers' NemotronH declares no tied weights, so
    it ignores ``tie_word_embeddings`` and so does this config.
    """

    vocab_size: int
    hidden_size: int
    layer_types: tuple[LayerKind, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    mamba_num_heads: int
    mamba_head_dim: int
    n_groups: int
    ssm_state_size: int
    conv_kernel: int
    use_conv_bias: bool = True
    use_bias: bool = False
    mlp_bias: bool = False
    time_step_min: float = 0.001
    layer_norm_epsilon: float = 1e-5
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: torch.dtype = torch.float32

    def __attrs_post_init__(self) -> None:
        for name in _SIZES:
            if getattr(self, name) < 1:
                raise InvalidConfig(f"HybridConfig: {name} must be >= 1, got {getattr(self, name)}")
        if self.conv_kernel < 2 or not self.layer_types:
            raise InvalidConfig(
                f"HybridConfig: need conv_kernel >= 2 and a layer, got {self.conv_kernel}, "
                f"{len(self.layer_types)} layers"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise InvalidConfig(
                f"HybridConfig: num_attention_heads {self.num_attention_heads} is not divisible "
                f"by num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise InvalidConfig(
                f"HybridConfig: head_dim must be even (the KV layout), got {self.head_dim}"
            )
        if self.mamba_num_heads % self.n_groups or self.mamba_intermediate % self.n_groups:
            raise InvalidConfig(
                f"HybridConfig: mamba_num_heads {self.mamba_num_heads} and the intermediate size "
                f"{self.mamba_intermediate} must divide by n_groups {self.n_groups}"
            )

    @property
    def num_hidden_layers(self) -> int:
        """Blocks in the stack."""
        return len(self.layer_types)

    @property
    def mamba_intermediate(self) -> int:
        """Width of a Mamba2 layer's inner stream (``mamba_num_heads * mamba_head_dim``)."""
        return self.mamba_num_heads * self.mamba_head_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the causal convolution: ``x``, ``B`` and ``C``."""
        return self.mamba_intermediate + 2 * self.n_groups * self.ssm_state_size

    @property
    def num_mamba_layers(self) -> int:
        """Blocks holding a Mamba2 mixer (each keeps a recurrent state)."""
        return sum(1 for k in self.layer_types if k is LayerKind.MAMBA)

    @property
    def num_attention_layers(self) -> int:
        """Blocks holding an attention mixer (each keeps KV)."""
        return sum(1 for k in self.layer_types if k is LayerKind.ATTENTION)

    def recurrent_spec(self, prefix: str = "target") -> RecurrentStateSpec | None:
        """The state rows a worker running this model declares (None: no Mamba2 layer)."""
        layers = self.num_mamba_layers
        if not layers:
            return None
        conv = StateTensorSpec(
            name="conv", shape=(self.conv_dim, self.conv_kernel - 1), dtype=self.dtype
        )
        ssm = StateTensorSpec(
            name="ssm",
            shape=(self.mamba_num_heads, self.mamba_head_dim, self.ssm_state_size),
            dtype=torch.float32,
        )
        group = RecurrentGroupSpec(name=f"{prefix}.mamba2", num_layers=layers, tensors=(conv, ssm))
        return RecurrentStateSpec(groups=(group,))


def is_hybrid_config(raw: Mapping[str, object]) -> bool:
    """True when a ``config.json`` object describes a NemotronH model."""
    architectures = raw.get("architectures")
    return raw.get("model_type") == MODEL_TYPE or (
        isinstance(architectures, list) and ARCHITECTURE in architectures
    )


def _layer_types(raw: Mapping[str, object], path: StrPath) -> tuple[LayerKind, ...]:
    value = raw.get("layers_block_type")
    if value is None and isinstance(raw.get("hybrid_override_pattern"), str):
        chars = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
        value = [chars.get(c, c) for c in str(raw["hybrid_override_pattern"])]
    if not isinstance(value, list) or not value:
        raise InvalidConfig(f"{path}: field 'layers_block_type' must be a non-empty list")
    kinds = {k.value: k for k in LayerKind}
    unknown = sorted({str(v) for v in value if v not in kinds})
    if unknown:
        raise InvalidConfig(
            f"{path}: field 'layers_block_type' has unsupported layers {unknown} "
            f"(supported: {sorted(kinds)})"
        )
    return tuple(kinds[str(v)] for v in value)


def _require(raw: Mapping[str, object], key: str, want: object, path: StrPath) -> None:
    got = raw.get(key, want)
    if got != want:
        raise InvalidConfig(f"{path}: field '{key}' is {got!r}; only {want!r} is supported")


def _token_ids(raw: Mapping[str, object], key: str, path: StrPath) -> tuple[int, ...]:
    value = raw.get(key)
    items = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(i, bool) or not isinstance(i, int) for i in items):
        raise InvalidConfig(f"{path}: field '{key}' must be null, an id or a list of ids")
    return tuple(items)


def from_hf_config(raw: Mapping[str, object], path: StrPath) -> HybridConfig:
    """Parse a transformers ``nemotron_h`` ``config.json`` object.

    Raises:
        InvalidConfig: not a NemotronH config, an unsupported feature (MoE layers, another
            activation, a sliding window, multi-token prediction layers, a non-float32 SSM
            cache), or a missing or mistyped field; the message names the file and field.
    """
    if not is_hybrid_config(raw):
        raise InvalidConfig(
            f"{path}: field 'model_type' is {raw.get('model_type')!r}; expected {MODEL_TYPE!r}"
        )
    _require(raw, "mlp_hidden_act", "relu2", path)
    _require(raw, "mamba_hidden_act", "silu", path)
    _require(raw, "sliding_window", None, path)
    _require(raw, "num_nextn_predict_layers", 0, path)
    _require(raw, "mamba_ssm_cache_dtype", "float32", path)
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    heads = read_int_field(raw, "num_attention_heads", path)
    bos = _token_ids(raw, "bos_token_id", path)
    try:
        return HybridConfig(
            vocab_size=read_int_field(raw, "vocab_size", path),
            hidden_size=read_int_field(raw, "hidden_size", path),
            layer_types=_layer_types(raw, path),
            num_attention_heads=heads,
            num_key_value_heads=read_int_field(raw, "num_key_value_heads", path, default=heads),
            head_dim=read_int_field(raw, "head_dim", path),
            intermediate_size=read_int_field(raw, "intermediate_size", path),
            mamba_num_heads=read_int_field(raw, "mamba_num_heads", path),
            mamba_head_dim=read_int_field(raw, "mamba_head_dim", path),
            n_groups=read_int_field(raw, "n_groups", path),
            ssm_state_size=read_int_field(raw, "ssm_state_size", path),
            conv_kernel=read_int_field(raw, "conv_kernel", path),
            use_conv_bias=raw.get("use_conv_bias", True) is True,
            use_bias=raw.get("use_bias", False) is True,
            mlp_bias=raw.get("mlp_bias", False) is True,
            time_step_min=read_float_field(raw, "time_step_min", path, default=0.001),
            layer_norm_epsilon=read_float_field(raw, "layer_norm_epsilon", path, default=1e-5),
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=_token_ids(raw, "eos_token_id", path),
            dtype=DTYPES[dtype_name],
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None


def to_hf_config(config: HybridConfig) -> dict[str, object]:
    """The ``config.json`` object transformers' ``NemotronHForCausalLM`` loads."""
    dtype_name = str(config.dtype).removeprefix("torch.")
    eos = config.eos_token_ids
    return {
        "architectures": [ARCHITECTURE],
        "model_type": MODEL_TYPE,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "layers_block_type": [k.value for k in config.layer_types],
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "intermediate_size": config.intermediate_size,
        "mlp_hidden_act": "relu2",
        "mlp_bias": config.mlp_bias,
        "mamba_num_heads": config.mamba_num_heads,
        "mamba_head_dim": config.mamba_head_dim,
        "mamba_hidden_act": "silu",
        "n_groups": config.n_groups,
        "ssm_state_size": config.ssm_state_size,
        "conv_kernel": config.conv_kernel,
        "use_conv_bias": config.use_conv_bias,
        "use_bias": config.use_bias,
        "time_step_min": config.time_step_min,
        "mamba_ssm_cache_dtype": "float32",
        "layer_norm_epsilon": config.layer_norm_epsilon,
        "tie_word_embeddings": False,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else list(eos),
        "dtype": dtype_name,
    }
