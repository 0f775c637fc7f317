"""KV allocation: extend, decode and speculative reservation, release, deferred release."""

from __future__ import annotations

import pytest
import torch
from memory_harness import Memory, build_memory

from specstate import DoubleRelease, KvPoolExhausted, LedgerViolation, OwnershipError
from specstate.core.request import Req
from specstate.internals import Role
from specstate.memory.deferred import DeferredReleases
from specstate.memory.sizing import ceil_to_page


def _row_pages(mem: Memory, slot: int, upto: int) -> list[int]:
    p = mem.allocator.token_pool.page_size
    return [int(mem.allocator.req_to_token[slot, pos]) // p for pos in range(0, upto, p)]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_extend_allocates_without_committing(page_size: int) -> None:
    """alloc_for_extend maps the prompt's slots and sets allocated, never committed."""
    mem = build_memory(page_size=page_size, num_pages=64, row_width=128)
    req = mem.new_req("r1", 10)
    with mem.checker.acting(Role.SCHEDULER):
        mem.allocator.admit(req)
        mem.allocator.alloc_for_extend(mem.slots(req), torch.tensor([10]))
    snap = mem.ledger.snapshot(mem.allocator.slot_of(req))
    assert (snap.kv_committed_len, snap.kv_allocated_len) == (0, 10)
    pages = _row_pages(mem, snap.slot, 10)
    assert len(set(pages)) == len(pages) and 0 not in pages
    assert mem.allocator.token_pool.available_pages() == 63 - len(pages)
    mem.allocator.check_balance()


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_spec_reserve_follows_the_formula(page_size: int) -> None:
    """Reserve grows allocated to max(allocated, ceil_P(committed + R)), committed untouched."""
    mem = build_memory(page_size=page_size, num_pages=128, row_width=256)
    reqs = [mem.new_req(f"r{i}", n) for i, n in enumerate([3, 9, 17])]
    for req in reqs:
        mem.prefill(req)
    slots = mem.slots(*reqs)
    before = mem.ledger.allocated(slots)
    committed = mem.ledger.committed(slots)
    with mem.checker.acting(Role.SCHEDULER):
        lens = mem.allocator.reserve_for_spec_decode(slots)
    r = mem.allocator.window.reserve
    expected = torch.maximum(before, ceil_to_page(committed + r, page_size))
    assert mem.ledger.allocated(slots).tolist() == expected.tolist() == lens.nxt.tolist()
    assert mem.ledger.committed(slots).tolist() == committed.tolist()
    assert (mem.ledger.allocated(slots) >= committed + r).all()
    mem.allocator.check_balance()
    with mem.checker.acting(Role.SCHEDULER):
        again = mem.allocator.reserve_for_spec_decode(slots)
    assert again.needed == 0


def test_decode_allocates_one_slot_and_returns_its_location(memory: Memory) -> None:
    """Non-speculative decode grows allocated by one and returns req_to_token at the old end."""
    req = memory.new_req("r1", 5)
    memory.prefill(req)
    slot = memory.allocator.slot_of(req)
    with memory.checker.acting(Role.SCHEDULER):
        loc = memory.allocator.alloc_for_decode(memory.slots(req))
    assert memory.ledger.snapshot(slot).kv_allocated_len == 6
    assert loc.tolist() == [int(memory.allocator.req_to_token[slot, 5])]


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_release_returns_every_page(page_size: int) -> None:
    """Releasing after reserve and commits frees exactly what the request held."""
    mem = build_memory(page_size=page_size, num_pages=64, row_width=128)
    total = mem.allocator.token_pool.available_pages()
    reqs = [mem.new_req(f"r{i}", 5 + 3 * i) for i in range(3)]
    for r in reqs:
        mem.prefill(r)
    with mem.checker.acting(Role.SCHEDULER):
        mem.allocator.reserve_for_spec_decode(mem.slots(*reqs))
    with mem.checker.acting(Role.RESULT_PROCESSOR):
        mem.ledger.advance_committed(mem.slots(*reqs), torch.tensor([4, 1, 3]))
    with mem.checker.acting(Role.SCHEDULER):
        released = [mem.allocator.release(r) for r in reqs]
    assert [x.kv_committed_len for x in released] == [9, 9, 14]
    assert mem.allocator.token_pool.available_pages() == total
    assert mem.ledger.batch_snapshot().is_empty
    mem.allocator.check_balance()


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("production", [False, True])
@pytest.mark.parametrize("count", [3, 16, 17, 40])
def test_releasing_many_rows_at_once_returns_exactly_their_pages(
    page_size: int, production: bool, count: int
) -> None:
    """A batch release (a few rows: sliced per row; many: one expansion) frees each row's own
    pages, all of them, and nothing else: the rows left balance with the free pages."""
    mem = build_memory(
        page_size=page_size,
        num_pages=4096 // page_size,
        row_width=128,
        max_requests=64,
        production=production,
    )
    reqs = [mem.new_req(f"r{i}", 3 + (7 * i) % 23) for i in range(count + 5)]
    for r in reqs:
        mem.prefill(r)
    with mem.checker.acting(Role.SCHEDULER):
        mem.allocator.reserve_for_spec_decode(mem.slots(*reqs))
    pool = mem.allocator.token_pool
    before = pool.available_pages()
    held = [_row_pages(mem, mem.allocator.slot_of(r), _allocated(mem, r)) for r in reqs[:count]]
    with mem.checker.acting(Role.SCHEDULER):
        released = mem.allocator.release_many(reqs[:count])
    assert pool.available_pages() == before + sum(len(pages) for pages in held)
    assert released.num_freed_pages.tolist() == [len(pages) for pages in held]
    mem.allocator.check_balance()  # the five rows left own exactly the pages not free


def _allocated(mem: Memory, req: Req) -> int:
    return mem.ledger.snapshot(mem.allocator.slot_of(req)).kv_allocated_len


def test_double_release_is_refused(memory: Memory) -> None:
    """A second release of the same request raises DoubleRelease and frees nothing."""
    req = memory.new_req("r1", 4)
    memory.prefill(req)
    with memory.checker.acting(Role.SCHEDULER):
        memory.allocator.release(req)
        free = memory.allocator.token_pool.available_pages()
        with pytest.raises(DoubleRelease, match="request r1: release of KV it does not hold"):
            memory.allocator.release(req)
    assert memory.allocator.token_pool.available_pages() == free


def test_stale_generation_of_a_reused_slot_is_refused(memory: Memory) -> None:
    """A handle kept from before a slot was reused cannot free the new owner's slot."""
    pool = memory.allocator._req_pool
    old = pool.alloc("a")
    pool.free(old)
    new = pool.alloc("b")
    assert new.slot == old.slot
    with pytest.raises(DoubleRelease, match=f"slot {old.slot}: free of generation 0"):
        pool.free(old)
    assert pool.is_current(new)


def test_pool_too_small_for_one_request_changes_nothing() -> None:
    """A prompt needing more pages than exist raises KvPoolExhausted; no page is taken."""
    mem = build_memory(page_size=4, num_pages=3, row_width=64)
    req = mem.new_req("big", 20)
    with mem.checker.acting(Role.SCHEDULER):
        slot = mem.allocator.admit(req)
        with pytest.raises(KvPoolExhausted, match="5 pages"):
            mem.allocator.alloc_for_extend(mem.slots(req), torch.tensor([20]))
    assert mem.ledger.snapshot(slot).kv_allocated_len == 0
    assert mem.allocator.token_pool.available_pages() == 2
    mem.allocator.check_balance()


def test_prompt_longer_than_the_row_is_refused(memory: Memory) -> None:
    """Allocating past the row width raises LedgerViolation naming the request."""
    req = memory.new_req("long", 10)
    with memory.checker.acting(Role.SCHEDULER):
        memory.allocator.admit(req)
        with pytest.raises(LedgerViolation, match="request long: extend to 65 tokens passes"):
            memory.allocator.alloc_for_extend(memory.slots(req), torch.tensor([65]))
    memory.allocator.check_balance()


def test_reservation_past_the_row_is_refused() -> None:
    """A reservation that would pass the row width raises before any page is taken."""
    mem = build_memory(row_width=16)
    req = mem.new_req("r1", 10)
    mem.prefill(req)
    free = mem.allocator.token_pool.available_pages()
    with mem.checker.acting(Role.SCHEDULER), pytest.raises(LedgerViolation, match="row width 16"):
        mem.allocator.reserve_for_spec_decode(mem.slots(req))
    assert mem.allocator.token_pool.available_pages() == free


def test_worker_cannot_allocate(memory: Memory) -> None:
    """The run-time check refuses allocation calls from the worker role."""
    req = memory.new_req("r1", 4)
    memory.prefill(req)
    with memory.checker.acting(Role.WORKER), pytest.raises(OwnershipError, match="worker"):
        memory.allocator.reserve_for_spec_decode(memory.slots(req))


def test_estimate_equals_what_the_reservation_takes() -> None:
    """decode_tokens_needed equals the tokens the next reservation takes from the pool."""
    for page_size in (1, 4, 16):
        mem = build_memory(page_size=page_size, num_pages=256, row_width=256)
        reqs = [mem.new_req(f"r{i}", 1 + 5 * i) for i in range(5)]
        for r in reqs:
            mem.prefill(r)
        slots = mem.slots(*reqs)
        for step in range(4):
            need = mem.allocator.decode_tokens_needed(slots)
            before = mem.allocator.token_pool.available_tokens()
            with mem.checker.acting(Role.SCHEDULER):
                mem.allocator.reserve_for_spec_decode(slots)
            assert before - mem.allocator.token_pool.available_tokens() == need
            with mem.checker.acting(Role.RESULT_PROCESSOR):
                mem.ledger.advance_committed(slots, torch.full_like(slots, step + 1))


def test_deferred_release_waits_for_the_batch_to_retire(memory: Memory) -> None:
    """A finished request keeps its pages until the batch launched after it retires."""
    req = memory.new_req("r1", 6)
    memory.prefill(req)
    deferred = DeferredReleases(memory.allocator)
    free = memory.allocator.token_pool.available_pages()
    deferred.defer(req, until_batch=5)
    with pytest.raises(DoubleRelease, match="already deferred"):
        deferred.defer(req, until_batch=6)
    with memory.checker.acting(Role.SCHEDULER):
        assert list(deferred.drain(4)) == []
        assert memory.allocator.token_pool.available_pages() == free
        (released,) = deferred.drain(5)
    assert released.request_id == "r1"
    assert memory.allocator.token_pool.available_pages() == free + 6
    assert deferred.pending() == ()


def test_deferring_several_at_once_refuses_a_repeat_and_keeps_the_order(memory: Memory) -> None:
    """`defer_many`: a request already deferred, or listed twice, raises naming it and defers
    nobody; otherwise the requests are released in the order given."""
    a, b, c = memory.new_req("a", 4), memory.new_req("b", 5), memory.new_req("c", 3)
    for req in (a, b, c):
        memory.prefill(req)
    deferred = DeferredReleases(memory.allocator)
    deferred.defer(c, until_batch=2)
    with pytest.raises(DoubleRelease, match="request c: release already deferred"):
        deferred.defer_many([a, c], until_batch=3)
    with pytest.raises(DoubleRelease, match="request b: release already deferred"):
        deferred.defer_many([b, a, b], until_batch=3)
    assert deferred.pending() == ("c",)
    deferred.defer_many([b, a], until_batch=3)
    assert deferred.pending() == ("c", "b", "a")
    with memory.checker.acting(Role.SCHEDULER):
        released = deferred.drain(3)
    assert [r.request_id for r in released] == ["c", "b", "a"]


def test_release_many_is_all_or_nothing(memory: Memory) -> None:
    """A batch release with one request that holds no KV releases nobody."""
    a, b = memory.new_req("a", 4), memory.new_req("b", 5)
    memory.prefill(a)
    memory.prefill(b)
    stranger = memory.new_req("c", 3)
    free = memory.allocator.token_pool.available_pages()
    with memory.checker.acting(Role.SCHEDULER):
        with pytest.raises(DoubleRelease, match="request c: release of KV it does not hold"):
            memory.allocator.release_many([a, stranger, b])
        with pytest.raises(DoubleRelease, match="released twice"):
            memory.allocator.release_many([a, a])
        assert memory.allocator.token_pool.available_pages() == free
        out = memory.allocator.release_many([a, b])
    assert [(r.request_id, r.num_freed_pages) for r in out] == [("a", 4), ("b", 5)]
    assert memory.allocator.token_pool.available_pages() == free + 9
