"""Request slots, the paged allocator, and the rows that map one onto the other (grow / free)."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from specstate.core.errors import DoubleRelease, InvalidConfig, KvPoolExhausted, LedgerViolation
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.sizing import page_aligned_decode_alloc_lens, spec_decode_tokens_needed
from specstate.memory.slots import ReqToTokenPool, SlotHandle


def t(values: list[int]) -> torch.Tensor:
    """An int64 tensor from a list."""
    return torch.tensor(values, dtype=torch.int64)


# ---------------------------------------------------------------- ReqToTokenPool


def test_request_slots_round_trip_and_skip_row_zero() -> None:
    """Slots come from 1..max_requests, never 0, and come back after free."""
    pool = ReqToTokenPool(3, 8)
    assert pool.req_to_token.shape == (4, 8)
    assert pool.req_to_token.dtype == torch.int64
    handles = [pool.alloc(f"r{i}") for i in range(3)]
    assert sorted(h.slot for h in handles) == [1, 2, 3]
    assert all(pool.is_current(h) for h in handles)
    pool.free(handles[1])
    assert not pool.is_current(handles[1])
    again = pool.alloc("r9")
    assert again == SlotHandle(handles[1].slot, 1)
    assert pool.snapshot().num_used_slots == 3


def test_request_pool_full_raises_and_changes_nothing() -> None:
    """A full pool raises KvPoolExhausted naming the request; the snapshot is unchanged."""
    pool = ReqToTokenPool(2, 8)
    pool.alloc("a")
    pool.alloc("b")
    before = pool.snapshot()
    with pytest.raises(KvPoolExhausted, match=r"request c: all 2 request slots are in use"):
        pool.alloc("c")
    assert pool.snapshot() == before


def test_double_free_names_slot_and_both_generations() -> None:
    """Freeing a handle twice raises DoubleRelease with both generations; nothing changes."""
    pool = ReqToTokenPool(2, 8)
    h = pool.alloc("a")
    pool.free(h)
    before = pool.snapshot()
    with pytest.raises(
        DoubleRelease, match=rf"slot {h.slot}: free of generation 0, .*generation 1"
    ):
        pool.free(h)
    assert pool.snapshot() == before


def test_stale_handle_of_reused_slot_is_refused() -> None:
    """A stale handle of a reused slot cannot free the new owner's slot."""
    pool = ReqToTokenPool(1, 8)
    old = pool.alloc("old")
    pool.free(old)
    new = pool.alloc("new")
    assert new.slot == old.slot
    with pytest.raises(
        DoubleRelease, match=r"generation 0, but .* generation 1 \(held by .* new\)"
    ):
        pool.free(old)
    assert pool.is_current(new)
    pool.free(new)


@pytest.mark.parametrize("slot", [0, 5, 2])
def test_forged_handles_are_refused(slot: int) -> None:
    """Handles to the padding row, past the pool or to a never-used slot raise DoubleRelease."""
    pool = ReqToTokenPool(4, 8)
    pool.alloc("a")
    with pytest.raises(DoubleRelease, match=rf"request slot {slot}: free of generation 0"):
        pool.free(SlotHandle(slot, 0))
    assert pool.snapshot().num_used_slots == 1


def test_pool_sizes_are_validated() -> None:
    """Empty pools are configuration errors."""
    with pytest.raises(InvalidConfig, match=r"got 0, 8"):
        ReqToTokenPool(0, 8)
    with pytest.raises(InvalidConfig, match=r"got 1, 4"):
        TokenSlotAllocator(1, 4)
    with pytest.raises(InvalidConfig, match=r"got 4, 0"):
        TokenSlotAllocator(4, 0)


# ---------------------------------------------------------------- TokenSlotAllocator


def test_fresh_allocator_hands_out_pages_in_order_and_balances() -> None:
    """A fresh allocator hands out pages 1, 2, ...; alloc and free round trip."""
    tokens = TokenSlotAllocator(6, 4)
    assert (tokens.num_pages, tokens.page_size, tokens.available_pages()) == (6, 4, 5)
    assert tokens.available_tokens() == 20
    pages = tokens.alloc_pages(3)
    assert pages.tolist() == [1, 2, 3]
    tokens.check_balance(pages)
    tokens.free_pages(pages[1:])
    tokens.check_balance(pages[:1])
    snap = tokens.snapshot()
    assert (snap.num_free_pages, snap.num_used_pages, snap.num_free_tokens) == (4, 1, 16)
    assert tokens.alloc_pages(0).numel() == 0


