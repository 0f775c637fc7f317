"""Verify budgets: how many drafts each row of the next decode round verifies.

A `VerifyBudgetPolicy` plans a budget per row when the scheduler plans a decode round, from
*settled* history only: under overlap round N+1 is planned while round N is in flight, so a plan
never waits for, or reads, the round in flight (`BudgetRows` carries no result). The engine hands
every settled decode round to the policy once (`SettledBudgets`) and tells it which requests
ended. Row ``i`` then verifies at most ``budgets[i]`` drafts (`specstate.batch.budgets`); its
reservation covers only what it may write.

The shipped policies:

* `FixedBudget`: every row verifies the round's width (what an engine without a policy does,
  planned per row so it can be compared with the others);
* `BatchSizeSchedule`: the width by batch size, e.g. 4 drafts up to 8 rows, 2 up to 64, 1 beyond
  (TensorRT-LLM's ``draft_len_schedule``, vLLM's per-batch-size speculative tokens);
* `GoodputBudget`: per request, the budget that maximizes expected tokens per unit of modelled
  cost from the request's acceptance so far, switched off (0) when speculation would not pay
  and back on through probes, with hysteresis;
* `ConfidenceBudget`: DSpark's confidence-scheduled verification: from the per-position
  confidences the worker reported for the request's last settled round, the verify length that
  maximizes expected accepted tokens per unit of cost, cut to 0 below a minimum predicted gain.

`CostProfile` is the throughput model the last two use: the cost of a decode round in which
every row verifies ``n`` drafts, by batch size, given as data (``CostProfile.from_json``).

Invariant: ``plan`` returns one integer per row in ``[0, rows.width]``; a policy sees only
settled rounds.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import InvalidConfig
from specstate.memory.host_arrays import IntArray

__all__ = [
    "BatchSizeSchedule",
    "BudgetGuardSnapshot",
    "BudgetRows",
    "ConfidenceBudget",
    "CostProfile",
    "FixedBudget",
    "GoodputBudget",
    "SettledBudgets",
    "VerifyBudgetPolicy",
    "best_prefix",
    "budget_policy",
]

FloatArray = npt.NDArray[np.float64]


@attrs.frozen(kw_only=True)
class BudgetRows:
    """What a policy sees when it plans a decode round (never anything of a round in flight).

    Attributes:
        request_ids: the rows' requests, in batch order.
        width: the round's draft width (the draft policy's choice, else the worker's steps):
            no budget may exceed it.
    """

    request_ids: tuple[str, ...]
    width: int

    @property
    def batch_size(self) -> int:
        """Rows in the round."""
        return len(self.request_ids)


@attrs.frozen(kw_only=True)
class SettledBudgets:
    """One settled decode round, as a policy observes it (rows whose request ended or was
    retracted while the round was in flight are left out).

    Attributes:
        request_ids: the settled rows' requests.
        budgets: the budget each row was planned with.
        verified: the drafts each row verified (at most its budget).
        accept: the tokens each row accepted, bonus included (at most verified + 1).
        confidences: ``[rows, width]`` the worker's predicted acceptance of each draft
            position, or None when the worker predicts none.
    """

    request_ids: tuple[str, ...]
    budgets: IntArray
    verified: IntArray
    accept: IntArray
    confidences: FloatArray | None = None


@attrs.frozen(kw_only=True)
class BudgetGuardSnapshot:
    """The engine's verify-budget policy at one instant (`EngineSnapshot.verify_budget`).

    Attributes:
        policy: the policy's class name.
        enabled: the policy still plans the budgets.
        failure: what disabled it, or None.
        num_planned_rounds: decode rounds planned with per-row budgets.
        rows_by_budget: decode rows planned at budget ``b``, at index ``b``.
    """

    policy: str
    enabled: bool
    failure: str | None
    num_planned_rounds: int
    rows_by_budget: tuple[int, ...] = ()


@runtime_checkable
class VerifyBudgetPolicy(Protocol):
    """Plans each row's verify budget from settled history; observes each settled round once."""

    def plan(self, rows: BudgetRows) -> IntArray:
        """``[len(rows.request_ids)]`` budgets, each in ``[0, rows.width]``."""
        ...

    def observe(self, settled: SettledBudgets) -> None:
        """A decode round settled (its rows as planned, verified and accepted)."""
        ...

    def forget(self, request_ids: Sequence[str]) -> None:
        """These requests ended: drop what the policy keeps of them."""
        ...


