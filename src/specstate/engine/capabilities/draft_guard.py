"""The draft policy guard: a user's `DraftPolicy` runs inside the round, so it is contained there.

A draft policy is user code called twice a round: `DraftPolicy.choose` at scheduling (the width
of the next decode round) and `DraftPolicy.observe` after a decode round settled. `DraftGuard`
wraps the policy an engine is given: the scheduler asks its ``choose`` (`DraftWidth`), and it
meets the round at the ``on_settled`` hook point (`specstate.engine.hooks`):

* ``choose``'s answer must be an integer (not a bool) in ``[0, max_steps]``; anything else, or
  an exception, is a policy failure;
* ``observe`` is called after the round is settled, its requests ended and its KV released, so
  nothing it does can change how the round settles; an exception there is a policy failure;
* the first failure **disables** the policy for the engine's life: it is logged once, with its
  traceback, on the ``specstate`` logger, `snapshot` names it, and every later decode round
  drafts the worker's full width (``num_steps``), exactly as without a policy. The round whose
  ``choose`` failed drafts the full width too. The worker is never blamed: no request ends.

A policy that failed once is not trusted again: its state may be half updated, and a policy
that fails every round would otherwise log every round. A ``KeyboardInterrupt`` or
``SystemExit`` raised inside the policy disables it too and is re-raised (it is the caller's);
from ``observe`` it leaves the round settled.

Invariant: ``choose`` returns an ``int`` in ``[0, max_steps]`` and ``max_steps <= num_steps``;
once disabled, the wrapped policy is never called again.
"""

from __future__ import annotations

import logging
import numbers
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import InvalidConfig
from specstate.engine.draft_policy import DraftPolicy
from specstate.engine.hooks import RoundHook

if TYPE_CHECKING:
    from specstate.engine.launch.outcome import Collected
    from specstate.engine.settle.results import Settlement

__all__ = ["DraftGuard", "DraftGuardSnapshot"]

_log = logging.getLogger("specstate")


@attrs.frozen(kw_only=True)
class DraftGuardSnapshot:
    """The guard at one instant.

    Attributes:
        enabled: the policy still chooses the widths.
        failure: what disabled it (``DraftPolicy.choose(8) returned -1 ...``), or None.
    """

    enabled: bool
    failure: str | None


class DraftGuard(RoundHook):
    """A `DraftPolicy` that contains the one it wraps (module docstring).

    Args:
        policy: the user's policy.
        algorithm: the worker's name, for messages.
        num_steps: the worker's draft steps: the width of every round once disabled.

    Raises:
        InvalidConfig: the policy's ``max_steps`` is not an integer in ``[0, num_steps]`` (or
            reading it raised).
    """

    def __init__(self, policy: DraftPolicy, *, algorithm: str, num_steps: int) -> None:
        try:
            max_steps = policy.max_steps
        except Exception as exc:
            raise InvalidConfig(
                f"draft policy {type(policy).__name__}: reading max_steps raised "
                f"{type(exc).__name__}: {exc}"
            ) from exc
        if not _is_steps(max_steps) or not 0 <= max_steps <= num_steps:
            raise InvalidConfig(
                f"draft policy may choose {max_steps!r:.40} steps; worker {algorithm!r} drafts "
                f"at most {num_steps} (max_steps must be an integer in [0, {num_steps}])"
            )
        self._policy = policy
        self._max = int(max_steps)
        self._num_steps = num_steps
        self._failure: str | None = None

    @property
    def max_steps(self) -> int:
        """The widest round the policy may choose."""
        return self._max

    @property
    def enabled(self) -> bool:
        """True until the policy's first failure."""
        return self._failure is None

    def choose(self, batch_size: int) -> int:
        """The policy's width for a round of ``batch_size`` rows, checked; else ``num_steps``."""
        if self._failure is not None:
            return self._num_steps
        try:
            steps = self._policy.choose(batch_size)
        except BaseException as exc:
            self._disable(f"DraftPolicy.choose({batch_size}) raised", exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise
            return self._num_steps
        if not _is_steps(steps) or not 0 <= steps <= self._max:
            self._disable(
                f"DraftPolicy.choose({batch_size}) returned {steps!r:.40}; it must return an "
                f"integer in [0, {self._max}]",
                None,
            )
            return self._num_steps
        return int(steps)

    def on_settled(self, flight: Collected, settlement: Settlement | None) -> None:
        """Hand the policy a settled decode round once, at the width it was launched with.

        Only rows that drafted count: not rows the worker marked invalid, and not requests
        with ``speculative=False`` (they accept one token whatever the drafts). The round is
        settled, its requests ended and their KV released: nothing the policy does changes it.
        """
        host, batch = flight.host, flight.plan.batch
        if settlement is None or host is None or batch.num_draft_steps is None:
            return
        drafted = np.ones(host.batch_size, dtype=np.bool_)
        if host.invalid is not None:
            drafted &= ~host.invalid
        if batch.sampling_info.speculative_host is not None:
            drafted &= batch.sampling_info.speculative_host
        self.observe(batch.num_draft_steps, host.accept[drafted].astype(np.int64))

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Hand a settled round to the policy; a failure disables it (nothing else changes)."""
        if self._failure is not None:
            return
        try:
            self._policy.observe(num_steps, accept_lens)
        except BaseException as exc:
            self._disable(f"DraftPolicy.observe({num_steps}, ...) raised", exc)
            if isinstance(exc, KeyboardInterrupt | SystemExit):
                raise

    def snapshot(self) -> DraftGuardSnapshot:
        """Whether the policy is still in use, and what disabled it."""
        return DraftGuardSnapshot(enabled=self._failure is None, failure=self._failure)

    def _disable(self, what: str, exc: BaseException | None) -> None:
        cause = "" if exc is None else f": {type(exc).__name__}: {exc}"
        self._failure = f"{what}{cause}"
        _log.error(
            "draft policy %s disabled after %s; every later decode round drafts the worker's "
            "%d steps",
            type(self._policy).__name__,
            self._failure,
            self._num_steps,
            exc_info=exc,
        )


def _is_steps(value: object) -> bool:
    """An integer that is not a bool (numpy integers count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)
