"""A hypothesis state machine over the memory layer with the device leading by one verify.

Requests are admitted, prefilled in chunks, decoded speculatively under a simulated overlap
(the device frontier S leads the host's committed length by the in-flight accepted run),
finished mid-run, aborted, retracted and re-admitted, over page sizes 1, 4 and 16 and chain and
tree windows. After every step the ledger keeps its ordering and the pool balances; right after
each reservation ``allocated >= committed + R``; every draft and verify write of the in-flight
round lands below ``allocated`` in a page the request owns; at the end every page is free.
"""

from __future__ import annotations

import attrs
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)
from memory_harness import Memory, build_memory

from specstate import FinishReason, FinishState, KvPoolExhausted, Req, ReqStatus, StaleResult
from specstate.internals import Role
from specstate.memory.retraction import retract_for_decode
from specstate.memory.sizing import SpecWindow

MAX_COMMITTED = 96  # finish a request before its row fills
CONTEXT = 104  # > MAX_COMMITTED + the longest in-flight run; the row adds the window headroom


@attrs.define
class Tracked:
    """What the test knows of one live request."""

    req: Req
    target: int  # prompt tokens to prefill (prompt + outputs on re-admission)
    progress: int = 0  # committed by prefill so far
    lead: int = 0  # accepted run in flight, not yet settled (device ahead of host)
    launched_for: int = 0  # incarnation the in-flight round was launched for


