"""The verify-budget guard: a `VerifyBudgetPolicy` is user code inside the round, contained here.

`BudgetGuard` wraps the policy an engine is given. The scheduler asks its `plan` for the rows of
each decode round (before the reservation, which then covers each row's budget); it meets the
round at two hook points (`specstate.engine.hooks`): ``on_settled`` hands the policy the settled
decode round (its live rows only), ``on_end`` the requests that ended. Neither sees a round in
flight: under overlap the plan of round N+1 is made before round N settles.

A plan must be one integer per row in ``[0, width]``; anything else, or an exception from the
policy, **disables** it for the engine's life (logged once, `snapshot` names it), and every later
round verifies its full width, as without a policy. A ``KeyboardInterrupt`` or ``SystemExit``
from the policy disables it too and is re-raised.

Invariant: a plan the guard returns has one integer per row in ``[0, width]``; once disabled,
the policy is never called again.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from specstate.engine.budgets import (
    BudgetGuardSnapshot,
    BudgetRows,
    SettledBudgets,
    VerifyBudgetPolicy,
)
from specstate.engine.capabilities.draft_guard import DraftGuard
from specstate.engine.draft_policy import PlanRound, RoundPlan, full_width
from specstate.engine.hooks import RoundHook
from specstate.memory.host_arrays import IntArray

if TYPE_CHECKING:
    from specstate.engine.config import StepReport
    from specstate.engine.launch.outcome import Collected
    from specstate.engine.settle.results import Settlement

__all__ = ["BudgetGuard", "round_planner"]

_log = logging.getLogger("specstate")


class BudgetGuard(RoundHook):
    """A `VerifyBudgetPolicy`, contained (module docstring)."""

    def __init__(self, policy: VerifyBudgetPolicy) -> None:
        self._policy = policy
        self._failure: str | None = None
        self._planned = 0
        self._rows_by_budget = np.zeros(0, dtype=np.int64)

    def plan(self, request_ids: tuple[str, ...], width: int) -> IntArray | None:
        """The policy's budgets for these rows, checked; None (the full width) once disabled."""
        if self._failure is not None:
            return None
        rows = BudgetRows(request_ids=request_ids, width=width)
        try:
            budgets = self._policy.plan(rows)
        except BaseException as exc:
            self._disable(f"{type(self._policy).__name__}.plan raised", exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return None
        plan = np.asarray(budgets)
        if (
            plan.shape != (len(request_ids),)
            or plan.dtype.kind not in "iu"
            or (plan.size and (int(plan.min()) < 0 or int(plan.max()) > width))
        ):
            self._disable(
                f"{type(self._policy).__name__}.plan returned {budgets!r:.60} for "
                f"{len(request_ids)} rows of width {width}; it must return one integer per row "
                f"in [0, {width}]",
                None,
            )
            return None
        self._planned += 1
        counts = np.bincount(plan, minlength=self._rows_by_budget.size)
        counts[: self._rows_by_budget.size] += self._rows_by_budget
        self._rows_by_budget = counts
        return plan.astype(np.int64, copy=False)

    def on_settled(self, flight: Collected, settlement: Settlement | None) -> None:
        """Hand the policy a settled decode round that was planned with budgets (live rows)."""
        host, budgets = flight.host, flight.plan.batch.verify_budgets
        if self._failure is not None or settlement is None or host is None or budgets is None:
            return
        live = settlement.live
        verified = budgets.host if host.verified is None else host.verified
        ids = flight.plan.batch.request_ids
        settled = SettledBudgets(
            request_ids=tuple(r for r, keep in zip(ids, live.tolist(), strict=True) if keep),
            budgets=budgets.host[live],
            verified=np.asarray(verified, dtype=np.int64)[live],
            accept=np.asarray(host.accept, dtype=np.int64)[live],
            confidences=(
                None
                if host.confidences is None
                else np.asarray(host.confidences[live], dtype=np.float64)
            ),
        )
        self._call("observe", settled)

    def on_end(self, report: StepReport) -> None:
        """The ended requests leave the policy."""
        if report.finished and self._failure is None:
            self._call("forget", report.finished)

    def snapshot(self) -> BudgetGuardSnapshot:
        """Whether the policy is in use, what disabled it, how many rounds it planned."""
        return BudgetGuardSnapshot(
            policy=type(self._policy).__name__,
            rows_by_budget=tuple(self._rows_by_budget.tolist()),
            enabled=self._failure is None,
            failure=self._failure,
            num_planned_rounds=self._planned,
        )

    def _call(self, name: str, arg: object) -> None:
        try:
            getattr(self._policy, name)(arg)
        except BaseException as exc:
            self._disable(f"{type(self._policy).__name__}.{name} raised", exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise

    def _disable(self, what: str, exc: BaseException | None) -> None:
        cause = "" if exc is None else f": {type(exc).__name__}: {exc}"
        self._failure = f"{what}{cause}"
        _log.error(
            "verify-budget policy %s disabled after %s; every later decode round verifies its "
            "full width",
            type(self._policy).__name__,
            self._failure,
            exc_info=exc,
        )


def round_planner(
    draft: DraftGuard | None, budgets: BudgetGuard | None, *, num_steps: int
) -> PlanRound:
    """The scheduler's one question per decode round: the width (the draft policy's, else the
    worker's ``num_steps``) and, within it, each row's budget (the budget policy's)."""
    if draft is None and budgets is None:
        return full_width

    def plan(request_ids: tuple[str, ...]) -> RoundPlan:
        width = None if draft is None else draft.choose(len(request_ids))
        if budgets is None:
            return width, None
        return width, budgets.plan(request_ids, num_steps if width is None else width)

    return plan
