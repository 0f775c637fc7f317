"""The invariant checker: the relations between clocks, owners and pools, checked after a step.

`check_engine` reads an engine's owners (never writes) and raises `InvariantViolation` for the
first relation that does not hold, naming the invariant, the request and the numbers. Each has
a name (`InvariantViolation.invariant`):

* ``ledger-order``: ``0 <= protected <= committed <= allocated <= row width`` for every open
  slot;
* ``pool-balance``: free pages plus pages of open rows are all pages, no page twice, no owned
  page free;
* ``slot-owners``: every open slot belongs to exactly one request that is prefilling, running,
  or waiting for a deferred release (or quarantined behind an abandoned forward); a waiting
  request holds no slot;
* ``prefill-progress``: a prefilling request's committed length equals its launched prefill
  progress, and it holds no speculative reservation (allocated == committed);
* ``steady-state``: a running request with no result in flight has ``seqlen == committed + 1``
  (the pending bonus);
* ``reserve``: a running request in the decode batch in flight has ``allocated >= committed +
  L`` (L the speculative window): the verify in flight writes from the frontier, at most
  ``committed`` now, for L positions (the 2·L reserve, minus the round settled meanwhile);
* ``idle-empty``: at idle, nothing is open and every page is free (unless KV is quarantined);
* ``output-rows``: every prefilling or running request holds the output row of its KV slot, and
  every open output row belongs to such a request;
* ``delivery``: a stream never delivered more of a request than it emitted
  (`specstate.engine.delivery`).

The engine also checks, around every settlement (with ``check_invariants``):

* ``commit-settlement``: a settled decode row advances committed by exactly its accept length
  and appends exactly that many outputs (up to its cap); a row whose request ended or was
  retracted while the batch was in flight changes neither (`check_settlement`);
* ``draft-width``: a decode round launched with an adaptive width settles a run and a stride
  of at most ``num_draft_steps + 1`` (the width changes between rounds; a round in flight
  keeps its own).

Forward isolation checks ``isolation`` (a worker wrote a scheduler-owned tensor in place:
`specstate.relay.isolation`); the FutureMap checks ``relay`` consume-once (a forward read a
frontier nobody published, or one was published twice) with ``debug_relay``; the ownership
checker refuses a counter write by a role that does not own it (`OwnershipError`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import SpecStateError
from specstate.core.request import Req, ReqStatus

if TYPE_CHECKING:
    from specstate.core.ledger import LedgerReader
    from specstate.engine.engine import Engine
    from specstate.engine.launch import InFlight
    from specstate.engine.outputs import OutputTable
    from specstate.engine.result_copy import HostResult
    from specstate.memory.allocation import KvAllocator


class SettlementParts(Protocol):
    """The owners a settlement check reads (the engine, or its round pipeline)."""

    @property
    def ledger(self) -> LedgerReader:
        """The KV ledger (read only)."""
        ...

    @property
    def allocator(self) -> KvAllocator:
        """The KV allocator (read only here)."""
        ...

    @property
    def outputs(self) -> OutputTable:
        """The output table (read only here)."""
        ...


__all__ = ["InvariantViolation", "SettlementProbe", "check_engine", "check_settlement"]


class InvariantViolation(SpecStateError):
    """A relation between the engine's clocks, owners or pools does not hold.

    Attributes:
        invariant: the name of the relation (see the module docstring).
    """

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"[{invariant}] {message}")
        self.invariant = invariant


def _fail(invariant: str, message: str) -> None:
    raise InvariantViolation(invariant, message)


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
            _fail("ledger-order", f"request {e.request_id}: ledger order broken {e}")
    try:
        engine.allocator.check_balance()
    except SpecStateError as exc:
        raise InvariantViolation("pool-balance", f"KV pool does not balance: {exc}") from exc
    sched = engine.scheduler
    owners = [*sched.prefilling, *sched.running]
    deferred = set(engine.deferred.pending())
    open_ids = [e.request_id for e in entries]
    holders = {r.request_id for r in owners} | deferred
    if sorted(open_ids) != sorted(holders):
        _fail(
            "slot-owners",
            f"open slots {sorted(open_ids)} != live or deferred requests {sorted(holders)}",
        )
    for req in sched.waiting:
        if engine.allocator.holds_slot(req):
            _fail("slot-owners", f"request {req.request_id}: waiting but holds a KV slot")
    for req in sched.prefilling:
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        done = sched.prefill_progress(req)
        if not entry.kv_committed_len == entry.kv_allocated_len == done:
            _fail(
                "prefill-progress",
                f"request {req.request_id}: prefilling with committed {entry.kv_committed_len}, "
                f"allocated {entry.kv_allocated_len}, launched prefill {done}",
            )
    in_flight = engine.in_flight
    busy = set() if in_flight is None else {id(r) for r in in_flight.plan.batch.reqs}
    for req in sched.running:
        if id(req) in busy or req.status is not ReqStatus.RUNNING:
            continue
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        if req.seqlen != entry.kv_committed_len + 1:
            _fail(
                "steady-state",
                f"request {req.request_id}: seqlen {req.seqlen} != committed "
                f"{entry.kv_committed_len} + 1 with no result in flight",
            )
    _check_reserve(engine)
    _check_output_rows(engine, [*sched.prefilling, *sched.running])
    for problem in engine.deliveries.problems():
        _fail("delivery", problem)
    if engine.is_idle and not engine.deferred.held():  # quarantined KV outlives idleness
        pool = engine.allocator.token_pool
        if entries or pool.available_pages() != pool.num_pages - 1:
            _fail(
                "idle-empty",
                f"idle engine holds {len(entries)} slots and "
                f"{pool.num_pages - 1 - pool.available_pages()} pages",
            )


def _check_reserve(engine: Engine) -> None:
    """``reserve``: the decode batch in flight may write L positions past committed."""
    flight = engine.in_flight
    if flight is None or not flight.plan.is_decode:
        return
    window = engine.allocator.window.alloc_len_per_decode
    batch = flight.plan.batch
    for req, inc in zip(batch.reqs, batch.incarnations, strict=True):
        if req.incarnation != inc or req.status is not ReqStatus.RUNNING:
            continue
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        if entry.kv_allocated_len < entry.kv_committed_len + window:
            _fail(
                "reserve",
                f"request {req.request_id}, batch {flight.batch_id} in flight: allocated "
                f"{entry.kv_allocated_len} < committed {entry.kv_committed_len} + L {window}",
            )


@attrs.frozen
class SettlementProbe:
    """A batch's rows just before settlement (see `check_settlement`)."""

    committed: npt.NDArray[np.int64]
    allocated: npt.NDArray[np.int64]
    outputs: npt.NDArray[np.int64]
    live: npt.NDArray[np.bool_]  # the request still holds the row it was launched for

    @classmethod
    def take(cls, engine: SettlementParts, flight: InFlight) -> SettlementProbe:
        """Read the rows of ``flight``'s batch (Python per row: checking mode only)."""
        plan = flight.plan
        slots = plan.slots_host
        committed, allocated = engine.ledger.host_lengths(slots)
        live = np.array(
            [
                req.incarnation == inc
                and req.status in (ReqStatus.PREFILL, ReqStatus.RUNNING)
                and engine.allocator.holds_slot(req)
                and engine.allocator.slot_of(req) == int(slot)
                for req, inc, slot in zip(
                    plan.batch.reqs, plan.batch.incarnations, slots, strict=True
                )
            ],
            dtype=np.bool_,
        )
        return cls(committed, allocated, engine.outputs.lengths(slots), live)