@attrs.frozen
class CostProfile:
    """The modelled cost of a decode round in which every row verifies ``n`` drafts.

    ``costs[i][n]`` is the cost (any unit: milliseconds of device time, say) of a round of
    ``batch_sizes[i]`` rows verifying ``n`` drafts each (``n + 1`` tokens per row); between two
    batch sizes the cost is interpolated linearly, beyond the last it is extrapolated from the
    last two (and never below the first), and beyond the widest ``n`` it grows by the last step.

    Attributes:
        batch_sizes: ascending batch sizes the table was measured at.
        costs: one row of costs per batch size, for ``n = 0, 1, ...``.
    """

    batch_sizes: tuple[int, ...]
    costs: tuple[tuple[float, ...], ...]

    def __attrs_post_init__(self) -> None:
        sizes = self.batch_sizes
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise InvalidConfig(f"cost profile: batch sizes {list(sizes)} must ascend from >= 1")
        if len(self.costs) != len(sizes) or any(len(r) < 1 for r in self.costs):
            raise InvalidConfig("cost profile: one non-empty row of costs per batch size")
        flat = [c for row in self.costs for c in row]
        if not all(math.isfinite(c) and c > 0 for c in flat):
            raise InvalidConfig("cost profile: every cost must be a positive finite number")

    @classmethod
    def linear(cls, *, per_draft: float) -> CostProfile:
        """A round costs ``1 + per_draft * n`` whatever the batch size (a stand-in profile)."""
        return cls((1,), (tuple(1.0 + per_draft * n for n in range(65)),))

    @classmethod
    def from_json(cls, path: str | Path) -> CostProfile:
        """Read ``{"batch_sizes": [...], "costs": [[...], ...]}`` (`to_json`'s format)."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
            return cls(
                tuple(int(b) for b in data["batch_sizes"]),
                tuple(tuple(float(c) for c in row) for row in data["costs"]),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InvalidConfig(f"cost profile {path}: {type(exc).__name__}: {exc}") from None

    def to_json(self) -> dict[str, Any]:
        """The profile as JSON data (`from_json` reads it back)."""
        return {"batch_sizes": list(self.batch_sizes), "costs": [list(r) for r in self.costs]}

    def cost(self, n: int, batch_size: int) -> float:
        """The cost of a round of ``batch_size`` rows verifying ``n`` drafts each."""
        rows = [self._at(row, n) for row in self.costs]
        sizes = self.batch_sizes
        if len(sizes) == 1 or batch_size <= sizes[0]:
            return rows[0]
        i = int(np.searchsorted(sizes, batch_size))
        i = min(max(i, 1), len(sizes) - 1)
        lo, hi = sizes[i - 1], sizes[i]
        t = (batch_size - lo) / (hi - lo)
        return max(rows[0], rows[i - 1] + t * (rows[i] - rows[i - 1]))

    @staticmethod
    def _at(row: tuple[float, ...], n: int) -> float:
        if n < len(row):
            return row[n]
        step = row[-1] - row[-2] if len(row) > 1 else 0.0
        return row[-1] + step * (n - len(row) + 1)


def best_prefix(
    survival: Sequence[float], profile: CostProfile, batch_size: int, *, min_gain: float
) -> int:
    """The verify length ``n`` (``0 <= n <= len(survival)``) that maximizes expected tokens per
    unit of cost, ``E(n) / cost(n)`` with ``E(n) = 1 + survival[0] + ... + survival[n - 1]``
    (``survival[j]``: the probability that drafts ``0..j`` are all accepted); 0 when its
    predicted gain over plain decoding, ``(E(n) / cost(n)) / (1 / cost(0)) - 1``, is below
    ``min_gain``. Ties go to the shorter length.
    """
    base = 1.0 / profile.cost(0, batch_size)
    best, best_rate, expected = 0, base, 1.0
    for n, s in enumerate(survival, start=1):
        expected += s
        rate = expected / profile.cost(n, batch_size)
        if rate > best_rate:
            best, best_rate = n, rate
    return best if best_rate / base - 1.0 >= min_gain else 0


@attrs.define
class FixedBudget:
    """Every row verifies the round's width."""

    def plan(self, rows: BudgetRows) -> IntArray:
        """The width for every row."""
        return np.full(rows.batch_size, rows.width, dtype=np.int64)

    def observe(self, settled: SettledBudgets) -> None:
        """Nothing to learn."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """Nothing kept."""


@attrs.define
class BatchSizeSchedule:
    """The width by batch size: ``schedule`` maps a largest batch size to its drafts.

    ``BatchSizeSchedule({8: 4, 64: 2})``: 4 drafts up to 8 rows, 2 up to 64, and beyond the
    largest key ``beyond`` (default 0: plain decoding of large batches, which are
    compute-bound). Each budget is capped at the round's width.

    Attributes:
        schedule: the largest batch size of each step of the schedule, and its drafts.
        beyond: the drafts of a batch larger than every key.
    """

    schedule: Mapping[int, int]
    beyond: int = 0

    def __attrs_post_init__(self) -> None:
        if not self.schedule or any(k < 1 or v < 0 for k, v in self.schedule.items()):
            raise InvalidConfig(
                f"batch-size schedule {dict(self.schedule)}: sizes >= 1, drafts >= 0"
            )
        if self.beyond < 0:
            raise InvalidConfig(f"batch-size schedule: beyond must be >= 0, got {self.beyond}")

    def plan(self, rows: BudgetRows) -> IntArray:
        """The scheduled drafts for this batch size, capped at the width, for every row."""
        steps = next(
            (v for k, v in sorted(self.schedule.items()) if rows.batch_size <= k), self.beyond
        )
        return np.full(rows.batch_size, min(steps, rows.width), dtype=np.int64)

    def observe(self, settled: SettledBudgets) -> None:
        """Nothing to learn."""

    def forget(self, request_ids: Sequence[str]) -> None:
        """Nothing kept."""


@attrs.define
class _Acceptance:
    """One request's acceptance so far (`GoodputBudget`)."""

    rate: float  # EMA of the acceptance of a verified draft
    off: bool = False
    rounds_off: int = 0


