"""A reference hybrid model: NemotronH (Mamba2 + attention) over paged KV and laid-out states.

`PagedHybrid` computes transformers' ``NemotronHForCausalLM``; its attention reads and writes KV
through ``req_to_token`` like the reference Llama, and its Mamba2 layers read and write their
recurrent states at the rows `specstate.memory.recurrent.RecurrentLayout` assigns, so a wrong
state selection shows up as wrong tokens. `load_paged_hybrid` / `save_paged_hybrid` read and
write transformers' checkpoint format.
"""

from __future__ import annotations

from specstate.reference.hybrid.checkpoint import (
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
from specstate.reference.hybrid.mamba import Mamba2Mixer, StateBuffers
from specstate.reference.hybrid.model import PagedHybrid

__all__ = [
    "HybridConfig",
    "LayerKind",
    "Mamba2Mixer",
    "PagedHybrid",
    "StateBuffers",
    "from_hf_config",
    "is_hybrid_checkpoint",
    "is_hybrid_config",
    "load_paged_hybrid",
    "read_hybrid_config",
    "save_paged_hybrid",
    "to_hf_config",
]
