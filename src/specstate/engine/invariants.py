"""The invariant checker: the relations between clocks, owners and pools, checked after a step.

`check_engine` reads an engine's owners through an `EngineView` (never writes) and raises
`InvariantViolation` for the first relation that does not hold, naming the invariant, the
request and the numbers. Each has a name (`InvariantViolation.invariant`):

* ``ledger-order``: ``0 <= protected <= committed <= allocated <= row width`` for every open
  slot;
* ``pool-balance``: free pages, pages of open rows and pages of the prefix cache are all pages,
  no page twice, no owned or cached page free;
* ``page-owners`` (prefix cache): every page is in exactly one of {free, owned by one request
  row, cached}; a cached page's reference count equals the number of rows that map it (at
  positions below their ``cache_protected_len``), and what a row maps there is exactly the
  cached path it holds; the tree's own structure holds (`PrefixCache.problems`);
* ``cache-committed`` (prefix cache, checked at every insert): a release inserts only positions
  below its request's ``kv_committed_len`` (a `LedgerViolation` naming the invariant);
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
* ``handoff``: a request parked for a handoff (prefilled, held for a decode engine) is RUNNING
  (PREFILL until its last chunk settles), holds a slot and sits in no other scheduler place;
  a handed-off request arriving at a decode engine is WAITING and holds no slot
  (`specstate.engine.handoff`);
* ``idle-empty``: at idle (nothing parked), nothing is open and every page is free or cached
  and unreferenced (unless KV is quarantined);
* ``output-rows``: every prefilling or running request holds the output row of its KV slot, and
  every open output row belongs to such a request;
* ``recurrent-slots`` (a worker with recurrent state): the open state records are exactly the
  open KV slots, each held by the same request and, for a live request, its current
  incarnation: every running hybrid request owns exactly one committed state, and the state
  pool balances with the KV pool; no such request shares a cached prefix
  (``cache_protected_len == 0``: the state has no checkpoint at a cache boundary);
* ``recurrent-commit``: a running request's committed state has absorbed exactly its committed
  KV (``recurrent_committed_len == kv_committed_len``); a prefilling one has committed none
  (its partial state is carried on the device from chunk to chunk);
* each capability's own invariants (`RoundHook.check`): ``grammar-records``,
  ``grammar-committed``, ``grammar-position`` (grammar requests: one grammar record per live
  grammar request, its committed count equal to the settled outputs, its matcher where the
  last forward left it, `specstate.engine.capabilities.grammar`); ``rank-agreement`` (one
  rank of a tensor-parallel group: the agreement saw every step's launch point and agreed on
  every retired batch before it was settled, `specstate.engine.capabilities.agreement`);
  ``delivery`` (a stream never delivered more of a request than it emitted,
  `specstate.engine.capabilities.delivery`).

The engine also checks, around every settlement (with ``check_invariants``):

* ``commit-settlement``: a settled decode row advances committed by exactly its accept length
  and appends exactly that many outputs (up to its cap); a row whose request ended or was
  retracted while the batch was in flight changes neither (`check_settlement`);
* ``recurrent-settlement``: a settled decode-like row advances its committed state by exactly
  its accept length (it selects the checkpoint of the accepted run: the round's other
  checkpoints are free again), and a row that was not live changes nothing;
* ``draft-width``: a decode round launched with an adaptive width settles a run and a stride
  of at most ``num_draft_steps + 1`` (the width changes between rounds; a round in flight
  keeps its own).
* ``decode-rows``: the persistent decode rows, every time a change patched them, equal the
  columns built from scratch for the same requests (slots, incarnations, ids, output-row
  epochs, the per-row sampling values), and at scheduling every row's epoch is current
  (`specstate.engine.schedule.decode_rows`).

Forward isolation checks ``isolation`` (a worker wrote a scheduler-owned tensor in place:
`specstate.batch.isolation`); the FutureMap checks ``relay`` consume-once (a forward read a
frontier nobody published, or one was published twice) with ``debug_relay``; the ownership
checker refuses a counter write by a role that does not own it (`OwnershipError`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import InvariantViolation, SpecStateError
from specstate.core.request import Req
from specstate.core.status import ReqStatus

if TYPE_CHECKING:
    from specstate.core.ledger import KvLedgerSnapshot
    from specstate.engine.hooks import EngineView
    from specstate.engine.launch.outcome import Collected
    from specstate.engine.launch.result_copy import HostResult


__all__ = [
    "SettlementProbe",
    "check_engine",
    "check_recurrent",
    "check_settlement",
]


def _fail(invariant: str, message: str) -> None:
    raise InvariantViolation(invariant, message)


def check_engine(engine: EngineView) -> None:
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
    admitted = [*sched.prefilling, *sched.running, *sched.parked]
    _check_handoff(engine)
    _check_slot_owners(engine, entries, admitted)
    _check_prefill_progress(engine, admitted)
    _check_steady_state(engine)
    _check_reserve(engine)
    _check_output_rows(engine, admitted)
    _check_recurrent(engine, admitted, entries)
    _check_page_owners(engine)
    for check in engine.hooks.check:  # each capability's own invariants
        check(engine)
    if engine.is_idle and not engine.deferred.held() and not sched.parked:
        # quarantined KV outlives idleness, and so does the KV of a request parked for handoff
        pool = engine.allocator.token_pool
        free = engine.allocator.available_tokens() // pool.page_size
        if entries or free != pool.num_pages - 1:
            _fail(
                "idle-empty",
                f"idle engine holds {len(entries)} slots and {pool.num_pages - 1 - free} pages",
            )


def _check_handoff(engine: EngineView) -> None:
    """``handoff``: parked requests run, hold a slot, and are nowhere else; arrivals wait."""
    sched, allocator = engine.scheduler, engine.allocator
    others = {*sched.waiting, *sched.prefilling, *sched.running}
    for req in sched.parked:
        status_ok = req.status in (ReqStatus.PREFILL, ReqStatus.RUNNING)  # PREFILL: unsettled
        if not status_ok or not allocator.holds_slot(req) or req in others:
            _fail(
                "handoff",
                f"request {req.request_id}: parked as {req.status.value}, holds a slot "
                f"{allocator.holds_slot(req)}, also elsewhere in the scheduler {req in others}",
            )
    for req, _ in sched.arriving:
        if req.status is not ReqStatus.WAITING or allocator.holds_slot(req):
            _fail(
                "handoff",
                f"request {req.request_id}: arriving as {req.status.value}, holds a slot "
                f"{allocator.holds_slot(req)}",
            )


def _check_slot_owners(
    engine: EngineView, entries: Sequence[KvLedgerSnapshot], admitted: list[Req]
) -> None:
    """``slot-owners``: open slots are the admitted and the deferred; no waiter holds one."""
    open_ids = [e.request_id for e in entries]
    holders = {r.request_id for r in admitted} | set(engine.deferred.pending())
    if sorted(open_ids) != sorted(holders):
        _fail(
            "slot-owners",
            f"open slots {sorted(open_ids)} != live or deferred requests {sorted(holders)}",
        )
    for req in engine.scheduler.waiting:
        if engine.allocator.holds_slot(req):
            _fail("slot-owners", f"request {req.request_id}: waiting but holds a KV slot")


def _check_prefill_progress(engine: EngineView, admitted: list[Req]) -> None:
    """``prefill-progress``: a prefill's committed length is its launched progress."""
    sched = engine.scheduler
    for req in sched.prefilling:
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        done = sched.prefill_progress(req)
        if not entry.kv_committed_len == entry.kv_allocated_len == done:
            _fail(
                "prefill-progress",
                f"request {req.request_id}: prefilling with committed {entry.kv_committed_len}, "
                f"allocated {entry.kv_allocated_len}, launched prefill {done}",
            )
    records = sched.num_prefill_records
    if records != len(admitted):
        _fail(
            "prefill-progress",
            f"{records} prefill records for {len(admitted)} admitted requests (an ended or "
            "retracted request kept its record)",
        )


