"""The capability seam: the fixed points at which the round calls each capability.

A capability (grammar, rank agreement, the draft policy, stream delivery, tracing) is an owner of
its own state. The round never branches on one: it calls every capability it was composed with
at the same points of every step, through `RoundHooks`, and a capability that is off is simply
not in the list. Where the points sit in one step (N is the batch launched this step; under
overlap the batch collected is N - 1, in the normal loop it is N)::

    submit      on_submit(req)                  a new request; may refuse it (InvalidRequest)
    ── step ─────────────────────────────────────────────────────────────────────────────────
    start       on_step()
                aborts → release → schedule N
    launch      on_launch(plan, N)              before anything of N reaches the worker (plan
                                                None: this step launches nothing)
                launch N → collect (checked result or error)
    collect     on_collect(flight, error)       the batch's verdict: the error every rank
                                                settles it with (None: settle the result)
    result      on_result(flight, host, live)   row verdicts on a good result, before
                                                settlement: the rows to end with an error
                                                (``live()``: the rows still to settle)
                settle (commit, append, find finishes) → end requests → release
    settled     on_settled(flight, settlement)  the round is settled, its requests ended and
                                                their KV released: observe, record
    end         on_end(report)                  the step's ended, retracted, admitted requests
    ─────────────────────────────────────────────────────────────────────────────────────────
    check       check(view)                     its invariants (``check_invariants``)

A capability never ends a request, re-derives which rows are live, or reaches into another
owner: it returns verdicts (an error for the batch, failures for rows) and the round's one owner
of request ends (`specstate.engine.lifecycle`) acts on them.

Invariant: every point is called from the thread that drives the engine, in the order above;
``on_collect`` and ``on_settled`` once per collected batch, in launch order; ``on_launch`` once
per step. A hook that overrides no point costs the round nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import attrs
import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from specstate.batch.plan import LaunchPlan
    from specstate.core.ledger import LedgerReader
    from specstate.core.request import Req
    from specstate.engine.config import StepReport
    from specstate.engine.launch.outcome import Collected, InFlightView
    from specstate.engine.launch.result_copy import HostResult
    from specstate.engine.schedule.scheduler import Scheduler
    from specstate.engine.settle.outputs import OutputTable
    from specstate.engine.settle.results import Settlement
    from specstate.memory.allocation import KvAllocator
    from specstate.memory.deferred import DeferredReleases

__all__ = ["BoolArray", "EngineView", "LiveRows", "RoundHook", "RoundHooks", "RowFailure"]

BoolArray = npt.NDArray[np.bool_]
"""A host array of one flag per batch row."""

LiveRows = Callable[[], BoolArray]
"""Which rows of the batch being settled are still live (`RoundHook.on_result`)."""


class EngineView(Protocol):
    """What `check_engine` and every `RoundHook.check` read of an engine: its owners (read
    only), the round's counters and its capabilities. `specstate.Engine` and its round
    pipeline both provide it."""

    @property
    def ledger(self) -> LedgerReader:
        """The KV ledger."""
        ...

    @property
    def allocator(self) -> KvAllocator:
        """The KV allocator (pools, prefix cache, recurrent state rows)."""
        ...

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (waiting, prefilling and running requests)."""
        ...

    @property
    def deferred(self) -> DeferredReleases:
        """The releases that wait for launched batches (or quarantined behind a timeout)."""
        ...

    @property
    def outputs(self) -> OutputTable:
        """The output table."""
        ...

    @property
    def hooks(self) -> RoundHooks:
        """The engine's capabilities."""
        ...

    @property
    def in_flight(self) -> InFlightView | None:
        """The batch launched and not settled yet (overlap), or None."""
        ...

    @property
    def num_launched(self) -> int:
        """Batches launched so far."""
        ...

    @property
    def num_retired(self) -> int:
        """Batches settled (or given up on) so far."""
        ...

    @property
    def is_idle(self) -> bool:
        """Nothing waits, runs or is in flight."""
        ...


@attrs.frozen
class RowFailure:
    """A row verdict: batch row ``row`` ends with ``error`` instead of being settled."""

    row: int
    error: BaseException


class RoundHook:
    """A capability's points in the round; each default does nothing (module docstring).

    Subclass and override the points the capability uses; `RoundHooks` calls only those.
    """

    def on_submit(self, req: Req) -> None:
        """A request is about to be queued; raise `InvalidRequest` to refuse it."""

    def on_step(self) -> None:
        """A step starts."""

    def on_launch(self, plan: LaunchPlan | None, batch_id: int) -> None:
        """``plan`` launches as batch ``batch_id`` next (None: nothing launches this step)."""

    def on_collect(self, flight: Collected, error: BaseException | None) -> BaseException | None:
        """The error batch ``flight`` is settled with (``error``: the verdict so far)."""
        return error

    def on_result(
        self, flight: Collected, host: HostResult, live_rows: LiveRows
    ) -> Sequence[RowFailure]:
        """The rows of a good result that must end with an error instead of settling.

        ``live_rows()[i]``: row ``i``'s request still holds the output row the batch was
        launched for, and no earlier verdict ended it (the round's answer, computed when
        asked: a hook with nothing to judge in this batch need not ask).
        """
        return ()

    def on_settled(self, flight: Collected, settlement: Settlement | None) -> None:
        """Batch ``flight`` is settled (``settlement`` None: it failed as a whole)."""

    def on_end(self, report: StepReport) -> None:
        """The step is over; ``report`` names what it launched and who ended or retracted."""

    def check(self, view: EngineView) -> None:
        """Raise `InvariantViolation` for the first of the capability's invariants broken."""


_POINTS = (
    "on_submit",
    "on_step",
    "on_launch",
    "on_collect",
    "on_result",
    "on_settled",
    "on_end",
    "check",
)


class RoundHooks:
    """The capabilities of one engine, grouped by the points each overrides.

    Each attribute is a tuple of bound methods: the round loops over it, so a point no
    capability uses costs nothing, and a capability costs only the points it overrides.
    """

    def __init__(self, hooks: Sequence[RoundHook]) -> None:
        self.hooks = tuple(hooks)
        by_point = {name: tuple(_overrides(self.hooks, name)) for name in _POINTS}
        self.on_submit: tuple[Callable[[Req], None], ...] = by_point["on_submit"]
        self.on_step: tuple[Callable[[], None], ...] = by_point["on_step"]
        self.on_launch: tuple[Callable[[LaunchPlan | None, int], None], ...] = by_point["on_launch"]
        self.on_collect: tuple[
            Callable[[Collected, BaseException | None], BaseException | None], ...
        ] = by_point["on_collect"]
        self.on_result: tuple[
            Callable[[Collected, HostResult, LiveRows], Sequence[RowFailure]], ...
        ] = by_point["on_result"]
        self.on_settled: tuple[Callable[[Collected, Settlement | None], None], ...] = by_point[
            "on_settled"
        ]
        self.on_end: tuple[Callable[[StepReport], None], ...] = by_point["on_end"]
        self.check: tuple[Callable[[EngineView], None], ...] = by_point["check"]


def _overrides(hooks: Sequence[RoundHook], name: str) -> list[Any]:
    """The bound ``name`` methods of the hooks whose class overrides `RoundHook`'s default."""
    default = getattr(RoundHook, name)
    return [getattr(h, name) for h in hooks if getattr(type(h), name) is not default]
