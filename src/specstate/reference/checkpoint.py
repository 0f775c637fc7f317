"""Hugging Face Llama checkpoints: the owner of the HF file format for the reference model.

Reads and writes ``config.json`` plus ``model.safetensors`` (or a sharded
``model.safetensors.index.json`` with its shards) and maps HF tensor names onto `PagedLlama`,
whose parameter names are HF's without the ``model.`` prefix. Every failure is an
`InvalidConfig` naming the file and the field or tensor, raised before any model is built::

    config.json                       -> ModelConfig   (from_hf_config / to_hf_config)
    model.safetensors[.index.json]    -> PagedLlama    (load_paged_llama / save_paged_llama)

Accepted ``config.json`` dialects: transformers >= 5 writes ``rope_parameters``
(``{"rope_type": "default", "rope_theta": ...}``) and ``dtype``; transformers 4.x writes
``rope_theta`` / ``rope_scaling`` and ``torch_dtype``. Only default RoPE is supported. Written
configs carry both dialects so either transformers major version reads them.

An Ernie 4.5 MoE checkpoint (``model_type`` ``ernie4_5_moe``: a Llama with interleaved RoPE and
sparse MLP layers) reads into the same `PagedLlama`; `specstate.reference.ernie` owns that
dialect.

Tensor policy: every expected tensor must be present with its exact shape; tensors this model
has no place for are rejected (they mean an architecture it would silently compute wrong, such
as projection biases), except two HF itself ignores: ``*.rotary_emb.inv_freq`` buffers of old
checkpoints and ``lm_head.weight`` when ``tie_word_embeddings`` is true; and the ``mtp.*``
tensors of a target's multi-token-prediction layers, which `specstate.reference.mtp` reads.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Final

import attrs
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specstate.core.errors import InvalidConfig
from specstate.reference.ernie import (
    ERNIE_MOE_MODEL_TYPE,
    ernie_config_fields,
    moe_mlp_shapes,
    read_moe_config,
)
from specstate.reference.model import ModelConfig, PagedLlama
from specstate.reference.tensor_parallel import shard_state

if TYPE_CHECKING:
    from specstate.engine.worker import ParallelGroup

__all__ = [
    "CONFIG_FILE",
    "DTYPES",
    "INDEX_FILE",
    "WEIGHTS_FILE",
    "from_hf_config",
    "layer_shapes",
    "load_paged_llama",
    "read_checked_tensors",
    "read_config_json",
    "read_float_field",
    "read_int_field",
    "read_model_config",
    "save_paged_llama",
    "to_hf_config",
    "write_safetensors",
]

CONFIG_FILE: Final = "config.json"
WEIGHTS_FILE: Final = "model.safetensors"
INDEX_FILE: Final = "model.safetensors.index.json"
DTYPES: Final = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_IGNORED_SUFFIX: Final = ".rotary_emb.inv_freq"
_MTP_PREFIX: Final = "mtp."
_DEFAULT_ROPE_KEYS: Final = frozenset({"rope_type", "type", "rope_theta"})

StrPath = str | os.PathLike[str]


def read_float_field(
    raw: Mapping[str, object], key: str, path: StrPath, default: object = None
) -> float:
    """Reads an int/float field (null or absent: ``default``; None means required)."""
    value = default if raw.get(key) is None else raw[key]
    if value is None:
        raise InvalidConfig(f"{path}: missing field '{key}'")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidConfig(f"{path}: field '{key}' must be a number, got {value!r}")
    return float(value)


def read_int_field(
    raw: Mapping[str, object], key: str, path: StrPath, default: object = None
) -> int:
    """Reads an integer field (null or absent: ``default``; None means required)."""
    value = default if raw.get(key) is None else raw[key]
    if value is None:
        raise InvalidConfig(f"{path}: missing field '{key}'")
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidConfig(f"{path}: field '{key}' must be an integer, got {value!r}")
    return value


def _token_ids(raw: Mapping[str, object], key: str, path: StrPath) -> tuple[int, ...]:
    """Reads an optional token id field that may be null, one id, or a list of ids."""
    value = raw.get(key)
    items = [] if value is None else value if isinstance(value, list) else [value]
    if any(isinstance(item, bool) or not isinstance(item, int) for item in items):
        raise InvalidConfig(f"{path}: field '{key}' must be null, an id or a list of ids")
    return tuple(items)


def _rope_theta(raw: Mapping[str, object], path: StrPath) -> float:
    """Returns the RoPE base from either config dialect; rejects any non-default RoPE."""
    params = raw.get("rope_parameters")
    key = "rope_parameters" if params is not None else "rope_scaling"
    scaling = params if params is not None else raw.get("rope_scaling")
    if scaling is None:
        return read_float_field(raw, "rope_theta", path, default=10000.0)
    if not isinstance(scaling, Mapping):
        raise InvalidConfig(f"{path}: field '{key}' must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind != "default":
        raise InvalidConfig(
            f"{path}: field '{key}' has rope_type {kind!r}; only default RoPE is supported"
        )
    unknown = sorted(set(scaling) - _DEFAULT_ROPE_KEYS)
    if unknown:  # e.g. per-layer-type parameters or a partial rotary factor: not plain RoPE
        raise InvalidConfig(f"{path}: field '{key}' has unsupported entries {unknown}")
    outer = read_float_field(raw, "rope_theta", path, default=10000.0)
    return read_float_field(scaling, "rope_theta", f"{path}: field '{key}'", default=outer)


def _check_llama_shaped(raw: Mapping[str, object], path: StrPath) -> None:
    """Rejects configs that are not a plain Llama (other model types, biases, activations)."""
    architectures = raw.get("architectures")
    is_llama_arch = isinstance(architectures, list) and "LlamaForCausalLM" in architectures
    if raw.get("model_type") not in ("llama", ERNIE_MOE_MODEL_TYPE) and not is_llama_arch:
        raise InvalidConfig(
            f"{path}: field 'model_type' is {raw.get('model_type')!r} (architectures"
            f" {architectures!r}); expected 'llama' ({ERNIE_MOE_MODEL_TYPE!r}) or LlamaForCausalLM"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise InvalidConfig(f"{path}: field 'hidden_act' is {raw['hidden_act']!r}; need 'silu'")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False) is not False:
            raise InvalidConfig(f"{path}: field '{key}' is {raw[key]!r}; biases are unsupported")


def from_hf_config(raw: Mapping[str, object], path: StrPath) -> ModelConfig:
    """Parses a Hugging Face Llama ``config.json`` object into a `ModelConfig`.

    Args:
        raw: The decoded JSON object.
        path: The file it came from; every error message starts with it.

    Raises:
        InvalidConfig: Not a Llama config, a missing or mistyped field, non-default RoPE, or
            inconsistent sizes; the message names the file and the field.
    """
    _check_llama_shaped(raw, path)
    heads = read_int_field(raw, "num_attention_heads", path)
    hidden = read_int_field(raw, "hidden_size", path)
    dtype_name = raw.get("dtype", raw.get("torch_dtype")) or "float32"
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise InvalidConfig(f"{path}: field 'dtype' is {dtype_name!r}; expected one of {[*DTYPES]}")
    bos = _token_ids(raw, "bos_token_id", path)
    if len(bos) > 1:
        raise InvalidConfig(f"{path}: field 'bos_token_id' must be null or one id, got {bos}")
    ernie = raw.get("model_type") == ERNIE_MOE_MODEL_TYPE  # ties its embeddings by default
    moe = read_moe_config(raw, path) if ernie else None
    try:
        return ModelConfig(
            vocab_size=read_int_field(raw, "vocab_size", path),
            hidden_size=hidden,
            intermediate_size=read_int_field(raw, "intermediate_size", path),
            num_hidden_layers=read_int_field(raw, "num_hidden_layers", path),
            num_attention_heads=heads,
            num_key_value_heads=read_int_field(raw, "num_key_value_heads", path, default=heads),
            head_dim=read_int_field(raw, "head_dim", path, default=hidden // max(heads, 1)),
            rms_norm_eps=read_float_field(raw, "rms_norm_eps", path, default=1e-6),
            rope_theta=_rope_theta(raw, path),
            max_position_embeddings=read_int_field(
                raw, "max_position_embeddings", path, default=2048
            ),
            tie_word_embeddings=raw.get("tie_word_embeddings", ernie) is True,
            bos_token_id=bos[0] if bos else None,
            eos_token_ids=_token_ids(raw, "eos_token_id", path),
            dtype=DTYPES[dtype_name],
            moe=moe,
            rope_interleaved=ernie,
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None


def to_hf_config(config: ModelConfig) -> dict[str, object]:
    """Returns the ``config.json`` object transformers' ``LlamaForCausalLM`` loads (4.x and 5.x),
    or its ``Ernie4_5_MoeForCausalLM`` for a config with sparse layers."""
    dtype_name = str(config.dtype).removeprefix("torch.")
    eos = config.eos_token_ids
    ernie = ernie_config_fields(config) if config.moe is not None else {}
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "tie_word_embeddings": config.tie_word_embeddings,
        "bos_token_id": config.bos_token_id,
        "eos_token_id": None if not eos else eos[0] if len(eos) == 1 else list(eos),
        "dtype": dtype_name,
        "torch_dtype": dtype_name,
        **ernie,
    }


def read_config_json(directory: StrPath, *, kind: str) -> tuple[dict[str, object], Path]:
    """The JSON object in ``directory/config.json`` and its path.

    Raises:
        InvalidConfig: The file is missing, unreadable, or not a JSON object; ``kind`` names
            what the directory was expected to be.
    """
    path = Path(directory) / CONFIG_FILE
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InvalidConfig(f"{path}: missing config.json (not {kind} directory?)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InvalidConfig(f"{path}: unreadable config.json: {error}") from None
    if not isinstance(raw, dict):
        raise InvalidConfig(f"{path}: config.json must hold a JSON object")
    return raw, path


def read_checked_tensors(
    path: Path,
    expected: Mapping[str, tuple[int, ...]],
    *,
    kind: str,
    keep: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Every tensor ``expected`` names, read from the safetensors file ``path`` once its names
    and shapes are checked: a drafter's weights (``kind`` names it in the messages, e.g. "the
    EAGLE head"). ``keep``: which of the file's tensors count (the others are ignored).

    Raises:
        InvalidConfig: the file is missing, or a tensor is missing, misshapen or unexpected;
            the message names the file and the tensor.
    """
    if not path.is_file():
        raise InvalidConfig(f"{path}: missing {path.name} of {kind}")
    with safe_open(str(path), framework="pt") as handle:
        present = {name for name in handle.keys() if keep is None or keep(name)}  # noqa: SIM118
        extras = sorted(present - set(expected))
        if extras:
            raise InvalidConfig(f"{path}: unexpected tensor '{extras[0]}' ({len(extras)} extra)")
        tensors: dict[str, torch.Tensor] = {}
        for name, shape in expected.items():
            if name not in present:
                raise InvalidConfig(f"{path}: missing tensor '{name}'")
            got = tuple(handle.get_slice(name).get_shape())
            if got != shape:
                raise InvalidConfig(f"{path}: tensor '{name}' has shape {got}, expected {shape}")
            tensors[name] = handle.get_tensor(name)
    return tensors