def _check_steady_state(engine: EngineView) -> None:
    """``steady-state``: a running request with nothing in flight holds its pending bonus."""
    in_flight = engine.in_flight
    busy = set() if in_flight is None else {id(r) for r in in_flight.plan.batch.reqs}
    for req in engine.scheduler.running:
        if id(req) in busy or req.status is not ReqStatus.RUNNING:
            continue
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        if req.seqlen != entry.kv_committed_len + 1:
            _fail(
                "steady-state",
                f"request {req.request_id}: seqlen {req.seqlen} != committed "
                f"{entry.kv_committed_len} + 1 with no result in flight",
            )


def _check_page_owners(engine: EngineView) -> None:
    """``page-owners``: cached pages are held exactly by the rows that map them."""
    prefix = engine.allocator.prefix
    if prefix is None:
        return
    problems = prefix.cache.problems()
    if problems:
        _fail("page-owners", "prefix cache: " + "; ".join(problems))
    pages, refs = prefix.cache.pages_and_refs()
    p = engine.allocator.token_pool.page_size
    table = engine.allocator.req_to_token_host
    mapped: list[npt.NDArray[np.int64]] = []
    for e in engine.ledger.batch_snapshot().entries:
        row = table[e.slot, : e.cache_protected_len : p] // p
        held = prefix.held_pages(e.slot)
        if not np.array_equal(row, held):
            _fail(
                "page-owners",
                f"request {e.request_id}: maps pages {row.tolist()} below protected "
                f"{e.cache_protected_len}, holds cached pages {held.tolist()}",
            )
        mapped.append(row)
    if len(prefix.held_slots()) != sum(1 for m in mapped if m.size):
        _fail("page-owners", f"rows holding a cached prefix: {sorted(prefix.held_slots())}")
    rows = np.concatenate(mapped) if mapped else np.zeros(0, dtype=np.int64)
    ref_by_page = np.zeros(engine.allocator.token_pool.num_pages, dtype=np.int64)
    np.add.at(ref_by_page, rows, 1)
    stray = rows[~np.isin(rows, pages)]
    if stray.size:
        _fail("page-owners", f"rows map pages {stray[:8].tolist()} below protected, not cached")
    wrong = ref_by_page[pages] != refs
    if wrong.any():
        _fail(
            "page-owners",
            f"cached pages {pages[wrong][:8].tolist()} hold references "
            f"{refs[wrong][:8].tolist()} but are mapped by "
            f"{ref_by_page[pages][wrong][:8].tolist()} rows",
        )


