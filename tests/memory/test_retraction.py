"""Retraction under KV pressure: order policy, at least one survivor, abort of the last."""

from __future__ import annotations

import pytest
import torch
from memory_harness import Memory, build_memory

from specstate import FinishReason, InvalidTransition, Req, ReqStatus
from specstate.internals import Role
from specstate.memory.retraction import retract_for_decode, retraction_order


def _running(mem: Memory, rid: str, prompt_len: int, num_outputs: int) -> Req:
    req = mem.new_req(rid, prompt_len)
    req.transition(ReqStatus.PREFILL)
    mem.prefill(req)
    req.transition(ReqStatus.RUNNING)
    with mem.checker.acting(Role.RESULT_PROCESSOR):
        req.append_outputs([1] * num_outputs)
    return req


def test_order_fewest_outputs_first_then_longer_prompt(memory: Memory) -> None:
    """Shortest output is retracted first; ties go to the longer prompt."""
    a = memory.new_req("a", 4)
    b = memory.new_req("b", 6)
    c = memory.new_req("c", 5)
    with memory.checker.acting(Role.RESULT_PROCESSOR):
        a.append_outputs([1, 1])
    assert [r.request_id for r in retraction_order([a, b, c])] == ["b", "c", "a"]


def test_retracts_until_the_rest_fits() -> None:
    """Under pressure the policy retracts in order, releases KV and bumps incarnations."""
    mem = build_memory(page_size=4, num_pages=11, row_width=64)  # 10 usable pages
    a = _running(mem, "a", 4, 2)
    b = _running(mem, "b", 8, 0)
    c = _running(mem, "c", 5, 0)
    need = mem.allocator.decode_tokens_needed(mem.slots(a, b, c))
    assert need > mem.allocator.token_pool.available_tokens()
    with mem.checker.acting(Role.SCHEDULER):
        out = retract_for_decode(mem.allocator, [a, b, c])
    assert [r.request_id for r in out.retracted] == ["b"]
    assert [r.request_id for r in out.kept] == ["a", "c"]
    assert b.status is ReqStatus.RETRACTED and b.incarnation == 1
    assert not mem.allocator.holds_slot(b)
    assert mem.allocator.decode_tokens_needed(mem.slots(a, c)) <= (
        mem.allocator.token_pool.available_tokens()
    )
    assert out.released[0].kv_committed_len == 8
    mem.allocator.check_balance()


def test_nothing_retracted_when_everything_fits(memory: Memory) -> None:
    """With room for every reservation, every request keeps running."""
    reqs = [_running(memory, f"r{i}", 3, 0) for i in range(2)]
    with memory.checker.acting(Role.SCHEDULER):
        out = retract_for_decode(memory.allocator, reqs)
    assert out.kept == tuple(reqs) and out.retracted == () and out.aborted == ()


def test_last_request_is_aborted_when_it_cannot_fit() -> None:
    """If even one request cannot hold its next reservation, it is aborted with a reason."""
    mem = build_memory(page_size=4, num_pages=4, row_width=64)  # 3 usable pages: 12 tokens
    a = _running(mem, "a", 9, 0)  # 3 pages; the next reservation needs more
    with mem.checker.acting(Role.SCHEDULER):
        out = retract_for_decode(mem.allocator, [a])
    assert out.kept == () and out.aborted == (a,)
    assert a.status is ReqStatus.RUNNING  # the pass decides; the engine's lifecycle ends it
    (finish,) = out.aborted_finishes
    assert finish.reason is FinishReason.ABORT and finish.finished_len == a.num_outputs
    assert "KV pool cannot hold its next decode" in (finish.detail or "")
    assert mem.allocator.token_pool.available_pages() == 3


def test_only_running_requests_retract(memory: Memory) -> None:
    """A waiting request passed in raises before anything is released."""
    a = _running(memory, "a", 3, 0)
    w = memory.new_req("w", 3)
    with memory.checker.acting(Role.SCHEDULER), pytest.raises(InvalidTransition, match="'w'"):
        retract_for_decode(memory.allocator, [a, w])
    assert memory.allocator.holds_slot(a)
    assert memory.ledger.committed(torch.tensor([memory.allocator.slot_of(a)])).tolist() == [3]
