"""Reference backend: a paged-attention Llama that loads Hugging Face checkpoints.

Its attention reads and writes KV only through ``req_to_token`` / ``out_cache_loc``, so any
bookkeeping error in the scheduling state shows up as wrong tokens.
"""

from __future__ import annotations

from specstate.reference.checkpoint import (
    from_hf_config,
    load_paged_llama,
    read_model_config,
    save_paged_llama,
    to_hf_config,
)
from specstate.reference.model import AttentionBatch, KvCache, ModelConfig, ModelOutput, PagedLlama

__all__ = [
    "AttentionBatch",
    "KvCache",
    "ModelConfig",
    "ModelOutput",
    "PagedLlama",
    "from_hf_config",
    "load_paged_llama",
    "read_model_config",
    "save_paged_llama",
    "to_hf_config",
]
