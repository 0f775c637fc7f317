"""Adaptive draft length: how many tokens to draft in the next decode round.

A `DraftPolicy` picks the number of draft steps of every decode round on the host, at
scheduling, from the batch size and the acceptance it observed; the engine tells it what each
settled round accepted, with the width *that* round was launched with. Under overlap a round is
scheduled before the previous one settles, so the policy decides from acceptance one round old,
and a result launched at an old width settles with its own stride and is observed once, at its
own width.

`AcceptanceEma` is the policy the engine ships:

* the acceptance rate of a round is ``(mean accept length - 1) / steps``: the fraction of
  drafts the target kept (bonus excluded);
* an exponential moving average of it moves the width by one step at a time, up above
  ``raise_above`` and down below ``lower_below`` (the gap between the two is the hysteresis);
* at the minimum width and below ``gate_below``, speculation switches *off* (0 steps: plain
  decoding, one token a round); after ``probe_after`` rounds off, one round at the minimum width
  probes again, and speculation stays on if the probe's acceptance lifts the average;
* ``batch_caps`` bounds the width by the batch size (large batches are compute-bound, where a
  wide verify costs more than it saves).

Invariant: ``0 <= choose(b) <= max_steps`` and, when not 0, ``choose(b) >= min(min_steps, cap)``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from specstate.core.errors import InvalidConfig
from specstate.memory.host_arrays import IntArray

__all__ = ["AcceptanceEma", "DraftPolicy", "PlanRound", "RoundPlan", "full_width"]

RoundPlan = tuple["int | None", "IntArray | None"]
"""A decode round's draft steps (None: the worker's ``num_steps``) and its rows' verify budgets
(None: every row verifies the round's width)."""

PlanRound = Callable[[tuple[str, ...]], RoundPlan]
"""What the scheduler asks when it plans a decode round of these rows (request ids, in batch
order): the round's `RoundPlan`, from settled history only (`full_width` without policies)."""

_FULL: RoundPlan = (None, None)


def full_width(request_ids: tuple[str, ...]) -> RoundPlan:
    """Every decode round drafts and verifies the worker's full width: no policy."""
    return _FULL


@runtime_checkable
class DraftPolicy(Protocol):
    """Chooses the draft steps of each decode round; observes each settled round once."""

    @property
    def max_steps(self) -> int:
        """The widest round it may choose (the worker's ``num_steps``; the reservation's width)."""
        ...

    def choose(self, batch_size: int) -> int:
        """Draft steps for the next decode round of ``batch_size`` rows, in ``[0, max_steps]``."""
        ...

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """A decode round launched with ``num_steps`` drafts settled with ``accept_lens``."""
        ...


class AcceptanceEma:
    """The shipped policy (see the module docstring).

    Args:
        max_steps: the worker's draft steps (the widest round).
        min_steps: the narrowest speculative round.
        smoothing: weight of the newest round in the moving average, in (0, 1].
        raise_above: widen by one step when the average acceptance is above this.
        lower_below: narrow by one step when it is below this (< ``raise_above``).
        gate_below: at ``min_steps``, switch speculation off below this (<= ``lower_below``);
            None never switches it off.
        probe_after: rounds off before one probe round at ``min_steps``.
        batch_caps: ``(batch_size, steps)`` pairs: batches of at least ``batch_size`` rows draft
            at most ``steps``.

    Raises:
        InvalidConfig: an inconsistent setting.
    """

    def __init__(
        self,
        max_steps: int,
        *,
        min_steps: int = 1,
        smoothing: float = 0.3,
        raise_above: float = 0.6,
        lower_below: float = 0.35,
        gate_below: float | None = 0.1,
        probe_after: int = 16,
        batch_caps: Sequence[tuple[int, int]] = (),
    ) -> None:
        problems = []
        if not 1 <= min_steps <= max_steps:
            problems.append(f"need 1 <= min_steps <= max_steps, got {min_steps}, {max_steps}")
        if not 0.0 < smoothing <= 1.0:
            problems.append(f"smoothing must be in (0, 1], got {smoothing}")
        if not 0.0 <= lower_below < raise_above <= 1.0:
            problems.append(
                f"need 0 <= lower_below < raise_above <= 1, got {lower_below}, {raise_above}"
            )
        if gate_below is not None and not 0.0 <= gate_below <= lower_below:
            problems.append(f"need 0 <= gate_below <= lower_below, got {gate_below}")
        if probe_after < 1:
            problems.append(f"probe_after must be >= 1, got {probe_after}")
        if any(b < 1 or s < 0 for b, s in batch_caps):
            problems.append(f"batch_caps need batch sizes >= 1 and steps >= 0, got {batch_caps}")
        if problems:
            raise InvalidConfig("AcceptanceEma: " + "; ".join(problems))
        self._max = max_steps
        self._min = min_steps
        self._alpha = smoothing
        self._up, self._down, self._gate = raise_above, lower_below, gate_below
        self._probe_after = probe_after
        self._caps = sorted(batch_caps)
        self._steps = max_steps
        self._rate = (raise_above + lower_below) / 2  # neutral until a round is observed
        self._off_rounds = 0
        self._probing = False

    @property
    def max_steps(self) -> int:
        """The widest round it may choose."""
        return self._max

    @property
    def steps(self) -> int:
        """The width it would choose without a batch cap (0: speculation is off)."""
        return self._steps

    @property
    def acceptance(self) -> float:
        """The moving average of the fraction of drafts accepted."""
        return self._rate

    def choose(self, batch_size: int) -> int:
        """Draft steps for the next decode round of ``batch_size`` rows."""
        if self._steps == 0 and self._off_rounds >= self._probe_after:
            self._steps, self._probing, self._off_rounds = self._min, True, 0
        cap = self._max
        for threshold, steps in self._caps:
            if batch_size >= threshold:
                cap = steps
        return min(self._steps, cap)

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Fold one settled round into the average and move the width (module docstring)."""
        if num_steps == 0:
            if self._steps == 0:
                self._off_rounds += 1
            return
        if accept_lens.size == 0:
            return
        rate = float(accept_lens.mean() - 1.0) / num_steps
        if self._probing:  # one probe decides: start the average again from it
            self._rate, self._probing = rate, False
        else:
            self._rate += self._alpha * (rate - self._rate)
        if self._steps == 0:  # a round launched before the gate closed: recorded, no move
            return
        if self._rate > self._up and self._steps < self._max:
            self._steps += 1
        elif self._rate < self._down and self._steps > self._min:
            self._steps -= 1
        elif self._gate is not None and self._rate < self._gate and self._steps == self._min:
            self._steps, self._off_rounds = 0, 0
