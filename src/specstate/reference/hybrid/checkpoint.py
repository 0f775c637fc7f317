"""Hugging Face hybrid checkpoints (NemotronH, LFM2): ``config.json`` plus safetensors, as models.

Tensor names are the ones transformers writes (``backbone.embeddings.weight``,
``backbone.layers.{i}.norm.weight``, ``backbone.layers.{i}.mixer.in_proj.weight``,
``backbone.norm_f.weight``, ``lm_head.weight``; ``model.`` instead of ``backbone.`` is read too);
the model's parameter names are the same without the prefix. Every expected tensor must
be present with its exact shape and no other tensor may be (``mtp.*`` multi-token-prediction
tensors, which transformers ignores too, excepted)::

    config.json         -> HybridConfig   (specstate.reference.hybrid.config)
    model.safetensors   -> PagedHybrid    (load_paged_hybrid / save_paged_hybrid)

An LFM2 checkpoint (``model_type`` ``lfm2``) reads (and `save_paged_hybrid` writes it) the same
way into a `PagedLfm2`
(``model.embed_tokens.weight``, ``model.layers.{i}.conv.in_proj.weight``, ...; with
``tie_word_embeddings`` ``lm_head.weight`` may be absent: it is the embedding).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Final

import attrs
import torch
from safetensors import SafetensorError, safe_open

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    StrPath,
    read_config_json,
    write_safetensors,
)
from specstate.reference.hybrid.config import (
    HybridConfig,
    from_hf_config,
    is_hybrid_config,
    to_hf_config,
)
from specstate.reference.hybrid.lfm2 import PagedLfm2
from specstate.reference.hybrid.lfm2_config import (
    Lfm2ModelConfig,
    from_hf_lfm2_config,
    is_lfm2_config,
    to_hf_lfm2_config,
)
from specstate.reference.hybrid.model import PagedHybrid

__all__ = [
    "AnyHybridConfig",
    "AnyPagedHybrid",
    "is_hybrid_checkpoint",
    "load_paged_hybrid",
    "read_hybrid_config",
    "save_paged_hybrid",
]

AnyHybridConfig = HybridConfig | Lfm2ModelConfig
"""The config of a reference hybrid model: NemotronH's or LFM2's."""

AnyPagedHybrid = PagedHybrid | PagedLfm2
"""A reference hybrid model: NemotronH or LFM2."""

_PREFIX: Final = "backbone."


def is_hybrid_checkpoint(directory: StrPath) -> bool:
    """True when ``directory/config.json`` is a NemotronH or LFM2 config (False if it cannot
    be read)."""
    try:
        raw, _ = read_config_json(directory, kind="a checkpoint")
    except InvalidConfig:
        return False
    return is_hybrid_config(raw) or is_lfm2_config(raw)


def read_hybrid_config(directory: StrPath) -> AnyHybridConfig:
    """``directory/config.json`` as a `HybridConfig` (NemotronH) or `Lfm2ModelConfig` (LFM2);
    `InvalidConfig` naming file and field."""
    raw, path = read_config_json(directory, kind="a hybrid checkpoint")
    if is_lfm2_config(raw):
        return from_hf_lfm2_config(raw, path)
    return from_hf_config(raw, path)


def _ignored(name: str) -> bool:
    return name.startswith("mtp.")


def _read_tensors(
    root: Path, shapes: dict[str, tuple[int, ...]], optional: frozenset[str] = frozenset()
) -> dict[str, torch.Tensor]:
    """Every expected tensor by parameter name, checking presence, shape and extras first
    (``optional`` parameter names may be absent; ``lm_head.weight`` when it is tied)."""
    file = root / WEIGHTS_FILE
    if not file.is_file():
        raise InvalidConfig(f"{root}: {WEIGHTS_FILE} is missing")
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(file), framework="pt") as handle:
        names = set(handle.keys())
        prefix = _PREFIX if any(n.startswith(_PREFIX) for n in names) else "model."
        expected = {_hf_name(n, prefix): shape for n, shape in shapes.items()}
        extras = sorted(n for n in names - set(expected) if not _ignored(n))
        if extras:
            raise InvalidConfig(f"{file}: unexpected tensor '{extras[0]}' ({len(extras)} extra)")
        for name, shape in expected.items():
            if name not in names:
                if name.removeprefix(prefix) in optional:
                    continue
                raise InvalidConfig(f"{file}: missing tensor '{name}'")
            got = tuple(handle.get_slice(name).get_shape())
            if got != shape:
                raise InvalidConfig(f"{file}: tensor '{name}' has shape {got}, expected {shape}")
            tensors[name.removeprefix(prefix)] = handle.get_tensor(name)
    return tensors


def _hf_name(name: str, prefix: str = _PREFIX) -> str:
    return name if name.startswith("lm_head.") else prefix + name


def load_paged_hybrid(
    directory: StrPath,
    *,
    num_token_slots: int,
    layout: RecurrentLayout | None,
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
) -> AnyPagedHybrid:
    """Build a `PagedHybrid` (NemotronH) or `PagedLfm2` (LFM2) from a transformers checkpoint.

    Args:
        directory: holds ``config.json`` and ``model.safetensors``.
        num_token_slots: KV token slots per attention layer, padding slot 0 included.
        layout: the state rows the engine laid out (required with recurrent layers).
        device: where parameters, KV and states live.
        dtype: parameter dtype (default: the config's).

    Raises:
        InvalidConfig: a bad config, a missing file, or a missing, misshapen or unexpected
            tensor; the message names the file and the field or tensor.
    """
    root = Path(directory)
    config = read_hybrid_config(root)
    if dtype is not None:
        config = attrs.evolve(config, dtype=dtype)
    model: AnyPagedHybrid
    tied: frozenset[str] = frozenset()
    if isinstance(config, Lfm2ModelConfig):
        model = PagedLfm2(config, num_token_slots=num_token_slots, layout=layout, device=device)
        tied = frozenset({"lm_head.weight"} if config.tie_word_embeddings else ())
    else:
        model = PagedHybrid(config, num_token_slots=num_token_slots, layout=layout, device=device)
    shapes = {n: tuple(p.shape) for n, p in model.state_dict().items()}
    try:
        tensors = _read_tensors(root, shapes, optional=tied)
    except SafetensorError as error:
        raise InvalidConfig(f"{root}: unreadable safetensors weights ({error})") from None
    if tied:  # the head is the embedding, whether or not the file repeats it
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]
    model.load_state_dict(tensors, strict=True)
    return model


def save_paged_hybrid(model: AnyPagedHybrid, directory: StrPath) -> None:
    """Write ``config.json`` and ``model.safetensors`` that transformers' NemotronH (for a
    `PagedHybrid`) or LFM2 (for a `PagedLfm2`; a tied head is not written twice) loads."""
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if isinstance(model, PagedLfm2):
        raw = to_hf_lfm2_config(model.config)
        prefix = "model."
        if model.config.tie_word_embeddings:
            del state["lm_head.weight"]  # the embedding
    else:
        raw, prefix = to_hf_config(model.config), _PREFIX
    (root / CONFIG_FILE).write_text(json.dumps(raw, indent=2) + "\n", encoding="utf-8")
    tensors = {
        _hf_name(name, prefix): t.detach().to("cpu").contiguous() for name, t in state.items()
    }
    write_safetensors(tensors, root / WEIGHTS_FILE)
