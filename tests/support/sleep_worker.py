"""Test-only: a worker whose device work is a timed wait, as DESIGN.md §4 measures overlap.

A sleep releases the GIL and uses no CPU, as a GPU forward would, so the normal loop costs
host + device per iteration and the overlap loop about max(host, device). Its tokens are a
fixed function of the inputs (the engine's bookkeeping does not depend on their values).
"""

from __future__ import annotations

import time

import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.relay.future_map import RelayPayload


class SleepWorker:
    """Sleeps ``device_seconds`` per forward and accepts ``accept`` tokens per decode row."""

    def __init__(self, *, device_seconds: float, num_steps: int = 3, accept: int = 2) -> None:
        self._seconds = device_seconds
        self._steps = num_steps
        self._accept = accept

    @property
    def capabilities(self) -> WorkerCapabilities:
        """A chain drafter of ``num_steps`` with its own KV."""
        return WorkerCapabilities(
            algorithm="sleep",
            num_steps=self._steps,
            num_draft_tokens=self._steps + 1,
            keeps_draft_kv=True,
        )

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Wait, then return a well-formed result."""
        time.sleep(self._seconds)
        b = batch.batch_size
        if batch.forward_mode.is_decode():
            stride = self._steps + 1
            accept = torch.full((b,), self._accept, dtype=torch.int64)
            new = batch.seq_lens + accept
        else:
            stride, accept, new = 1, torch.ones(b, dtype=torch.int64), batch.seq_lens
        tokens = torch.full((b * stride,), 7, dtype=torch.int64)
        if on_publish is not None:
            on_publish(new)
        return GenerationBatchResult(
            next_token_ids=tokens,
            accept_lens=accept,
            stride=stride,
            new_seq_lens=new,
            next_draft_input=RelayPayload(bonus_tokens=torch.full((b,), 7, dtype=torch.int64)),
        )