@attrs.define
class GoodputBudget:
    """Per request, the budget with the best expected tokens per unit of cost; off when
    speculation does not pay, back on through probes (module docstring).

    A request's acceptance ``a`` is an exponential moving average of accepted drafts per
    verified draft (``alpha`` the weight of the newest round; ``prior`` before any). With ``a``
    the survival of ``j + 1`` drafts is ``a ** (j + 1)``, and the budget is `best_prefix`'s.
    Hysteresis: a request whose best predicted gain is at most ``off_below`` is switched off
    (budget 0); while off it is probed with the full width every ``probe_after`` rounds (a
    request at 0 learns nothing otherwise, and would never come back), and switched on again
    once the predicted gain reaches ``on_above``.

    Attributes:
        profile: the cost of a round by drafts verified and batch size.
        alpha: the weight of the newest round in a request's acceptance average.
        prior: a request's acceptance before it settled a verify.
        off_below: the predicted gain at or below which a request is switched off.
        on_above: the predicted gain from which a request off is switched on again.
        probe_after: rounds between the probes of a request that is off.
    """

    profile: CostProfile
    alpha: float = 0.3
    prior: float = 0.6
    off_below: float = 0.0
    on_above: float = 0.05
    probe_after: int = 8
    _state: dict[str, _Acceptance] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        if not (0 < self.alpha <= 1 and 0 <= self.prior <= 1 and self.probe_after >= 1):
            raise InvalidConfig(
                "goodput budget: alpha in (0, 1], prior in [0, 1], probe_after >= 1"
            )
        if self.on_above < self.off_below:
            raise InvalidConfig("goodput budget: on_above must be >= off_below (hysteresis)")

    def plan(self, rows: BudgetRows) -> IntArray:
        """Each row's budget from its request's acceptance (module docstring)."""
        out = np.empty(rows.batch_size, dtype=np.int64)
        for i, rid in enumerate(rows.request_ids):
            state = self._state.get(rid)
            rate = self.prior if state is None else state.rate
            survival = [rate ** (j + 1) for j in range(rows.width)]
            best = best_prefix(survival, self.profile, rows.batch_size, min_gain=-math.inf)
            gain = self._gain(survival[:best], rows.batch_size)
            if state is not None and state.off:
                if gain >= self.on_above:
                    state.off, state.rounds_off = False, 0
                else:
                    state.rounds_off += 1
                    best = rows.width if state.rounds_off % self.probe_after == 0 else 0
            elif state is not None and gain <= self.off_below:
                state.off, state.rounds_off, best = True, 1, 0  # this round is the first off
            out[i] = best
        return out

    def _gain(self, survival: Sequence[float], batch_size: int) -> float:
        expected = 1.0 + sum(survival)
        n = len(survival)
        cost = self.profile
        return (expected / cost.cost(n, batch_size)) * cost.cost(0, batch_size) - 1.0

    def observe(self, settled: SettledBudgets) -> None:
        """Move each request's acceptance towards this round's accepted / verified drafts."""
        for rid, verified, accept in zip(
            settled.request_ids, settled.verified.tolist(), settled.accept.tolist(), strict=True
        ):
            if verified <= 0:
                continue  # a round at budget 0 says nothing about acceptance
            state = self._state.setdefault(rid, _Acceptance(rate=self.prior))
            state.rate += self.alpha * ((accept - 1) / verified - state.rate)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the ended requests' acceptance."""
        for rid in request_ids:
            self._state.pop(rid, None)


