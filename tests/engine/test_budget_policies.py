"""The verify-budget policies: the confidence rule against a plain re-computation, the goodput
policy's hysteresis, the cost profile, and the guard that contains a failing policy."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from specstate.core.errors import InvalidConfig
from specstate.engine.budgets import (
    STAND_IN_PROFILE,
    BatchSizeSchedule,
    BudgetRows,
    ConfidenceBudget,
    CostProfile,
    FixedBudget,
    GoodputBudget,
    SettledBudgets,
    best_prefix,
    budget_policy,
)
from specstate.engine.capabilities.budgets import BudgetGuard
from specstate.engine.config import EngineConfig

TABLE = CostProfile((1, 16), ((1.0, 1.1, 1.2, 1.3, 1.4), (2.0, 2.4, 2.8, 3.2, 3.6)))
"""Batch 1: each draft costs a tenth of a plain step; batch 16: a fifth."""


def _plain_rule(conf: Sequence[float], costs: Sequence[float], min_gain: float) -> int:
    """The rule written out by hand: maximize E(n) / cost(n), E(n) = 1 + sum of survivals."""
    rates = []
    for n in range(len(conf) + 1):
        survival, expected = 1.0, 1.0
        for c in conf[:n]:
            survival *= c
            expected += survival
        rates.append(expected / costs[n])
    best = max(range(len(rates)), key=lambda n: (rates[n], -n))
    return best if rates[best] / rates[0] - 1.0 >= min_gain else 0


@pytest.mark.parametrize(
    ("conf", "batch_size", "want"),
    [
        ((0.9, 0.9, 0.9, 0.9), 1, 4),  # confident: verify everything
        ((0.9, 0.1, 0.9, 0.9), 1, 1),  # E(1)/1.1 = 1.73 > E(2)/1.2 = 1.99/1.2 = 1.66
        ((0.05, 0.9, 0.9, 0.9), 1, 0),  # E(1) / 1.1 = 0.955 < 1: plain decoding wins
        ((0.9, 0.9, 0.9, 0.9), 16, 4),  # at batch 16 a draft costs 0.2 of a step (2.0)
        ((0.15, 0.9, 0.9, 0.9), 16, 0),  # E(1)/2.4 = 0.479 < 1/2.0: verifying does not pay
        ((0.12, 0.1, 0.1, 0.1), 1, 0),  # E(1)/1.1 = 1.018: a gain of 1.8%, under 4%: cut to 0
    ],
)
def test_the_confidence_rule_equals_the_rule_written_out(
    conf: tuple[float, ...], batch_size: int, want: int
) -> None:
    """`best_prefix` over survivals (and `ConfidenceBudget` end to end) give the hand answer."""
    costs = [TABLE.cost(n, batch_size) for n in range(5)]
    assert _plain_rule(conf, costs, 0.04) == want
    survival = np.cumprod(conf).tolist()
    assert best_prefix(survival, TABLE, batch_size, min_gain=0.04) == want
    policy = ConfidenceBudget(TABLE)
    settled = SettledBudgets(
        request_ids=("a",),
        budgets=np.array([4]),
        verified=np.array([4]),
        accept=np.array([2]),
        confidences=np.array([conf]),
    )
    policy.observe(settled)
    rows = BudgetRows(request_ids=("a", "new") + ("x",) * (batch_size - 2), width=4)
    plan = (
        policy.plan(rows)
        if batch_size >= 2
        else policy.plan(BudgetRows(request_ids=("a",), width=4))
    )
    assert int(plan[0]) == want
    if batch_size >= 2:
        assert int(plan[1]) == 4  # no history yet: the full width


def test_a_confidence_plan_never_exceeds_the_width() -> None:
    """A round narrower than the confidences kept (adaptive width) caps every budget."""
    policy = ConfidenceBudget(TABLE, min_gain=0.0)
    policy.observe(
        SettledBudgets(
            request_ids=("a",),
            budgets=np.array([4]),
            verified=np.array([4]),
            accept=np.array([5]),
            confidences=np.array([[1.0, 1.0, 1.0, 1.0]]),
        )
    )
    assert policy.plan(BudgetRows(request_ids=("a",), width=2)).tolist() == [2]
    policy.forget(["a"])
    assert policy.plan(BudgetRows(request_ids=("a",), width=3)).tolist() == [3]


def test_the_goodput_policy_switches_off_and_probes_back_on() -> None:
    """Low acceptance turns a request off (0); every probe_after rounds it verifies the full
    width; high acceptance on a probe turns it back on, with hysteresis."""
    profile = CostProfile.linear(per_draft=0.3)
    policy = GoodputBudget(
        profile, alpha=1.0, prior=0.9, off_below=0.0, on_above=0.2, probe_after=3
    )
    rows = BudgetRows(request_ids=("a",), width=4)

    def settle(budget: int, accept: int) -> None:
        policy.observe(
            SettledBudgets(
                request_ids=("a",),
                budgets=np.array([budget]),
                verified=np.array([budget]),
                accept=np.array([accept]),
            )
        )

    first = int(policy.plan(rows)[0])
    assert first > 0  # the prior is optimistic
    settle(first, 1)  # nothing accepted: the average drops to 0 (alpha 1)
    plans = [int(policy.plan(rows)[0]) for _ in range(6)]
    assert plans == [0, 0, 4, 0, 0, 4]  # off, probed every third round
    settle(4, 5)  # the probe accepts everything: back on
    assert int(policy.plan(rows)[0]) > 0


def test_the_cost_profile_interpolates_and_reads_back(tmp_path: Path) -> None:
    """Between batch sizes linearly, past the widest n by the last step; JSON round trip."""
    assert TABLE.cost(2, 1) == pytest.approx(1.2)
    assert TABLE.cost(2, 8) == pytest.approx(1.2 + (7 / 15) * (2.8 - 1.2))
    assert TABLE.cost(6, 1) == pytest.approx(1.6)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(TABLE.to_json()))
    assert CostProfile.from_json(path) == TABLE
    path.write_text('{"batch_sizes": [4, 2], "costs": [[1], [1]]}')
    with pytest.raises(InvalidConfig, match="must ascend"):
        CostProfile.from_json(path)


class _Broken:
    def __init__(self, answer: object) -> None:
        self.answer = answer

    def plan(self, rows: BudgetRows) -> object:
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer

    def observe(self, settled: SettledBudgets) -> None:
        raise AssertionError("a disabled policy is never called again")

    def forget(self, request_ids: Sequence[str]) -> None:
        raise AssertionError("a disabled policy is never called again")


@pytest.mark.parametrize(
    "answer",
    [RuntimeError("boom"), np.array([5]), np.array([-1]), np.array([1.5]), [1, 2], "x"],
)
def test_a_failing_policy_is_disabled_and_the_round_verifies_its_width(
    answer: object, caplog: pytest.LogCaptureFixture
) -> None:
    """A plan that raises or is out of range disables the policy, logged once; None after."""
    guard = BudgetGuard(_Broken(answer))  # type: ignore[arg-type]
    with caplog.at_level(logging.ERROR, logger="specstate"):
        assert guard.plan(("a",), 4) is None
        assert guard.plan(("a",), 4) is None
    snap = guard.snapshot()
    assert not snap.enabled and snap.failure is not None and snap.num_planned_rounds == 0
    assert len([r for r in caplog.records if "disabled" in r.getMessage()]) == 1


def test_a_shipped_policy_is_built_by_name(tmp_path: Path) -> None:
    """`budget_policy` (`EngineConfig.verify_budget`, ``--verify-budget``): each name gives its
    policy, a schedule plans by batch size, and a profile file is the one the policy uses."""
    assert isinstance(budget_policy("fixed"), FixedBudget)
    schedule = budget_policy("schedule:2=3, 4=1,beyond=0")
    assert isinstance(schedule, BatchSizeSchedule)
    for size, drafts in [(1, 3), (2, 3), (3, 1), (4, 1), (5, 0)]:
        rows = BudgetRows(request_ids=tuple(f"r{i}" for i in range(size)), width=4)
        assert schedule.plan(rows).tolist() == [drafts] * size
    costly = CostProfile((1,), ((1.0, 3.0, 5.0, 7.0, 9.0),))  # a draft costs two steps
    (tmp_path / "costly.json").write_text(json.dumps(costly.to_json()))
    rows = BudgetRows(request_ids=("a",), width=4)
    # the stand-in profile (a draft costs 15% of a step) speculates at the prior...
    stand_in = budget_policy("goodput").plan(rows).tolist()
    assert stand_in == GoodputBudget(STAND_IN_PROFILE).plan(rows).tolist() and stand_in[0] > 0
    # ...a profile where drafts cost more than they can return turns speculation off
    assert budget_policy("goodput", str(tmp_path / "costly.json")).plan(rows).tolist() == [0]
    assert isinstance(budget_policy("confidence"), ConfidenceBudget)


@pytest.mark.parametrize(
    ("spec", "profile", "message"),
    [
        ("fixd", None, "verify_budget 'fixd': expected fixed"),
        ("fixed:3", None, "verify_budget 'fixed:3': expected fixed"),
        ("schedule:8=four", None, "a schedule is SIZE=DRAFTS pairs"),
        ("schedule:8=-1", None, "schedule"),
        ("goodput", "missing.json", "cost profile missing.json"),
        ("fixed", "p.json", "cost_profile 'p.json' is used only by the goodput and confidence"),
        (None, "p.json", "got verify_budget=None"),
    ],
)
def test_a_bad_policy_name_is_refused_by_the_config(
    spec: str | None, profile: str | None, message: str
) -> None:
    """`EngineConfig` refuses a policy name it cannot build, or a profile no policy reads."""
    with pytest.raises(InvalidConfig, match="EngineConfig: .*" + re.escape(message)):
        EngineConfig(verify_budget=spec, cost_profile=profile)
