"""A steady decode round costs a fixed number of operations, whatever the batch size.

Counted, not timed: Python-level calls (function calls and calls into C, through
``sys.setprofile``) and torch operations (through a ``TorchFunctionMode``) made by one
`Engine.step` of a steady decode round — schedule (reserve), launch (relay, isolation, the
worker, publish, stash) and settle. The normal loop runs the whole round on this thread, so
every call is seen. Equal counts at batch 4 and 64 prove there is no per-request Python or
per-request torch work on the round's hot path; the torch count is also pinned, and the
Python call count is held to a budget (the fixed cost that dominates a small batch).
"""

from __future__ import annotations

import pytest
from op_count import count_decode_step, steady_engine

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.engine.invariants import check_engine
from specstate.tools.timed_worker import TimedWaitWorker

TORCH_OPS_PER_ROUND = {1: 42, 16: 42}
"""Torch calls of one steady decode round, by page size (engine and the timed-wait worker).

Most are metadata reads (``shape``, ``dtype``, ``numel``, ``numpy()``): the host bookkeeping
and the always-on check of the worker's result run on NumPy views (two of them read the relay
payload's bonus tokens: a result without one fails its batch). A page size of 1 maps new
pages every round (16 does not, in the counted round); it made one call more (43) while the
slot table's row width was read from the table's shape."""


PYTHON_CALLS_PER_ROUND = {1: 330, 16: 298}
"""The most Python-level calls (``sys.setprofile`` "call" and "c_call" events) a steady decode
round may make, by page size: the fixed cost of a round, which dominates at small batches (it
was 517 and 449 before the launch stopped building a thread event, copying an unchanged
sampling state and re-reading an unchanged relay write, then 429 and 361 before the reservation
tested for growth first, isolation rebound only what a forward changed, the relay skipped
no-op casts and a steady write replaced the previous one without a scan, then 352 and 306
before the row arithmetic called NumPy's array methods, not its Python-level wrappers, then 345
and 306 before a step entered the release's role scope only when a release is due, a steady
settlement kept its all-live mask and the resolved forward inputs became the batch's relay
payload as they are and the new pages were counted with a ufunc's sum; it is 328 and 296)."""


TORCH_OPS_CHURNED_ROUND = 55
"""Torch calls of a decode round whose rows changed (joiners in freed rows) and in which
requests finish (page 16): the changed rows' columns (plain rows: one packed host array, whose
rows are viewed without tensor indexing),
the relay's patch (one gather per buffer and one write of the joined rows), the release and
the prefix cache's insert of the finished requests' pages (on by default). It was 139 while
every column was patched with torch operations and the rows that left were moved into the
relay's buffers, 66 while the plain columns were rows of tensors indexed in torch, and 60
while the relay's row patch moved each of its three index arrays with a call of its own and the
slot table's row width was read from the table's shape."""


PYTHON_CALLS_CHURNED_ROUND = 655
"""The most Python-level calls of that churned round with one request finishing, at any batch
size (it was 780 before the changes above, the admission's read of the next round's slots
without a patch and the finished rows resolved per candidate, then 715 before the end of the
finished requests became one pass per owner, then 705 before the row arithmetic called
NumPy's array methods, not its Python-level wrappers, and the scheduler's reservation stopped
building a report nobody read, then 670 before the plain rows became one packed array whose
views are made once and the relay's row patch one move). It is 650 alone; a full test run may
count a few more (calls that the first use of some library path makes)."""


PYTHON_CALLS_PER_FINISH = 5
"""The most Python-level calls each further finishing request adds to that round (with the
request that joins in its row): its `FinishState`, the copy of its output row and of its accept
lengths (one slice each: a row is contiguous, and faster sliced than gathered), and the lookup
of its first stop. Its transition, the release's insertable length, the end of its scheduling,
the deferral of its release and the joiner's row are one pass over all of them (55 before the
last three were, 28 before the first two were)."""


@pytest.mark.parametrize("page_size", [1, 16])
def test_steady_round_cost_does_not_grow_with_the_batch(page_size: int) -> None:
    """Batch 4 and batch 64 make exactly the same calls in a steady decode round."""
    counts = []
    for batch_size in (4, 64):
        worker = TimedWaitWorker(device_seconds=0.0, accept=2)
        engine = steady_engine(worker, batch_size, page_size)
        try:
            count_decode_step(engine)  # page-boundary effects settle after one more round
            counts.append(count_decode_step(engine))
        finally:
            engine.close()
    (small_py, small_torch), (large_py, large_torch) = counts
    assert small_torch == large_torch == TORCH_OPS_PER_ROUND[page_size]
    assert small_py == large_py <= PYTHON_CALLS_PER_ROUND[page_size]


def _churned_engine(batch_size: int, finishing: int) -> Engine:
    """An engine about to run a churned decode round.

    ``finishing`` requests end two rounds in (5 outputs) and as many waiting requests join in
    their rows; the round counted next runs with those changed rows, and another
    ``finishing`` requests end in it (7 outputs). The rest run long.
    """
    config = EngineConfig(
        overlap=False,
        page_size=16,
        kv_tokens=(batch_size + finishing) * 512 + 64,
        max_running=batch_size,
        check_invariants=False,
    )
    worker = TimedWaitWorker(device_seconds=0.0, accept=2)
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=256), config=config)
    caps = [5] * finishing + [7] * finishing + [200] * (batch_size - 2 * finishing)
    for i, cap in enumerate([*caps, *[200] * finishing]):
        engine.submit(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=cap, ignore_eos=True))
    for _ in range(4):  # prefill, two decode rounds (the first group ends), the joiners' prefill
        engine.step()
        check_engine(engine)
    return engine


def test_a_churned_round_costs_the_same_whatever_the_batch_and_the_finishes() -> None:
    """Rows changed and requests finishing: the torch count of the round stays fixed.

    Python calls grow only with the requests that end (each one's finish state and the copy
    of its row), never with the batch.
    """
    counts = {}
    for batch_size, finishing in ((8, 1), (32, 1), (32, 3)):
        engine = _churned_engine(batch_size, finishing)
        try:
            calls, ops = count_decode_step(engine)
            assert len(engine.scheduler.waiting) == 0
            counts[batch_size, finishing] = (calls, ops)
            assert (
                sum(r.is_finished for r in (engine.request(f"r{i}") for i in range(2 * finishing)))
                == 2 * finishing
            )
        finally:
            engine.close()
    assert counts[8, 1][1] == counts[32, 1][1] == counts[32, 3][1] == TORCH_OPS_CHURNED_ROUND
    assert counts[8, 1][0] == counts[32, 1][0] <= PYTHON_CALLS_CHURNED_ROUND
    assert counts[32, 3][0] - counts[32, 1][0] <= 2 * PYTHON_CALLS_PER_FINISH
