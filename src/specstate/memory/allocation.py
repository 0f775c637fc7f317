"""KV allocation: the only owner of ``kv_allocated_len``, and of opening and closing ledger slots.

`KvAllocator` composes the request-slot pool, the paged token allocator and the allocator's view
of the ledger. It is called by the scheduler (checked at run time) and acts as the allocator for
every ledger write. Every batch-wide operation is a fixed number of tensor ops.

Reservation under overlap (docs/design.md, "The reservation"): the device frontier S may
lead the host's committed length c by one verify (up to ``max_accept <= L`` tokens).
Draft writes end at ``S + L`` and verify writes ``[S, S + D)`` with ``D <= L``, so
reserving from the committed base, ``nxt = max(allocated, ceil_P(c + 2L))``, puts every
write of the in-flight round inside ``[0, allocated)``::

    c          S = c + lead          S + L            c + 2L     allocated
    |--lead <= L--|--draft / verify <= L--|               |...page...|

Reservation never touches ``kv_committed_len``, the batch ``seq_lens`` or ``out_cache_loc``:
prepare reserves future capacity, it never declares the future correct.

Release (finish, abort, retraction) frees exactly the request's own pages,
``[ceil_P(cache_protected_len), kv_allocated_len)``, then closes the ledger slot and the request
slot. Under overlap the batch launched after a finish may still read those pages, so the engine
hands the request to `DeferredReleases` and drains it when that batch retires.

With a prefix cache (`PrefixRows`): admission maps the longest cached prefix into the new row
(`map_prefix`), a release first hands the committed prefix it may cache to the tree (only then
frees the rest), and a reservation that does not fit evicts unreferenced cached pages first.

Invariant: after every call, for every open slot, ``kv_allocated_len`` equals the number of
positions mapped in its ``req_to_token`` row, and the pages mapped by open rows plus the free
pages are all pages (``check_balance``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np
import torch

from specstate.core.errors import DoubleRelease, InvalidConfig, KvPoolExhausted, LedgerViolation
from specstate.core.ledger import AllocatorLedgerView
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import Req
from specstate.memory.host_arrays import IntArray, host_index
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.prefix_cache import PrefixMatch
from specstate.memory.prefix_rows import NoPrefixRows, PrefixRows
from specstate.memory.recurrent import NoRecurrentState, RecurrentStatePool
from specstate.memory.releases import ReleasedBatch, ReleasedKv
from specstate.memory.sizing import DecodeAllocLens, SpecWindow
from specstate.memory.slots import ReqToTokenPool, SlotHandle

__all__ = ["KvAllocator"]

_CALLERS = (Role.SCHEDULER, Role.ALLOCATOR)


class KvAllocator:
    """Owner of KV memory for every request: admit, reserve, release.

    Args:
        ledger: the allocator's view of the ledger.
        req_pool: request slots and their ``req_to_token`` rows.
        token_pool: the paged KV token-slot allocator.
        window: the speculative window (L, R, page size) the reservations follow.
        checker: the engine's ownership checker.
        validate: run the per-row checks of every call (tests and ``check_invariants``);
            off, a round's reservation is a fixed number of host array operations.
        recurrent: the recurrent-state records of a hybrid worker, opened and closed with the
            request slots (None: the worker keeps no recurrent state; `NoRecurrentState`
            stands in).
        prefix: the prefix cache's rows, or None to share nothing between requests
            (`NoPrefixRows` stands in).
    """

    def __init__(
        self,
        *,
        ledger: AllocatorLedgerView,
        req_pool: ReqToTokenPool,
        token_pool: TokenSlotAllocator,
        window: SpecWindow,
        checker: OwnershipChecker,
        validate: bool = True,
        recurrent: RecurrentStatePool | None = None,
        prefix: PrefixRows | None = None,
    ) -> None:
        if window.page_size != token_pool.page_size:
            raise InvalidConfig(
                f"window page size {window.page_size} != pool page size {token_pool.page_size}"
            )
        if req_pool.row_width != ledger.row_width or ledger.row_width <= window.row_headroom:
            raise InvalidConfig(
                f"row width {req_pool.row_width} (ledger {ledger.row_width}) must equal and "
                f"exceed the window's row headroom {window.row_headroom}"
            )
        self._ledger = ledger
        self._req_pool = req_pool
        self._token_pool = token_pool
        self.window = window
        self._page_size, self._reserve = window.page_size, window.reserve  # read every round
        self._checker = checker
        self._validate = validate
        self._recurrent = recurrent
        self._states: RecurrentStatePool | NoRecurrentState = (
            NoRecurrentState() if recurrent is None else recurrent
        )
        self.prefix = prefix
        """The prefix cache's rows (read them), or None: the engine shares no KV."""
        self._prefix: PrefixRows | NoPrefixRows = NoPrefixRows() if prefix is None else prefix
        # Per request slot: its holder and the pool generation it was admitted at (the handle).
        self._holders: dict[int, Req] = {}
        self._admitted_generation = np.zeros(req_pool.max_requests + 1, dtype=np.int64)
        # Req -> slot (a Req hashes by identity).
        self._slot_by_req: dict[Req, int] = {}

    # ------------------------------------------------------------------ reads
    @property
    def req_to_token(self) -> torch.Tensor:
        """The request → token-slot table (read it; only the pools write it)."""
        return self._req_pool.req_to_token

    @property
    def req_to_token_host(self) -> IntArray:
        """The host copy of the table (what the scheduler computes batch locations from)."""
        return self._req_pool.table_host

    @property
    def recurrent(self) -> RecurrentStatePool | None:
        """The recurrent-state records opened and closed with the slots (None: no state)."""
        return self._recurrent

    @property
    def token_pool(self) -> TokenSlotAllocator:
        """The paged token-slot allocator (for its statistics and balance check)."""
        return self._token_pool

    def slot_of(self, req: Req) -> int:
        """The request slot ``req`` holds; `LedgerViolation` if it holds none."""
        slot = self._slot_by_req.get(req)
        if slot is None:
            raise LedgerViolation(f"request {req.request_id} holds no KV slot")
        return slot

    def slots_of(self, reqs: Sequence[Req]) -> list[int]:
        """The request slots ``reqs`` hold, in order; `LedgerViolation` naming the first
        that holds none."""
        try:
            return list(map(self._slot_by_req.__getitem__, reqs))
        except KeyError:
            for req in reqs:
                self.slot_of(req)  # raises, naming it
            raise

    def holds_slot(self, req: Req) -> bool:
        """True while ``req`` holds a request slot (admitted and not yet released)."""
        return req in self._slot_by_req

    def holding_slots(self, reqs: Sequence[Req]) -> list[Req]:
        """Those of ``reqs`` that hold a request slot, in order."""
        held = self._slot_by_req
        return [req for req in reqs if req in held]

    def owned_pages(self) -> torch.Tensor:
        """Every page mapped by an open row (for ``TokenSlotAllocator.check_balance``)."""
        p = self._token_pool.page_size
        if not self._holders:
            return torch.zeros(0, dtype=torch.int64)
        slots = torch.tensor(sorted(self._holders), dtype=torch.int64)
        first = torch.div(self._ledger.protected(slots) + p - 1, p, rounding_mode="floor")
        end = torch.div(self._ledger.allocated(slots) + p - 1, p, rounding_mode="floor")
        counts = (end - first).clamp_min(0)
        rows = torch.repeat_interleave(torch.arange(slots.numel()), counts)
        offsets = torch.arange(int(counts.sum())) - (torch.cumsum(counts, 0) - counts)[rows]
        table = torch.from_numpy(self._req_pool.table_host)
        pos = (first[rows] + offsets) * p
        return torch.div(table[slots[rows], pos], p, rounding_mode="floor")

    def check_balance(self) -> None:
        """Debug: free pages, pages of open rows and cached pages are all pages, none twice."""
        cached = torch.from_numpy(self._prefix.cached_pages())
        self._token_pool.check_balance(torch.cat([self.owned_pages(), cached]))

    def available_tokens(self) -> int:
        """Token slots a reservation can get: free pages plus evictable cached pages."""
        pages = self._token_pool.available_pages() + self._prefix.evictable_pages()
        return pages * self._token_pool.page_size

    # -------------------------------------------------------------- admission
    def admit(self, req: Req) -> int:
        """Give ``req`` a request slot and open its ledger entry (all counters 0)."""
        self._checker.require(_CALLERS, counter="request slot", request=req.request_id)
        if req in self._slot_by_req:
            raise LedgerViolation(
                f"request {req.request_id} already holds slot {self._slot_by_req[req]}"
            )
        handle = self._req_pool.alloc(req.request_id)
        with self._checker.acting(Role.ALLOCATOR):
            self._ledger.open_slot(handle.slot, req.request_id)
            self._states.open_state(handle.slot, req.request_id, req.incarnation)
        self._holders[handle.slot] = req
        self._admitted_generation[handle.slot] = handle.generation
        self._slot_by_req[req] = handle.slot
        return handle.slot

    def match_prefix(self, tokens: Sequence[int]) -> PrefixMatch | None:
        """The longest cached prefix of ``tokens`` a new row could map (None: no cache)."""
        return self._prefix.match(tokens)

    def map_prefix(self, req: Req, match: PrefixMatch | None, num_query_tokens: int) -> int:
        """Map ``match`` into ``req``'s fresh row and hold it; ``allocated`` = its length.

        Returns the positions mapped (0 without a cache or a match). ``num_query_tokens``
        (prompt plus earlier outputs) feeds the hit-rate statistics.
        """
        self._checker.require(_CALLERS, counter="kv_allocated_len (prefix)", request=req.request_id)
        if match is None:
            return 0
        slot = self.slot_of(req)
        if int(self._ledger.allocated(torch.tensor([slot]))[0]):
            raise LedgerViolation(f"request {req.request_id}: a prefix maps only into a fresh row")
        n = self._prefix.map(slot, match, num_query_tokens)
        if n:
            with self._checker.acting(Role.ALLOCATOR):
                self._ledger.grow_allocated(np.array([slot]), np.array([n]))
        return n

    # ------------------------------------------------------------- allocation
    def alloc_for_extend(self, slots: torch.Tensor, extend_ends: torch.Tensor) -> None:
        """Map KV slots for positions up to ``extend_ends`` (prefill or chunk).

        Sets ``kv_allocated_len = max(allocated, extend_end)``; never sets committed (that is
        the scheduler's prepare-for-extend).
        """
        cur = self._ledger.allocated(slots)
        self._grow(slots, cur, torch.maximum(cur, extend_ends), counter="extend")

    def alloc_for_decode(self, slots: torch.Tensor) -> torch.Tensor:
        """Non-speculative decode: one more KV slot per request; returns ``out_cache_loc``."""
        cur = self._ledger.allocated(slots)
        self._grow(slots, cur, cur + 1, counter="decode")
        return torch.from_numpy(self._req_pool.table_host)[slots, cur]

    def reserve_for_spec_decode(self, slots: torch.Tensor | IntArray) -> DecodeAllocLens:
        """Grow each reservation to ``max(allocated, ceil_P(committed + R))`` (vectorized).

        Writes the new slots into ``req_to_token[slot, cur:nxt]``; never touches committed,
        the batch ``seq_lens`` or ``out_cache_loc``. `KvPoolExhausted` if the pool cannot
        hold it, with nothing taken.
        """
        cur, nxt = self._reserve_rows(host_index(slots))
        needed = 0 if nxt is cur else int((nxt - cur).sum())
        return DecodeAllocLens(cur=torch.from_numpy(cur), nxt=torch.from_numpy(nxt), needed=needed)

    def reserve_decode_rows(self, slots: IntArray, reserve: IntArray | None = None) -> None:
        """`reserve_for_spec_decode` without its report (the scheduler's call every round:
        nothing reads the lengths, so none are built).

        ``reserve``: per row, the tokens to hold past ``committed`` instead of the window's R
        (a round planned with verify budgets: the round in flight's width plus this one's,
        each a row's budget + 1); it never shrinks a reservation.
        """
        self._reserve_rows(slots, reserve)

    def _reserve_rows(
        self, s: IntArray, reserve: IntArray | None = None
    ) -> tuple[IntArray, IntArray]:
        """Grow the rows ``s`` for a decode round; their allocated lengths before and after
        (the same array when nothing grew)."""
        committed, cur = self._ledger.host_lengths(s)
        p = self._page_size
        target = committed + (self._reserve if reserve is None else reserve)
        # ceil_P(target) > cur exactly when target > floor_P(cur): most rounds nothing grows.
        if not np.count_nonzero(target > (cur if p == 1 else cur // p * p)):
            return cur, cur
        nxt = np.maximum(cur, target if p == 1 else -(-target // p) * p)
        self._grow(s, cur, nxt, counter="spec reserve")
        return cur, nxt

    def decode_tokens_needed(self, slots: torch.Tensor | IntArray) -> int:
        """Free tokens the next `reserve_for_spec_decode` of ``slots`` takes, page for page.

        The engine reserves every decode round that way, with or without speculation (a
        worker that does not speculate has L = 1, R = 2): right after a prefill that is two
        tokens, not the one a bare +1 step (`alloc_for_decode`) would take. Host arrays only
        (`spec_decode_tokens_needed` is the same formula).
        """
        s = host_index(slots)
        committed, cur = self._ledger.host_lengths(s)
        p = self._page_size
        nxt = np.maximum(cur, -(-(committed + self._reserve) // p) * p)
        if p == 1:
            return int((nxt - cur).sum())
        return int((-(-nxt // p) - -(-cur // p)).sum()) * p

    def _grow(
        self,
        slots: torch.Tensor | IntArray,
        cur: torch.Tensor | IntArray,
        nxt: torch.Tensor | IntArray,
        counter: str,
    ) -> None:
        """Map ``[cur, nxt)`` of each row and raise ``kv_allocated_len`` to ``nxt``.

        The row-width check always runs: a range past the row would land in the next row.
        """
        s, c, n = host_index(slots), host_index(cur), host_index(nxt)
        if self._checker.enabled:
            self._checker.require(
                _CALLERS,
                counter=f"kv_allocated_len ({counter})",
                request=self._names(torch.from_numpy(s)),
            )
        width = self._ledger.row_width
        if s.size and int(n.max()) > width:
            i = int(n.argmax())
            raise LedgerViolation(
                f"request {self._name(int(s[i]))}: {counter} to {int(n[i])} tokens "
                f"passes the row width {width}"
            )
        try:
            self._req_pool.grow_rows(self._token_pool, s, c, n, validate=self._validate)
        except KvPoolExhausted:
            if not self._evict_for(c, n):
                raise
            self._req_pool.grow_rows(self._token_pool, s, c, n, validate=self._validate)
        with self._checker.acting(Role.ALLOCATOR):
            self._ledger.grow_allocated(s, n)

    def _evict_for(self, cur: IntArray, nxt: IntArray) -> bool:
        """Evict cached pages so that growing ``[cur, nxt)`` fits; False if it cannot."""
        p = self._token_pool.page_size
        need = int(np.maximum(-(-nxt // p) - -(-cur // p), 0).sum())
        short = need - self._token_pool.available_pages()
        if short <= 0 or short > self._prefix.evictable_pages():
            return False
        self._prefix.evict(short)
        return True

    # ---------------------------------------------------------------- release
    def release(self, req: Req) -> ReleasedKv:
        """Free ``req``'s own KV pages, close its ledger entry and its request slot.

        Raises:
            DoubleRelease: ``req`` holds no slot (already released, or never admitted).
        """
        return self.release_many([req])[0]

    def release_many(self, reqs: Sequence[Req]) -> ReleasedBatch:
        """Release several requests at once (finish, abort, retract): O(1) array operations.

        Every request is validated before anything is freed: a request that holds no slot (or
        appears twice) raises `DoubleRelease` and nothing is released.
        """
        if self._checker.enabled:
            names = ", ".join(r.request_id for r in reqs[:4])
            self._checker.require(_CALLERS, counter="kv release", request=names)
        held = self._slot_by_req
        try:
            slots = list(map(held.__getitem__, reqs))
        except KeyError:
            self._refuse_release(reqs, [held.get(r, 0) for r in reqs])
            raise  # _refuse_release always raises
        if len(set(slots)) != len(slots):
            self._refuse_release(reqs, slots)
        index = np.array(slots, dtype=np.int64)
        generations = self._admitted_generation[index]
        if self._validate:
            for req, slot, gen in zip(reqs, slots, generations.tolist(), strict=True):
                if not self._req_pool.is_current(SlotHandle(slot, gen)):
                    raise DoubleRelease(f"request {req.request_id}: slot {slot} handle is stale")
        protected = self._ledger.host_protected(index)
        committed, allocated = self._ledger.host_lengths(index)
        # Cache what the rows may share first (module docstring); the rest is freed.
        start, kept = self._prefix.release(reqs, index, protected, committed)
        self._req_pool.free_rows(self._token_pool, index, start, allocated, validate=self._validate)
        with self._checker.acting(Role.ALLOCATOR):
            self._ledger.close_slots(torch.from_numpy(index))
            self._states.close_states(index)  # the states go with the slots
        self._req_pool.free_slots(index, generations, distinct=True)
        deque(map(self._holders.pop, slots), maxlen=0)  # C loops: no Python per request
        deque(map(held.pop, reqs), maxlen=0)
        return ReleasedBatch(
            reqs=tuple(reqs),
            slots=index,
            cache_protected_len=protected,
            kv_committed_len=committed,
            kv_allocated_len=allocated,
            page_size=self._token_pool.page_size,
            num_cached_pages=kept,
        )

    def _refuse_release(self, reqs: Sequence[Req], slots: list[int]) -> None:
        for req, slot in zip(reqs, slots, strict=True):
            if not slot:
                raise DoubleRelease(f"request {req.request_id}: release of KV it does not hold")
        names = ", ".join(r.request_id for r in reqs[:4])
        raise DoubleRelease(f"requests {names}: the same request is released twice")

    def _name(self, slot: int) -> str:
        holder = self._holders.get(slot)
        return holder.request_id if holder is not None else f"<slot {slot}>"

    def _names(self, slots: torch.Tensor) -> str:
        names = [self._name(s) for s in slots.tolist()[:4]]
        return ", ".join(names) + ("" if slots.numel() <= 4 else f" (+{slots.numel() - 4} more)")