def test_exhaustion_takes_nothing() -> None:
    """Asking for more pages than are free raises with the numbers and takes nothing."""
    tokens = TokenSlotAllocator(4, 16)
    held = tokens.alloc_pages(1)
    with pytest.raises(
        KvPoolExhausted, match=r"requested 3 pages \(48 tokens\), available 2 pages"
    ):
        tokens.alloc_pages(3)
    assert tokens.available_pages() == 2
    tokens.check_balance(held)
    with pytest.raises(LedgerViolation, match=r"negative number of pages: -1"):
        tokens.alloc_pages(-1)


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        ([2, 0], r"outside \[1, 5\] \(page 0 is padding\): 0..2"),
        ([6], r"outside \[1, 5\] .*: 6..6"),
        ([2, 2], r"the same page appears twice in one free: \[2, 2\]"),
        ([2, 4], r"free of 1 already free pages: \[4\]"),
    ],
)
def test_bad_free_raises_double_release_and_changes_nothing(bad: list[int], match: str) -> None:
    """Page 0, out-of-range, repeated or already-free pages raise and leave the pool as it was."""
    tokens = TokenSlotAllocator(6, 4)
    owned = tokens.alloc_pages(3)  # pages 1, 2, 3
    before = tokens.snapshot()
    with pytest.raises(DoubleRelease, match=match):
        tokens.free_pages(t(bad))
    assert tokens.snapshot() == before
    tokens.check_balance(owned)


def test_check_balance_detects_bad_owned_sets() -> None:
    """check_balance reports leaked, double-owned and owned-but-free pages."""
    tokens = TokenSlotAllocator(6, 4)
    tokens.alloc_pages(3)  # pages 1, 2, 3
    with pytest.raises(LedgerViolation, match=r"1 pages neither free nor owned \(leaked\)"):
        tokens.check_balance(t([1, 2]))
    with pytest.raises(LedgerViolation, match=r"pages owned twice: \[2\]"):
        tokens.check_balance(t([1, 2, 2, 3]))
    with pytest.raises(LedgerViolation, match=r"owned pages that are free: \[4\]"):
        tokens.check_balance(t([1, 2, 3, 4]))
    with pytest.raises(LedgerViolation, match=r"owned pages out of range"):
        tokens.check_balance(t([0, 1, 2, 3]))


def test_check_balance_detects_corrupted_internals() -> None:
    """A corrupted copy (flag cleared, stack entry duplicated, page 0 freed) fails the check."""
    tokens = TokenSlotAllocator(6, 4)
    tokens.alloc_pages(2)
    tokens.check_balance()

    flag = copy.deepcopy(tokens)
    flag._is_free[5] = False
    with pytest.raises(LedgerViolation, match=r"not marked free; 2 pages marked free, stack has 3"):
        flag.check_balance()

    dup = copy.deepcopy(tokens)
    dup._free_stack[0] = dup._free_stack[1]
    with pytest.raises(LedgerViolation, match=r"a page is on the free stack twice"):
        dup.check_balance()

    zero = copy.deepcopy(tokens)
    zero._is_free[0] = True
    with pytest.raises(LedgerViolation, match=r"page 0 is marked free"):
        zero.check_balance()
    tokens.check_balance()  # the original is untouched


# ---------------------------------------------------------------- grow_rows / free_rows


def make_pools(
    num_rows: int, page_size: int, num_pages: int = 32, width: int = 64
) -> tuple[ReqToTokenPool, TokenSlotAllocator, torch.Tensor]:
    """Pools with ``num_rows`` open rows; returns their slots."""
    req_pool = ReqToTokenPool(8, width)
    tokens = TokenSlotAllocator(num_pages, page_size)
    slots = t([req_pool.alloc(f"r{i}").slot for i in range(num_rows)])
    return req_pool, tokens, slots


