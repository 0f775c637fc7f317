"""Where a reference worker's models come from: a checkpoint directory or an in-memory model.

A worker is configured before the engine knows how many KV token slots its caches need, so it
holds a `ModelSource` and builds the model only at ``attach``. Configs are read eagerly, at
construction, so a wrong checkpoint (not a Llama, NemotronH or LFM2, a draft whose vocabulary
differs from the target's) fails before an engine is built around the worker::

    ModelSource ──read_source_config──▶ (ModelConfig | AnyHybridConfig, label)  at construction
    ModelSource ──build_model(num_token_slots, layout)──▶ PagedLlama | AnyPagedHybrid  at attach

A NemotronH checkpoint (``model_type`` ``nemotron_h``) builds a `PagedHybrid`, an LFM2 one
(``lfm2``) a `PagedLfm2`; their recurrent states live in the rows of the engine's
`RecurrentLayout` (``WorkerMemory.recurrent``).

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
from specstate.memory.recurrent_layout import RecurrentLayout
from specstate.reference.checkpoint import CONFIG_FILE, load_paged_llama, read_model_config
from specstate.reference.hybrid.checkpoint import (
    AnyHybridConfig,
    AnyPagedHybrid,
    is_hybrid_checkpoint,
    load_paged_hybrid,
    read_hybrid_config,
)
from specstate.reference.hybrid.config import HybridConfig
from specstate.reference.hybrid.lfm2 import PagedLfm2
from specstate.reference.hybrid.lfm2_config import Lfm2ModelConfig
from specstate.reference.hybrid.model import PagedHybrid
from specstate.reference.model import ModelConfig, PagedLlama
from specstate.reference.tensor_parallel import shard_state

if TYPE_CHECKING:
    from specstate.engine.worker import ParallelGroup

__all__ = [
    "ModelSource",
    "SourceConfig",
    "SourceModel",
    "build_model",
    "check_same_vocab",
    "read_source_config",
    "source_label",
]

ModelSource = str | os.PathLike[str] | PagedLlama | PagedHybrid | PagedLfm2
"""A Hugging Face Llama, NemotronH or LFM2 checkpoint directory, or an already built model."""

SourceConfig = ModelConfig | AnyHybridConfig
"""The config of a source: a Llama's or a hybrid's."""

SourceModel = PagedLlama | AnyPagedHybrid
"""A built reference model."""


def source_label(source: ModelSource) -> str:
    """How error messages name ``source``: its ``config.json`` path, or ``<in-memory model>``."""
    if isinstance(source, PagedLlama | PagedHybrid | PagedLfm2):
        return f"<in-memory {type(source).__name__}>"
    return str(Path(source) / CONFIG_FILE)


def read_source_config(source: ModelSource, *, dtype: torch.dtype | None = None) -> SourceConfig:
    """The config of ``source`` (``dtype`` overrides the checkpoint's).

    Raises:
        InvalidConfig: the loader's error for a missing or unsupported checkpoint.
    """
    config: SourceConfig
    if isinstance(source, PagedLlama | PagedHybrid | PagedLfm2):
        config = source.config
    elif is_hybrid_checkpoint(source):
        config = read_hybrid_config(source)
    else:
        config = read_model_config(source)
    return config if dtype is None else attrs.evolve(config, dtype=dtype)


def check_same_vocab(
    target: ModelSource,
    target_config: SourceConfig,
    draft: ModelSource,
    draft_config: SourceConfig,
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
    recurrent: RecurrentLayout | None = None,
    parallel: ParallelGroup | None = None,
) -> SourceModel:
    """The model of ``source``, whose own KV cache holds ``num_token_slots`` slots (and, for a
    hybrid, whose states hold the rows of ``recurrent``); a Llama is sharded over ``parallel``.

    With ``parallel``, this rank's tensor-parallel shard of it.

    Raises:
        InvalidConfig: the checkpoint cannot be loaded (`load_paged_llama`, `load_paged_hybrid`),
            an in-memory source is itself a shard, or a hybrid model is asked to shard.
    """
    slots = num_token_slots
    sharded = parallel is not None and parallel.world_size > 1
    if isinstance(source, PagedLlama | PagedHybrid | PagedLfm2):
        shard = source.parallel if isinstance(source, PagedLlama) else None
        if shard is not None and shard.world_size > 1:
            raise InvalidConfig(f"{source_label(source)} is a tensor-parallel shard, not a model")
        config = read_source_config(source, dtype=dtype)
        if isinstance(config, HybridConfig | Lfm2ModelConfig):
            if sharded:
                raise InvalidConfig(f"{source_label(source)}: hybrid models are not sharded")
            hybrid: AnyPagedHybrid
            if isinstance(config, Lfm2ModelConfig):
                hybrid = PagedLfm2(config, num_token_slots=slots, layout=recurrent, device=device)
            else:
                hybrid = PagedHybrid(config, num_token_slots=slots, layout=recurrent, device=device)
            hybrid.load_state_dict(source.state_dict(), strict=True)
            return hybrid
        state = source.state_dict()
        if parallel is not None:
            state = shard_state(state, config, rank=parallel.rank, world_size=parallel.world_size)
        model = PagedLlama(config, num_token_slots=slots, device=device, parallel=parallel)
        model.load_state_dict(state, strict=True)
        return model
    if is_hybrid_checkpoint(source):
        if sharded:
            raise InvalidConfig(f"{source_label(source)}: hybrid models are not sharded")
        return load_paged_hybrid(
            source, num_token_slots=slots, layout=recurrent, device=device, dtype=dtype
        )
    return load_paged_llama(
        source, num_token_slots=slots, device=device, dtype=dtype, parallel=parallel
    )
