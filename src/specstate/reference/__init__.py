"""Reference backend: a paged-attention Llama that loads Hugging Face checkpoints.

Its attention reads and writes KV only through ``req_to_token`` / ``out_cache_loc``, so any
bookkeeping error in the scheduling state shows up as wrong tokens. `default_registry` builds
the workers (``none``, ``draft_model``, ``eagle``, ``ngram``, and the hidden-state drafters ``mtp``,
``eagle3`` and ``frozen_kv_mtp``) that implement `WorkerProtocol`.
"""

from __future__ import annotations

from specstate.reference.checkpoint import (
    from_hf_config,
    load_paged_llama,
    read_model_config,
    save_paged_llama,
    to_hf_config,
)
from specstate.reference.eagle_head import (
    EagleHead,
    EagleHeadConfig,
    load_eagle_head,
    save_eagle_head,
)
from specstate.reference.model import AttentionBatch, KvCache, ModelConfig, ModelOutput, PagedLlama
from specstate.reference.workers import default_registry

__all__ = [
    "AttentionBatch",
    "EagleHead",
    "EagleHeadConfig",
    "KvCache",
    "ModelConfig",
    "ModelOutput",
    "PagedLlama",
    "default_registry",
    "from_hf_config",
    "load_eagle_head",
    "load_paged_llama",
    "read_model_config",
    "save_eagle_head",
    "save_paged_llama",
    "to_hf_config",
]
