"""A forward that never returns: with ``forward_timeout_s`` the engine gives up on it and serves on.

A wrapper wedges one decode forward of a real reference worker (it blocks before delegating).
The step that waits for it returns after the timeout: the batch's requests end with
`FinishReason.ERROR` naming the timeout, their KV is quarantined (the forward may still write
it), and — under overlap — a request whose batch was queued behind the wedged one ends too
(and is quarantined as well: its pages may have come from a retraction of the wedged rows).
While the forward is still wedged, new requests run on a fresh stream and match HF
`generate()` token for token. Once the wedged forward is released and returns (its result is
thrown away, nothing is published), the quarantine is released and the pool balances. The
invariant checker runs after every step.
"""

from __future__ import annotations

import threading
import time

import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints, make_spec_checkpoints
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.request import Req
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.worker import OnPublish, WorkerProtocol

PROMPTS = [[3, 14, 15, 92], [65, 35, 89]]
LATE_PROMPTS = [[79, 32, 38, 46], [26, 43]]
NEW_TOKENS = 8
TIMEOUT_S = 2.0  # far above a forward of these tiny models, even on a loaded machine


class _Wedges(SpyWorker):
    """Delegates to ``inner``; its ``wedge_on``-th decode forward waits for `release` first."""

    def __init__(self, inner: WorkerProtocol, *, wedge_on: int) -> None:
        super().__init__(inner)
        self._wedge_on = wedge_on
        self._decodes = 0
        self.entered = threading.Event()  # the wedged forward has started
        self.release = threading.Event()  # let it go on
        self.returned = threading.Event()  # the wedged forward has returned
        self._wedged_thread: int | None = None
        self.calls_after_wedge = 0  # later forwards on the wedged (abandoned) stream's thread

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Delegate; the wedged forward first blocks until released (at most a minute)."""
        if threading.get_ident() == self._wedged_thread:
            self.calls_after_wedge += 1
        if batch.forward_mode.is_decode():
            self._decodes += 1
            if self._decodes == self._wedge_on:
                self._wedged_thread = threading.get_ident()
                self.entered.set()
                self.release.wait(60)
                try:
                    return self._inner.forward_batch_generation(batch, on_publish=on_publish)
                finally:
                    self.returned.set()
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("timeout"), seed=5)


@pytest.mark.parametrize(
    ("algorithm", "overlap"), [("eagle", False), ("eagle", True), ("none", True)]
)
def test_a_wedged_forward_times_out_and_the_engine_serves_on(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """The wedged batch ends with ERROR; new requests are exact while it is still wedged."""
    worker = _Wedges(ckpt.worker(algorithm), wedge_on=2)
    config = EngineConfig(
        overlap=overlap,
        kv_tokens=512,
        forward_timeout_s=TIMEOUT_S,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    engine = Engine(
        worker, limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64), config=config
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    first = [engine.submit(f"a{i}", p, params) for i, p in enumerate(PROMPTS)]
    queued: Req | None = None
    try:
        for _ in range(50):
            if all(r.is_finished for r in first):
                break
            if overlap and worker.entered.is_set() and queued is None:
                # Arrives while the forward is wedged: its prefill queues behind it.
                queued = engine.submit("behind", LATE_PROMPTS[0], params)
            engine.step()
            check_engine(engine)
        for req in first:
            assert req.finish is not None and req.finish.reason is FinishReason.ERROR, req
            assert "not done after 2 s" in req.finish.detail
        assert worker.entered.is_set() and not worker.returned.is_set()
        snap = engine.snapshot()
        assert {r.request_id for r in first} <= set(snap.quarantined)
        if overlap:
            assert queued is not None and queued.finish is not None
            assert queued.finish.reason is FinishReason.ERROR
            assert "queued behind" in queued.finish.detail
            assert queued.request_id in snap.quarantined

        # The forward is still wedged: later requests run on a fresh stream, exactly.
        later = [engine.submit(f"b{i}", p, params) for i, p in enumerate(LATE_PROMPTS)]
        run_checked(engine)
        for req, prompt in zip(later, LATE_PROMPTS, strict=True):
            assert list(req.emitted_ids) == greedy(ckpt.hf, prompt, NEW_TOKENS), req.request_id
        assert not worker.returned.is_set()
        assert engine.snapshot().quarantined == snap.quarantined
    finally:
        worker.release.set()
    assert worker.returned.wait(30)
    for _ in range(500):  # the abandoned stream drains on its own thread
        engine.step()
        check_engine(engine)
        if not engine.snapshot().quarantined:
            break
        time.sleep(0.01)
    snap = engine.snapshot()
    assert snap.quarantined == () and snap.num_open_slots == 0
    assert snap.num_free_pages == snap.num_pages
    assert [r.finish.reason for r in first if r.finish] == [FinishReason.ERROR] * len(first)
    assert worker.calls_after_wedge == 0  # the batch queued behind it never ran
    engine.close()
