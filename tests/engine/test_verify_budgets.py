"""Per-row verify budgets: planned from settled history, honoured, checked, reserved by, reported.

Runs the engine on the shipped timed worker (synthetic acceptance, budgets honoured) with every
invariant checked after every step; the reference workers' exactness under budgets is in
tests/engine/test_budget_lossless.py.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import pytest

from specstate import Engine, EngineConfig, Req, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvalidConfig
from specstate.engine.budgets import (
    BatchSizeSchedule,
    BudgetRows,
    FixedBudget,
    SettledBudgets,
)
from specstate.engine.invariants import check_engine
from specstate.engine.worker import OnPublish
from specstate.memory.host_arrays import IntArray
from specstate.reference.embedded import draft_dir, target_dir
from specstate.reference.workers import default_registry
from specstate.tools.timed_worker import TimedWaitWorker

STEPS = 4


class _ByRequest:
    """Budget = the request number mod (width + 1): ragged rows, 0 included; records what it
    saw, and when, so a test can tell a plan never read the round in flight."""

    def __init__(self) -> None:
        self.observed: list[SettledBudgets] = []
        self.plans: list[tuple[int, tuple[str, ...], IntArray]] = []  # (rounds observed, ...)
        self.forgotten: list[str] = []

    def plan(self, rows: BudgetRows) -> IntArray:
        budgets = np.array([int(r[1:]) % (rows.width + 1) for r in rows.request_ids])
        self.plans.append((len(self.observed), rows.request_ids, budgets))
        return budgets

    def observe(self, settled: SettledBudgets) -> None:
        self.observed.append(settled)

    def forget(self, request_ids: Sequence[str]) -> None:
        self.forgotten.extend(request_ids)


def _engine(policy: object, *, overlap: bool, page_size: int = 1, rates: bool = True) -> Engine:
    worker = TimedWaitWorker(
        device_seconds=0.0,
        num_steps=STEPS,
        accept=STEPS + 1,
        accept_rates=[0.8, 0.7, 0.6, 0.5] if rates else None,
        seed=7,
    )
    config = EngineConfig(
        overlap=overlap, page_size=page_size, kv_tokens=4096, max_running=8, check_invariants=True
    )
    limits = RequestLimits(vocab_size=64, max_context_len=512)
    return Engine(worker, limits=limits, config=config, verify_budget=policy)  # type: ignore[arg-type]


def _run(engine: Engine, n: int = 8, new_tokens: int = 40) -> list[Req]:
    reqs = [
        engine.submit(
            f"r{i}", [1, 2, 3, 4 + i], SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
        )
        for i in range(n)
    ]
    for _ in range(2000):
        if engine.is_idle:
            break
        engine.step()
        check_engine(engine)
    return reqs


@pytest.mark.parametrize("overlap", [False, True])
def test_each_row_verifies_at_most_its_budget(overlap: bool) -> None:
    """Ragged budgets (0 to the width): every run fits its budget, and budget-0 rows decode."""
    policy = _ByRequest()
    with _engine(policy, overlap=overlap) as engine:
        reqs = _run(engine)
    assert policy.plans and policy.observed
    partial = capped = 0
    for req in reqs:
        budget = int(req.request_id[1:]) % (STEPS + 1)
        assert req.finish is not None and len(req.emitted_ids) == 40
        assert set(req.verified_lengths) == {budget}, req.verified_lengths
        assert max(req.accept_lengths) <= budget + 1
        partial += sum(1 < a < budget + 1 for a in req.accept_lengths)
        capped += sum(a == budget + 1 for a in req.accept_lengths if budget < STEPS)
    assert partial and capped  # runs end inside budgets, and budgets cut runs short
    assert sorted(policy.forgotten) == sorted(r.request_id for r in reqs)


def test_a_plan_never_sees_the_round_in_flight() -> None:
    """Under overlap, round N+1 is planned before round N settles: at most N-1 observed."""
    policy = _ByRequest()
    with _engine(policy, overlap=True) as engine:
        _run(engine)
    for i, (observed, _, _) in enumerate(policy.plans):
        assert observed <= max(i - 1, 0), (i, observed)
    assert any(observed == i - 1 for i, (observed, _, _) in enumerate(policy.plans) if i)


def test_the_reservation_follows_each_rows_budget() -> None:
    """Once the first rounds' full-width reservation is used up, a row holds at most the round
    in flight's width plus its own (each its budget + 1): far less than the full window."""
    policy = _ByRequest()
    held = {}
    with _engine(policy, overlap=False) as engine:
        reqs = [
            engine.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=60, ignore_eos=True))
            for i in range(STEPS + 1)
        ]
        for _ in range(14):
            engine.step()
            check_engine(engine)
        for req in reqs:
            entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
            held[int(req.request_id[1:])] = entry.kv_allocated_len - entry.kv_committed_len
        full = engine.allocator.window.reserve
    for budget, tokens in held.items():
        assert tokens <= 2 * (budget + 1), held
    assert held[0] <= 2 < full and held[STEPS] > held[0]


def test_a_worker_that_exceeds_a_budget_fails_its_batch() -> None:
    """A run past budget + 1 is a WorkerResultError: the batch's requests end with ERROR."""

    class _Ignores(TimedWaitWorker):
        def forward_batch_generation(
            self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
        ) -> GenerationBatchResult:
            unbudgeted = attrs.evolve(batch, verify_budgets=None)
            return super().forward_batch_generation(unbudgeted, on_publish=on_publish)

    worker = _Ignores(device_seconds=0.0, num_steps=STEPS, accept=STEPS + 1)
    config = EngineConfig(overlap=False, kv_tokens=2048, max_running=4, check_invariants=True)
    limits = RequestLimits(vocab_size=64, max_context_len=256)
    with Engine(worker, limits=limits, config=config, verify_budget=_ByRequest()) as engine:
        req = engine.submit("r1", [1, 2, 3], SamplingParams(max_new_tokens=20, ignore_eos=True))
        for _ in range(20):
            if engine.is_idle:
                break
            engine.step()
            check_engine(engine)
    assert req.finish is not None and req.finish.reason.value == "error"
    assert "verify budget of 1" in (req.finish.detail or "")


def test_a_worker_without_budget_support_is_refused() -> None:
    """A reference tree worker does not declare budgets: InvalidConfig at construction."""
    worker = default_registry().create(
        "draft_model",
        target=target_dir(),
        draft=draft_dir(),
        num_steps=2,
        topk=2,
        num_draft_tokens=4,
    )
    assert not worker.capabilities.supports_verify_budgets
    with pytest.raises(InvalidConfig, match="does not support per-row verify budgets"):
        Engine(
            worker,
            limits=RequestLimits(vocab_size=260, max_context_len=256),
            config=EngineConfig(),
            verify_budget=FixedBudget(),
        )


@pytest.mark.parametrize("overlap", [False, True])
def test_a_batch_size_schedule_shortens_large_batches(overlap: bool) -> None:
    """BatchSizeSchedule: small batches verify the width, larger ones less, the largest none."""
    schedule = BatchSizeSchedule({2: STEPS, 5: 2}, beyond=0)
    with _engine(schedule, overlap=overlap) as engine:  # the batch shrinks as requests end
        reqs = [
            engine.submit(
                f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=8 + 8 * i, ignore_eos=True)
            )
            for i in range(8)
        ]
        while not engine.is_idle:
            engine.step()
            check_engine(engine)
    widths = {v for r in reqs for v in r.verified_lengths}
    assert widths <= {0, 2, STEPS} and 0 in widths and 2 in widths
    assert engine.snapshot().metrics.num_rejected_drafts >= 0
