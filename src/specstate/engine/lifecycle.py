"""The request lifecycle: the engine's requests by id, pending aborts, and how a request ends.

`RequestLifecycle` owns the table of requests an engine knows (live ones, and the last
``finished_history`` ended ones), the user aborts not applied yet, and the one way a request
leaves the engine: its status becomes terminal, the scheduler forgets it, and its KV goes to
`DeferredReleases` — released once no launched batch can read it any more.

Invariant: a request id maps to at most one live request; a request with a pending abort is
live; an ended request holds no scheduler place, and its KV slot (if any) is deferred or held.
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat

from specstate.core.request import FinishReason, FinishState, Req, ReqStatus
from specstate.engine.finish import abort_finish
from specstate.engine.scheduler import Scheduler
from specstate.memory.allocation import DeferredReleases, KvAllocator

__all__ = ["RequestLifecycle"]


class RequestLifecycle:
    """Owner of the engine's request table and pending aborts; see the module docstring.

    Args:
        scheduler: forgets an ended request (`Scheduler.drop`).
        allocator: tells whether an ended request still holds a KV slot.
        deferred: where an ended request's KV waits for the batches that may read it.
        finished_history: how many ended requests stay findable by id.
    """

    def __init__(
        self,
        *,
        scheduler: Scheduler,
        allocator: KvAllocator,
        deferred: DeferredReleases,
        finished_history: int,
    ) -> None:
        self._scheduler = scheduler
        self._allocator = allocator
        self._deferred = deferred
        self._history = finished_history
        self._requests: dict[str, Req] = {}
        self._ended: deque[Req] = deque()  # ended requests still findable, oldest first
        self._aborts: dict[Req, str] = {}  # pending user aborts (a Req hashes by identity)

    # ----------------------------------------------------------------- table
    def register(self, req: Req) -> None:
        """Make ``req`` the request its id names (a previous holder of the id has ended)."""
        self._requests[req.request_id] = req

    def find(self, request_id: str) -> Req | None:
        """The latest request submitted under ``request_id``, if the engine still knows it."""
        return self._requests.get(request_id)

    def is_live(self, request_id: str) -> bool:
        """True when a request with this id is known and has not ended."""
        req = self._requests.get(request_id)
        return req is not None and not req.is_finished

    def live(self) -> Iterator[Req]:
        """Every live request, in submission order."""
        return (r for r in self._requests.values() if not r.is_finished)

    def remember_ended(self, request_ids: Sequence[str]) -> tuple[Req, ...]:
        """The ended requests of ``request_ids``; the oldest beyond the history are forgotten."""
        ended = tuple(map(self._requests.__getitem__, request_ids))
        self._ended.extend(ended)
        while len(self._ended) > self._history:
            old = self._ended.popleft()
            if self._requests.get(old.request_id) is old:  # not a live reuse of the id
                del self._requests[old.request_id]
        return ended

    # ---------------------------------------------------------------- aborts
    @property
    def abort_reasons(self) -> Mapping[Req, str]:
        """Pending user aborts, by request (a result in flight for one is skipped)."""
        return self._aborts

    def request_abort(self, request_id: str, reason: str) -> bool:
        """Mark a live request for abort at the next step; True if it was live."""
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._aborts[req] = reason
        return True

    def abort_live(self, reason: str, *, until_batch: int) -> tuple[str, ...]:
        """End every live request with ABORT (``reason``) now; their ids (the engine closes)."""
        for req in list(self.live()):
            self._aborts.setdefault(req, reason)  # a pending user abort keeps its reason
        return self.apply_aborts(until_batch=until_batch)

    def apply_aborts(self, *, until_batch: int) -> tuple[str, ...]:
        """End every request with a pending abort; their KV waits for batch ``until_batch``."""
        if not self._aborts:
            return ()
        ended: list[str] = []
        for req in list(self._scheduler.waiting):
            reason = self._aborts.pop(req, None)
            if reason is not None:
                req.transition(ReqStatus.ABORTED, finish=abort_finish(req, reason))
                self._scheduler.drop(req)
                ended.append(req.request_id)
        for req in [*self._scheduler.prefilling, *self._scheduler.running]:
            reason = self._aborts.get(req)
            if reason is not None:
                req.transition(ReqStatus.ABORTED, finish=abort_finish(req, reason))
                self.end(req, until_batch=until_batch)
                ended.append(req.request_id)
        return tuple(ended)

    # ---------------------------------------------------------------- ending
    def end(self, req: Req, *, until_batch: int) -> None:
        """Forget an ended request; its KV is released once batch ``until_batch`` retired."""
        self.end_many((req,), until_batch=until_batch)

    def end_many(self, reqs: Sequence[Req], *, until_batch: int) -> None:
        """`end` for the requests one settlement ended, in one pass per owner (no Python call
        per request on the way: a batch-1024 round ends some fifteen)."""
        if not reqs:
            return
        self._scheduler.drop_many(reqs)
        if self._aborts:
            deque(map(self._aborts.pop, reqs, repeat(None)), maxlen=0)
        self._deferred.defer_many(self._allocator.holding_slots(reqs), until_batch=until_batch)

    def quarantine(self, req: Req, *, until: Callable[[], bool]) -> None:
        """Forget an ended request; its KV is held until ``until()`` turns true."""
        self._scheduler.drop(req)
        self._aborts.pop(req, None)
        if self._allocator.holds_slot(req):
            self._deferred.hold(req, until=until)

    @staticmethod
    def fail(reqs: Sequence[Req], incarnations: Sequence[int], error: BaseException) -> list[Req]:
        """End with ERROR the rows whose request is still the incarnation launched; the ended.

        A row whose request was meanwhile retracted (waiting), re-admitted (a new
        incarnation) or ended is left alone.
        """
        ended = []
        trace = "".join(traceback.format_exception(error))
        for req, inc in zip(reqs, incarnations, strict=True):
            if req.incarnation != inc or req.is_finished or req.status is ReqStatus.WAITING:
                continue
            finish = FinishState(
                reason=FinishReason.ERROR,
                finished_len=min(req.num_outputs, req.sampling.max_new_tokens),
                detail=f"{type(error).__name__}: {error}",
                traceback=trace,
            )
            req.transition(ReqStatus.FINISHED, finish=finish)
            ended.append(req)
        return ended