def test_grow_rows_reuses_started_pages_and_takes_new_ones() -> None:
    """Positions in a started page reuse it; later positions take fresh pages in order."""
    req_pool, tokens, slots = make_pools(3, 4)
    assert req_pool.grow_rows(tokens, slots, t([0, 0, 0]), t([5, 1, 8])) == 5
    table = req_pool.req_to_token
    assert table[slots[0], :5].tolist() == [4, 5, 6, 7, 8]  # pages 1, 2
    assert table[slots[1], :1].tolist() == [12]  # page 3
    assert table[slots[2], :8].tolist() == list(range(16, 24))  # pages 4, 5
    assert req_pool.grow_rows(tokens, slots, t([5, 1, 8]), t([9, 4, 9])) == 2
    assert table[slots[0], :9].tolist() == [4, 5, 6, 7, 8, 9, 10, 11, 24]  # page 2 reused, 6 new
    assert table[slots[1], :4].tolist() == [12, 13, 14, 15]  # page 3 filled, nothing new
    assert table[slots[2], :9].tolist() == [*range(16, 24), 28]  # page 7
    tokens.check_balance(t([1, 2, 3, 4, 5, 6, 7]))


def test_grow_rows_with_page_size_one_maps_every_position_to_its_own_page() -> None:
    """With P = 1 each new position takes one page, and the slot id is the page id."""
    req_pool, tokens, slots = make_pools(2, 1)
    assert req_pool.grow_rows(tokens, slots, t([0, 0]), t([2, 3])) == 5
    assert req_pool.req_to_token[slots, :3].tolist() == [[1, 2, 0], [3, 4, 5]]


def test_grow_rows_never_writes_outside_the_grown_range() -> None:
    """Positions below cur and at or past nxt keep their contents."""
    req_pool, tokens, slots = make_pools(1, 4)
    req_pool.grow_rows(tokens, slots, t([0]), t([6]))
    req_pool.req_to_token[slots[0], 6:] = -1  # a sentinel the grow must not touch past nxt
    before = req_pool.req_to_token.clone()
    req_pool.grow_rows(tokens, slots, t([6]), t([10]))
    after = req_pool.req_to_token
    assert torch.equal(after[:, :6], before[:, :6])
    assert torch.equal(after[:, 10:], before[:, 10:])
    assert after[slots[0], 6:10].tolist() == [10, 11, 12, 13]


def test_grow_rows_exhaustion_changes_nothing() -> None:
    """Growing past the free pages raises KvPoolExhausted; table and pool are unchanged."""
    req_pool, tokens, slots = make_pools(2, 4, num_pages=4)  # 3 usable pages
    req_pool.grow_rows(tokens, slots, t([0, 0]), t([2, 0]))
    table, snap = req_pool.req_to_token.clone(), tokens.snapshot()
    with pytest.raises(KvPoolExhausted, match=r"requested 3 pages \(12 tokens\), available 2"):
        req_pool.grow_rows(tokens, slots, t([2, 0]), t([8, 8]))
    assert torch.equal(req_pool.req_to_token, table)
    assert tokens.snapshot() == snap


@pytest.mark.parametrize(
    ("rows", "cur", "nxt", "match"),
    [
        ([0], [0], [4], r"request slots must be in \[1, 8\]: \[0\]"),
        ([1, 1], [0, 0], [4, 4], r"request slots repeat in one call: \[1, 1\]"),
        ([3], [0], [4], r"request slots not in use: \[3\]"),
        ([1], [4], [2], r"request slot 1: range \[4, 2\) is not within"),
        ([1], [0], [65], r"range \[0, 65\) is not within \[0, row width 64\]"),
        ([1], [5], [6], r"position 4 maps to page 0 \(host mirror 0\), which is free"),
        ([1, 2], [0], [4, 4], r"slots, start, stop lengths: \[2, 1, 2\]"),
    ],
)
def test_grow_rows_rejects_bad_rows_and_ranges(
    rows: list[int], cur: list[int], nxt: list[int], match: str
) -> None:
    """Bad slots or ranges raise LedgerViolation and allocate nothing."""
    req_pool, tokens, _ = make_pools(2, 4)
    with pytest.raises(LedgerViolation, match=match):
        req_pool.grow_rows(tokens, t(rows), t(cur), t(nxt))
    assert tokens.available_pages() == 31
    assert int(req_pool.req_to_token.abs().sum()) == 0


