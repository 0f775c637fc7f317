"""The engine's usage contract: one driving thread, nothing after close, faults contained.

A worker that raises anything — an `Exception`, a `BaseException` that is not one, even a
`KeyboardInterrupt` — ends only its batch (with `FinishReason.ERROR`, logged with the
traceback); the stream stays usable, later requests are served, and `close` works. The
invariant checker runs after every step.
"""

from __future__ import annotations

import logging
import threading

import pytest

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import UsageError
from specstate.core.status import FinishReason
from specstate.engine.invariants import check_engine
from specstate.engine.worker import OnPublish
from specstate.tools.timed_worker import TimedWaitWorker

LIMITS = RequestLimits(vocab_size=32, max_context_len=64)
PARAMS = SamplingParams(max_new_tokens=6, ignore_eos=True)


class Boom(BaseException):
    """A BaseException that is not an Exception."""


class _RaisesOnce(TimedWaitWorker):
    """Raises ``error`` from its second decode forward, then behaves."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(device_seconds=0.0)
        self._error = error
        self._decodes = 0

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Raise once, on the second decode round."""
        if batch.forward_mode.is_decode():
            self._decodes += 1
            if self._decodes == 2:
                raise self._error
        return super().forward_batch_generation(batch, on_publish=on_publish)


def _engine(worker: TimedWaitWorker, *, overlap: bool) -> Engine:
    config = EngineConfig(overlap=overlap, kv_tokens=512, check_invariants=True)
    return Engine(worker, limits=LIMITS, config=config)


def _drive(engine: Engine) -> int:
    """Step to idle, checking invariants; count the KeyboardInterrupts that reached us."""
    interrupts = 0
    for _ in range(100):
        if engine.is_idle:
            return interrupts
        try:
            engine.step()
        except KeyboardInterrupt:
            interrupts += 1
        check_engine(engine)
    raise AssertionError("engine not idle after 100 steps")


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    "error", [RuntimeError("device lost"), Boom("custom"), KeyboardInterrupt()], ids=repr
)
def test_any_worker_exception_ends_only_its_batch(
    overlap: bool, error: BaseException, caplog: pytest.LogCaptureFixture
) -> None:
    """The batch ends with ERROR, logged with the traceback; the engine keeps serving."""
    with _engine(_RaisesOnce(error), overlap=overlap) as engine:
        first = engine.submit("first", [1, 2, 3], PARAMS)
        with caplog.at_level(logging.ERROR, logger="specstate"):
            interrupts = _drive(engine)
        later = engine.submit("later", [4, 5], PARAMS)
        assert _drive(engine) == 0
        snap = engine.snapshot()
    assert first.finish is not None and first.finish.reason is FinishReason.ERROR
    assert type(error).__name__ in first.finish.detail
    assert "forward_batch_generation" in first.finish.traceback  # where the worker raised
    assert interrupts == (1 if isinstance(error, KeyboardInterrupt) else 0)
    assert later.finish is not None and later.finish.reason is FinishReason.LENGTH
    assert len(later.emitted_ids) == 6
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    (record,) = [r for r in caplog.records if "failed" in r.getMessage()]
    assert record.exc_info is not None and record.exc_info[1] is error
    assert record.exc_info[2] is not None  # the traceback travelled with it


def test_a_second_thread_is_refused() -> None:
    """Only the thread that made the first call drives the engine."""
    with _engine(TimedWaitWorker(device_seconds=0.0), overlap=True) as engine:
        engine.submit("a", [1, 2], PARAMS)
        errors: list[BaseException] = []

        def other() -> None:
            for call in (engine.step, lambda: engine.submit("b", [1], PARAMS)):
                try:
                    call()
                except UsageError as exc:
                    errors.append(exc)

        thread = threading.Thread(target=other, name="intruder")
        thread.start()
        thread.join()
        assert len(errors) == 2 and all("'intruder'" in str(e) for e in errors)
        assert engine.snapshot().num_waiting == 1  # the refused calls changed nothing
        assert _drive(engine) == 0


def test_nothing_runs_after_close() -> None:
    """After close, submit, step and abort raise UsageError; close again is a no-op."""
    engine = _engine(TimedWaitWorker(device_seconds=0.0), overlap=True)
    engine.close()
    for call in (
        lambda: engine.submit("a", [1], PARAMS),
        engine.step,
        lambda: engine.abort("a"),
    ):
        with pytest.raises(UsageError, match=r"after close\(\)"):
            call()
    engine.close()


def test_ended_requests_are_forgotten_past_the_history() -> None:
    """A long-running engine keeps only the last `finished_history` ended requests."""
    config = EngineConfig(overlap=True, kv_tokens=512, check_invariants=True, finished_history=3)
    with Engine(TimedWaitWorker(device_seconds=0.0), limits=LIMITS, config=config) as engine:
        reqs = [engine.submit(f"r{i}", [1, 2], PARAMS) for i in range(8)]
        assert _drive(engine) == 0
        again = engine.submit("r7", [3], PARAMS)  # an id reused while its old request is kept
        assert _drive(engine) == 0
        kept = [r.request_id for r in reqs if engine.lifecycle.find(r.request_id) is not None]
        assert len(kept) <= 3 and engine.request("r7") is again
        for req in reqs[:4]:
            with pytest.raises(KeyError):
                engine.request(req.request_id)
    assert all(len(r.emitted_ids) == 6 for r in reqs)  # the caller's objects stay valid
