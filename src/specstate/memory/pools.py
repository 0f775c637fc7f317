"""The two KV pools: request rows of ``req_to_token`` and the paged token-slot allocator.

`ReqToTokenPool` owns request slots and their rows; `TokenSlotAllocator` owns the free KV pages.
`grow_rows` / `free_rows`, the only writers of ``req_to_token``, bridge the two for whole batches;
the allocation layer (owner of ``kv_allocated_len`` and friends) calls them. Token slot id =
``page * P + offset``; position ``pos`` of a row sits at offset ``pos % P`` of one of its pages::

    req_to_token[slot]   pos: 0  1  2  3 | 4  5  6  7 | 8  9  .  . | .  .
                       page:  [  17      ] [  4       ] [  9 ... ]  (row pages, any order)
                       slot:  68 69 70 71  16 17 18 19  36 37 ...

Invariant:
    Page 0 (token slots ``0..P-1``) and request slot 0 are padding: never handed out, so padded
    batch rows and padded positions read and write them harmlessly. Every other page is either
    free (on the stack, ``is_free``) or owned by exactly one row (or by the prefix cache).
"""

from __future__ import annotations

import attrs
import torch
from torch import Tensor

from specstate.core.errors import DoubleRelease, InvalidConfig, KvPoolExhausted, LedgerViolation
from specstate.memory.sizing import ceil_to_page

__all__ = [
    "ReqToTokenPool",
    "ReqToTokenPoolSnapshot",
    "SlotHandle",
    "TokenSlotAllocator",
    "TokenSlotAllocatorSnapshot",
    "free_rows",
    "grow_rows",
]

_I64 = torch.int64


@attrs.frozen
class SlotHandle:
    """A request's claim on one row of ``req_to_token``; stale once the slot is freed."""

    slot: int
    generation: int


@attrs.frozen(kw_only=True)
class ReqToTokenPoolSnapshot:
    """Frozen statistics of a `ReqToTokenPool`."""

    max_requests: int
    row_width: int
    num_free_slots: int
    num_used_slots: int


@attrs.define(init=False, eq=False)
class ReqToTokenPool:
    """Request slots and their ``req_to_token`` rows (int64 token-slot ids).

    ``req_to_token`` is ``[max_requests + 1, row_width]`` int64: int64 so it indexes the KV
    buffers and gathers ``out_cache_loc`` without a conversion per iteration. Row 0 is the
    padding row. `alloc` and `free` are O(1) (a free-list stack).

    Invariant:
        A slot's generation increments on every `free`, so a handle is current iff its slot is
        in use and its generation matches; a stale or repeated free raises `DoubleRelease`.
    """

    _req_to_token: Tensor = attrs.field(repr=False)
    _free_slots: list[int] = attrs.field(repr=False)
    _generation: list[int] = attrs.field(repr=False)
    _request_ids: list[str | None] = attrs.field(repr=False)
    _in_use: Tensor = attrs.field(repr=False)  # bool [max_requests + 1], host side

    def __init__(self, max_requests: int, row_width: int, *, device: torch.device | str = "cpu"):
        """Create ``max_requests`` usable slots with rows of ``row_width`` positions."""
        if max_requests < 1 or row_width < 1:
            raise InvalidConfig(
                f"max_requests, row_width must be >= 1: got {max_requests}, {row_width}"
            )
        self._req_to_token = torch.zeros(max_requests + 1, row_width, dtype=_I64, device=device)
        self._free_slots = list(range(max_requests, 0, -1))
        self._generation = [0] * (max_requests + 1)
        self._request_ids = [None] * (max_requests + 1)
        self._in_use = torch.zeros(max_requests + 1, dtype=torch.bool)

    @property
    def req_to_token(self) -> Tensor:
        """The table; read it (gather views from it), write it only through `grow_rows`."""
        return self._req_to_token

    @property
    def max_requests(self) -> int:
        """Usable request slots (row 0 excluded)."""
        return self._req_to_token.shape[0] - 1

    @property
    def row_width(self) -> int:
        """Positions per row."""
        return self._req_to_token.shape[1]

    def alloc(self, request_id: str) -> SlotHandle:
        """Claim a slot for ``request_id``; `KvPoolExhausted` when every slot is in use."""
        if not self._free_slots:
            raise KvPoolExhausted(
                f"request {request_id}: all {self.max_requests} request slots are in use"
            )
        slot = self._free_slots.pop()
        self._request_ids[slot] = request_id
        self._in_use[slot] = True
        return SlotHandle(slot, self._generation[slot])

    def is_current(self, handle: SlotHandle) -> bool:
        """Whether ``handle`` still owns its slot (in use, same generation)."""
        s = handle.slot
        return (
            1 <= s <= self.max_requests
            and bool(self._in_use[s])
            and self._generation[s] == handle.generation
        )

    def free(self, handle: SlotHandle) -> None:
        """Release ``handle``'s slot; `DoubleRelease` if the handle is stale or already freed."""
        s = handle.slot
        if not self.is_current(handle):
            known = 1 <= s <= self.max_requests
            holder = self._request_ids[s] if known else None
            raise DoubleRelease(
                f"request slot {s}: free of generation {handle.generation}, but the slot is at "
                f"generation {self._generation[s] if known else None} "
                f"({'held by request ' + holder if holder else 'free'})"
            )
        self._generation[s] += 1
        self._request_ids[s] = None
        self._in_use[s] = False
        self._free_slots.append(s)

    def snapshot(self) -> ReqToTokenPoolSnapshot:
        """Frozen slot statistics."""
        free = len(self._free_slots)
        return ReqToTokenPoolSnapshot(
            max_requests=self.max_requests,
            row_width=self.row_width,
            num_free_slots=free,
            num_used_slots=self.max_requests - free,
        )

    def _check_rows(self, slots: Tensor, lo: Tensor, hi: Tensor) -> None:
        """Raise `LedgerViolation` unless rows are distinct, in use, ``0 <= lo <= hi <= width``."""
        if not slots.shape == lo.shape == hi.shape:
            raise LedgerViolation(f"slots, start, stop lengths: {[len(slots), len(lo), len(hi)]}")
        host = slots.cpu()
        if host.numel() and (int(host.min()) < 1 or int(host.max()) > self.max_requests):
            raise LedgerViolation(
                f"request slots must be in [1, {self.max_requests}]: {host.tolist()}"
            )
        if torch.unique(host).numel() != host.numel():
            raise LedgerViolation(f"request slots repeat in one call: {host.tolist()}")
        if not bool(self._in_use[host].all()):
            unused = host[~self._in_use[host]].tolist()
            raise LedgerViolation(f"request slots not in use: {unused}")
        bad = (lo < 0) | (hi < lo) | (hi > self.row_width)
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise LedgerViolation(
                f"request slot {int(slots[i])}: range [{int(lo[i])}, {int(hi[i])}) is not "
                f"within [0, row width {self.row_width}] (or shrinks)"
            )


