"""The request lifecycle: the requests by id, pending aborts, and the one place a request ends.

`RequestLifecycle` owns the table of requests an engine knows (live ones, and the last
``finished_history`` ended ones), the user aborts not applied yet, and every way a request leaves
the engine. Whoever decides that a request ends — the result processor (a stop, the cap, an
abort that met a result), a capability (a grammar dead end), the launcher (a failed batch), the
scheduler (retraction could not keep it) — hands a verdict to the round, and the round asks this
module to act on it: the status becomes terminal with its `FinishState`, the scheduler forgets
the request, and its KV goes to `DeferredReleases`, released once no launched batch can read it
(or held while an abandoned forward may still write it).

Invariant: a request id maps to at most one live request; a request with a pending abort is
live; an ended request holds no scheduler place, and its KV slot (if any) is deferred or held;
no other module of the engine moves a request to FINISHED or ABORTED.
"""

from __future__ import annotations

import traceback
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat

from specstate.core.request import Req
from specstate.core.status import FinishReason, FinishState, ReqStatus
from specstate.engine.schedule.scheduler import Scheduler
from specstate.memory.allocation import KvAllocator
from specstate.memory.deferred import DeferredReleases
from specstate.memory.retraction import RetractionOutcome

__all__ = ["RequestLifecycle", "abort_finish"]


def abort_finish(req: Req, reason: str) -> FinishState:
    """The finish of an abort: what ``req`` emitted so far (never past its cap) stays visible."""
    emitted = min(req.num_outputs, req.sampling.max_new_tokens)
    return FinishState(reason=FinishReason.ABORT, finished_len=emitted, detail=reason)


class RequestLifecycle:
    """Owner of the engine's request table, pending aborts and request ends (module docstring).

    Args:
        scheduler: forgets an ended request (`Scheduler.drop_many`).
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

    def remember_ended(self, ended: Sequence[Req]) -> None:
        """Keep ``ended`` findable; the oldest beyond the history are forgotten."""
        self._ended.extend(ended)
        while len(self._ended) > self._history:
            old = self._ended.popleft()
            if self._requests.get(old.request_id) is old:  # not a live reuse of the id
                del self._requests[old.request_id]

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

    def abort_live(self, reason: str, *, until_batch: int) -> list[Req]:
        """End every live request with ABORT (``reason``) now; those it ended (engine close)."""
        for req in list(self.live()):
            self._aborts.setdefault(req, reason)  # a pending user abort keeps its reason
        return self.apply_aborts(until_batch=until_batch)

    def apply_aborts(self, *, until_batch: int) -> list[Req]:
        """End every request with a pending abort; their KV waits for batch ``until_batch``."""
        if not self._aborts:
            return []
        sched = self._scheduler
        arriving = (r for r, _ in sched.arriving)
        places = (*sched.waiting, *arriving, *sched.prefilling, *sched.running, *sched.parked)
        reqs = [r for r in places if r in self._aborts]
        self.finish(reqs, [abort_finish(r, self._aborts[r]) for r in reqs], until_batch=until_batch)
        return reqs

    # ---------------------------------------------------------------- ending
    def finish(
        self, reqs: Sequence[Req], finishes: Sequence[FinishState], *, until_batch: int
    ) -> None:
        """End each of ``reqs`` with its finish (ABORTED for an abort, else FINISHED), forget
        it, and defer its KV until batch ``until_batch`` retired.

        One pass per owner, no Python call per request on the way (a batch-1024 round ends
        some fifteen). Every request is checked before any changes (`Req.end_many`).
        """
        if not reqs:
            return
        Req.end_many(reqs, finishes)
        self._forget(reqs)
        self._deferred.defer_many(self._allocator.holding_slots(reqs), until_batch=until_batch)

    def fail(
        self,
        reqs: Sequence[Req],
        incarnations: Sequence[int],
        error: BaseException,
        *,
        until_batch: int,
        quarantine: Callable[[], bool] | None = None,
    ) -> list[Req]:
        """End with ERROR the rows whose request is still the incarnation launched; the ended.

        A row whose request was meanwhile retracted (waiting), re-admitted (a new incarnation)
        or ended is left alone. With ``quarantine`` (an abandoned forward may still write their
        pages), the KV of those ended is held until ``quarantine()`` turns true instead.
        """
        failed = [
            req
            for req, inc in zip(reqs, incarnations, strict=True)
            if req.incarnation == inc
            and not req.is_finished
            and req.status is not ReqStatus.WAITING
        ]
        if not failed:
            return failed
        trace = "".join(traceback.format_exception(error))
        detail = f"{type(error).__name__}: {error}"
        finishes = [
            FinishState(
                reason=FinishReason.ERROR,
                finished_len=min(req.num_outputs, req.sampling.max_new_tokens),
                detail=detail,
                traceback=trace,
            )
            for req in failed
        ]
        if quarantine is None:
            self.finish(failed, finishes, until_batch=until_batch)
            return failed
        Req.end_many(failed, finishes)
        self._forget(failed)
        for req in self._allocator.holding_slots(failed):
            self._deferred.hold(req, until=quarantine)
        return failed

    def end_retraction(self, outcome: RetractionOutcome | None, *, until_batch: int) -> list[Req]:
        """End the requests a retraction pass could not keep (their KV is already released)."""
        if outcome is None or not outcome.aborted:
            return []
        reqs = list(outcome.aborted)
        self.finish(reqs, list(outcome.aborted_finishes), until_batch=until_batch)
        return reqs

    def _forget(self, reqs: Sequence[Req]) -> None:
        """The scheduler forgets ``reqs``; their pending aborts are dropped."""
        self._scheduler.drop_many(reqs)
        if self._aborts:
            deque(map(self._aborts.pop, reqs, repeat(None)), maxlen=0)