def check_settlement(
    engine: SettlementParts, flight: InFlight, host: HostResult, before: SettlementProbe
) -> None:
    """``commit-settlement`` and the verify's write bound (``reserve``) of one settled batch.

    A live decode-like row (a verify, or a mixed tail) advances committed by exactly its
    accept length, appends that many outputs (fewer only when the request finished in this
    settlement), and its verify wrote below allocated (``frontier_in + D <= allocated``); a
    row that was not live changes nothing. A decode round launched with an adaptive width
    settles at that width (``draft-width``: run and stride at most ``num_draft_steps + 1``).
    """
    plan = flight.plan
    slots = plan.slots_host
    committed, _ = engine.ledger.host_lengths(slots)
    outputs = engine.outputs.lengths(slots)
    n_prefill = len(plan.last_chunk)
    width = host.stride
    batch = plan.batch
    for i, req in enumerate(batch.reqs):
        grew, emitted = committed[i] - before.committed[i], outputs[i] - before.outputs[i]
        where = f"request {req.request_id}, batch {flight.batch_id}"
        if not before.live[i]:
            if grew or emitted:
                _fail(
                    "commit-settlement",
                    f"{where}: a row whose request ended or was retracted changed committed "
                    f"by {grew} and outputs by {emitted}",
                )
            continue
        if i < n_prefill:
            continue
        accept = int(host.accept[i])
        if grew != accept or emitted > accept or (emitted < accept and not req.is_finished):
            _fail(
                "commit-settlement",
                f"{where}: accept length {accept} but committed moved by {grew} "
                f"({before.committed[i]} -> {committed[i]}) and outputs by {emitted}",
            )
        steps = batch.num_draft_steps
        if plan.is_decode and steps is not None and (accept > steps + 1 or width > steps + 1):
            _fail(
                "draft-width",
                f"{where}: a round launched with {steps} draft steps settled a run of "
                f"{accept} (stride {width}); at most {steps + 1}",
            )
        if plan.is_decode and int(host.seq_lens[i]) + width > before.allocated[i]:
            _fail(
                "reserve",
                f"{where}: the verify wrote positions {int(host.seq_lens[i])}.."
                f"{int(host.seq_lens[i]) + width - 1}, allocated is {before.allocated[i]}",
            )


def _check_output_rows(engine: Engine, admitted: list[Req]) -> None:
    """``output-rows``: output rows and admitted requests correspond one to one."""
    rows = set(engine.outputs.open_rows())
    for req in admitted:
        slot = engine.allocator.slot_of(req)
        if engine.outputs.holder(slot) is not req:
            _fail(
                "output-rows", f"request {req.request_id}: slot {slot}'s output row is not its own"
            )
        rows.discard(slot)
    if rows:
        _fail("output-rows", f"output rows {sorted(rows)} are open without an admitted request")
