"""The Scheduler: admission, chunked prefill, decode batches, retraction and aborts.

It owns the waiting queue, the running set and each request's prefill progress, and it builds
one `LaunchPlan` per iteration from *host* state — which, under overlap, lags the device by the
batch in flight. Scheduling never waits for that batch: a request whose last prefill chunk or
decode round is in flight is scheduled again with `Unresolved` inputs that the FutureMap
resolves at forward entry.

Per iteration: a prefill batch when there is prefill work (the chunked request first, then
waiting requests FCFS within the token budget, the running-request cap and memory), else one
decode round for every running request, after retracting under KV pressure. The rows' columns
(slots, sampling state, epochs) come from `specstate.engine.schedule.column_builder`; a decode
round's persist from round to round in `specstate.engine.schedule.decode_rows`.

Prefill → decode handoff (docs/handoff.md): a request submitted for handoff (`mark_handoff`) is
*parked* once its last prefill chunk is launched instead of joining the running set: it holds its
slot and pages, and no decode round is scheduled for it, until the engine releases it. A handed-off
request arriving at a decode engine (`enqueue_arrival`) waits in ``arriving``; the next schedule
admits arrivals first, whole (never chunked), in a batch of their own whose rows carry their
records (`LaunchPlan.handoff`), and they join the running set like any finished prefill.

Invariant: a waiting or arriving request holds no KV slot; a running, prefilling or parked request
holds exactly one; ``committed == prefill progress`` while a request prefills.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from itertools import repeat

import attrs
import numpy as np
import torch

from specstate.batch.budgets import VerifyBudgets
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.plan import LaunchPlan, PrefillPart
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.errors import InvariantViolation, KvPoolExhausted
from specstate.core.ledger import SchedulerLedgerView
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import Req
from specstate.core.status import ReqStatus
from specstate.engine.draft_policy import PlanRound, full_width
from specstate.engine.schedule.column_builder import RowColumns
from specstate.engine.schedule.decode_columns import DecodeColumns
from specstate.engine.schedule.decode_rows import DecodeRows, DecodeRowsSnapshot
from specstate.engine.settle.outputs import OutputTable
from specstate.handoff.record import HandoffRecord
from specstate.memory.allocation import KvAllocator
from specstate.memory.host_arrays import IntArray
from specstate.memory.prefix_cache import PrefixMatch
from specstate.memory.retraction import RetractionOutcome, retract_for_decode
from specstate.relay.future_map import Unresolved

__all__ = ["Scheduler", "SchedulerConfig"]


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Admission and batching limits."""

    max_running: int
    prefill_token_budget: int
    chunked_prefill: bool
    vocab_size: int
    mixed_chunk: bool = False
    validate: bool = False
    """Check every patched set of decode rows against a fresh build (``check_invariants``)."""


@attrs.define
class _Progress:
    """Prefill progress of one admitted request."""

    target: int  # tokens to prefill: prompt + every settled output (re-admission)
    done: int = 0
    cached: int = 0  # of those, the prefix the cache supplied (its first chunk starts there)