def test_free_rows_rounds_start_up_to_a_page() -> None:
    """Pages holding any position below start stay; the partial last page is freed whole."""
    req_pool, tokens, slots = make_pools(2, 4)
    req_pool.grow_rows(tokens, slots, t([0, 0]), t([10, 10]))  # pages 1,2,3 and 4,5,6
    assert req_pool.free_rows(tokens, slots, t([5, 4]), t([10, 10])) == 3
    tokens.check_balance(t([1, 2, 4]))  # row 0 keeps pages 1, 2; row 1 keeps page 4
    assert req_pool.free_rows(tokens, slots, t([0, 0]), t([8, 4])) == 3
    assert tokens.available_pages() == 31


def test_free_rows_twice_raises_and_changes_nothing() -> None:
    """Freeing the same rows twice raises DoubleRelease naming the pages; nothing changes."""
    req_pool, tokens, slots = make_pools(1, 4)
    req_pool.grow_rows(tokens, slots, t([0]), t([7]))
    req_pool.free_rows(tokens, slots, t([4]), t([7]))
    snap = tokens.snapshot()
    with pytest.raises(DoubleRelease, match=r"free of 1 already free pages: \[2\]"):
        req_pool.free_rows(tokens, slots, t([0]), t([7]))
    assert tokens.snapshot() == snap
    tokens.check_balance(t([1]))


# ---------------------------------------------------------------- stateful model


