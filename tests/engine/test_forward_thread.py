"""Which thread runs `forward_batch_generation`, and what torch's thread-local state it sees.

What docs/workers.md states, observed: the normal loop runs the forward inline on the thread
that calls `Engine.step()`, so a ``torch.no_grad()`` around the engine reaches it; with a
forward timeout, and under the overlap loop, a CPU engine runs it on its forward stream's own
thread, where grad mode and inference mode are torch's defaults whatever the caller entered.
"""

from __future__ import annotations

import threading

import attrs
import pytest
import torch

from specstate import (
    Engine,
    EngineConfig,
    ForwardBatch,
    GenerationBatchResult,
    OnPublish,
    RequestLimits,
    SamplingParams,
)
from specstate.tools.timed_worker import TimedWaitWorker


@attrs.frozen
class _Seen:
    thread: int
    grad: bool
    inference: bool


class _Recording(TimedWaitWorker):
    """The stand-in worker, recording where each forward ran and the torch modes it saw."""

    def __init__(self) -> None:
        super().__init__(device_seconds=0.0)
        self.seen: list[_Seen] = []

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Record, then run the stand-in forward."""
        self.seen.append(
            _Seen(
                thread=threading.get_ident(),
                grad=torch.is_grad_enabled(),
                inference=torch.is_inference_mode_enabled(),
            )
        )
        return super().forward_batch_generation(batch, on_publish=on_publish)


def _serve(worker: _Recording, config: EngineConfig) -> None:
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=64), config=config)
    engine.submit("a", [1, 2, 3], SamplingParams(max_new_tokens=6, ignore_eos=True))
    engine.run_until_idle()
    engine.close()


def test_the_normal_loop_runs_the_forward_on_the_driving_thread() -> None:
    """Inline: the caller's thread, and the caller's no_grad / inference_mode reach it."""
    worker = _Recording()
    with torch.no_grad():
        _serve(worker, EngineConfig(overlap=False, kv_tokens=256))
    assert {s.thread for s in worker.seen} == {threading.get_ident()}
    assert not any(s.grad for s in worker.seen)
    worker = _Recording()
    with torch.inference_mode():
        _serve(worker, EngineConfig(overlap=False, kv_tokens=256))
    assert all(s.inference for s in worker.seen)


@pytest.mark.parametrize(
    "config",
    [
        EngineConfig(overlap=True, kv_tokens=256),
        EngineConfig(overlap=False, forward_timeout_s=60.0),
    ],
    ids=["overlap", "normal-with-timeout"],
)
def test_a_stream_runs_the_forward_on_its_own_thread(config: EngineConfig) -> None:
    """One other thread for every forward; a no_grad around the engine does not reach it."""
    worker = _Recording()
    with torch.no_grad():
        _serve(worker, config)
    threads = {s.thread for s in worker.seen}
    assert len(worker.seen) > 2 and len(threads) == 1 and threading.get_ident() not in threads
    assert all(s.grad and not s.inference for s in worker.seen)
