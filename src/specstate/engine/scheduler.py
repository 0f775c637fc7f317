"""The Scheduler: admission, chunked prefill, decode batches, retraction and aborts.

It owns the waiting queue, the running set and each request's prefill progress, and it builds
one `LaunchPlan` per iteration from *host* state — which, under overlap, lags the device by the
batch in flight. Scheduling never waits for that batch: a request whose last prefill chunk or
decode round is in flight is scheduled again with `Unresolved` inputs that the FutureMap
resolves at forward entry.

Per iteration: a prefill batch when there is prefill work (the chunked request first, then
waiting requests FCFS within the token budget, the running-request cap and memory), else one
decode round for every running request, after retracting under KV pressure.

Invariant: a waiting request holds no KV slot; a running or prefilling request holds exactly
one; ``committed == prefill progress`` while a request prefills.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import attrs
import torch

from specstate.batch.forward_mode import ForwardMode
from specstate.batch.sampling import SamplingInfo
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.errors import KvPoolExhausted
from specstate.core.ledger import SchedulerLedgerView
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import FinishReason, FinishState, Req, ReqStatus
from specstate.engine.results import RowKind
from specstate.memory.allocation import KvAllocator
from specstate.memory.retraction import RetractionOutcome, retract_for_decode
from specstate.relay.future_map import Unresolved

__all__ = ["LaunchPlan", "PrefillPart", "Scheduler", "SchedulerConfig"]


@attrs.frozen(kw_only=True)
class SchedulerConfig:
    """Admission and batching limits."""

    max_running: int
    prefill_token_budget: int
    chunked_prefill: bool
    vocab_size: int
    mixed_chunk: bool = False


@attrs.frozen(kw_only=True)
class LaunchPlan:
    """One batch to launch, with what each row is (for settlement)."""

    batch: ScheduleBatch
    kinds: tuple[str, ...]
    slots: torch.Tensor
    prefill: PrefillPart | None = None

    @property
    def is_decode(self) -> bool:
        """True for a decode round."""
        return self.batch.forward_mode is ForwardMode.DECODE


@attrs.frozen(kw_only=True)
class PrefillPart:
    """The host-known prefill rows of a MIXED batch; its running tails bind at forward entry."""

    input_ids: torch.Tensor
    out_cache_loc: torch.Tensor
    seq_lens: torch.Tensor
    prefix_lens: tuple[int, ...]
    extend_lens: tuple[int, ...]
    tail_slots: torch.Tensor


@attrs.frozen(kw_only=True)
class _DecodeRows:
    """The per-row tensors of one set of decoding requests (see `Scheduler._decode_rows`)."""

    reqs: tuple[Req, ...]
    slots: torch.Tensor
    device_slots: torch.Tensor
    incarnations: tuple[int, ...]
    sampling: SamplingInfo


@attrs.define
class _Progress:
    """Prefill progress of one admitted request."""

    target: int  # tokens to prefill: prompt + every settled output (re-admission)
    done: int = 0


class Scheduler:
    """Builds batches from host state; see the module docstring."""

    def __init__(
        self,
        *,
        config: SchedulerConfig,
        allocator: KvAllocator,
        ledger: SchedulerLedgerView,
        checker: OwnershipChecker,
        device: torch.device,
    ) -> None:
        self._config = config
        self._allocator = allocator
        self._ledger = ledger
        self._checker = checker
        self._device = device
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []  # prefilled (or last chunk launched): decode candidates
        self.prefilling: list[Req] = []  # admitted, prefill not fully launched
        self._progress: dict[int, _Progress] = {}
        self._decode_cache: _DecodeRows | None = None

    # ------------------------------------------------------------------ queue
    def enqueue(self, req: Req, *, front: bool = False) -> None:
        """Put a WAITING request in the queue (retracted ones go first)."""
        if front:
            self.waiting.appendleft(req)
        else:
            self.waiting.append(req)

    def drop(self, req: Req) -> None:
        """Forget ``req`` wherever it is (it ended, or was retracted)."""
        self._decode_cache = None
        if req in self.waiting:
            self.waiting.remove(req)
        for group in (self.running, self.prefilling):
            if req in group:
                group.remove(req)
        self._progress.pop(id(req), None)

    def prefill_progress(self, req: Req) -> int:
        """Tokens of ``req``'s prefill launched so far (its committed length while it prefills)."""
        return self._progress[id(req)].done

    @property
    def has_work(self) -> bool:
        """True while anything waits, prefills or runs."""
        return bool(self.waiting or self.running or self.prefilling)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> tuple[LaunchPlan | None, RetractionOutcome | None]:
        """The next batch (prefill first), and the retraction done to make room, if any."""
        with self._checker.acting(Role.SCHEDULER):
            plan = self._schedule_prefill()
            if plan is not None:
                return plan, None
            return self._schedule_decode()

    def _schedule_prefill(self) -> LaunchPlan | None:
        rows: list[tuple[Req, int, int]] = []  # (req, start, stop)
        budget = self._config.prefill_token_budget
        for req in list(self.prefilling):
            if budget <= 0:
                break
            prog = self._progress[id(req)]
            n = min(prog.target - prog.done, budget)
            rows.append((req, prog.done, prog.done + n))
            budget -= n
        room = self._admission_room() if self.waiting else 0
        while self.waiting and budget > 0 and self._num_admitted() < self._config.max_running:
            req = self.waiting[0]
            target = req.seqlen
            if not self._config.chunked_prefill and target > budget and rows:
                break
            n = target if not self._config.chunked_prefill else min(target, budget)
            left = self._admit(req, target, room)
            if left is None:
                break
            room = left
            self.waiting.popleft()
            rows.append((req, 0, n))
            budget -= n
        return self._extend_plan(rows) if rows else None

    def _num_admitted(self) -> int:
        return len(self.running) + len(self.prefilling)

    def _admission_room(self) -> int:
        """Free tokens not already promised to running decodes or unfinished prefills."""
        pending = sum(
            self._progress[id(r)].target - self._progress[id(r)].done for r in self.prefilling
        )
        available = self._allocator.token_pool.available_tokens()
        return available - self._decode_need(self.running) - pending

    def _admit(self, req: Req, target: int, room: int) -> int | None:
        """Give ``req`` a slot if ``room`` holds its whole prefill and first reservation.

        Returns the room left, or None when ``req`` was not admitted. Memory promised to the
        running requests' next decode and to unfinished prefills is never counted as room, so
        an admitted prefill can always complete.
        """
        window = self._allocator.window
        cost = target + window.reserve + window.page_size
        if room < cost:
            return None
        try:
            self._allocator.admit(req)
        except KvPoolExhausted:
            return None
        req.transition(ReqStatus.PREFILL)
        self._progress[id(req)] = _Progress(target=target)
        self.prefilling.append(req)
        return room - cost

    def _decode_need(self, reqs: Sequence[Req]) -> int:
        if not reqs:
            return 0
        return self._allocator.decode_tokens_needed(self._slots(reqs))

    def _slots(self, reqs: Sequence[Req]) -> torch.Tensor:
        return torch.tensor([self._allocator.slot_of(r) for r in reqs], dtype=torch.int64)

    def _extend_plan(self, rows: list[tuple[Req, int, int]]) -> LaunchPlan | None:
        reqs = [r for r, _, _ in rows]
        slots = self._slots(reqs)
        ends = torch.tensor([stop for _, _, stop in rows], dtype=torch.int64)
        try:
            self._allocator.alloc_for_extend(slots, ends)
        except KvPoolExhausted:
            return None  # memory went to decodes; try again after they settle or retract
        self._ledger.commit_extend(slots, ends)
        tails = self._reserve_tails() if self._config.mixed_chunk else []
        kinds: list[str] = []
        ids: list[int] = []
        for req, start, stop in rows:
            prog = self._progress[id(req)]
            prog.done = stop
            fill = (*req.prompt_ids, *req.output_ids)
            ids.extend(fill[start:stop])
            last = stop == prog.target
            kinds.append(RowKind.LAST_CHUNK if last else RowKind.CHUNK)
            if last:  # the last chunk is launched: the request decodes from the next batch
                self.prefilling.remove(req)
                self.running.append(req)
                self._decode_cache = None
        starts = [start for _, start, _ in rows]
        lens = [stop - start for _, start, stop in rows]
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens, strict=True)])
        row_index = torch.repeat_interleave(slots, torch.tensor(lens))
        table = self._allocator.req_to_token
        if tails:
            return self._mixed_plan(rows, kinds, ids, table[row_index, positions], tails)
        batch = ScheduleBatch(
            reqs=tuple(reqs),
            incarnations=tuple(r.incarnation for r in reqs),
            forward_mode=ForwardMode.EXTEND,
            req_pool_indices=slots.to(self._device),
            seq_lens=ends.to(self._device),
            seq_lens_cpu=tuple(ends.tolist()),
            sampling_info=self._sampling(reqs),
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self._device),
            out_cache_loc=table[row_index, positions].to(self._device),
            prefix_lens=tuple(starts),
            extend_lens=tuple(lens),
            future_indices=slots.to(self._device),
        )
        return LaunchPlan(batch=batch, kinds=tuple(kinds), slots=slots)

    def _reserve_tails(self) -> list[Req]:
        """Running requests that ride this prefill as 1-token extends (their KV reserved)."""
        tails = list(self.running)
        if not tails:
            return []
        try:
            self._allocator.reserve_for_spec_decode(self._slots(tails))
        except KvPoolExhausted:
            return []  # no room to mix: they decode once the prefill settles
        return tails

    def _mixed_plan(
        self,
        rows: list[tuple[Req, int, int]],
        kinds: list[str],
        ids: list[int],
        locs: torch.Tensor,
        tails: list[Req],
    ) -> LaunchPlan:
        """A MIXED batch: prefill rows first, then each running request as a tail."""
        reqs = [r for r, _, _ in rows] + tails
        slots = self._slots(reqs)
        tail_slots = slots[len(rows) :].to(self._device)
        part = PrefillPart(
            input_ids=torch.tensor(ids, dtype=torch.int64, device=self._device),
            out_cache_loc=locs.to(self._device),
            seq_lens=torch.tensor([stop for _, _, stop in rows], device=self._device),
            prefix_lens=tuple(start for _, start, _ in rows),
            extend_lens=tuple(stop - start for _, start, stop in rows),
            tail_slots=tail_slots,
        )
        dev_slots = slots.to(self._device)
        batch = ScheduleBatch(
            reqs=tuple(reqs),
            incarnations=tuple(r.incarnation for r in reqs),
            forward_mode=ForwardMode.MIXED,
            req_pool_indices=dev_slots,
            seq_lens=Unresolved(tail_slots),
            sampling_info=self._sampling(reqs),
            input_ids=Unresolved(tail_slots),
            future_indices=dev_slots,
        )
        all_kinds = (*kinds, *(RowKind.MIXED_TAIL,) * len(tails))
        return LaunchPlan(batch=batch, kinds=all_kinds, slots=slots, prefill=part)

    def _schedule_decode(self) -> tuple[LaunchPlan | None, RetractionOutcome | None]:
        if not self.running:
            return None, None
        rows = self._decode_rows(self.running)
        outcome = retract_for_decode(self._allocator, rows.reqs, slots=rows.slots)
        for req in outcome.retracted:
            self.drop(req)
            req.transition(ReqStatus.WAITING)
            self.enqueue(req, front=True)
        for req in outcome.aborted:
            self.drop(req)
        if not outcome.kept:
            return None, outcome
        rows = self._decode_rows(list(outcome.kept))
        self._allocator.reserve_for_spec_decode(rows.slots)
        batch = ScheduleBatch(
            reqs=rows.reqs,
            incarnations=rows.incarnations,
            forward_mode=ForwardMode.DECODE,
            req_pool_indices=rows.device_slots,
            seq_lens=Unresolved(rows.device_slots),
            sampling_info=rows.sampling,
            input_ids=Unresolved(rows.device_slots),
            future_indices=rows.device_slots,
        )
        kinds = (RowKind.DECODE,) * len(rows.reqs)
        plan = LaunchPlan(batch=batch, kinds=kinds, slots=rows.slots)
        has_retraction = outcome.retracted or outcome.aborted
        return plan, outcome if has_retraction else None

    def _decode_rows(self, reqs: Sequence[Req]) -> _DecodeRows:
        """Per-row tensors of a decode batch, rebuilt only when its requests change.

        Consecutive decode rounds usually run the same requests; their slots, incarnations and
        sampling tensors are then reused (they are never written in place, so sharing them
        between batches is safe). Every change of the running set (a request joins, ends or is
        retracted) drops the cache, so a re-admitted request never reuses a stale slot or
        incarnation.
        """
        key = tuple(reqs)
        cached = self._decode_cache
        if cached is not None and cached.reqs == key:  # Req compares by identity
            return cached
        slots = self._slots(key)
        rows = _DecodeRows(
            reqs=key,
            slots=slots,
            device_slots=slots.to(self._device),
            incarnations=tuple(r.incarnation for r in key),
            sampling=self._sampling(key),
        )
        self._decode_cache = rows
        return rows

    def _sampling(self, reqs: Sequence[Req]) -> SamplingInfo:
        return SamplingInfo.from_params(
            [r.sampling for r in reqs], vocab_size=self._config.vocab_size, device=self._device
        )

    @staticmethod
    def abort_finish(req: Req, reason: str) -> FinishState:
        """The finish state of an abort applied outside a result."""
        emitted = min(len(req.output_ids), req.sampling.max_new_tokens)
        return FinishState(reason=FinishReason.ABORT, finished_len=emitted, detail=reason)