@attrs.define
class ConfidenceBudget:
    """DSpark's confidence-scheduled verification (module docstring).

    For each request the worker's confidences of its last settled round (``c[j]``: the
    predicted probability that draft ``j`` is accepted, given drafts ``0..j-1`` were) are the
    prediction for its next round; survival ``s[j] = c[0] * ... * c[j]``; the budget is
    `best_prefix`'s, with ``min_gain`` (TensorRT-LLM's default, 0.04) cutting a request to 0.
    A request with no settled round yet verifies the full width.

    Attributes:
        profile: the cost of a round by drafts verified and batch size.
        min_gain: the predicted gain over plain decoding below which a request verifies 0.
    """

    profile: CostProfile
    min_gain: float = 0.04
    _last: dict[str, FloatArray] = attrs.field(factory=dict, init=False)

    def plan(self, rows: BudgetRows) -> IntArray:
        """Each row's budget from its request's last confidences (module docstring)."""
        out = np.full(rows.batch_size, rows.width, dtype=np.int64)
        for i, rid in enumerate(rows.request_ids):
            conf = self._last.get(rid)
            if conf is not None:
                survival = np.cumprod(conf[: rows.width]).tolist()
                out[i] = best_prefix(
                    survival, self.profile, rows.batch_size, min_gain=self.min_gain
                )
        return out

    def observe(self, settled: SettledBudgets) -> None:
        """Keep each request's confidences of this round (none reported: nothing changes)."""
        if settled.confidences is None:
            return
        for rid, conf in zip(settled.request_ids, settled.confidences, strict=True):
            self._last[rid] = np.asarray(conf, dtype=np.float64)

    def forget(self, request_ids: Sequence[str]) -> None:
        """Drop the ended requests' confidences."""
        for rid in request_ids:
            self._last.pop(rid, None)


STAND_IN_PROFILE = CostProfile.linear(per_draft=0.15)
"""The cost profile of `budget_policy` without a file: each draft costs 15% of a plain step."""


def budget_policy(spec: str, cost_profile: str | None = None) -> VerifyBudgetPolicy:
    """A shipped policy by name (`EngineConfig.verify_budget`): ``fixed``, ``goodput``,
    ``confidence``, or ``schedule:SIZE=DRAFTS,...[,beyond=DRAFTS]``; ``cost_profile`` is the
    JSON file of the profile the goodput and confidence policies use.

    Raises:
        InvalidConfig: an unknown name, a malformed schedule, or an unreadable profile.
    """
    name, _, rest = spec.partition(":")
    if name == "fixed" and not rest:
        return FixedBudget()
    if name == "schedule":
        return _schedule(spec, rest)
    if name in ("goodput", "confidence") and not rest:
        profile = STAND_IN_PROFILE if cost_profile is None else CostProfile.from_json(cost_profile)
        return GoodputBudget(profile) if name == "goodput" else ConfidenceBudget(profile)
    raise InvalidConfig(
        f"verify_budget {spec!r}: expected fixed, goodput, confidence or "
        "schedule:SIZE=DRAFTS,...[,beyond=DRAFTS]"
    )


def _schedule(spec: str, rest: str) -> BatchSizeSchedule:
    schedule: dict[int, int] = {}
    beyond = 0
    try:
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key.strip() == "beyond":
                beyond = int(value)
            else:
                schedule[int(key)] = int(value)
    except ValueError:
        raise InvalidConfig(
            f"verify_budget {spec!r}: a schedule is SIZE=DRAFTS pairs, e.g. schedule:8=4,64=2"
        ) from None
    return BatchSizeSchedule(schedule, beyond=beyond)
