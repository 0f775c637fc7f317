"""Test-only: a worker wrapper that records each forward's mode and can fail on purpose."""

from __future__ import annotations

from pathlib import Path

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory, WorkerProtocol
from specstate.reference.workers import PlainWorker


class SpyWorker:
    """Delegates to ``inner``; records modes in ``calls``; raises on the ``fail_on``-th call."""

    def __init__(self, inner: WorkerProtocol, *, fail_on: int | None = None) -> None:
        self._inner = inner
        self._fail_on = fail_on
        self.calls: list[str] = []

    @classmethod
    def plain(cls, model_dir: Path, *, fail_on: int | None = None) -> SpyWorker:
        """A spy around the reference ``none`` worker on ``model_dir``."""
        return cls(PlainWorker(target=model_dir), fail_on=fail_on)

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's."""
        return self._inner.capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Attach the inner worker."""
        self._inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Record, maybe fail, then delegate."""
        self.calls.append(batch.forward_mode.value)
        if len(self.calls) == self._fail_on:
            raise RuntimeError("device lost")
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)