def _writes(window: SpecWindow, s: int) -> list[int]:
    """Positions the draft and the verify of one round write, with frontier ``s``.

    The layout is SGLang spec v2's round layout.
    """
    p, steps, topk, d = window.page_size, window.num_steps, window.topk, window.num_draft_tokens
    verify = list(range(s, s + d))
    if p == 1 or topk == 1:
        return verify + list(range(s, s + steps * topk))
    last = s % p
    pages = -(-(last + steps) // p)
    base = s - last
    draft = [base + b * pages * p + last + i for b in range(topk) for i in range(steps)]
    return verify + draft


class MemoryMachine(RuleBasedStateMachine):
    """Random admissions, chunks, rounds, finishes, aborts and retractions."""

    def __init__(self) -> None:
        super().__init__()
        self.mem: Memory | None = None
        self.live: list[Tracked] = []
        self.retracted: list[Tracked] = []
        self.count = 0

    @initialize(
        page_size=st.sampled_from([1, 4, 16]),
        topk=st.sampled_from([1, 4]),
        steps=st.integers(1, 3),
        num_pages=st.integers(6, 40),
    )
    def setup(self, page_size: int, topk: int, steps: int, num_pages: int) -> None:
        window = SpecWindow(
            speculative=True,
            num_steps=steps,
            topk=topk,
            num_draft_tokens=steps * topk + 1,
            keeps_draft_kv=True,
            page_size=page_size,
        )
        tokens = max(num_pages * 8, 2 * window.reserve + 32)  # at least one request fits
        self.mem = build_memory(
            page_size=page_size,
            num_pages=-(-tokens // page_size) + 1,
            max_requests=6,
            row_width=CONTEXT + window.row_headroom,
            window=window,
        )

    @property
    def m(self) -> Memory:
        assert self.mem is not None
        return self.mem

    def _slots(self, items: list[Tracked]) -> torch.Tensor:
        return self.m.slots(*(t.req for t in items))

    @rule(prompt_len=st.integers(1, 24))
    def admit(self, prompt_len: int) -> None:
        self.count += 1
        req = self.m.new_req(f"r{self.count}", prompt_len)
        self._admit(Tracked(req, target=prompt_len))

    def _admit(self, t: Tracked) -> None:
        with self.m.checker.acting(Role.SCHEDULER):
            try:
                self.m.allocator.admit(t.req)
            except KvPoolExhausted:
                return  # every request slot is in use; nothing changed
        t.req.transition(ReqStatus.PREFILL)
        self.live.append(t)

    @precondition(lambda self: any(t.req.status is ReqStatus.PREFILL for t in self.live))
    @rule(data=st.data(), chunk=st.integers(1, 9))
    def extend_chunk(self, data: st.DataObject, chunk: int) -> None:
        t = data.draw(st.sampled_from([t for t in self.live if t.req.status is ReqStatus.PREFILL]))
        end = min(t.progress + chunk, t.target)
        slots = self._slots([t])
        before = self.m.ledger.snapshot(int(slots[0]))
        with self.m.checker.acting(Role.SCHEDULER):
            try:
                self.m.allocator.alloc_for_extend(slots, torch.tensor([end]))
            except KvPoolExhausted:
                assert self.m.ledger.snapshot(int(slots[0])) == before
                return
            self.m.ledger.commit_extend(slots, torch.tensor([end]))
        t.progress = end
        if end == t.target:
            t.req.transition(ReqStatus.RUNNING)

    @precondition(lambda self: any(t.req.status is ReqStatus.RUNNING for t in self.live))
    @rule(data=st.data())
    def decode_round(self, data: st.DataObject) -> None:
        running = [t for t in self.live if t.req.status is ReqStatus.RUNNING]
        batch = data.draw(st.lists(st.sampled_from(running), min_size=1, unique_by=id))
        slots = self._slots(batch)
        window = self.m.allocator.window
        with self.m.checker.acting(Role.SCHEDULER):
            try:
                self.m.allocator.reserve_for_spec_decode(slots)
            except KvPoolExhausted:
                return self._retract([t.req for t in batch])
        committed = self.m.ledger.committed(slots)
        allocated = self.m.ledger.allocated(slots)
        assert (allocated >= committed + window.reserve).all()
        for t, c, a, slot in zip(
            batch, committed.tolist(), allocated.tolist(), slots.tolist(), strict=True
        ):
            writes = _writes(window, c + t.lead)  # device frontier S = committed + in-flight run
            assert max(writes) < a, (t.req.request_id, c, t.lead, a)
            pages = self.m.allocator.req_to_token[slot, writes] // window.page_size
            assert not bool(self.m.allocator.token_pool._is_free[pages].any())
        # Settle the previous round's result (host lags one verify), launch a new one.
        leads = torch.tensor([t.lead for t in batch])
        with self.m.checker.acting(Role.RESULT_PROCESSOR):
            self.m.ledger.advance_committed(slots, leads)
        max_accept = window.num_steps + 1
        for t in batch:
            t.lead = data.draw(st.integers(1, max_accept))
            t.launched_for = t.req.incarnation
            if int(self.m.ledger.committed(self._slots([t]))[0]) > MAX_COMMITTED:
                self._finish(t)

    def _finish(self, t: Tracked) -> None:
        with self.m.checker.acting(Role.RESULT_PROCESSOR):
            self.m.ledger.advance_committed(self._slots([t]), torch.tensor([t.lead]))
        with self.m.checker.acting(Role.SCHEDULER):
            self.m.allocator.release(t.req)
        t.req.transition(
            ReqStatus.FINISHED, finish=FinishState(reason=FinishReason.LENGTH, finished_len=0)
        )
        self.live.remove(t)

    @precondition(lambda self: any(t.req.status is ReqStatus.RUNNING for t in self.live))
    @rule(data=st.data())
    def finish_mid_run(self, data: st.DataObject) -> None:
        running = [t for t in self.live if t.req.status is ReqStatus.RUNNING]
        self._finish(data.draw(st.sampled_from(running)))

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        t = data.draw(st.sampled_from(self.live))
        with self.m.checker.acting(Role.SCHEDULER):
            self.m.allocator.release(t.req)
        finish = FinishState(reason=FinishReason.ABORT, finished_len=0)
        t.req.transition(ReqStatus.ABORTED, finish=finish)
        self.live.remove(t)

    @precondition(lambda self: any(t.req.status is ReqStatus.RUNNING for t in self.live))
    @rule()
    def retract_under_pressure(self) -> None:
        self._retract([t.req for t in self.live if t.req.status is ReqStatus.RUNNING])

    def _retract(self, reqs: list[Req]) -> None:
        with self.m.checker.acting(Role.SCHEDULER):
            out = retract_for_decode(self.m.allocator, reqs)
        gone = {id(r) for r in out.retracted + out.aborted}
        for t in [t for t in self.live if id(t.req) in gone]:
            self.live.remove(t)
            with_pending = t.lead
            if with_pending:  # the in-flight result arrives late and is refused
                try:
                    t.req.check_incarnation(t.launched_for)
                    raise AssertionError("a late result for a retracted request was accepted")
                except StaleResult:
                    pass
            if t.req.status is ReqStatus.RETRACTED:
                self.retracted.append(t)

    @precondition(lambda self: bool(self.retracted))
    @rule()
    def readmit(self) -> None:
        t = self.retracted.pop(0)
        t.req.transition(ReqStatus.WAITING)
        self._admit(Tracked(t.req, target=t.req.seqlen))
        if t.req.status is ReqStatus.WAITING:  # no slot free: stays retracted-and-waiting
            t.req.transition(
                ReqStatus.ABORTED, finish=FinishState(reason=FinishReason.ABORT, finished_len=0)
            )

    @invariant()
    def ledger_ordered_and_pool_balanced(self) -> None:
        if self.mem is None:
            return
        for e in self.m.ledger.batch_snapshot().entries:
            assert 0 <= e.cache_protected_len <= e.kv_committed_len <= e.kv_allocated_len
            assert e.kv_allocated_len <= e.row_width
        self.m.allocator.check_balance()

    def teardown(self) -> None:
        if self.mem is None:
            return
        with self.m.checker.acting(Role.SCHEDULER):
            for t in self.live:
                self.m.allocator.release(t.req)
        pool = self.m.allocator.token_pool
        assert pool.available_pages() == pool.num_pages - 1
        assert self.m.ledger.batch_snapshot().is_empty


TestMemoryMachine = MemoryMachine.TestCase
TestMemoryMachine.settings = settings(max_examples=60, stateful_step_count=30, deadline=None)
