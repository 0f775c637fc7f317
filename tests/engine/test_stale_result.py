"""A late result whose incarnation alone decides: it changes nothing.

The engine never re-admits a retracted request before the result launched for its old
incarnation settles (admission runs in a later step), so this drives the owners by hand to
build the worst case the settlement guard must still refuse: the *same* request object, in the
*same* request slot, RUNNING again, with the same prompt and outputs — only its incarnation
(and so its output row's epoch) differs from what the late decode was launched for. Settling
that result must skip the row: committed, allocated, outputs and accept lengths unchanged.
"""

from __future__ import annotations

from engine_driver import run_checked

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.core.ownership import Role
from specstate.core.status import ReqStatus
from specstate.engine.invariants import check_engine
from specstate.tools.timed_worker import TimedWaitWorker

LIMITS = RequestLimits(vocab_size=32, max_context_len=64)


def test_a_late_result_for_an_old_incarnation_in_the_same_slot_is_skipped() -> None:
    """Retract, re-admit into the same slot and catch up; the old decode result settles nothing."""
    engine = Engine(
        TimedWaitWorker(device_seconds=0.0),
        limits=LIMITS,
        config=EngineConfig(overlap=False, kv_tokens=256, check_invariants=True),
    )
    req = engine.submit("r", [1, 2, 3], SamplingParams(max_new_tokens=20, ignore_eos=True))
    for _ in range(3):  # prefill, then two decode rounds
        engine.step()
        check_engine(engine)
    assert req.status is ReqStatus.RUNNING
    slot = engine.allocator.slot_of(req)

    # A decode round launched for incarnation 0 (its result is ready, not settled).
    with engine.checker.acting(Role.SCHEDULER):
        plan, _ = engine.scheduler.schedule()
    assert plan is not None and plan.batch.forward_mode.is_decode()
    engine.rounds.launcher.launch(plan, batch_id=999)
    late = engine.rounds.launcher.collect()
    assert late.error is None and late.host is not None

    # Retract it (the pool's retraction path), then re-admit it: it lands in the same slot.
    with engine.checker.acting(Role.SCHEDULER):
        engine.allocator.release(req)
        engine.scheduler.drop(req)
        req.transition(ReqStatus.RETRACTED)
        req.transition(ReqStatus.WAITING)
        engine.scheduler.enqueue(req, front=True)
    assert req.incarnation == 1
    for _ in range(10):  # recompute prefill of prompt + outputs
        if req.status is ReqStatus.RUNNING:
            break
        engine.step()
        check_engine(engine)
    assert engine.allocator.slot_of(req) == slot and req.status is ReqStatus.RUNNING

    before = engine.ledger.snapshot(slot)
    outputs, accepts = req.output_ids, req.accept_lengths
    settled = engine.rounds.settle_result(plan, late.host)
    assert settled.num_skipped_rows == 1 and settled.num_settled_rows == 0
    assert settled.finished == ()
    assert engine.ledger.snapshot(slot) == before
    assert req.output_ids == outputs and req.accept_lengths == accepts
    check_engine(engine)

    # The request then runs to its cap with nothing lost or doubled.
    run_checked(engine, max_steps=100)
    assert req.finish is not None and req.num_outputs == 20
    engine.close()
