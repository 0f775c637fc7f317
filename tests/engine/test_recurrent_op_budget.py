"""Committing recurrent states costs a fixed number of operations per round, whatever the batch.

Counted, not timed, as in test_op_budget.py: one `Engine.step` of a steady decode round of a
worker that declares a recurrent state (the engine lays out its rows and commits its states at
settlement), at batch 4 and batch 64. Equal counts mean no per-request work; the torch count
equals a stateless worker's (the commit is host NumPy work), and the Python calls exceed it by
a small fixed number.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

import pytest
from torch.overrides import TorchFunctionMode

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.engine.invariants import check_engine
from specstate.tools.bench_recurrent import StatefulTimedWorker
from specstate.tools.timed_worker import TimedWaitWorker

EXTRA_PYTHON_CALLS = 4
"""Python calls the state commit adds to a steady round (the result processor's seam and the
pool's settle and commit: one vectorized add)."""


class _CountTorch(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def _steady_engine(batch_size: int, page_size: int, *, stateful: bool) -> Engine:
    config = EngineConfig(
        overlap=False,
        page_size=page_size,
        kv_tokens=batch_size * 512 + 64,
        max_running=batch_size,
        check_invariants=False,
    )
    worker = (StatefulTimedWorker if stateful else TimedWaitWorker)(device_seconds=0.0, accept=2)
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=256), config=config)
    for i in range(batch_size):
        engine.submit(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=200, ignore_eos=True))
    for _ in range(4):
        engine.step()
        check_engine(engine)
    return engine


def _count_round(engine: Engine) -> tuple[int, int]:
    python_calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal python_calls
        if event in ("call", "c_call"):
            python_calls += 1

    counter = _CountTorch()
    with counter:
        sys.setprofile(profile)
        try:
            report = engine.step()
        finally:
            sys.setprofile(None)
    assert report.launched_mode == "decode"
    check_engine(engine)
    return python_calls, counter.calls


def _counts(batch_size: int, page_size: int, *, stateful: bool) -> tuple[int, int]:
    engine = _steady_engine(batch_size, page_size, stateful=stateful)
    try:
        _count_round(engine)
        return _count_round(engine)
    finally:
        engine.close()


@pytest.mark.parametrize("page_size", [1, 16])
def test_state_commit_is_flat_in_the_batch_size(page_size: int) -> None:
    """Batch 4 and 64 make the same calls with state; the state adds no torch op and a fixed
    number of Python calls."""
    small, large = _counts(4, page_size, stateful=True), _counts(64, page_size, stateful=True)
    assert small == large
    stateless = _counts(4, page_size, stateful=False)
    assert small[1] == stateless[1]
    assert small[0] - stateless[0] == EXTRA_PYTHON_CALLS