@attrs.frozen(kw_only=True)
class TokenSlotAllocatorSnapshot:
    """Frozen statistics of a `TokenSlotAllocator` (page 0 counted nowhere)."""

    num_pages: int
    page_size: int
    num_free_pages: int
    num_used_pages: int

    @property
    def num_free_tokens(self) -> int:
        """Free token slots (whole free pages)."""
        return self.num_free_pages * self.page_size


@attrs.define(init=False, eq=False)
class TokenSlotAllocator:
    """Free KV pages: an int64 stack with a top pointer plus an ``is_free`` flag per page.

    Invariant:
        ``stack[:top]`` holds exactly the pages with ``is_free`` set, each once; page 0 is
        never free. `alloc_pages` and `free_pages` are all-or-nothing and touch only the pages
        they move (O(pages), never O(pool)).
    """

    _page_size: int
    _free_stack: Tensor = attrs.field(repr=False)  # int64 [num_pages - 1]
    _top: int
    _is_free: Tensor = attrs.field(repr=False)  # bool [num_pages]

    def __init__(self, num_pages: int, page_size: int, *, device: torch.device | str = "cpu"):
        """Create ``num_pages`` pages of ``page_size`` slots; pages ``1..num_pages-1`` free."""
        if num_pages < 2 or page_size < 1:
            raise InvalidConfig(
                f"need num_pages >= 2 (page 0 is padding) and page_size >= 1, "
                f"got {num_pages}, {page_size}"
            )
        self._page_size = page_size
        # Highest page at the bottom, so a fresh pool hands out pages 1, 2, 3, ... in order.
        self._free_stack = torch.arange(num_pages - 1, 0, -1, dtype=_I64, device=device)
        self._top = num_pages - 1
        self._is_free = torch.ones(num_pages, dtype=torch.bool, device=device)
        self._is_free[0] = False

    @property
    def num_pages(self) -> int:
        """Pages including the padding page 0."""
        return self._is_free.shape[0]

    @property
    def page_size(self) -> int:
        """Token slots per page (P)."""
        return self._page_size

    def available_pages(self) -> int:
        """Free pages."""
        return self._top

    def available_tokens(self) -> int:
        """Free token slots (free pages × P)."""
        return self._top * self._page_size

    def alloc_pages(self, n: int) -> Tensor:
        """Take ``n`` pages (int64 [n]); `KvPoolExhausted` with nothing taken if too few."""
        if n < 0:
            raise LedgerViolation(f"cannot allocate a negative number of pages: {n}")
        if n > self._top:
            raise KvPoolExhausted(
                f"requested {n} pages ({n * self._page_size} tokens), available {self._top} "
                f"pages ({self.available_tokens()} tokens)"
            )
        pages = self._free_stack[self._top - n : self._top].flip(0)
        self._top -= n
        self._is_free[pages] = False
        return pages

    def free_pages(self, pages: Tensor) -> None:
        """Return ``pages``; `DoubleRelease` with nothing changed on any bad page."""
        pages = pages.to(device=self._free_stack.device, dtype=_I64).reshape(-1)
        n = pages.numel()
        if n == 0:
            return
        lo, hi = int(pages.min()), int(pages.max())
        if lo < 1 or hi >= self.num_pages:
            raise DoubleRelease(
                f"free of pages outside [1, {self.num_pages - 1}] (page 0 is padding): {lo}..{hi}"
            )
        if torch.unique(pages).numel() != n:
            raise DoubleRelease(f"the same page appears twice in one free: {pages.tolist()}")
        already = pages[self._is_free[pages]]
        if already.numel():
            raise DoubleRelease(f"free of {already.numel()} already free pages: {already.tolist()}")
        self._free_stack[self._top : self._top + n] = pages
        self._top += n
        self._is_free[pages] = True

    def check_balance(self, owned: Tensor | None = None) -> None:
        """Prove the free list is consistent, and free ∪ ``owned`` = pages 1.. with no overlap.

        O(pool); debug and tests only. Raises `LedgerViolation` listing every problem found.
        """
        problems = self._stack_problems()
        if owned is not None and not problems:
            problems = self._owned_problems(owned.to(self._free_stack.device, _I64).reshape(-1))
        if problems:
            raise LedgerViolation("KV page balance broken: " + "; ".join(problems))

    def snapshot(self) -> TokenSlotAllocatorSnapshot:
        """Frozen page statistics."""
        return TokenSlotAllocatorSnapshot(
            num_pages=self.num_pages,
            page_size=self._page_size,
            num_free_pages=self._top,
            num_used_pages=self.num_pages - 1 - self._top,
        )

    def _stack_problems(self) -> list[str]:
        """Disagreements between the stack and ``is_free``."""
        free, n_marked = self._free_stack[: self._top], int(self._is_free.sum())
        if free.numel() and (int(free.min()) < 1 or int(free.max()) >= self.num_pages):
            return [f"the free stack holds out-of-range pages: {free.tolist()}"]
        checks = {
            "page 0 is marked free": bool(self._is_free[0]),
            "a page is on the free stack twice": torch.unique(free).numel() != free.numel(),
            "a page on the free stack is not marked free": not bool(self._is_free[free].all()),
            f"{n_marked} pages marked free, stack has {self._top}": n_marked != self._top,
        }
        return [problem for problem, failed in checks.items() if failed]

    def _owned_problems(self, owned: Tensor) -> list[str]:
        """Ways in which ``owned`` and the free pages fail to partition pages 1.."""
        if owned.numel() and (int(owned.min()) < 1 or int(owned.max()) >= self.num_pages):
            return [f"owned pages out of range [1, {self.num_pages - 1}]: {owned.tolist()}"]
        uniq, counts = torch.unique(owned, return_counts=True)
        leaked = self.num_pages - 1 - self._top - uniq.numel()
        checks = {
            f"pages owned twice: {uniq[counts > 1].tolist()}": bool((counts > 1).any()),
            f"owned pages that are free: {owned[self._is_free[owned]].tolist()}": bool(
                self._is_free[owned].any()
            ),
            f"{leaked} pages neither free nor owned (leaked)": leaked != 0,
        }
        return [problem for problem, failed in checks.items() if failed]


