"""What the launcher hands the round: a frozen view of a batch in flight, and a collected batch.

The launcher keeps its batches in flight to itself (`specstate.engine.launch.launcher`); the round
and the capabilities see them only through these values.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from specstate.batch.plan import LaunchPlan
from specstate.engine.launch.result_copy import HostResult
from specstate.relay.streams import Event

__all__ = ["Collected", "InFlightView"]


@attrs.frozen(kw_only=True)
class InFlightView:
    """A batch launched and not collected yet.

    Attributes:
        plan: what was launched.
        batch_id: its launch number (1, 2, ...).
        done: the forward stream's event after the batch (None: it ran inline, it is done).
    """

    plan: LaunchPlan
    batch_id: int
    done: Event | None


@attrs.frozen(kw_only=True)
class Collected:
    """One launched batch, collected: its checked host result, or why it failed.

    Exactly one of ``host`` and ``error`` is set. A batch whose forward (or result copy) did
    not finish within the forward timeout has ``quarantine`` set: the forward stream was
    abandoned, the batch queued behind it on that stream (``queued``) never ran, and the KV
    of both batches' requests must stay held until ``quarantine()`` turns true (the abandoned
    forward may still write it).

    Attributes:
        plan: what was launched.
        batch_id: its launch number.
        host: the worker's result as host arrays, every value checked against the batch
            (`specstate.engine.launch.result_check`).
        error: the worker raised, its result broke the contract, or the batch timed out.
        queued: a timed-out stream's batches that never ran, each with its own error.
        quarantine: a timed-out stream's drain predicate (None: not timed out).
        marks: the forward's clock marks (start, worker called, worker returned, end; fewer
            when it failed early), traced engines only.
        publish_ns: when the worker published (traced engines only; 0: not recorded).
        wait_ns: when collecting started and ended (traced engines only).
    """

    plan: LaunchPlan
    batch_id: int
    host: HostResult | None = None
    error: BaseException | None = None
    queued: tuple[Collected, ...] = ()
    quarantine: Callable[[], bool] | None = None
    marks: tuple[int, ...] = ()
    publish_ns: int = 0
    wait_ns: tuple[int, int] = (0, 0)
