"""The releases that wait for launched batches to retire.

`DeferredReleases` owns the requests whose KV must outlive the batches launched before they
finished (under overlap, and behind an abandoned forward), and releases each exactly once
through the allocator.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from typing import TYPE_CHECKING, Final

from specstate.core.errors import DoubleRelease
from specstate.core.request import Req
from specstate.memory.releases import NOTHING_RELEASED, ReleasedBatch

if TYPE_CHECKING:
    from specstate.memory.allocation import KvAllocator

__all__ = ["DeferredReleases"]

_NEVER: Final = 1 << 62


class DeferredReleases:
    """Requests whose KV must outlive the batches already launched when they finished.

    Under overlap, batch N+1 is launched before result N is settled; a request that finishes in
    result N may still be read by batch N+1. The engine calls `defer` with the id of the last
    launched batch and `drain` with the id of each batch as it retires; a request is released
    once every batch that could read its KV has retired.

    Invariant: a deferred request is released exactly once, and never before its batch retires.
    """

    def __init__(self, allocator: KvAllocator) -> None:
        self._allocator = allocator
        self._pending: list[tuple[int, Req]] = []
        self._waiting: set[Req] = set()  # the requests of ``_pending`` (a Req hashes by identity)
        self._oldest = _NEVER  # the smallest batch id in _pending
        # Quarantined: requests of an abandoned forward, released once ``until()`` is true.
        self._held: list[tuple[Callable[[], bool], Req]] = []

    def defer(self, req: Req, *, until_batch: int) -> None:
        """Release ``req`` when batch ``until_batch`` retires."""
        self.defer_many((req,), until_batch=until_batch)

    def defer_many(self, reqs: Sequence[Req], *, until_batch: int) -> None:
        """`defer` for several requests (C loops; the same order as one by one)."""
        if not reqs:
            return
        if not self._waiting.isdisjoint(reqs) or len(set(reqs)) != len(reqs):
            for req in reqs:  # name the first one deferred twice, nothing changed
                if req in self._waiting or reqs.count(req) > 1:
                    raise DoubleRelease(f"request {req.request_id}: release already deferred")
        self._pending.extend(zip(repeat(until_batch), reqs))
        self._waiting.update(reqs)
        self._oldest = min(self._oldest, until_batch)

    def hold(self, req: Req, *, until: Callable[[], bool]) -> None:
        """Quarantine ``req``'s KV until ``until()`` is true (checked at each `drain`).

        For the requests of a forward the engine abandoned (a timeout): the forward may still
        write their pages, so they are not reused until its stream is past it (maybe never).
        """
        if req in self._waiting or any(r is req for _, r in self._held):
            raise DoubleRelease(f"request {req.request_id}: release already deferred")
        self._held.append((until, req))

    @property
    def has_pending(self) -> bool:
        """Some release waits for a launched batch to retire (its pages come back then)."""
        return bool(self._pending)

    def held(self) -> Sequence[str]:
        """Request ids whose KV is quarantined behind an abandoned forward."""
        return tuple(r.request_id for _, r in self._held)

    def is_due(self, retired_batch: int) -> bool:
        """Whether a `drain` up to ``retired_batch`` has anything to do: a release waits on a
        batch up to it, or a quarantine to test."""
        return bool(self._held) or self._oldest <= retired_batch

    def drain(self, retired_batch: int) -> ReleasedBatch:
        """Release every request waiting on batches up to ``retired_batch``.

        Quarantined requests whose abandoned forward has since finished are released too.
        """
        if self._held:
            free = [r for until, r in self._held if until()]
            if free:
                self._held = [(u, r) for u, r in self._held if not any(r is f for f in free)]
                self._allocator.release_many(free)
        if self._oldest > retired_batch:
            return NOTHING_RELEASED  # nothing is due (the common case): no scan
        due = [r for b, r in self._pending if b <= retired_batch]
        released = self._allocator.release_many(due)
        self._pending = [(b, r) for b, r in self._pending if b > retired_batch]
        self._waiting.difference_update(due)
        self._oldest = min((b for b, _ in self._pending), default=_NEVER)
        return released

    def pending(self) -> Sequence[str]:
        """Request ids still waiting, in deferral order (quarantined ones last)."""
        return tuple(r.request_id for _, r in self._pending) + tuple(self.held())