def _as_index(req_pool: ReqToTokenPool, *ts: Tensor) -> list[Tensor]:
    """Each of ``ts`` as a 1-D int64 tensor on the table's device."""
    return [t.to(device=req_pool.req_to_token.device, dtype=_I64).reshape(-1) for t in ts]


def _expand(counts: Tensor) -> tuple[Tensor, Tensor]:
    """For ``counts[b]`` items per row: (row index, index within the row) of each item."""
    rows = torch.repeat_interleave(torch.arange(counts.numel(), device=counts.device), counts)
    starts = torch.cumsum(counts, 0) - counts
    return rows, torch.arange(rows.numel(), device=counts.device) - starts[rows]


def _tail_pages(
    req_pool: ReqToTokenPool, allocator: TokenSlotAllocator, slots: Tensor, cur: Tensor, nxt: Tensor
) -> Tensor:
    """The page of position ``cur - 1`` per row; `LedgerViolation` if a reused one is not owned."""
    p = allocator.page_size
    tail = torch.div(req_pool.req_to_token[slots, (cur - 1).clamp_min(0)], p, rounding_mode="floor")
    reused = (cur % p != 0) & (nxt > cur)
    bad = reused & ((tail == 0) | allocator._is_free[tail])
    if bool(bad.any()):
        i = int(bad.nonzero()[0])
        raise LedgerViolation(
            f"request slot {int(slots[i])}: position {int(cur[i]) - 1} maps to page "
            f"{int(tail[i])}, which is free or padding; allocated length {int(cur[i])} is wrong"
        )
    return tail


