"""What the reference hybrid models share: paged KV for their attention layers, state rows for
their recurrent layers, and the refusal of draft trees.

`PagedStateModel` is the base of `PagedHybrid` (NemotronH) and `PagedLfm2` (LFM2): each builds
its own blocks under transformers' parameter names, then calls `PagedStateModel.allocate` for its
memory; its forward takes `PagedStateModel.token_grid` (where each token's state row is) before
running its blocks.
"""

from __future__ import annotations

import torch
from torch import nn

from specstate.core.errors import InvalidConfig
from specstate.memory.recurrent_layout import RecurrentLayout, RecurrentStateSpec
from specstate.reference.hybrid.mamba import StateBuffers, TokenGrid
from specstate.reference.model import AttentionBatch, KvCache, ModelConfig, TreeAttentionBatch

__all__ = ["PagedStateModel"]


class PagedStateModel(nn.Module):
    """A model whose attention layers keep paged KV and whose recurrent layers keep state rows.

    Attributes:
        layout: where request states sit (None when the model has no recurrent layer).
    """

    layout: RecurrentLayout | None
    _kv_cache: KvCache
    _states: StateBuffers | None

    def allocate(
        self,
        geometry: ModelConfig,
        spec: RecurrentStateSpec | None,
        *,
        num_token_slots: int,
        device: torch.device | str,
    ) -> None:
        """The KV cache of ``geometry``'s attention layers and the state buffers of ``spec``'s
        one group (none without a spec or a layout)."""
        self._kv_cache = KvCache.allocate(geometry, num_token_slots=num_token_slots, device=device)
        self._states = (
            None
            if self.layout is None or spec is None
            else StateBuffers(spec.groups[0], self.layout, device=device)
        )

    @property
    def kv_cache(self) -> KvCache:
        """The attention layers' KV, written at ``out_cache_loc``, read via ``req_to_token``."""
        return self._kv_cache

    @property
    def states(self) -> StateBuffers | None:
        """The recurrent layers' states (None when the model has no recurrent layer)."""
        return self._states

    def token_grid(self, batch: AttentionBatch) -> TokenGrid | None:
        """Where each token of ``batch`` reads and writes its state (None without states).

        Raises:
            InvalidConfig: a tree batch for a model with state (a state follows one chain).
        """
        if self._states is None or self.layout is None:
            return None
        if isinstance(batch, TreeAttentionBatch):
            raise InvalidConfig("a hybrid model verifies chains only: tree batches are refused")
        return TokenGrid.build(
            slots=batch.req_pool_indices,
            prefix_lens=batch.prefix_lens,
            extend_lens=batch.extend_lens,
            layout=self.layout,
        )