def _check_reserve(engine: EngineView) -> None:
    """``reserve``: the decode batch in flight may write L positions past committed (with
    verify budgets, a row's budget + 1)."""
    flight = engine.in_flight
    if flight is None or not flight.plan.is_decode:
        return
    window = engine.allocator.window.alloc_len_per_decode
    batch = flight.plan.batch
    budgets = None if batch.verify_budgets is None else batch.verify_budgets.host
    for i, (req, inc) in enumerate(zip(batch.reqs, batch.incarnations, strict=True)):
        if req.incarnation != inc or req.status is not ReqStatus.RUNNING:
            continue
        need = window if budgets is None else int(budgets[i]) + 1
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        if entry.kv_allocated_len < entry.kv_committed_len + need:
            _fail(
                "reserve",
                f"request {req.request_id}, batch {flight.batch_id} in flight: allocated "
                f"{entry.kv_allocated_len} < committed {entry.kv_committed_len} + L {need}",
            )


@attrs.frozen
class SettlementProbe:
    """A batch's rows just before settlement (see `check_settlement`)."""

    committed: npt.NDArray[np.int64]
    allocated: npt.NDArray[np.int64]
    outputs: npt.NDArray[np.int64]
    live: npt.NDArray[np.bool_]  # the request still holds the row it was launched for
    states: npt.NDArray[np.int64] | None = None  # committed recurrent lengths (hybrid)

    @classmethod
    def take(cls, engine: EngineView, flight: Collected) -> SettlementProbe:
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
        pool = engine.allocator.recurrent
        states = None if pool is None else pool.committed_lengths(slots)
        return cls(committed, allocated, engine.outputs.lengths(slots), live, states)


