"""Where a reference worker's models come from: a checkpoint directory or an in-memory model.

A worker is configured before the engine knows how many KV token slots its caches need, so it
holds a `ModelSource` and builds the model only at ``attach``. Configs are read eagerly, at
construction, so a wrong checkpoint (not a Llama, a draft whose vocabulary differs from the
target's) fails before an engine is built around the worker::

    ModelSource ──read_source_config──▶ (ModelConfig, label)      at construction
    ModelSource ──build_model(num_token_slots)──▶ PagedLlama      at attach

Invariant: a model built from an in-memory `PagedLlama` is a copy with its own KV cache; the
source model's parameters and cache are never written.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
import torch

from specstate.core.errors import InvalidConfig
from specstate.reference.checkpoint import CONFIG_FILE, load_paged_llama, read_model_config
from specstate.reference.model import ModelConfig, PagedLlama
from specstate.reference.tensor_parallel import shard_state

if TYPE_CHECKING:
    from specstate.engine.worker import ParallelGroup

__all__ = [
    "ModelSource",
    "build_model",
    "check_same_vocab",
    "read_source_config",
    "source_label",
]

ModelSource = str | os.PathLike[str] | PagedLlama
"""A Hugging Face Llama checkpoint directory, or an already built `PagedLlama`."""


def source_label(source: ModelSource) -> str:
    """How error messages name ``source``: its ``config.json`` path, or ``<in-memory model>``."""
    if isinstance(source, PagedLlama):
        return "<in-memory PagedLlama>"
    return str(Path(source) / CONFIG_FILE)


def read_source_config(source: ModelSource, *, dtype: torch.dtype | None = None) -> ModelConfig:
    """The config of ``source`` (``dtype`` overrides the checkpoint's).

    Raises:
        InvalidConfig: the loader's error for a missing or non-Llama checkpoint.
    """
    config = source.config if isinstance(source, PagedLlama) else read_model_config(source)
    return config if dtype is None else attrs.evolve(config, dtype=dtype)


def check_same_vocab(
    target: ModelSource, target_config: ModelConfig, draft: ModelSource, draft_config: ModelConfig
) -> None:
    """Raise `InvalidConfig` naming both sources and sizes unless the vocabularies agree."""
    if draft_config.vocab_size != target_config.vocab_size:
        raise InvalidConfig(
            f"draft {source_label(draft)} has vocab_size {draft_config.vocab_size} but target "
            f"{source_label(target)} has vocab_size {target_config.vocab_size}; a drafter must "
            "share the target's vocabulary"
        )


def build_model(
    source: ModelSource,
    *,
    num_token_slots: int,
    device: torch.device | str,
    dtype: torch.dtype | None = None,
    parallel: ParallelGroup | None = None,
) -> PagedLlama:
    """A `PagedLlama` of ``source`` whose own KV cache holds ``num_token_slots`` slots.

    With ``parallel``, this rank's tensor-parallel shard of it.

    Raises:
        InvalidConfig: the checkpoint cannot be loaded (see `load_paged_llama`), or an
            in-memory source is itself a shard.
    """
    if not isinstance(source, PagedLlama):
        return load_paged_llama(
            source, num_token_slots=num_token_slots, device=device, dtype=dtype, parallel=parallel
        )
    if source.parallel is not None and source.parallel.world_size > 1:
        raise InvalidConfig(f"{source_label(source)} is a tensor-parallel shard, not a model")
    config = read_source_config(source, dtype=dtype)
    state = source.state_dict()
    if parallel is not None:
        state = shard_state(state, config, rank=parallel.rank, world_size=parallel.world_size)
    model = PagedLlama(config, num_token_slots=num_token_slots, device=device, parallel=parallel)
    model.load_state_dict(state, strict=True)
    return model
