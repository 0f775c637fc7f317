"""An asynchronous worker is launched inline: on the driving thread, as on a CUDA stream.

A worker that declares `WorkerCapabilities.asynchronous` only enqueues its device work; its
result's ``copy_done`` event completes once the work is done. On a CPU the engine then runs
every launch (resolve, isolation, the worker, the result check, publish, stash) on the thread
that drives it, with no forward-stream thread, under both loops:

* a real reference worker declared asynchronous decodes exactly what HF ``generate()`` does,
  under overlap with the consume-once relay, and every forward runs on the driving thread;
* with a forward timeout, a result whose copy event never completes ends its batch (and, under
  overlap, the batch launched behind it) with ERROR; their KV stays quarantined until the copy
  event completes, then the pools balance.
"""

from __future__ import annotations

import threading

import attrs
import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints, make_spec_checkpoints
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerProtocol
from specstate.relay.streams import Stream

PROMPTS = [[3, 14, 15, 92], [65, 35, 89], [79, 32, 38, 46, 26]]
NEW_TOKENS = 10


class _GateEvent:
    """A copy event that completes when the test opens its gate."""

    def __init__(self, gate: threading.Event) -> None:
        self._gate = gate

    def query(self) -> bool:
        """Whether the gate is open."""
        return self._gate.is_set()

    def synchronize(self) -> None:
        """Wait for the gate."""
        self._gate.wait()

    def synchronize_within(self, seconds: float) -> bool:
        """Wait for the gate up to ``seconds``."""
        return self._gate.wait(seconds)

    def wait(self, stream: Stream) -> None:
        """Make ``stream`` wait for the gate."""
        stream.submit(self._gate.wait)

    def wait_current(self) -> None:
        """Wait for the gate."""
        self._gate.wait()


class _Asynchronous(SpyWorker):
    """Declares the inner worker asynchronous; records each forward's thread.

    Its ``late_on``-th decode forward returns a result whose copy event completes only when
    `gate` opens.
    """

    def __init__(self, inner: WorkerProtocol, *, late_on: int | None = None) -> None:
        super().__init__(inner)
        self.threads: list[int] = []
        self.gate = threading.Event()
        self._late_on = late_on
        self._decodes = 0

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The inner worker's, declared asynchronous."""
        return attrs.evolve(self._inner.capabilities, asynchronous=True)

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Delegate; the late forward's result carries the gated copy event."""
        self.threads.append(threading.get_ident())
        result = self._inner.forward_batch_generation(batch, on_publish=on_publish)
        if batch.forward_mode.is_decode():
            self._decodes += 1
            if self._decodes == self._late_on:
                return attrs.evolve(result, copy_done=_GateEvent(self.gate))
        return result


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("inline"), seed=3)


def _engine(
    worker: _Asynchronous, ckpt: SpecCheckpoints, *, overlap: bool, timeout: float
) -> Engine:
    config = EngineConfig(
        overlap=overlap,
        kv_tokens=512,
        forward_timeout_s=timeout,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    return Engine(worker, limits=limits, config=config)


@pytest.mark.parametrize("overlap", [False, True])
def test_an_asynchronous_worker_runs_on_the_driving_thread_and_stays_exact(
    ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """Every forward runs on the driving thread; the tokens equal HF greedy decoding."""
    worker = _Asynchronous(ckpt.worker("eagle"))
    engine = _engine(worker, ckpt, overlap=overlap, timeout=30.0)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    run_checked(engine)
    engine.close()
    assert len(worker.threads) > NEW_TOKENS // 4
    assert set(worker.threads) == {threading.get_ident()}
    for req, prompt in zip(reqs, PROMPTS, strict=True):
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH
        assert list(req.emitted_ids) == greedy(ckpt.hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_result_copy_that_never_completes_times_out_and_is_quarantined(
    ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """The late batch ends with ERROR; its KV is released only once its copy event completes."""
    worker = _Asynchronous(ckpt.worker("eagle"), late_on=2)
    engine = _engine(worker, ckpt, overlap=overlap, timeout=0.5)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    for _ in range(50):
        if all(r.is_finished for r in reqs):
            break
        engine.step()
        check_engine(engine)
    for req in reqs:
        assert req.finish is not None and req.finish.reason is FinishReason.ERROR, req.finish
    details = {r.finish.detail for r in reqs if r.finish is not None}
    assert any("result copy not done after 0.5 s" in d for d in details)
    assert {r.request_id for r in reqs} <= set(engine.snapshot().quarantined)
    for _ in range(3):  # the copy event is still pending: the KV stays quarantined
        engine.step()
        check_engine(engine)
    assert {r.request_id for r in reqs} <= set(engine.snapshot().quarantined)
    worker.gate.set()
    engine.step()
    check_engine(engine)
    snap = engine.snapshot()
    assert snap.quarantined == () and snap.num_open_slots == 0
    assert snap.num_free_pages == snap.num_pages
    engine.close()
