"""Committing recurrent states costs a fixed number of operations per round, whatever the batch.

Counted, not timed, as in test_op_budget.py: one `Engine.step` of a steady decode round of a
worker that declares a recurrent state (the engine lays out its rows and commits its states at
settlement), at batch 4 and batch 64. Equal counts mean no per-request work; the torch count
equals a stateless worker's (the commit is host NumPy work), and the Python calls exceed it by
a small fixed number.
"""

from __future__ import annotations

import pytest
from op_count import count_decode_step, steady_engine

from specstate.tools.bench_recurrent import StatefulTimedWorker
from specstate.tools.timed_worker import TimedWaitWorker

EXTRA_PYTHON_CALLS = 4
"""Python calls the state commit adds to a steady round (the result processor's seam and the
pool's settle and commit: one vectorized add)."""


def _counts(batch_size: int, page_size: int, *, stateful: bool) -> tuple[int, int]:
    worker = (StatefulTimedWorker if stateful else TimedWaitWorker)(device_seconds=0.0, accept=2)
    engine = steady_engine(worker, batch_size, page_size)
    try:
        count_decode_step(engine)
        return count_decode_step(engine)
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
