"""The two KV pools: request rows of ``req_to_token`` and the paged token-slot allocator.

`ReqToTokenPool` owns request slots and their rows; `TokenSlotAllocator` owns the free KV pages.
`grow_rows` / `free_rows` / `map_prefix`, the only writers of ``req_to_token``, bridge the two;
the allocation layer (owner of ``kv_allocated_len`` and friends) calls them. Token slot id =
``page * P + offset``; position ``pos`` of a row sits at offset ``pos % P`` of one of its pages::

    req_to_token[slot]   pos: 0  1  2  3 | 4  5  6  7 | 8  9  .  . | .  .
                       page:  [  17      ] [  4       ] [  9 ... ]  (row pages, any order)
                       slot:  68 69 70 71  16 17 18 19  36 37 ...

Placement: ``req_to_token`` lives where the worker reads it (the forward's device); everything
the host decides alone — the free-page stack, the page flags, which slots are in use and the
page each row last mapped — is host state in NumPy arrays. Growing a batch of rows is computed
on the host with a fixed number of array operations and written into the table with one
indexed store; it never reads the table back (no device-to-host transfer).

Invariant:
    Page 0 (token slots ``0..P-1``) and request slot 0 are padding: never handed out, so padded
    batch rows and padded positions read and write them harmlessly. Every other page is either
    free (on the stack, ``is_free``) or owned by exactly one row (or by the prefix cache).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from specstate.core.errors import DoubleRelease, InvalidConfig, KvPoolExhausted, LedgerViolation

__all__ = [
    "ReqToTokenPool",
    "ReqToTokenPoolSnapshot",
    "SlotHandle",
    "TokenSlotAllocator",
    "TokenSlotAllocatorSnapshot",
    "free_rows",
    "grow_rows",
    "has_duplicates",
    "map_prefix",
]

_I64 = torch.int64
IntArray = npt.NDArray[np.int64]
Indices = Tensor | IntArray


def host_index(values: Indices) -> IntArray:
    """``values`` as a 1-D int64 host array (no copy for a CPU int64 tensor or array)."""
    if type(values) is np.ndarray and values.dtype == np.int64 and values.ndim == 1:
        return values  # the hot path: already one (a contiguous copy is not needed to index)
    if isinstance(values, Tensor):
        values = values.detach().to("cpu", _I64).numpy()
    return np.ascontiguousarray(values, dtype=np.int64).reshape(-1)


def has_duplicates(values: IntArray) -> bool:
    """Whether any value repeats (a sort: NumPy's hash-based ``unique`` is far slower here)."""
    if values.size < 2:
        return False
    ordered = np.sort(values)
    return bool((ordered[1:] == ordered[:-1]).any())


def _ceil_page(x: IntArray, p: int) -> IntArray:
    return x if p == 1 else -(-x // p) * p


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
    _generation: IntArray = attrs.field(repr=False)
    _request_ids: list[str | None] = attrs.field(repr=False)
    _in_use: npt.NDArray[np.bool_] = attrs.field(repr=False)  # [max_requests + 1], host
    # The page of a row's last mapped position, for rows whose length ends inside a page.
    _last_page: IntArray = attrs.field(repr=False)
    _table_host: IntArray = attrs.field(repr=False)  # flat host copy (a view on the host CPU)
    _mirrored: bool = attrs.field(repr=False)  # the table is a separate (device) tensor

    def __init__(self, max_requests: int, row_width: int, *, device: torch.device | str = "cpu"):
        """Create ``max_requests`` usable slots with rows of ``row_width`` positions."""
        if max_requests < 1 or row_width < 1:
            raise InvalidConfig(
                f"max_requests, row_width must be >= 1: got {max_requests}, {row_width}"
            )
        # Placement: the table lives where the forward reads it; the host computes from its
        # own copy and writes each change through (one indexed store), never reading it back.
        shape = (max_requests + 1, row_width)
        self._mirrored = torch.device(device) != torch.device("cpu")
        if self._mirrored:
            self._table_host = np.zeros(shape[0] * shape[1], dtype=np.int64)
            self._req_to_token = torch.zeros(shape, dtype=_I64, device=device)
        else:
            self._req_to_token = torch.zeros(shape, dtype=_I64)
            self._table_host = self._req_to_token.numpy().reshape(-1)
        self._free_slots = list(range(max_requests, 0, -1))
        self._generation = np.zeros(max_requests + 1, dtype=np.int64)
        self._request_ids = [None] * (max_requests + 1)
        self._in_use = np.zeros(max_requests + 1, dtype=np.bool_)
        self._last_page = np.zeros(max_requests + 1, dtype=np.int64)

    @property
    def table_host(self) -> IntArray:
        """The host copy of the table, ``[max_requests + 1, row_width]`` (read only)."""
        return self._table_host.reshape(self._req_to_token.shape)

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
        return SlotHandle(slot, int(self._generation[slot]))

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
        self._last_page[s] = 0
        self._free_slots.append(s)

    def free_many(self, handles: list[SlotHandle]) -> None:
        """`free` every handle; see `free_slots`."""
        slots = np.fromiter((h.slot for h in handles), dtype=np.int64, count=len(handles))
        gens = np.fromiter((h.generation for h in handles), dtype=np.int64, count=len(handles))
        self.free_slots(slots, gens)

    def free_slots(self, slots: IntArray, gens: IntArray, *, distinct: bool = False) -> None:
        """Free the handles ``(slots[i], gens[i])`` with a fixed number of array operations.

        All are checked first (in use, current generation, no slot twice: ``distinct`` says
        the caller already checked that none repeats), so a bad handle frees nothing:
        `DoubleRelease` names it.
        """
        if slots.size == 0:
            return
        listed = slots.tolist()
        ok = min(listed) >= 1 and max(listed) <= self.max_requests
        ok = ok and (distinct or len(set(listed)) == len(listed))
        if not (ok and self._in_use[slots].all() and (self._generation[slots] == gens).all()):
            for s, g in zip(listed, gens.tolist(), strict=True):
                if not self.is_current(SlotHandle(s, g)):
                    self.free(SlotHandle(s, g))  # raises DoubleRelease naming the slot
            raise DoubleRelease(f"request slots {listed}: a slot is freed twice")
        self._generation[slots] += 1
        self._in_use[slots] = False
        self._last_page[slots] = 0
        ids = self._request_ids
        for slot in listed:
            ids[slot] = None
        self._free_slots.extend(listed)

    def snapshot(self) -> ReqToTokenPoolSnapshot:
        """Frozen slot statistics."""
        free = len(self._free_slots)
        return ReqToTokenPoolSnapshot(
            max_requests=self.max_requests,
            row_width=self.row_width,
            num_free_slots=free,
            num_used_slots=self.max_requests - free,
        )

    def _check_rows(self, slots: IntArray, lo: IntArray, hi: IntArray) -> None:
        """Raise `LedgerViolation` unless rows are distinct, in use, ``0 <= lo <= hi <= width``."""
        if not slots.shape == lo.shape == hi.shape:
            raise LedgerViolation(f"slots, start, stop lengths: {[len(slots), len(lo), len(hi)]}")
        if slots.size and (int(slots.min()) < 1 or int(slots.max()) > self.max_requests):
            raise LedgerViolation(
                f"request slots must be in [1, {self.max_requests}]: {slots.tolist()}"
            )
        if has_duplicates(slots):
            raise LedgerViolation(f"request slots repeat in one call: {slots.tolist()}")
        if not bool(self._in_use[slots].all()):
            unused = slots[~self._in_use[slots]].tolist()
            raise LedgerViolation(f"request slots not in use: {unused}")
        bad = (lo < 0) | (hi < lo) | (hi > self.row_width)
        if bool(bad.any()):
            i = int(np.flatnonzero(bad)[0])
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

    Host state (NumPy): which page is free is decided by the host alone; only the token-slot
    ids written into ``req_to_token`` reach the device.

    Invariant:
        ``stack[:top]`` holds exactly the pages with ``is_free`` set, each once; page 0 is
        never free. `alloc_pages` and `free_pages` are all-or-nothing and touch only the pages
        they move (O(pages), never O(pool)).
    """

    _page_size: int
    _free_stack: IntArray = attrs.field(repr=False)  # [num_pages - 1]
    _top: int
    _is_free: npt.NDArray[np.bool_] = attrs.field(repr=False)  # [num_pages]

    def __init__(self, num_pages: int, page_size: int):
        """Create ``num_pages`` pages of ``page_size`` slots; pages ``1..num_pages-1`` free."""
        if num_pages < 2 or page_size < 1:
            raise InvalidConfig(
                f"need num_pages >= 2 (page 0 is padding) and page_size >= 1, "
                f"got {num_pages}, {page_size}"
            )
        self._page_size = page_size
        # Highest page at the bottom, so a fresh pool hands out pages 1, 2, 3, ... in order.
        self._free_stack = np.arange(num_pages - 1, 0, -1, dtype=np.int64)
        self._top = num_pages - 1
        self._is_free = np.ones(num_pages, dtype=np.bool_)
        self._is_free[0] = False

    @property
    def num_pages(self) -> int:
        """Pages including the padding page 0."""
        return int(self._is_free.shape[0])

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
        return torch.from_numpy(self.take_pages(n))

    def take_pages(self, n: int) -> IntArray:
        """`alloc_pages` as a host array (the allocation layer's hot path)."""
        if n < 0:
            raise LedgerViolation(f"cannot allocate a negative number of pages: {n}")
        if n > self._top:
            raise KvPoolExhausted(
                f"requested {n} pages ({n * self._page_size} tokens), available {self._top} "
                f"pages ({self.available_tokens()} tokens)"
            )
        pages = self._free_stack[self._top - n : self._top][::-1].copy()
        self._top -= n
        self._is_free[pages] = False
        return pages

    def free_pages(self, pages: Indices, *, validate: bool = True) -> None:
        """Return ``pages``; `DoubleRelease` with nothing changed on any bad page.

        A page that is already free is always refused; ``validate`` adds the range and
        duplicate checks (per-page work that only a caller's bug can fail).
        """
        pages = host_index(pages)
        n = pages.size
        if n == 0:
            return
        if validate:
            lo, hi = int(pages.min()), int(pages.max())
            if lo < 1 or hi >= self.num_pages:
                raise DoubleRelease(
                    f"free of pages outside [1, {self.num_pages - 1}] (page 0 is padding): "
                    f"{lo}..{hi}"
                )
            if has_duplicates(pages):
                raise DoubleRelease(f"the same page appears twice in one free: {pages.tolist()}")
        if np.count_nonzero(self._is_free[pages]):
            already = pages[self._is_free[pages]]
            raise DoubleRelease(f"free of {already.size} already free pages: {already.tolist()}")
        self._free_stack[self._top : self._top + n] = pages
        self._top += n
        self._is_free[pages] = True

    def check_balance(self, owned: Tensor | None = None) -> None:
        """Prove the free list is consistent, and free ∪ ``owned`` = pages 1.. with no overlap.

        O(pool); debug and tests only. Raises `LedgerViolation` listing every problem found.
        """
        problems = self._stack_problems()
        if owned is not None and not problems:
            problems = self._owned_problems(host_index(owned))
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
        if free.size and (int(free.min()) < 1 or int(free.max()) >= self.num_pages):
            return [f"the free stack holds out-of-range pages: {free.tolist()}"]
        checks = {
            "page 0 is marked free": bool(self._is_free[0]),
            "a page is on the free stack twice": has_duplicates(free),
            "a page on the free stack is not marked free": not bool(self._is_free[free].all()),
            f"{n_marked} pages marked free, stack has {self._top}": n_marked != self._top,
        }
        return [problem for problem, failed in checks.items() if failed]

    def _owned_problems(self, owned: IntArray) -> list[str]:
        """Ways in which ``owned`` and the free pages fail to partition pages 1.."""
        if owned.size and (int(owned.min()) < 1 or int(owned.max()) >= self.num_pages):
            return [f"owned pages out of range [1, {self.num_pages - 1}]: {owned.tolist()}"]
        uniq, counts = np.unique(owned, return_counts=True)
        leaked = self.num_pages - 1 - self._top - uniq.size
        checks = {
            f"pages owned twice: {uniq[counts > 1].tolist()}": bool((counts > 1).any()),
            f"owned pages that are free: {owned[self._is_free[owned]].tolist()}": bool(
                self._is_free[owned].any()
            ),
            f"{leaked} pages neither free nor owned (leaked)": leaked != 0,
        }
        return [problem for problem, failed in checks.items() if failed]


def _expand(counts: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """For ``counts[b]`` items per row: (row of each item, index within its row, row starts)."""
    starts = np.cumsum(counts) - counts
    rows = np.repeat(np.arange(counts.size), counts)
    return rows, np.arange(rows.size) - starts[rows], starts


def _check_tail_pages(
    req_pool: ReqToTokenPool, allocator: TokenSlotAllocator, slots: IntArray, cur: IntArray
) -> None:
    """Debug: the host's last-page mirror agrees with the table and names an owned page."""
    p = allocator.page_size
    reused = cur % p != 0
    if not reused.any():
        return
    s, c = slots[reused], cur[reused]
    mapped = req_pool._table_host[s * req_pool.row_width + c - 1]
    tail = req_pool._last_page[s]
    bad = (mapped // p != tail) | (tail == 0) | allocator._is_free[tail]
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise LedgerViolation(
            f"request slot {int(s[i])}: position {int(c[i]) - 1} maps to page "
            f"{int(mapped[i]) // p} (host mirror {int(tail[i])}), which is free, padding or "
            f"disagrees; allocated length {int(c[i])} is wrong"
        )


def grow_rows(
    req_pool: ReqToTokenPool,
    allocator: TokenSlotAllocator,
    slots: Indices,
    cur: Indices,
    nxt: Indices,
    *,
    validate: bool = True,
) -> int:
    """Map positions ``[cur, nxt)`` of each row to token slots; return the new pages taken.

    Positions in the page a row already started (the page of position ``cur - 1`` when ``cur``
    is not a multiple of P, known from the host's last-page mirror) reuse that page; the rest
    take ``ceil_P(nxt)/P - ceil_P(cur)/P`` new pages per row. A fixed number of host array
    operations and one indexed store into the table, whatever the batch size. Raises
    `KvPoolExhausted` with nothing changed; with ``validate``, also `LedgerViolation` for bad
    rows, ``nxt < cur``, a range past the row width, or a tail page that is not the row's.

    NOTE: writes ``req_to_token`` in place: it is this pool's own table, not a scheduler-owned
    batch tensor; on a device the write must be ordered after the previous forward's reads.

    Invariant:
        Row contents outside ``[cur, nxt)`` are never written.
    """
    p = allocator.page_size
    s, c, n = host_index(slots), host_index(cur), host_index(nxt)
    if validate:
        req_pool._check_rows(s, c, n)
        _check_tail_pages(req_pool, allocator, s, c)
    counts = n - c
    if p == 1:  # every position is a new page, taken in row order
        num_new = int(counts.sum())
        pages = allocator.take_pages(num_new)  # raises before any change
        if num_new:
            # Row b's positions [c, n) are flat [base_b + c_b, ...): one repeat and one range.
            ends = np.cumsum(counts)
            first = s * req_pool.row_width + c - (ends - counts)
            _store(req_pool, np.repeat(first, counts) + np.arange(num_new), pages)
        return num_new
    grows = counts > 0
    if not grows.all():  # rows with nothing to map take no part
        s, c, n, counts = s[grows], c[grows], n[grows], counts[grows]
    first_new = _ceil_page(c, p)  # first position that needs a new page
    n_new = (_ceil_page(n, p) - first_new) // p
    num_new = int(n_new.sum())
    pages = allocator.take_pages(num_new)  # raises before any change
    if s.size == 0:
        return 0
    if not np.count_nonzero(n % p):
        # A decode reservation ends on a page boundary: whole new pages, and the rest of the
        # started page of the rows that just prefilled.
        tails = np.flatnonzero(c % p)
        _map_pages_to_boundary(req_pool, s, c, first_new, n_new, pages, tails, p)
        return num_new
    rows, j, starts = _expand(counts)
    pos = c[rows] + j
    k = (pos - first_new[rows]) // p + (np.cumsum(n_new) - n_new)[rows]
    fresh = pos >= first_new[rows]
    page = np.where(
        fresh,
        pages[np.clip(k, 0, max(num_new - 1, 0))] if num_new else 0,
        req_pool._last_page[s][rows],
    )
    values = page * p + pos % p
    flat = (s * req_pool.row_width)[rows] + pos
    _store(req_pool, flat, values)
    req_pool._last_page[s] = values[starts + counts - 1] // p
    return num_new


def _map_pages_to_boundary(
    req_pool: ReqToTokenPool,
    s: IntArray,
    c: IntArray,
    first_new: IntArray,
    n_new: IntArray,
    pages: IntArray,
    tails: IntArray,
    p: int,
) -> None:
    """Map ``n_new[i]`` whole new pages from the page boundary ``first_new[i]`` of row ``s[i]``,
    and, for the rows ``tails``, positions ``[c, first_new)`` of the page they started.

    The new pages are taken in row order and fill each row's positions in order, so the
    values are the pages' slots in order: one repeat and one range for the positions. The
    started pages' positions are expanded the same way (a fixed number of operations).
    """
    width = req_pool.row_width
    flat_parts, value_parts = [], []
    num_new = pages.size
    if num_new:
        counts = n_new * p
        ends = np.cumsum(counts)
        first = s * width + first_new - (ends - counts)
        flat_parts.append(np.repeat(first, counts) + np.arange(num_new * p))
        value_parts.append((pages[:, None] * p + np.arange(p)).reshape(-1))
    if tails.size:  # rows whose prefill ended inside a page: the rest of that page first
        ts, tc, tf = s[tails], c[tails], first_new[tails]
        counts = tf - tc
        ends = np.cumsum(counts)
        offset = np.arange(int(ends[-1])) - np.repeat(ends - counts, counts)
        flat_parts.append(np.repeat(ts * width + tc, counts) + offset)
        value_parts.append(np.repeat(req_pool._last_page[ts] * p + tc % p, counts) + offset)
    if not flat_parts:
        return
    flat = flat_parts[0] if len(flat_parts) == 1 else np.concatenate(flat_parts)
    values = value_parts[0] if len(value_parts) == 1 else np.concatenate(value_parts)
    # NOTE: the last-page mirror is not updated: every row now ends on a page boundary, and
    # the mirror is read only for a row that ends inside a page, which only the
    # position-by-position path leaves (and sets).
    _store(req_pool, flat, values)


def _store(req_pool: ReqToTokenPool, flat: IntArray, values: IntArray) -> None:
    """Write ``values`` at flat positions of ``req_to_token``: one indexed store.

    On a device, the host copy is written too and the indices and values travel in one
    host-to-device copy; the store is enqueued on the host's current stream, which the forward
    stream waits for before the next forward (the input fence).
    """
    req_pool._table_host[flat] = values
    if req_pool._mirrored:
        table = req_pool._req_to_token
        both = torch.from_numpy(np.concatenate([flat, values])).to(table.device)
        table.view(-1).index_copy_(0, both[: flat.size], both[flat.size :])


def free_rows(
    req_pool: ReqToTokenPool,
    allocator: TokenSlotAllocator,
    slots: Indices,
    start: Indices,
    stop: Indices,
    *,
    validate: bool = True,
) -> int:
    """Free the pages that hold positions ``[ceil_P(start), stop)`` of each row.

    ``start`` is the first position the request owns (its ``cache_protected_len``); it is
    rounded UP to a page, because a page holding any position below ``start`` belongs to the
    prefix cache. ``stop`` is the allocated length; its partial last page is freed whole. Call
    before `ReqToTokenPool.free`; the row contents are left as they are (stale, never read).
    Returns the number of pages freed. Raises `DoubleRelease` (a page already free; with
    ``validate`` also one listed twice) or, with ``validate``, `LedgerViolation` (bad rows or
    ranges), with nothing changed.
    """
    p = allocator.page_size
    s, lo, hi = host_index(slots), host_index(start), host_index(stop)
    if validate:
        req_pool._check_rows(s, lo, hi)
    first = _ceil_page(lo, p)
    table, width = req_pool._table_host, req_pool.row_width
    # One slice of the table per row (a row's pages are every P-th entry of its range): at
    # page 1 a contiguous copy per row, and faster than a vectorized expansion of the
    # positions for any number of rows (that gathers every position through index arrays).
    bases = (s * width).tolist()
    parts = [
        table[base + a : base + b : p]
        for base, a, b in zip(bases, first.tolist(), hi.tolist(), strict=True)
    ]
    slots_held = np.concatenate(parts) if parts else table[:0]
    pages = slots_held if p == 1 else slots_held // p
    allocator.free_pages(pages, validate=validate)
    return int(pages.size)


def map_prefix(
    req_pool: ReqToTokenPool, allocator: TokenSlotAllocator, slot: int, pages: IntArray
) -> int:
    """Map positions ``[0, P * len(pages))`` of a fresh row to ``pages`` (a cached prefix).

    The pages are not taken from ``allocator`` (the prefix cache holds them); the row must be
    in use and map nothing yet. Returns the number of positions mapped. One indexed store.

    Invariant:
        Only positions ``[0, P * len(pages))`` of ``slot``'s row are written.
    """
    p = allocator.page_size
    n = int(pages.size) * p
    if n == 0:
        return 0
    req_pool._check_rows(np.array([slot]), np.zeros(1, dtype=np.int64), np.array([n]))
    values = (pages[:, None] * p + np.arange(p, dtype=np.int64)).reshape(-1)
    _store(req_pool, slot * req_pool.row_width + np.arange(n, dtype=np.int64), values)
    req_pool._last_page[slot] = int(pages[-1])
    return n
