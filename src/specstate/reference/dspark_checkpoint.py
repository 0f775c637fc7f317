"""DSpark assistant checkpoints: a DFlash assistant directory with the two heads added.

A DSpark assistant is a DFlash assistant directory (`specstate.reference.dflash_checkpoint`:
``config.json`` of ``model_type`` ``muse_glimmer_assistant``, ``model.safetensors``) with::

    config.json        + "markov_rank": r, "markov_head_type": "vanilla" | "gated"
    model.safetensors  + markov_head.* and confidence_head.* (`specstate.reference.dspark_heads`)

The DFlash tensors load as the backbone (the heads' tensors set aside); the heads load from the
same file, every name and shape checked. `save_dspark_assistant` writes such a directory from a
DFlash assistant directory and a `DSparkHeads`. Every loading failure is an `InvalidConfig`
naming the file and the field or tensor.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    read_checked_tensors,
    read_config_json,
    read_int_field,
    write_safetensors,
)
from specstate.reference.dflash_assistant import DFlashAssistant, DFlashConfig
from specstate.reference.dflash_checkpoint import load_dflash_assistant, parse_dflash_config
from specstate.reference.dspark_heads import (
    HEAD_PREFIXES,
    MARKOV_VARIANTS,
    DSparkHeadConfig,
    DSparkHeads,
)
from specstate.reference.model import PagedLlama

__all__ = [
    "load_dspark_assistant",
    "load_dspark_heads",
    "read_dspark_config",
    "save_dspark_assistant",
]

StrPath = str | os.PathLike[str]


def _is_head(name: str) -> bool:
    return name.startswith(HEAD_PREFIXES)


def read_dspark_config(directory: StrPath) -> tuple[DFlashConfig, DSparkHeadConfig]:
    """The backbone's and the heads' configs of the DSpark assistant in ``directory``.

    Raises:
        InvalidConfig: a bad DFlash config, a missing or mistyped ``markov_rank``, or a
            ``markov_head_type`` the reference worker does not run; the message names the file.
    """
    raw, path = read_config_json(directory, kind="a DSpark assistant")
    backbone = parse_dflash_config(raw, path)
    variant = raw.get("markov_head_type", "vanilla")
    if variant not in MARKOV_VARIANTS:
        raise InvalidConfig(
            f"{path}: field 'markov_head_type' is {variant!r}; the reference DSpark worker runs "
            f"{' and '.join(MARKOV_VARIANTS)} Markov heads"
        )
    try:
        heads = DSparkHeadConfig(
            vocab_size=backbone.vocab_size,
            hidden_size=backbone.hidden_size,
            markov_rank=read_int_field(raw, "markov_rank", path),
            markov_variant=variant,
        )
    except InvalidConfig as error:
        raise InvalidConfig(f"{path}: {error}") from None
    return backbone, heads


def load_dspark_heads(
    directory: StrPath,
    config: DSparkHeadConfig,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> DSparkHeads:
    """The heads in ``directory/model.safetensors`` (the backbone's tensors ignored).

    Raises:
        InvalidConfig: the file is missing or unreadable, or a head tensor is missing,
            misshapen or unexpected; the message names the file and the tensor.
    """
    path = Path(directory) / WEIGHTS_FILE
    try:
        tensors = read_checked_tensors(
            path, config.expected_shapes(), kind="the DSpark heads", keep=_is_head
        )
    except SafetensorError as error:
        raise InvalidConfig(f"{path}: unreadable safetensors weights ({error})") from None
    heads = DSparkHeads(config, device=device, dtype=dtype)
    heads.load_state_dict(tensors, strict=True)
    return heads


def load_dspark_assistant(
    directory: StrPath, target: PagedLlama, *, num_token_slots: int | None = None
) -> tuple[DFlashAssistant, DSparkHeads]:
    """The DFlash backbone and the heads of the DSpark assistant in ``directory``, for
    ``target`` (both compute in the target's dtype on its device).

    Raises:
        InvalidConfig: as `read_dspark_config`, `load_dflash_assistant` and
            `load_dspark_heads`.
    """
    _, config = read_dspark_config(directory)
    backbone = load_dflash_assistant(
        directory, target, num_token_slots=num_token_slots, keep=lambda name: not _is_head(name)
    )
    device = target.embed_tokens.weight.device
    heads = load_dspark_heads(directory, config, device=device, dtype=target.config.dtype)
    return backbone, heads


def save_dspark_assistant(directory: StrPath, *, backbone: StrPath, heads: DSparkHeads) -> None:
    """Write a DSpark assistant to ``directory``: the DFlash assistant directory ``backbone``
    with ``heads``' config fields and tensors added (created if needed; files overwritten).

    Raises:
        InvalidConfig: ``backbone`` is not a DFlash assistant, or its sizes differ from the
            heads'.
    """
    raw, path = read_config_json(backbone, kind="a DFlash assistant")
    config = parse_dflash_config(raw, path)
    ours = heads.config
    if (config.vocab_size, config.hidden_size) != (ours.vocab_size, ours.hidden_size):
        raise InvalidConfig(
            f"{path}: the heads' vocab_size {ours.vocab_size} and hidden_size "
            f"{ours.hidden_size} differ from the backbone's {config.vocab_size} and "
            f"{config.hidden_size}"
        )
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    fields = {"markov_rank": ours.markov_rank, "markov_head_type": ours.markov_variant}
    tensors = load_file(str(Path(backbone) / WEIGHTS_FILE))
    tensors |= {
        name: t.detach().to(config.dtype).contiguous().cpu()
        for name, t in heads.state_dict().items()
    }
    (root / CONFIG_FILE).write_text(json.dumps(raw | fields, indent=2) + "\n", encoding="utf-8")
    write_safetensors(tensors, root / WEIGHTS_FILE)
