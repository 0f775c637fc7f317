"""Inject each class of recurrent-state bug; the checker names the invariant that broke.

The engine runs a worker that declares a recurrent state (a zero-cost timed worker: the engine
lays out and commits states for it exactly as for a model) with every check on. One bug per
test, in the engine (monkeypatched, as a refactor would break it) or in the state record:

| bug | named by |
|---|---|
| a settlement commits the verify width instead of the accept length | ``recurrent-settlement`` |
| a completed prefill is not committed | ``recurrent-commit`` |
| a release leaves the state record open | ``recurrent-slots`` |
| a hybrid request shares a cached prefix | ``recurrent-slots`` |

The same workload without a bug runs clean (the first test).
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_driver import run_checked

from specstate import RequestLimits, SamplingParams
from specstate.core.errors import InvariantViolation
from specstate.core.ownership import Role
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_recurrent
from specstate.memory.recurrent import RecurrentStatePool
from specstate.tools.bench_recurrent import StatefulTimedWorker


def _engine(overlap: bool = True) -> Engine:
    config = EngineConfig(
        overlap=overlap, kv_tokens=1024, check_invariants=True, check_ownership=True
    )
    worker = StatefulTimedWorker(device_seconds=0.0, accept=2)
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=128), config=config)
    for i, n in enumerate((3, 7, 5)):
        engine.submit(f"r{i}", list(range(1, 9)), SamplingParams(max_new_tokens=n, ignore_eos=True))
    return engine


@pytest.mark.parametrize("overlap", [False, True])
def test_a_clean_run_keeps_every_recurrent_invariant(overlap: bool) -> None:
    """No bug: the workload runs to idle, every state record closed."""
    with _engine(overlap) as engine:
        run_checked(engine)
        pool = engine.allocator.recurrent
        assert pool is not None and pool.snapshot().num_open == 0


def test_committing_the_verify_width_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host selects the last checkpoint instead of the accepted one."""
    real = RecurrentStatePool.commit_states

    def commit_width(self: RecurrentStatePool, slots: np.ndarray, accept: np.ndarray) -> None:
        real(self, slots, np.full_like(accept, 4))

    monkeypatch.setattr(RecurrentStatePool, "commit_states", commit_width)
    with _engine() as engine, pytest.raises(InvariantViolation, match=r"\[recurrent-settlement\]"):
        run_checked(engine)


def test_an_uncommitted_prefill_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The last chunk settles but the state of the prefill is never committed."""
    monkeypatch.setattr(RecurrentStatePool, "commit_prefilled", lambda *_: None)
    with _engine() as engine, pytest.raises(InvariantViolation, match=r"\[recurrent-commit\]"):
        run_checked(engine)


def test_a_record_left_open_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """A released slot whose state record stays open: the pools no longer balance."""
    monkeypatch.setattr(RecurrentStatePool, "close_states", lambda *_: None)
    with _engine() as engine, pytest.raises(InvariantViolation, match=r"\[recurrent-slots\]"):
        run_checked(engine)


def test_a_shared_prefix_is_named() -> None:
    """A hybrid request that holds a protected (cached) prefix: its state has no checkpoint.

    (The prefix is protected by hand, with no prefix cache to own its pages, so the check runs
    alone: the whole checker would first report those pages as leaked.)"""
    with _engine() as engine:
        for _ in range(3):
            engine.step()
        req = engine.scheduler.running[0]
        slot = engine.allocator.slot_of(req)
        with engine.checker.acting(Role.SCHEDULER):
            engine.ledger.set_protected(slot, 4)
        with pytest.raises(InvariantViolation, match=r"\[recurrent-slots\].*cached prefix of 4"):
            check_recurrent(engine)
        with engine.checker.acting(Role.SCHEDULER):
            engine.ledger.set_protected(slot, 0)