def ceil_div(x: int, p: int) -> int:
    """Plain-Python ceiling division."""
    return -(-x // p)


class PoolMachine(RuleBasedStateMachine):
    """Random batched grow / free against a plain-Python model of which row owns which page."""

    WIDTH = 64
    MAX_ROWS = 4

    def __init__(self) -> None:
        """Start with no pools; `setup` creates them for a drawn page size."""
        super().__init__()
        self.p = 1
        self.req_pool = ReqToTokenPool(self.MAX_ROWS, self.WIDTH)
        self.tokens = TokenSlotAllocator(2, 1)
        self.rows: dict[int, tuple[SlotHandle, list[int], int]] = {}  # slot -> handle, pages, len
        self.cache_pages: list[int] = []  # pages kept by a "prefix cache" below start
        self.free: set[int] = set()
        self.next_id = 0

    @initialize(page_size=st.sampled_from([1, 4, 16]))
    def setup(self, page_size: int) -> None:
        """Create pools small enough that exhaustion happens."""
        self.p = page_size
        num_pages = 1 + max(6, 96 // page_size)
        self.tokens = TokenSlotAllocator(num_pages, page_size)
        self.free = set(range(1, num_pages))

    @precondition(lambda self: len(self.rows) < self.MAX_ROWS)
    @rule()
    def open_row(self) -> None:
        """Claim a request slot with an empty row."""
        handle = self.req_pool.alloc(f"r{self.next_id}")
        self.next_id += 1
        self.rows[handle.slot] = (handle, [], 0)

    def _grow(self, slots: list[int], nxt: list[int]) -> int | None:
        """Grow rows in the pool and the model; None when the pool was (rightly) exhausted."""
        cur = [self.rows[s][2] for s in slots]
        want = sum(ceil_div(n, self.p) - ceil_div(c, self.p) for c, n in zip(cur, nxt, strict=True))
        table, snap = self.req_pool.req_to_token.clone(), self.tokens.snapshot()
        if want > len(self.free):
            with pytest.raises(KvPoolExhausted, match=rf"requested {want} pages"):
                self.req_pool.grow_rows(self.tokens, t(slots), t(cur), t(nxt))
            assert torch.equal(self.req_pool.req_to_token, table)
            assert self.tokens.snapshot() == snap
            return None
        assert self.req_pool.grow_rows(self.tokens, t(slots), t(cur), t(nxt)) == want
        for s, c, n in zip(slots, cur, nxt, strict=True):
            handle, pages, _ = self.rows[s]
            row = self.req_pool.req_to_token[s]
            new = [int(row[k * self.p]) // self.p for k in range(len(pages), ceil_div(n, self.p))]
            assert set(new) <= self.free, "a new page was not free"
            self.free -= set(new)
            self.rows[s] = (handle, pages + new, n)
            assert torch.equal(row[:c], table[s, :c]), "grow rewrote positions below cur"
            assert torch.equal(row[n:], table[s, n:]), "grow wrote past nxt"
        assert len(self.free) == len(set(self.free))
        return want

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def grow_some(self, data: st.DataObject) -> None:
        """Grow several rows at once by random amounts (some by zero)."""
        slots = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, unique=True))
        deltas = [data.draw(st.integers(0, 2 * self.p + 6)) for _ in slots]
        nxt = [min(self.WIDTH, self.rows[s][2] + d) for s, d in zip(slots, deltas, strict=True)]
        self._grow(slots, nxt)

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data(), reserve=st.integers(0, 20))
    def reserve_for_decode(self, data: st.DataObject, reserve: int) -> None:
        """Reserve like a decode round; the pages taken equal the sizing estimate."""
        slots = [s for s in sorted(self.rows) if self.rows[s][2] + reserve + self.p <= self.WIDTH]
        if not slots:
            return
        alloc = [self.rows[s][2] for s in slots]
        commit = [data.draw(st.integers(0, a)) for a in alloc]
        lens = page_aligned_decode_alloc_lens(alloc, commit, reserve=reserve, page_size=self.p)
        taken = self._grow(slots, lens.nxt.tolist())
        estimate = spec_decode_tokens_needed(alloc, commit, reserve=reserve, page_size=self.p)
        if taken is not None:
            assert taken * self.p == estimate

    @precondition(lambda self: bool(self.rows))
    @rule(data=st.data())
    def close_some(self, data: st.DataObject) -> None:
        """Free several rows; pages below a random protected start go to the prefix cache."""
        slots = data.draw(st.lists(st.sampled_from(sorted(self.rows)), min_size=1, unique=True))
        starts = [data.draw(st.integers(0, self.rows[s][2])) for s in slots]
        stops = [self.rows[s][2] for s in slots]
        freed = self.req_pool.free_rows(self.tokens, t(slots), t(starts), t(stops))
        expected = 0
        for s, start in zip(slots, starts, strict=True):
            handle, pages, _ = self.rows.pop(s)
            keep = ceil_div(start, self.p)
            self.cache_pages += pages[:keep]
            self.free |= set(pages[keep:])
            expected += len(pages) - keep
            self.req_pool.free(handle)
        assert freed == expected

    @invariant()
    def pages_balance_and_rows_map_to_their_own_pages(self) -> None:
        """Free ∪ owned = all pages; each position maps into a page its row alone owns."""
        owned = [pg for _, pages, _ in self.rows.values() for pg in pages] + self.cache_pages
        assert len(owned) == len(set(owned)), "a page is owned twice"
        self.tokens.check_balance(t(owned))
        assert self.tokens.available_pages() == len(self.free)
        for s, (_, pages, length) in self.rows.items():
            assert len(pages) == ceil_div(length, self.p)
            got = self.req_pool.req_to_token[s, :length]
            pos = torch.arange(length)
            assert torch.equal(got % self.p, pos % self.p)
            assert torch.equal(got // self.p, t(pages)[pos // self.p] if pages else got)

    def teardown(self) -> None:
        """Free every row and the cache pages: every page is free again."""
        if self.rows:
            slots = sorted(self.rows)
            stops = [self.rows[s][2] for s in slots]
            self.req_pool.free_rows(self.tokens, t(slots), t([0] * len(slots)), t(stops))
        self.tokens.free_pages(t(self.cache_pages))
        self.tokens.check_balance(t([]))
        assert self.tokens.available_pages() == self.tokens.num_pages - 1


PoolMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=25, deadline=None)
TestPoolMachine = PoolMachine.TestCase
