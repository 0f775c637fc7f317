"""The paged EAGLE draft head: one Llama decoder layer over the target's features and tokens.

`EagleHead` owns the head's parameters and its own paged KV cache, indexed by the SAME token
slots as the target. At position ``p`` with token ``t_p`` and feature ``f_(p-1)`` (the target's
last decoder layer output *before* the final norm at ``p - 1``, `ModelOutput.hidden_states`;
zeros for ``p = 0``)::

    e   = target.embed_tokens(t_p)
    x   = fc(cat([e, f_(p-1)], -1))                      fc: [hidden, 2 * hidden], no bias
    h   = decoder_layer(x)                               pre-norm residual, RoPE at p, causal
                                                         attention over the head's KV <= p
    logits = target_lm_head(norm(h))                     tied target: embed_tokens.weight
    draft  = argmax(logits); h is the feature of the next draft step

On disk (this module owns the format) a head is a directory::

    config.json        {"model_type": "specstate_eagle", "vocab_size", "hidden_size",
                        "intermediate_size", "num_attention_heads", "num_key_value_heads",
                        "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings",
                        "dtype"}
    model.safetensors  fc.weight; layers.0.{input_layernorm, post_attention_layernorm}.weight;
                       layers.0.self_attn.{q,k,v,o}_proj.weight; layers.0.mlp.{gate,up,down}_
                       proj.weight; norm.weight  (HF Llama shapes; no embedding, no lm_head)

Every loading failure is an `InvalidConfig` naming the file and the field or tensor.

Invariant: the head reads the target's embedding and lm_head (shared, never written) and writes
only its own KV cache, at ``out_cache_loc``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Final

import attrs
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    CONFIG_FILE,
    DTYPES,
    WEIGHTS_FILE,
    read_checked_tensors,
    read_config_json,
    read_float_field,
    read_int_field,
    write_safetensors,
)
from specstate.reference.model import (
    AttentionBatch,
    DecoderLayer,
    KvCache,
    ModelConfig,
    ModelOutput,
    PagedLlama,
    RMSNorm,
    plan_forward,
)

__all__ = [
    "EAGLE_MODEL_TYPE",
    "EagleHead",
    "EagleHeadConfig",
    "load_eagle_head",
    "read_eagle_config",
    "save_eagle_head",
]

EAGLE_MODEL_TYPE: Final = "specstate_eagle"

StrPath = str | os.PathLike[str]


@attrs.frozen(kw_only=True)
class EagleHeadConfig:
    """The shape of an EAGLE head; ``dtype`` is the dtype its weights are stored in.

    Invariant: the sizes satisfy `ModelConfig`'s checks for a one-layer model (checked by
    `layer_config`, which every constructor calls).
    """

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    dtype: torch.dtype = torch.float32

    @classmethod
    def for_target(
        cls, target: ModelConfig, *, intermediate_size: int | None = None
    ) -> EagleHeadConfig:
        """A head shaped like one decoder layer of ``target``."""
        return cls(
            vocab_size=target.vocab_size,
            hidden_size=target.hidden_size,
            intermediate_size=intermediate_size or target.intermediate_size,
            num_attention_heads=target.num_attention_heads,
            num_key_value_heads=target.num_key_value_heads,
            head_dim=target.head_dim,
            rms_norm_eps=target.rms_norm_eps,
            rope_theta=target.rope_theta,
            max_position_embeddings=target.max_position_embeddings,
            dtype=target.dtype,
        )

    def layer_config(self, dtype: torch.dtype | None = None) -> ModelConfig:
        """The one-layer `ModelConfig` of the head's decoder layer and KV cache."""
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
            tie_word_embeddings=True,
            dtype=self.dtype if dtype is None else dtype,
        )

    def to_json(self) -> dict[str, object]:
        """The ``config.json`` object of this head."""
        fields = attrs.asdict(self, filter=lambda a, _: a.name != "dtype")
        return {"model_type": EAGLE_MODEL_TYPE, **fields, "dtype": str(self.dtype).split(".")[-1]}

    def expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Tensor name -> shape of ``model.safetensors``."""
        hidden, inter = self.hidden_size, self.intermediate_size
        q_rows, kv_rows = (
            self.num_attention_heads * self.head_dim,
            self.num_key_value_heads * self.head_dim,
        )
        layer = "layers.0."
        return {
            "fc.weight": (hidden, 2 * hidden),
            layer + "input_layernorm.weight": (hidden,),
            layer + "self_attn.q_proj.weight": (q_rows, hidden),
            layer + "self_attn.k_proj.weight": (kv_rows, hidden),
            layer + "self_attn.v_proj.weight": (kv_rows, hidden),
            layer + "self_attn.o_proj.weight": (hidden, q_rows),
            layer + "post_attention_layernorm.weight": (hidden,),
            layer + "mlp.gate_proj.weight": (inter, hidden),
            layer + "mlp.up_proj.weight": (inter, hidden),
            layer + "mlp.down_proj.weight": (hidden, inter),
            "norm.weight": (hidden,),
        }


def parse_eagle_config(raw: Mapping[str, object], path: StrPath) -> EagleHeadConfig:
    """Parses a head's ``config.json`` object.

    Raises:
        InvalidConfig: the wrong ``model_type``, a missing or mistyped field, or inconsistent
            sizes; the message names the file and the field.
    """
    if raw.get("model_type") != EAGLE_MODEL_TYPE:
        raise InvalidConfig(
            f"{path}: field 'model_type' is {raw.get('model_type')!r};"
            f" expected {EAGLE_MODEL_TYPE!r}"
        )
    dtype_name = raw.get("dtype") or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    sizes = {
        key: read_int_field(raw, key, path)
        for key in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
        )
    }
    config = EagleHeadConfig(
        **sizes,
        rms_norm_eps=read_float_field(raw, "rms_norm_eps", path, default=1e-6),
        rope_theta=read_float_field(raw, "rope_theta", path, default=10000.0),
        max_position_embeddings=read_int_field(raw, "max_position_embeddings", path, default=2048),
        dtype=DTYPES[dtype_name],
    )
    try:
        config.layer_config()
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None
    return config


def read_eagle_config(directory: StrPath) -> EagleHeadConfig:
    """Reads ``directory/config.json`` of an EAGLE head (see `parse_eagle_config`)."""
    raw, path = read_config_json(directory, kind="an EAGLE head")
    return parse_eagle_config(raw, path)


def _check_fits_target(config: EagleHeadConfig, target: ModelConfig, where: str) -> None:
    """Raise `InvalidConfig` unless the head's hidden and vocab sizes equal the target's."""
    for name in ("hidden_size", "vocab_size"):
        ours, theirs = getattr(config, name), getattr(target, name)
        if ours != theirs:
            raise InvalidConfig(
                f"{where}: EAGLE head {name} {ours} differs from the target's {theirs}"
            )


class EagleHead(nn.Module):
    """The paged EAGLE head (see the module docstring); inference only.

    Args:
        config: the head's shape.
        target: the target whose embedding and lm_head the head shares; the head computes in
            the target's dtype on the target's device.
        num_token_slots: KV slots of the head's cache (default: the target cache's).

    Raises:
        InvalidConfig: the head's hidden or vocab size differs from the target's.
    """

    def __init__(
        self, config: EagleHeadConfig, target: PagedLlama, *, num_token_slots: int | None = None
    ) -> None:
        super().__init__()
        _check_fits_target(config, target.config, "EagleHead")
        self.config = config
        self._layer_config = config.layer_config(dtype=target.config.dtype)
        device = target.embed_tokens.weight.device
        hidden = config.hidden_size
        with torch.device(device):
            self.fc = nn.Linear(2 * hidden, hidden, bias=False)
            self.layers = nn.ModuleList([DecoderLayer(self._layer_config, 0)])
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
        self.to(dtype=target.config.dtype)
        self.requires_grad_(False)
        # Detached views, not parameters: they share the target's storage and are not saved
        # with the head (assigning a Parameter would register it).
        self._embedding = target.embed_tokens.weight.detach()
        lm_head = target.embed_tokens if target.lm_head is None else target.lm_head
        self._lm_head = lm_head.weight.detach()
        slots = target.kv_cache.num_token_slots if num_token_slots is None else num_token_slots
        self._kv_cache = KvCache.allocate(self._layer_config, num_token_slots=slots, device=device)

    @property
    def kv_cache(self) -> KvCache:
        """The head's own KV cache (same slot indexing as the target's)."""
        return self._kv_cache

    def forward(
        self,
        batch: AttentionBatch,
        features: torch.Tensor,
        *,
        logit_rows: torch.Tensor | None = None,
    ) -> ModelOutput:
        """One extend of the head: writes its KV at ``out_cache_loc``.

        Args:
            batch: the tokens ``t_p`` and slot tables.
            features: ``[T, hidden]`` ``f_(p-1)`` of each token (zeros at position 0).
            logit_rows: optional rows that get logits (empty: a KV-only forward).

        Returns:
            logits of the next token, and ``h`` ``[T, hidden]`` (the next step's features).

        Raises:
            InvalidConfig: ``features`` is not ``[T, hidden]``, or the batch is inconsistent.
        """
        num_tokens = batch.input_ids.shape[0]
        if tuple(features.shape) != (num_tokens, self.config.hidden_size):
            raise InvalidConfig(
                f"EagleHead: features {tuple(features.shape)} must be "
                f"[{num_tokens}, {self.config.hidden_size}]"
            )
        with torch.no_grad():
            plan = plan_forward(batch, self._layer_config, self._kv_cache.num_token_slots)
            embedded = F.embedding(batch.input_ids, self._embedding)
            x = self.fc(torch.cat([embedded, features.to(embedded.dtype)], dim=-1))
            x = self.layers[0](x, plan, self._kv_cache)
            normed = self.norm(x if logit_rows is None else x[logit_rows])
            logits = F.linear(normed, self._lm_head).float()
        return ModelOutput(logits=logits, hidden_states=x)


def _read_head_tensors(path: Path, config: EagleHeadConfig) -> dict[str, torch.Tensor]:
    """Reads every expected tensor of ``path``, checking names and shapes first."""
    return read_checked_tensors(path, config.expected_shapes(), kind="the EAGLE head")


def load_eagle_head(
    directory: StrPath, target: PagedLlama, *, num_token_slots: int | None = None
) -> EagleHead:
    """Loads the EAGLE head in ``directory`` for ``target`` (see `EagleHead` for the args).

    Raises:
        InvalidConfig: a bad config, a head that does not fit the target, a missing file, or a
            missing, misshapen or unexpected tensor; the message names the file.
    """
    root = Path(directory)
    config = read_eagle_config(root)
    _check_fits_target(config, target.config, str(root / CONFIG_FILE))
    try:
        tensors = _read_head_tensors(root / WEIGHTS_FILE, config)
    except SafetensorError as error:  # a truncated or foreign file: name it, not a traceback
        raise InvalidConfig(f"{root}: unreadable safetensors weights ({error})") from None
    head = EagleHead(config, target, num_token_slots=num_token_slots)
    head.load_state_dict(tensors, strict=True)
    return head


def save_eagle_head(head: EagleHead, directory: StrPath) -> None:
    """Writes ``config.json`` and ``model.safetensors`` of ``head`` (created if needed)."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    dtype = head.fc.weight.dtype
    raw = attrs.evolve(head.config, dtype=dtype).to_json()
    (root / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    tensors = {name: t.detach().to("cpu").contiguous() for name, t in head.state_dict().items()}
    write_safetensors(tensors, root / WEIGHTS_FILE)
