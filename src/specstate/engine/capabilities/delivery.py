"""Deliveries: what the engine's streams have handed out, per request, kept by the engine.

`Deliveries` is the engine-side record behind `specstate.engine.stream.stream`, a capability of the
round at its ``on_end`` hook point (`specstate.engine.hooks`). It is off (and costs a call a step)
until the first ``stream(engine)``; from then on, after every step it compares
the output table's lengths and row openings with the previous step's (two array comparisons)
and queues the requests whose outputs changed, the requests that took a row since (a new holder
may have emitted as many tokens as the row's previous holder ended with), and the requests that
ended. A stream pops the queue one request at a time: the tokens it emitted since its last
delivery, and on its last one its `FinishState`.
Because the record is the engine's and a request is marked delivered exactly when its event is
handed out, every way of driving the engine sees each token once, in order:

* leaving a stream and calling ``stream(engine)`` again resumes: nothing is yielded twice, and
  what the first stream had not handed out yet comes first;
* ``engine.step()`` calls between (or instead of) stream iterations are seen too: their tokens
  and finishes wait in the queue for the next stream;
* one reader at a time (`claim`): a second stream, or a `StreamCursor`, while one is live is
  refused with `UsageError` (each event would reach only one of them).

Retention: a request stays queued until its finish is delivered. If nobody streams any more,
ended requests stop being queued once more than ``finished_history`` of them wait (the oldest
are dropped first), the same bound as `Engine.request` keeps.

Invariant: for every request, the tokens delivered so far are a prefix of ``Req.emitted_ids``
and grow only; a request's finish is delivered at most once, after its last token, and nothing
of it is delivered afterwards.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import numpy as np

from specstate.core.errors import InvariantViolation, UsageError
from specstate.core.request import Req
from specstate.core.status import FinishState
from specstate.engine.hooks import RoundHook
from specstate.engine.settle.outputs import IntArray, OutputTable

if TYPE_CHECKING:
    from specstate.engine.config import StepReport
    from specstate.engine.hooks import EngineView

__all__ = ["Deliveries", "Delivery", "DeliverySnapshot"]

Delivery = tuple[Req, tuple[int, ...], FinishState | None]
"""One event: the request, its tokens since its last delivery, and its finish on the last one."""


@attrs.frozen(kw_only=True)
class DeliverySnapshot:
    """The record at one instant.

    Attributes:
        active: a stream started, so every step is recorded.
        queued: ids of the requests with something undelivered, in delivery order.
        ended_waiting: how many of them ended and wait for their last event.
        reader: the live reader (``"a stream(engine) iterator"``, ``"a StreamCursor"``), or
            None.
    """

    active: bool
    queued: tuple[str, ...]
    ended_waiting: int
    reader: str | None = None


class Deliveries(RoundHook):
    """Owner of what has been delivered per request (module docstring).

    Args:
        outputs: the engine's output table (read: its lengths and row holders).
        history: how many ended requests may wait undelivered before the oldest are dropped.
    """

    def __init__(self, outputs: OutputTable, *, history: int) -> None:
        self._outputs = outputs
        self._history = history
        self._seen: IntArray | None = None  # output lengths after the last step (None: off)
        self._seen_openings: IntArray | None = None  # row openings after the last step
        self._delivered: dict[Req, int] = {}  # tokens delivered, by request (hash: identity)
        # To look at, in the order their changes came, with the row each held then (None: it
        # ended): a live request still in that row reads only its new tokens there.
        self._queued: dict[Req, int | None] = {}
        self._ended: dict[Req, None] = {}  # queued requests that ended (oldest first)
        self._reader: tuple[str, object] | None = None  # the live reader: its name and token

    @property
    def is_active(self) -> bool:
        """True once a stream started: every step is then recorded."""
        return self._seen is not None

    def start(self) -> None:
        """Record from now on (a no-op once started): the first ``stream(engine)`` calls it.

        Tokens a running request emitted before are delivered with its next event.
        """
        if self._seen is None:
            self._seen = self._outputs.all_lengths()
            self._seen_openings = self._outputs.all_openings()

    def claim(self, reader: str) -> object:
        """Make ``reader`` (``"a stream(engine) iterator"``, ``"a StreamCursor"``) the one
        reader of the events until `release` gets the token returned.

        Raises:
            UsageError: another reader is live (each event would reach only one of them).
        """
        if self._reader is not None:
            raise UsageError(
                f"{reader.removeprefix('a ')}: another reader is live: {self._reader[0]} (each "
                "event would reach only one of them; close it, or let it end, first)"
            )
        token = object()
        self._reader = (reader, token)
        return token

    def release(self, token: object) -> None:
        """The reader holding ``token`` is done (a no-op for any other token)."""
        if self._reader is not None and self._reader[1] is token:
            self._reader = None

    def has_due(self) -> bool:
        """Whether an event waits (`pop` would return one); nothing is marked delivered."""
        return any(self._event(req, slot) is not None for req, slot in self._queued.items())

    def on_end(self, report: StepReport) -> None:
        """After a step: queue the requests whose outputs changed or that took a row, then
        those that ended."""
        if self._seen is None:
            return
        ended = report.ended
        now, openings = self._outputs.all_lengths(), self._outputs.all_openings()
        # NOTE: a length compare alone misses a new holder that emitted exactly as many tokens
        # as the row's previous holder ended with: its first tokens would wait a step.
        changed = np.flatnonzero((now != self._seen) | (openings != self._seen_openings))
        self._seen, self._seen_openings = now, openings
        for slot in changed.tolist():
            req = self._outputs.holder(slot)
            if req is not None:
                self._queued[req] = slot
        for req in ended:
            self._queued[req] = None
            self._ended[req] = None
        while len(self._ended) > self._history:  # nobody streams: forget the oldest
            old = next(iter(self._ended))
            self._forget(old)

    def pop(self) -> Delivery | None:
        """The next event, marked delivered as it is returned; None when nothing waits."""
        while self._queued:
            req = next(iter(self._queued))
            slot = self._queued.pop(req)
            event = self._event(req, slot)
            if event is None:
                continue
            tokens, finish = event
            if req.is_finished:
                self._forget(req)
            else:
                self._delivered[req] = self._delivered.get(req, 0) + len(tokens)
            return req, tokens, finish
        return None

    def check(self, view: EngineView) -> None:
        """``delivery``: no stream delivered more of a request than it emitted."""
        for problem in self.problems():
            raise InvariantViolation("delivery", problem)

    def problems(self) -> list[str]:
        """Debug (the invariant checker): requests delivered past what they emitted."""
        return [
            f"request {req.request_id}: {n} tokens delivered, {len(req.emitted_ids)} emitted"
            for req, n in self._delivered.items()
            if n > len(req.emitted_ids)
        ]

    def snapshot(self) -> DeliverySnapshot:
        """What waits to be delivered."""
        return DeliverySnapshot(
            active=self._seen is not None,
            queued=tuple(r.request_id for r in self._queued),
            ended_waiting=len(self._ended),
            reader=None if self._reader is None else self._reader[0],
        )

    def _event(
        self, req: Req, slot: int | None
    ) -> tuple[tuple[int, ...], FinishState | None] | None:
        """Queued ``req``'s event (its new tokens, its finish once ended), not yet marked
        delivered; None when it has none. A live request still holding ``slot`` reads its new
        tokens from the row (the cost is the tokens read, not the request's length)."""
        finished = req.is_finished
        if finished and req not in self._ended:
            return None  # its finish was delivered already (or dropped: nobody streamed)
        start = self._delivered.get(req, 0)
        if not finished and slot is not None and self._outputs.holder(slot) is req:
            new = self._outputs.read_outputs_since(slot, start)
            return (tuple(new), None) if new else None
        emitted = req.emitted_ids
        if len(emitted) <= start and not finished:
            return None  # a change with nothing new for the user (a retraction's row)
        return tuple(emitted[start:]), req.finish if finished else None

    def _forget(self, req: Req) -> None:
        self._queued.pop(req, None)
        self._ended.pop(req, None)
        self._delivered.pop(req, None)
