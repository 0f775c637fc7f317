"""The invariant checker: the relations between clocks, owners and pools, checked after a step.

`check_engine` reads an engine's owners (never writes) and raises `InvariantViolation` naming
the request and the numbers for the first relation that does not hold:

1. ledger order ``0 <= protected <= committed <= allocated <= row width`` for every open slot;
2. the KV pool balances: free pages plus pages of open rows are all pages, no duplicate;
3. every open slot belongs to exactly one request that is prefilling, running, or waiting for
   a deferred release (or quarantined behind an abandoned forward); a waiting request holds
   no slot;
4. a prefilling request's committed length equals its launched prefill progress, and it
   holds no speculative reservation (a chunk never speculates: allocated == committed);
5. a running request with no result in flight is in the steady state ``seqlen == committed + 1``
   (the pending bonus), and its reservation covers its committed KV;
6. at idle, nothing is open and every page is free (unless KV is quarantined);
7. every prefilling or running request holds the output row of its KV slot, and every open
   output row belongs to such a request.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from specstate.core.errors import SpecStateError
from specstate.core.request import Req, ReqStatus

if TYPE_CHECKING:
    from specstate.engine.engine import Engine

__all__ = ["InvariantViolation", "check_engine"]


class InvariantViolation(SpecStateError):
    """A relation between the engine's clocks, owners or pools does not hold."""


def _fail(message: str) -> None:
    raise InvariantViolation(message)


def check_engine(engine: Engine) -> None:
    """Check every invariant of the module docstring; raise on the first that fails."""
    entries = engine.ledger.batch_snapshot().entries
    for e in entries:
        if (
            not 0
            <= e.cache_protected_len
            <= e.kv_committed_len
            <= e.kv_allocated_len
            <= e.row_width
        ):
            _fail(f"request {e.request_id}: ledger order broken {e}")
    try:
        engine.allocator.check_balance()
    except SpecStateError as exc:
        raise InvariantViolation(f"KV pool does not balance: {exc}") from exc
    sched = engine.scheduler
    owners = [*sched.prefilling, *sched.running]
    deferred = set(engine.deferred.pending())
    open_ids = [e.request_id for e in entries]
    holders = {r.request_id for r in owners} | deferred
    if sorted(open_ids) != sorted(holders):
        _fail(f"open slots {sorted(open_ids)} != live or deferred requests {sorted(holders)}")
    for req in sched.waiting:
        if engine.allocator.holds_slot(req):
            _fail(f"request {req.request_id}: waiting but holds a KV slot")
    for req in sched.prefilling:
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        done = sched.prefill_progress(req)
        if not entry.kv_committed_len == entry.kv_allocated_len == done:
            _fail(
                f"request {req.request_id}: prefilling with committed {entry.kv_committed_len}, "
                f"allocated {entry.kv_allocated_len}, launched prefill {done}"
            )
    in_flight = engine.in_flight
    busy = set() if in_flight is None else {id(r) for r in in_flight.plan.batch.reqs}
    for req in sched.running:
        if id(req) in busy or req.status is not ReqStatus.RUNNING:
            continue
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        if req.seqlen != entry.kv_committed_len + 1:
            _fail(
                f"request {req.request_id}: seqlen {req.seqlen} != committed "
                f"{entry.kv_committed_len} + 1 with no result in flight"
            )
    _check_output_rows(engine, [*sched.prefilling, *sched.running])
    if engine.is_idle and not engine.deferred.held():  # quarantined KV outlives idleness
        pool = engine.allocator.token_pool
        if entries or pool.available_pages() != pool.num_pages - 1:
            _fail(
                f"idle engine holds {len(entries)} slots and "
                f"{pool.num_pages - 1 - pool.available_pages()} pages"
            )


def _check_output_rows(engine: Engine, admitted: list[Req]) -> None:
    """Invariant 7: output rows and admitted requests correspond one to one."""
    rows = set(engine.outputs.open_rows())
    for req in admitted:
        slot = engine.allocator.slot_of(req)
        if engine.outputs.holder(slot) is not req:
            _fail(f"request {req.request_id}: slot {slot}'s output row is not its own")
        rows.discard(slot)
    if rows:
        _fail(f"output rows {sorted(rows)} are open without an admitted request")