def grow_rows(
    req_pool: ReqToTokenPool, allocator: TokenSlotAllocator, slots: Tensor, cur: Tensor, nxt: Tensor
) -> int:
    """Map positions ``[cur, nxt)`` of each row to token slots; return the new pages taken.

    Positions in the page a row already started (the page of position ``cur - 1`` when ``cur``
    is not a multiple of P) reuse that page; the rest take ``ceil_P(nxt)/P - ceil_P(cur)/P``
    new pages per row. A fixed number of tensor ops, whatever the batch size. Raises
    `LedgerViolation` (bad rows, ``nxt < cur``, past the row width) or `KvPoolExhausted` with
    nothing changed.

    NOTE: writes ``req_to_token`` in place: it is this pool's own table, not a scheduler-owned
    batch tensor; on a device the write must be ordered after the previous forward's reads.

    Invariant:
        Row contents outside ``[cur, nxt)`` are never written.
    """
    p = allocator.page_size
    slots, cur, nxt = _as_index(req_pool, slots, cur, nxt)
    req_pool._check_rows(slots, cur, nxt)
    first_new = ceil_to_page(cur, p)  # first position that needs a new page
    n_new = torch.div(ceil_to_page(nxt, p) - first_new, p, rounding_mode="floor")
    num_new = int(n_new.sum())
    tail_page = _tail_pages(req_pool, allocator, slots, cur, nxt)
    pages = allocator.alloc_pages(num_new).to(cur.device)  # raises before any change
    rows, j = _expand(nxt - cur)
    pos = cur[rows] + j
    page = tail_page[rows]
    if num_new:
        k = torch.div(pos - first_new[rows], p, rounding_mode="floor").clamp_min(0)
        new_page = pages[((torch.cumsum(n_new, 0) - n_new)[rows] + k).clamp_max(num_new - 1)]
        page = torch.where(pos >= first_new[rows], new_page, page)
    req_pool._req_to_token[slots[rows], pos] = page * p + pos % p
    return num_new


def free_rows(
    req_pool: ReqToTokenPool,
    allocator: TokenSlotAllocator,
    slots: Tensor,
    start: Tensor,
    stop: Tensor,
) -> int:
    """Free the pages that hold positions ``[ceil_P(start), stop)`` of each row.

    ``start`` is the first position the request owns (its ``cache_protected_len``); it is
    rounded UP to a page, because a page holding any position below ``start`` belongs to the
    prefix cache. ``stop`` is the allocated length; its partial last page is freed whole. Call
    before `ReqToTokenPool.free`; the row contents are left as they are (stale, never read).
    Returns the number of pages freed. Raises `LedgerViolation` (bad rows or ranges) or
    `DoubleRelease` (a page already free or listed twice) with nothing changed.
    """
    p = allocator.page_size
    slots, start, stop = _as_index(req_pool, slots, start, stop)
    req_pool._check_rows(slots, start, stop)
    first = torch.div(ceil_to_page(start, p), p, rounding_mode="floor")
    end = torch.div(ceil_to_page(stop, p), p, rounding_mode="floor")
    rows, j = _expand((end - first).clamp_min(0))
    token_slots = req_pool.req_to_token[slots[rows], (first[rows] + j) * p]
    pages = torch.div(token_slots, p, rounding_mode="floor")
    allocator.free_pages(pages)
    return int(pages.numel())
