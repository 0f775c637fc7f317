"""A decode round's positions are a fresh copy of its frontier, on the host and on a device.

On a device the launch makes them in the same operation as the frontier's clamp bounds
(`Launcher._decode_frame`); on the host CPU `ForwardBatch.from_schedule` copies ``seq_lens``.
Either way a worker that writes its positions in place leaves the batch's frontier alone.
"""

from __future__ import annotations

import pytest
from engine_driver import checked_config, run_checked

from specstate import Engine, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.tools.timed_worker import TimedWaitWorker


class _PositionsWorker:
    """A `TimedWaitWorker` that records each decode round's positions and frontier, then
    scribbles over its positions before the forward runs."""

    def __init__(self) -> None:
        self._inner = TimedWaitWorker(device_seconds=0.0, accept=2)
        self.rounds: list[tuple[list[int], list[int], list[int]]] = []

    @property
    def capabilities(self) -> WorkerCapabilities:
        return self._inner.capabilities

    def attach(self, memory: WorkerMemory) -> None:
        self._inner.attach(memory)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        if batch.forward_mode.is_decode():
            assert batch.positions is not None
            positions, seq_lens = batch.positions.tolist(), batch.seq_lens.tolist()
            batch.positions.add_(1000)  # the forward's own tensor: nothing else may see this
            self.rounds.append((positions, seq_lens, batch.seq_lens.tolist()))
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
def test_decode_positions_are_the_frontier_and_the_forwards_own(device: str, overlap: bool) -> None:
    worker = _PositionsWorker()
    config = checked_config(device=device, overlap=overlap, page_size=4)
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=128), config=config)
    caps = (9, 14, 20)
    reqs = [
        engine.submit(
            f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_new_tokens=cap, ignore_eos=True)
        )
        for i, cap in enumerate(caps)
    ]
    run_checked(engine)
    engine.close()
    assert [len(r.emitted_ids) for r in reqs] == list(caps)
    assert len(worker.rounds) >= 5
    for positions, seq_lens, after in worker.rounds:
        assert positions == seq_lens  # the round's first position is its frontier
        assert after == seq_lens  # writing the positions did not move the frontier