def read_model_config(directory: StrPath) -> ModelConfig:
    """Reads ``directory/config.json`` into a `ModelConfig`.

    Raises:
        InvalidConfig: The file is missing, is not a JSON object, or fails `from_hf_config`.
    """
    raw, path = read_config_json(directory, kind="a checkpoint")
    return from_hf_config(raw, path)


def _expected_shapes(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape for a checkpoint of ``config``."""
    hidden, _inter = config.hidden_size, config.intermediate_size
    config.num_attention_heads * config.head_dim
    config.num_key_value_heads * config.head_dim
    shapes = {
        "model.embed_tokens.weight": (config.vocab_size, hidden),
        "model.norm.weight": (hidden,),
    }
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)
    for i in range(config.num_hidden_layers):
        shapes |= layer_shapes(f"model.layers.{i}.", config, i)
    return shapes


def layer_shapes(prefix: str, config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """HF tensor name -> shape of decoder layer ``layer`` of ``config``, names under ``prefix``."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    shapes = {
        prefix + "self_attn.q_proj.weight": (q_rows, hidden),
        prefix + "self_attn.k_proj.weight": (kv_rows, hidden),
        prefix + "self_attn.v_proj.weight": (kv_rows, hidden),
        prefix + "self_attn.o_proj.weight": (hidden, q_rows),
        prefix + "input_layernorm.weight": (hidden,),
        prefix + "post_attention_layernorm.weight": (hidden,),
    }
    if config.moe is not None and config.moe.is_sparse(layer):
        return shapes | moe_mlp_shapes(prefix + "mlp.", config)
    return shapes | {
        prefix + "mlp.gate_proj.weight": (inter, hidden),
        prefix + "mlp.up_proj.weight": (inter, hidden),
        prefix + "mlp.down_proj.weight": (hidden, inter),
    }


