"""Reference hybrid models: NemotronH (Mamba2 + attention) and LFM2 (short convolutions +
attention) over paged KV and laid-out states.

`PagedHybrid` computes transformers' ``NemotronHForCausalLM`` and `PagedLfm2` its
``Lfm2ForCausalLM``; their attention reads and writes KV through ``req_to_token`` like the
reference Llama, and their recurrent layers (Mamba2, short convolutions) read and write their
states at the rows `specstate.memory.recurrent.RecurrentLayout` assigns, so a wrong state
selection shows up as wrong tokens. `load_paged_hybrid` reads either from transformers'
checkpoint format (dispatching on ``model_type``); `save_paged_hybrid` writes either.
"""

from __future__ import annotations

from specstate.reference.hybrid.checkpoint import (
    AnyHybridConfig,
    AnyPagedHybrid,
    is_hybrid_checkpoint,
    load_paged_hybrid,
    read_hybrid_config,
    save_paged_hybrid,
)
from specstate.reference.hybrid.config import (
    HybridConfig,
    LayerKind,
    from_hf_config,
    is_hybrid_config,
    to_hf_config,
)
from specstate.reference.hybrid.lfm2 import PagedLfm2, ShortConv
from specstate.reference.hybrid.lfm2_config import (
    Lfm2LayerKind,
    Lfm2ModelConfig,
    from_hf_lfm2_config,
    is_lfm2_config,
    to_hf_lfm2_config,
)
from specstate.reference.hybrid.mamba import Mamba2Mixer, StateBuffers
from specstate.reference.hybrid.model import PagedHybrid

__all__ = [
    "AnyHybridConfig",
    "AnyPagedHybrid",
    "HybridConfig",
    "LayerKind",
    "Lfm2LayerKind",
    "Lfm2ModelConfig",
    "Mamba2Mixer",
    "PagedHybrid",
    "PagedLfm2",
    "ShortConv",
    "StateBuffers",
    "from_hf_config",
    "from_hf_lfm2_config",
    "is_hybrid_checkpoint",
    "is_hybrid_config",
    "is_lfm2_config",
    "load_paged_hybrid",
    "read_hybrid_config",
    "save_paged_hybrid",
    "to_hf_config",
    "to_hf_lfm2_config",
]