def check_settlement(
    engine: EngineView, flight: Collected, host: HostResult, before: SettlementProbe
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
    batch = plan.batch
    widths = np.full(len(batch.reqs), host.stride, dtype=np.int64)
    if batch.verify_budgets is not None:  # a row writes at most its budget + 1 positions
        widths = batch.verify_budgets.host + 1
    for i, req in enumerate(batch.reqs):
        grew, emitted = committed[i] - before.committed[i], outputs[i] - before.outputs[i]
        where = f"request {req.request_id}, batch {flight.batch_id}"
        if not before.live[i]:
            _check_state_settled(engine, flight, i, 0, before)
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
        if plan.is_decode and steps is not None and (accept > steps + 1 or host.stride > steps + 1):
            _fail(
                "draft-width",
                f"{where}: a round launched with {steps} draft steps settled a run of "
                f"{accept} (stride {host.stride}); at most {steps + 1}",
            )
        _check_state_settled(engine, flight, i, accept, before)
        width = int(widths[i])
        if plan.is_decode and int(host.seq_lens[i]) + width > before.allocated[i]:
            _fail(
                "reserve",
                f"{where}: the verify wrote positions {int(host.seq_lens[i])}.."
                f"{int(host.seq_lens[i]) + width - 1}, allocated is {before.allocated[i]}",
            )


def _check_output_rows(engine: EngineView, admitted: list[Req]) -> None:
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


def _check_state_settled(
    engine: EngineView, flight: Collected, row: int, accept: int, before: SettlementProbe
) -> None:
    """``recurrent-settlement``: row ``row``'s committed state moved by exactly ``accept``."""
    pool = engine.allocator.recurrent
    if pool is None or before.states is None:
        return
    slot = flight.plan.slots_host[row : row + 1]
    moved = int(pool.committed_lengths(slot)[0] - before.states[row])
    if moved != accept and pool.is_open(int(slot[0])):
        req = flight.plan.batch.reqs[row]
        _fail(
            "recurrent-settlement",
            f"request {req.request_id}, batch {flight.batch_id}: accept length {accept} but the "
            f"committed state moved by {moved} ({int(before.states[row])} -> "
            f"{int(before.states[row]) + moved})",
        )


def check_recurrent(engine: EngineView) -> None:
    """``recurrent-slots`` and ``recurrent-commit`` alone (`check_engine` runs them too)."""
    sched = engine.scheduler
    entries = engine.ledger.batch_snapshot().entries
    _check_recurrent(engine, [*sched.prefilling, *sched.running], entries)


def _check_recurrent(
    engine: EngineView, admitted: list[Req], entries: Sequence[KvLedgerSnapshot]
) -> None:
    """``recurrent-slots`` and ``recurrent-commit`` (see the module docstring)."""
    pool = engine.allocator.recurrent
    if pool is None:
        return
    by_slot = {e.slot: e for e in entries}
    if pool.open_slots() != sorted(by_slot):
        _fail(
            "recurrent-slots",
            f"open state records {pool.open_slots()} != open KV slots {sorted(by_slot)}",
        )
    for slot, entry in by_slot.items():
        holder = pool.holder(slot)
        if holder is None or holder[0] != entry.request_id:
            _fail(
                "recurrent-slots", f"slot {slot}: state record {holder}, KV of {entry.request_id}"
            )
        if entry.cache_protected_len:  # the state is not checkpointed at cache boundaries
            _fail(
                "recurrent-slots",
                f"request {entry.request_id}: shares a cached prefix of "
                f"{entry.cache_protected_len} tokens; its recurrent state has no checkpoint there",
            )
    for req in admitted:
        slot = engine.allocator.slot_of(req)
        if pool.holder(slot) != (req.request_id, req.incarnation):
            _fail(
                "recurrent-slots",
                f"request {req.request_id} (incarnation {req.incarnation}): slot {slot}'s state "
                f"record is {pool.holder(slot)}",
            )
        state = int(pool.committed_lengths(np.array([slot], dtype=np.int64))[0])
        want = by_slot[slot].kv_committed_len if req.status is ReqStatus.RUNNING else 0
        if state != want:
            _fail(
                "recurrent-commit",
                f"request {req.request_id} ({req.status.value}): committed state has absorbed "
                f"{state} tokens, committed KV {by_slot[slot].kv_committed_len} (want {want})",
            )
