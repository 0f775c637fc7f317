"""DFlash assistant checkpoints: Hugging Face's ``muse_glimmer_assistant`` directory format.

A DFlash assistant is a directory as ``transformers`` saves a ``MuseGlimmerAssistantModel``
(the assistant of ``generate(..., speculation_type="dflash")``)::

    config.json        {"model_type": "muse_glimmer_assistant", "vocab_size", "hidden_size",
                        "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters":
                        {"rope_type": "default", "rope_theta"}, "max_position_embeddings",
                        "hidden_act": "silu", "layer_types", "sliding_window", "block_size",
                        "mask_token_id", "target_layer_ids", "dtype"}
    model.safetensors  encoder.fc.weight, encoder.output_norm_enc.weight, norm.weight;
                       layers.N.{input_layernorm, post_attention_layernorm}.weight;
                       layers.N.self_attn.{q,k,v,o}_proj.weight, .{q,k}_norm.weight;
                       layers.N.mlp.{gate,up,down}_proj.weight  (no embedding, no LM head: the
                       target's are shared)

Fields absent from ``config.json`` take ``transformers``' defaults. The reference assistant
attends over the whole context: a layer of type ``sliding_attention`` is refused unless its
window covers every position (``sliding_window`` null or at least
``max_position_embeddings``). Every loading failure is an `InvalidConfig` naming the file and
the field or tensor.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

import torch
from safetensors import SafetensorError

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    CONFIG_FILE,
    DTYPES,
    WEIGHTS_FILE,
    read_checked_tensors,
    read_config_json,
    read_float_field,
    read_int_field,
)
from specstate.reference.dflash_assistant import DFlashAssistant, DFlashConfig, check_fits_target
from specstate.reference.model import PagedLlama

__all__ = [
    "DFLASH_MODEL_TYPE",
    "load_dflash_assistant",
    "parse_dflash_config",
    "read_dflash_config",
]

DFLASH_MODEL_TYPE: Final = "muse_glimmer_assistant"

StrPath = str | os.PathLike[str]

_SIZES: Final = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
)


def _rope_theta(raw: Mapping[str, object], path: StrPath) -> float:
    """The RoPE base of ``rope_parameters`` (default RoPE only; transformers' default base)."""
    params = raw.get("rope_parameters")
    if params is None:
        return 500000.0
    if not isinstance(params, dict) or params.get("rope_type", "default") != "default":
        raise InvalidConfig(
            f"{path}: field 'rope_parameters' is {params!r}; the reference assistant runs "
            "default RoPE only"
        )
    return read_float_field(params, "rope_theta", path, default=500000.0)


def _layer_ids(raw: Mapping[str, object], path: StrPath) -> tuple[int, ...]:
    value = raw.get("target_layer_ids")
    ids = [1, 13, 25, 37, 49] if value is None else value
    if not isinstance(ids, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in ids):
        raise InvalidConfig(f"{path}: field 'target_layer_ids' must be a list of layer ids")
    return tuple(ids)


def _check_attention(raw: Mapping[str, object], path: StrPath, num_layers: int) -> None:
    """Refuse a non-SwiGLU MLP and a sliding window narrower than the context."""
    if raw.get("hidden_act", "silu") != "silu":
        raise InvalidConfig(f"{path}: field 'hidden_act' is {raw['hidden_act']!r}; expected 'silu'")
    types = raw.get("layer_types")
    kinds = ["sliding_attention"] * num_layers if types is None else types
    if not isinstance(kinds, list) or len(kinds) != num_layers:
        raise InvalidConfig(f"{path}: field 'layer_types' must list {num_layers} layer types")
    window = raw.get("sliding_window", 2048)
    positions = read_int_field(raw, "max_position_embeddings", path, default=131072)
    for i, kind in enumerate(kinds):
        if kind == "full_attention":
            continue
        binding = isinstance(window, int) and window < positions
        if kind != "sliding_attention" or binding:
            raise InvalidConfig(
                f"{path}: layer {i} is {kind!r} with sliding_window {window} below "
                f"max_position_embeddings {positions}; the reference assistant attends over the "
                "whole context (set layer_types to full_attention)"
            )


def parse_dflash_config(raw: Mapping[str, object], path: StrPath) -> DFlashConfig:
    """Parses an assistant's ``config.json`` object.

    Raises:
        InvalidConfig: the wrong ``model_type``, a missing or mistyped field, an unsupported
            layer, or inconsistent sizes; the message names the file and the field.
    """
    if raw.get("model_type") != DFLASH_MODEL_TYPE:
        raise InvalidConfig(
            f"{path}: field 'model_type' is {raw.get('model_type')!r}; expected "
            f"{DFLASH_MODEL_TYPE!r} (a DFlash assistant)"
        )
    dtype_name = raw.get("dtype") or raw.get("torch_dtype") or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    sizes = {key: read_int_field(raw, key, path) for key in _SIZES}
    _check_attention(raw, path, sizes["num_hidden_layers"])
    head_dim = sizes["hidden_size"] // max(sizes["num_attention_heads"], 1)
    try:
        return DFlashConfig(
            **sizes,
            head_dim=read_int_field(raw, "head_dim", path, default=head_dim),
            block_size=read_int_field(raw, "block_size", path, default=16),
            mask_token_id=read_int_field(raw, "mask_token_id", path, default=201818),
            target_layer_ids=_layer_ids(raw, path),
            rms_norm_eps=read_float_field(raw, "rms_norm_eps", path, default=1e-5),
            rope_theta=_rope_theta(raw, path),
            max_position_embeddings=read_int_field(
                raw, "max_position_embeddings", path, default=131072
            ),
            dtype=DTYPES[dtype_name],
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None


def read_dflash_config(directory: StrPath) -> DFlashConfig:
    """Reads ``directory/config.json`` of a DFlash assistant (see `parse_dflash_config`)."""
    raw, path = read_config_json(directory, kind="a DFlash assistant")
    return parse_dflash_config(raw, path)


def _read_tensors(
    path: Path, config: DFlashConfig, keep: Callable[[str], bool] | None
) -> dict[str, torch.Tensor]:
    """Every expected tensor of ``path``, names and shapes checked first."""
    return read_checked_tensors(
        path, config.expected_shapes(), kind="the DFlash assistant", keep=keep
    )


def load_dflash_assistant(
    directory: StrPath,
    target: PagedLlama,
    *,
    num_token_slots: int | None = None,
    keep: Callable[[str], bool] | None = None,
) -> DFlashAssistant:
    """Loads the DFlash assistant in ``directory`` for ``target`` (see `DFlashAssistant`);
    ``keep``: which tensors of the file are the assistant's (None: all; a DSpark assistant's
    heads share the file, `specstate.reference.dspark_checkpoint`).

    Raises:
        InvalidConfig: a bad config, an assistant that does not fit the target, a missing file,
            or a missing, misshapen or unexpected tensor; the message names the file.
    """
    root = Path(directory)
    config = read_dflash_config(root)
    check_fits_target(config, target.config, str(root / CONFIG_FILE))
    try:
        tensors = _read_tensors(root / WEIGHTS_FILE, config, keep)
    except SafetensorError as error:  # a truncated or foreign file: name it, not a traceback
        raise InvalidConfig(f"{root}: unreadable safetensors weights ({error})") from None
    assistant = DFlashAssistant(config, target, num_token_slots=num_token_slots)
    assistant.load_state_dict(tensors, strict=True)
    return assistant
