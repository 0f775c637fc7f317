"""Test-only: a minimal non-speculative worker over PagedLlama, to drive the engine."""

from __future__ import annotations

from pathlib import Path

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.model import AttentionBatch, PagedLlama
from specstate.relay.future_map import RelayPayload


class PlainWorker:
    """Greedy plain decode: EXTEND samples after each row's last token, DECODE extends by 1."""

    def __init__(self, model_dir: Path) -> None:
        self._dir = model_dir
        self._model: PagedLlama | None = None
        self._table = torch.zeros(1, 1, dtype=torch.int64)
        self.calls: list[str] = []

    @property
    def capabilities(self) -> WorkerCapabilities:
        """No speculation."""
        return WorkerCapabilities(algorithm="test-plain")

    def attach(self, memory: WorkerMemory) -> None:
        """Load the model with the engine's token slots."""
        self._model = load_paged_llama(self._dir, num_token_slots=memory.num_token_slots)
        self._table = memory.req_to_token

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """One forward; see `specstate.engine.worker`."""
        assert self._model is not None and batch.input_ids is not None
        self.calls.append(batch.forward_mode.value)
        slots = batch.req_pool_indices
        if batch.forward_mode.is_decode():
            prefix, lens = batch.seq_lens, torch.ones_like(batch.seq_lens)
            loc = self._table[slots, batch.seq_lens]
            positions = batch.seq_lens
        else:
            assert batch.prefix_lens is not None and batch.extend_lens is not None
            assert batch.out_cache_loc is not None and batch.positions is not None
            prefix, lens = torch.tensor(batch.prefix_lens), torch.tensor(batch.extend_lens)
            loc, positions = batch.out_cache_loc, batch.positions
        out = self._model(
            AttentionBatch(
                input_ids=batch.input_ids,
                positions=positions,
                out_cache_loc=loc,
                req_pool_indices=slots,
                req_to_token=self._table,
                prefix_lens=prefix,
                extend_lens=lens,
            ),
            logit_rows=torch.cumsum(lens, 0) - 1,
        )
        nxt = out.logits.argmax(-1)
        new = batch.seq_lens + 1 if batch.forward_mode.is_decode() else batch.seq_lens
        if on_publish is not None:
            on_publish(new)
        return GenerationBatchResult(
            next_token_ids=nxt,
            accept_lens=torch.ones_like(nxt),
            stride=1,
            new_seq_lens=new,
            next_draft_input=RelayPayload(bonus_tokens=nxt),
        )