class Scheduler:
    """Builds batches from host state; see the module docstring.

    Args:
        releases_pending: True while some request's KV waits for a launched batch to retire
            (`DeferredReleases.has_pending`). A decode round that does not fit then waits one
            step for those pages instead of retracting or aborting anyone.
        plan_round: each decode round's draft steps and its rows' verify budgets (adaptive
            draft length, verify-budget policies: `round_planner`), asked before the round's
            reservation, which then covers each row's budget; the default, `full_width`,
            drafts and verifies the worker's ``num_steps`` every round.
    """

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        allocator: KvAllocator,
        ledger: SchedulerLedgerView,
        outputs: OutputTable,
        checker: OwnershipChecker,
        device: torch.device,
        releases_pending: Callable[[], bool] | None = None,
        plan_round: PlanRound = full_width,
    ) -> None:
        self._config = config
        self._releases_pending = releases_pending
        self._plan_round = plan_round
        self._allocator = allocator
        self._ledger = ledger
        self._outputs = outputs
        self._checker = checker
        self._device = device
        self.waiting: deque[Req] = deque()
        # Prefilled (or last chunk launched): decode candidates, in admission order. A dict
        # (Req hashes by identity) so that ending or retracting one request is O(1).
        self._running: dict[Req, None] = {}
        self.prefilling: list[Req] = []  # admitted, prefill not fully launched
        self.admitted: list[Req] = []  # admitted by the last `schedule` call (trace events)
        # Handoff: requests to park after prefill, the parked ones (prefilled, held for a
        # decode engine), and handed-off requests arriving with their records.
        self._to_park: set[Req] = set()
        self.parked: dict[Req, None] = {}
        self.arriving: deque[tuple[Req, HandoffRecord]] = deque()
        # Arrivals admitted (slot and room taken) whose import batch is not launched yet: the
        # next schedule imports them first; they never prefill.
        self._importing: dict[Req, HandoffRecord] = {}
        self._progress: dict[int, _Progress] = {}
        # The persistent decode rows.
        self._columns = RowColumns(
            allocator=allocator, outputs=outputs, vocab_size=config.vocab_size, device=device
        )
        self._rows = DecodeRows(
            self._columns.build,
            self._columns.plain,
            device,
            reference=self._columns.general if config.validate else None,
        )
        # Per request slot: the verify budget its last decode round was planned with (the
        # round that may be in flight when the next is reserved); the full width at first.
        width = allocator.window.alloc_len_per_decode - 1
        self._last_budget = np.full(allocator.req_to_token.shape[0], width, dtype=np.int64)

    @property
    def running(self) -> list[Req]:
        """The running requests (decode candidates), in admission order (a new list)."""
        return list(self._running)

    def decode_rows_snapshot(self) -> DecodeRowsSnapshot:
        """How the persistent decode rows changed so far (`DecodeRows.snapshot`)."""
        return self._rows.snapshot()

    @property
    def num_running(self) -> int:
        """How many requests run."""
        return len(self._running)

    # ------------------------------------------------------------------ queue
    def enqueue(self, req: Req, *, front: bool = False) -> None:
        """Put a WAITING request in the queue (retracted ones go first)."""
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def mark_handoff(self, req: Req) -> None:
        """Park ``req`` (not yet admitted) after its prefill instead of decoding it."""
        self._to_park.add(req)

    def enqueue_arrival(self, req: Req, record: HandoffRecord) -> None:
        """Queue a handed-off WAITING request with its record (admitted before any prefill)."""
        self.arriving.append((req, record))

    def drop(self, req: Req) -> None:
        """Forget ``req`` wherever it is (it ended, or was retracted)."""
        self.drop_many((req,))

    def drop_many(self, reqs: Sequence[Req]) -> None:
        """`drop` for several requests (C loops over the running ones; the rest, rare at a
        settlement, one by one)."""
        popped = list(map(self._running.pop, reqs, repeat(False)))
        pairs = list(zip(reqs, popped, strict=True))
        self._rows.leave_many([req for req, was in pairs if was is None])
        if False in popped:  # some were not running: prefilling, waiting, parked, arriving
            for req, was in pairs:
                if was is not False:
                    continue
                if req in self.prefilling:
                    self.prefilling.remove(req)
                elif req in self.waiting:
                    self.waiting.remove(req)
                elif req in self.parked:
                    del self.parked[req]
                else:
                    for entry in self.arriving:
                        if entry[0] is req:
                            self.arriving.remove(entry)
                            break
                self._to_park.discard(req)
                self._importing.pop(req, None)
        deque(map(self._progress.pop, map(id, reqs), repeat(None)), maxlen=0)

    @property
    def num_prefill_records(self) -> int:
        """Requests whose prefill progress is kept: every admitted request until it is
        dropped (the invariant checker compares it with the prefilling and running ones)."""
        return len(self._progress)

    def prefill_progress(self, req: Req) -> int:
        """Tokens of ``req``'s prefill launched so far (its committed length while it prefills)."""
        return self._progress[id(req)].done

    @property
    def has_work(self) -> bool:
        """True while anything waits, prefills or runs."""
        return bool(self.waiting or self._running or self.prefilling or self.arriving)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> tuple[LaunchPlan | None, RetractionOutcome | None]:
        """The next batch (prefill first), and the retraction done to make room, if any."""
        self.admitted = []
        with self._checker.acting(Role.SCHEDULER):
            plan = self._schedule_prefill()
            if plan is not None:
                return plan, None
            return self._schedule_decode()

    def _schedule_arrivals(self) -> LaunchPlan | None:
        """Admit arriving handed-off requests, whole, in a batch of their own (module docstring);
        those admitted earlier whose import could not be launched go first."""
        rows = [
            (req, self._progress[id(req)].done, self._progress[id(req)].target)
            for req in self._importing
        ]
        room = self._admission_room()
        while self.arriving and self._num_admitted() < self._config.max_running:
            req, record = self.arriving[0]
            admitted = self._admit(req, room, req.seqlen, alone=True)
            if admitted is None:
                break
            room, start = admitted
            self.arriving.popleft()
            self._importing[req] = record
            rows.append((req, start, req.seqlen))
        if not rows:
            return None
        plan = self._extend_plan(rows, handoff=tuple(self._importing[r] for r, _, _ in rows))
        if plan is not None:
            self._importing.clear()  # launched: they run from the next batch
        return plan

    def _schedule_prefill(self) -> LaunchPlan | None:
        if self.arriving or self._importing:
            arrivals = self._schedule_arrivals()
            if arrivals is not None:
                return arrivals
        rows: list[tuple[Req, int, int]] = []  # (req, start, stop)
        budget = self._config.prefill_token_budget
        for req in list(self.prefilling):
            if budget <= 0:
                break
            if req in self._importing:  # an arrival: imported, never prefilled
                continue
            prog = self._progress[id(req)]
            n = min(prog.target - prog.done, budget)
            rows.append((req, prog.done, prog.done + n))
            budget -= n
        room = self._admission_room() if self.waiting else 0
        while self.waiting and budget > 0 and self._num_admitted() < self._config.max_running:
            req = self.waiting[0]
            admitted = self._admit(req, room, budget, alone=not rows)
            if admitted is None:
                break
            room, start = admitted
            self.waiting.popleft()
            left = req.seqlen - start  # the cached prefix is not prefilled
            n = left if not self._config.chunked_prefill else min(left, budget)
            rows.append((req, start, start + n))
            budget -= n
        return self._extend_plan(rows) if rows else None

    def _num_admitted(self) -> int:
        return len(self._running) + len(self.prefilling)

    def _admission_room(self) -> int:
        """Available tokens (free, or cached and evictable) not already promised to running
        decodes or unfinished prefills."""
        pending = sum(
            self._progress[id(r)].target - self._progress[id(r)].done for r in self.prefilling
        )
        available = self._allocator.available_tokens()
        return available - self._decode_need() - pending

    def _admit(self, req: Req, room: int, budget: int, *, alone: bool) -> tuple[int, int] | None:
        """Give ``req`` a slot if ``room`` holds its whole prefill and first reservation.

        The longest cached prefix of its tokens is mapped into its row (prefix cache): only the
        rest is prefilled, and cached pages it starts to hold stop counting as room. Returns
        the room left and the position its prefill starts at, or None when ``req`` was not
        admitted. Memory promised to the running requests' next decode and to unfinished
        prefills is never counted as room, so an admitted prefill can always complete.
        """
        window, target = self._allocator.window, req.seqlen
        if room < 1 + window.reserve + window.page_size:
            return None  # not even a whole-prompt hit would fit: do not look it up
        fill = (*req.prompt_ids, *req.output_ids)
        match = self._allocator.match_prefix(fill)
        cached = 0 if match is None else match.num_tokens
        if not self._config.chunked_prefill and target - cached > budget and not alone:
            return None
        held = 0 if match is None else match.num_unlocked_pages * window.page_size
        cost = target - cached + window.reserve + window.page_size + held
        if room < cost:
            return None
        try:
            slot = self._allocator.admit(req)
        except KvPoolExhausted:
            return None
        self._share_prefix(req, slot, match, len(fill))
        self._outputs.open_row(slot, req)
        req.transition(ReqStatus.PREFILL)
        self._progress[id(req)] = _Progress(target=target, done=cached, cached=cached)
        self.prefilling.append(req)
        self.admitted.append(req)
        return room - cost, cached

    def _share_prefix(self, req: Req, slot: int, match: PrefixMatch | None, fill: int) -> None:
        """Map ``match`` into the new row: its KV is committed and the cache's (protected)."""
        cached = self._allocator.map_prefix(req, match, fill)
        req.record_admission(cached_tokens=cached)
        if cached:
            at = torch.tensor([slot], dtype=torch.int64)
            self._ledger.commit_extend(at, torch.tensor([cached], dtype=torch.int64))
            self._ledger.set_protected(slot, cached)

    def _decode_need(self) -> int:
        """What the running requests' next decode reservation takes (the persistent rows)."""
        if not self._running:
            return 0
        slots = self._rows.running_slots(self._allocator.slot_of)  # no patch: admission only
        if slots is None:
            slots = self._decode_rows().slots_host
        return self._allocator.decode_tokens_needed(slots)

    def _extend_plan(
        self, rows: list[tuple[Req, int, int]], *, handoff: tuple[HandoffRecord, ...] | None = None
    ) -> LaunchPlan | None:
        reqs = [r for r, _, _ in rows]
        slots = self._columns.slots(reqs)
        ends = torch.tensor([stop for _, _, stop in rows], dtype=torch.int64)
        try:
            self._allocator.alloc_for_extend(slots, ends)
        except KvPoolExhausted:
            return None  # memory went to decodes; try again after they settle or retract
        self._ledger.commit_extend(slots, ends)
        tails = self._reserve_tails() if self._config.mixed_chunk and handoff is None else []
        last_chunk: list[bool] = []
        ids: list[int] = []
        for req, start, stop in rows:
            prog = self._progress[id(req)]
            prog.done = stop
            fill = (*req.prompt_ids, *req.output_ids)
            ids.extend(fill[start:stop])
            last = stop == prog.target
            last_chunk.append(last)
            if last and req in self._to_park:  # handoff: held for a decode engine
                self.prefilling.remove(req)
                self._to_park.discard(req)
                self.parked[req] = None
            elif last:  # the last chunk is launched: the request decodes from the next batch
                self.prefilling.remove(req)
                self._running[req] = None
                self._rows.join(req)
        starts = [start for _, start, _ in rows]
        lens = [stop - start for _, start, stop in rows]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
        row_index = torch.repeat_interleave(slots, torch.tensor(lens))
        table = torch.from_numpy(self._allocator.req_to_token_host)
        if tails:
            locs = table[row_index, positions]
            return self._mixed_plan(rows, last_chunk, ids, locs, positions, tails)
        continuing = [i for i, (r, s, _) in enumerate(rows) if s > self._progress[id(r)].cached]
        batch = ScheduleBatch(
            reqs=tuple(reqs),
            incarnations=tuple(Req.incarnations_of(reqs)),
            forward_mode=ForwardMode.EXTEND,
            req_pool_indices=slots.to(self._device),
            seq_lens=ends.to(self._device),
            seq_lens_cpu=tuple(ends.tolist()),
            sampling_info=self._columns.sampling(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self._device),
            out_cache_loc=table[row_index, positions].to(self._device),
            prefix_lens=tuple(starts),
            extend_lens=tuple(lens),
            positions=positions.to(self._device),
            future_indices=slots.to(self._device),
        )
        epochs = self._outputs.epochs(slots.numpy())
        return LaunchPlan(
            batch=batch,
            slots=slots,
            epochs=epochs,
            last_chunk=tuple(last_chunk),
            relay_rows=self._device_index(continuing) if continuing else None,
            handoff=handoff,
        )

    def _device_index(self, rows: Sequence[int]) -> torch.Tensor:
        """A row index on the device, built now (the launch then copies nothing over)."""
        return torch.tensor(rows, dtype=torch.int64, device=self._device)

    def _reserve_tails(self) -> list[Req]:
        """Running requests that ride this prefill as 1-token extends (their KV reserved)."""
        if not self._running:
            return []
        rows = self._decode_rows()
        try:
            self._allocator.reserve_decode_rows(rows.slots_host)
        except KvPoolExhausted:
            return []  # no room to mix: they decode once the prefill settles
        return list(rows.reqs)

    def _mixed_plan(
        self,
        rows: list[tuple[Req, int, int]],
        last_chunk: list[bool],
        ids: list[int],
        locs: torch.Tensor,
        positions: torch.Tensor,
        tails: list[Req],
    ) -> LaunchPlan:
        """A MIXED batch: prefill rows first, then each running request as a tail."""
        reqs = [r for r, _, _ in rows] + tails
        slots = self._columns.slots(reqs)
        tail_slots = slots[len(rows) :].to(self._device)
        part = PrefillPart(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self._device),
            out_cache_loc=locs.to(self._device),
            seq_lens=torch.tensor([stop for _, _, stop in rows], device=self._device),
            prefix_lens=tuple(start for _, start, _ in rows),
            extend_lens=tuple(stop - start for _, start, stop in rows),
            tail_slots=tail_slots,
            prefix_lens_device=self._device_index([start for _, start, _ in rows]),
            positions=positions.to(self._device),
        )
        n = len(rows)
        continuing = [i for i, (r, s, _) in enumerate(rows) if s > self._progress[id(r)].cached]
        dev_slots = slots.to(self._device)
        batch = ScheduleBatch(
            reqs=tuple(reqs),
            incarnations=tuple(Req.incarnations_of(reqs)),
            forward_mode=ForwardMode.MIXED,
            req_pool_indices=dev_slots,
            seq_lens=Unresolved(tail_slots),
            sampling_info=self._columns.sampling(reqs),
            input_ids=Unresolved(tail_slots),
            future_indices=dev_slots,
        )
        return LaunchPlan(
            batch=batch,
            slots=slots,
            epochs=self._outputs.epochs(slots.numpy()),
            last_chunk=tuple(last_chunk),
            prefill=part,
            relay_rows=self._device_index(continuing + list(range(n, n + len(tails)))),
        )

    def _schedule_decode(self) -> tuple[LaunchPlan | None, RetractionOutcome | None]:
        """One decode round of every running request; retract first if the pool is short.

        The common case is one reservation of the persistent running batch (a fixed number
        of array operations); the retraction pass runs only when that reservation does not fit.
        """
        if not self._running:
            return None, None
        rows = self._decode_rows()
        width, budgets = self._plan_round(rows.request_ids)
        outcome = None
        try:
            self._reserve(rows, budgets)
        except KvPoolExhausted:  # nothing was taken
            if self._releases_pending is not None and self._releases_pending():
                # Pages of requests that ended under the batch in flight come back when it
                # retires (this step, under overlap): wait a step rather than retract or abort.
                return None, None
            # Retract until the rest fit.
            outcome = retract_for_decode(self._allocator, rows.reqs, slots=rows.slots)
            for req in outcome.retracted:
                self.drop(req)
                req.transition(ReqStatus.WAITING)
                self.enqueue(req, front=True)
            for req in outcome.aborted:
                self.drop(req)
            if not outcome.kept:
                return None, outcome
            rows = self._decode_rows()
            width, budgets = self._plan_round(rows.request_ids)  # planned again: fewer rows
            self._reserve(rows, budgets)
        # Both relay values of a row live at its slot: one (immutable) handle for the two.
        relayed = Unresolved(rows.device_slots, self._rows.relay_patch(rows))
        batch = ScheduleBatch(
            reqs=rows.reqs,
            incarnations=rows.incarnations,
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=rows.device_slots,
            seq_lens=relayed,
            sampling_info=rows.sampling,
            input_ids=relayed,
            future_indices=rows.device_slots,
            ids=rows.request_ids,
            num_draft_steps=width,
            verify_budgets=None if budgets is None else VerifyBudgets.of(budgets, self._device),
        )
        if self._config.validate and not np.array_equal(
            self._outputs.epochs(rows.slots_host), rows.epochs
        ):
            raise InvariantViolation(
                "decode-rows", "a decode row's output-row epoch is stale at scheduling"
            )
        plan = LaunchPlan(
            batch=batch,
            slots=rows.slots,
            epochs=rows.epochs,
            slots_host=rows.slots_host,
            detached=self._outputs.num_detached,  # the rows' epochs are current now
        )
        has_retraction = outcome is not None and (outcome.retracted or outcome.aborted)
        return plan, outcome if has_retraction else None

    def _reserve(self, rows: DecodeColumns, budgets: IntArray | None) -> None:
        """Reserve a decode round: the window's R for every row, or, with verify budgets, the
        width of the round that may be in flight plus this round's (each a budget + 1)."""
        if budgets is None:
            self._allocator.reserve_decode_rows(rows.slots_host)
            return
        slots = rows.slots_host
        self._allocator.reserve_decode_rows(slots, self._last_budget[slots] + budgets + 2)
        self._last_budget[slots] = budgets

    def _decode_rows(self) -> DecodeColumns:
        """The persistent running batch (`specstate.engine.schedule.decode_rows`)."""
        return self._rows.columns(lambda: tuple(self._running))