def _tensor_files(root: Path) -> tuple[Path, dict[str, Path]]:
    """Returns the file errors should name (weights or index) and tensor name -> file."""
    single, index = root / WEIGHTS_FILE, root / INDEX_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as handle:
            return single, dict.fromkeys(handle.keys(), single)
    if not index.is_file():
        raise InvalidConfig(f"{root}: neither {WEIGHTS_FILE} nor {INDEX_FILE} is present")
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, KeyError, TypeError, json.JSONDecodeError) as error:
        raise InvalidConfig(f"{index}: unreadable index (no weight_map?): {error}") from None
    files = {str(name): root / str(shard) for name, shard in dict(weight_map).items()}
    for shard in sorted(set(files.values())):
        if not shard.is_file():
            raise InvalidConfig(f"{index}: shard {shard.name} is missing")
    return index, files


def _is_ignored(name: str, config: ModelConfig) -> bool:
    """True for tensors HF itself ignores (see the module docstring)."""
    return (
        name.endswith(_IGNORED_SUFFIX)
        or name.startswith(_MTP_PREFIX)
        or (config.tie_word_embeddings and name == "lm_head.weight")
    )


def _read_tensors(root: Path, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Reads every expected tensor (HF names), checking presence, shape and extras first."""
    named_file, files = _tensor_files(root)
    expected = _expected_shapes(config)
    extras = sorted(n for n in files if n not in expected and not _is_ignored(n, config))
    if extras:
        raise InvalidConfig(f"{named_file}: unexpected tensor '{extras[0]}' ({len(extras)} extra)")
    for name in expected:
        if name not in files:
            raise InvalidConfig(f"{named_file}: missing tensor '{name}'")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted({files[name] for name in expected}):
        with safe_open(str(shard), framework="pt") as handle:
            present = set(handle.keys())
            for name in (n for n in expected if files[n] == shard):
                if name not in present:
                    raise InvalidConfig(f"{shard}: missing tensor '{name}' (listed in the index)")
                got = tuple(handle.get_slice(name).get_shape())
                if got != expected[name]:
                    raise InvalidConfig(
                        f"{shard}: tensor '{name}' has shape {got}, expected {expected[name]}"
                    )
                tensors[name] = handle.get_tensor(name)
    return tensors


def _module_name(hf_name: str) -> str:
    """HF tensor name -> `PagedLlama` parameter name (drop the ``model.`` prefix)."""
    return hf_name.removeprefix("model.")


def _hf_name(module_name: str) -> str:
    """`PagedLlama` parameter name -> HF tensor name."""
    return module_name if module_name.startswith("lm_head.") else "model." + module_name


def load_paged_llama(
    directory: StrPath,
    *,
    num_token_slots: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    parallel: ParallelGroup | None = None,
) -> PagedLlama:
    """Builds a `PagedLlama` from a Hugging Face Llama checkpoint directory.

    Args:
        directory: Holds ``config.json`` and ``model.safetensors`` or a sharded index.
        num_token_slots: KV token slots per layer, padding slot 0 included.
        device: Where the parameters and KV cache live.
        dtype: Parameter and KV dtype; defaults to the config's ``dtype`` (float32 if absent).
        parallel: build this rank's tensor-parallel shard (every rank reads the same files and
            keeps its slice, `specstate.reference.tensor_parallel`); None: the whole model.

    Raises:
        InvalidConfig: A bad config, a missing file, or a missing, misshapen or unexpected
            tensor; the message names the file and the field or tensor.
    """
    root = Path(directory)
    config = read_model_config(root)
    if dtype is not None:
        config = attrs.evolve(config, dtype=dtype)
    try:
        tensors = _read_tensors(root, config)
    except SafetensorError as error:  # a truncated or foreign file: name it, not a traceback
        raise InvalidConfig(f"{root}: unreadable safetensors weights ({error})") from None
    state = {_module_name(name): t for name, t in tensors.items()}
    if parallel is not None:
        state = shard_state(state, config, rank=parallel.rank, world_size=parallel.world_size)
    model = PagedLlama(config, num_token_slots=num_token_slots, device=device, parallel=parallel)
    model.load_state_dict(state, strict=True)
    return model


def write_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Write ``tensors`` to ``path`` readable like any file the user creates.

    safetensors creates its files with mode 0600; a checkpoint is meant to be shared and
    shipped, so the mode is widened to what the process umask allows for a new file.
    """
    save_file(tensors, str(path), metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def save_paged_llama(model: PagedLlama, directory: StrPath) -> None:
    """Writes ``config.json`` and ``model.safetensors`` that transformers' LlamaForCausalLM loads.

    The directory is created if needed; existing files of those names are overwritten. Tied
    models write no ``lm_head.weight`` (HF re-ties it from ``tie_word_embeddings``).

    Raises:
        InvalidConfig: ``model`` is one rank's tensor-parallel shard (not the whole model).
    """
    if model.parallel is not None and model.parallel.world_size > 1:
        raise InvalidConfig("save_paged_llama: the model is a tensor-parallel shard")
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    raw = to_hf_config(model.config)
    (root / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    tensors = {
        _hf_name(name): tensor.detach().to("cpu").contiguous()
        for name, tensor in model.state_dict().items()
    }
    write_safetensors(tensors, root / WEIGHTS_FILE)
