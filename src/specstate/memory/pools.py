"""The two KV pools, and the row functions that map one onto the other.

`ReqToTokenPool` (`specstate.memory.slots`) owns request slots and their rows of
``req_to_token``; `TokenSlotAllocator` (`specstate.memory.pages`) owns the free KV pages; both
are importable from here. `grow_rows` / `free_rows` / `map_prefix`, the only writers of
``req_to_token``, bridge the two (they keep the pools' host state, as friends of both);
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

import numpy as np
import torch

from specstate.core.errors import LedgerViolation
from specstate.memory.host_arrays import Indices, IntArray, host_index
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.slots import ReqToTokenPool

__all__ = ["free_rows", "grow_rows", "map_prefix"]


def _ceil_page(x: IntArray, p: int) -> IntArray:
    return x if p == 1 else -(-x // p) * p


def _expand(counts: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """For ``counts[b]`` items per row: (row of each item, index within its row, row starts)."""
    starts = counts.cumsum() - counts
    rows = np.arange(counts.size).repeat(counts)
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
            ends: IntArray = counts.cumsum()
            first = s * req_pool.row_width + c - (ends - counts)
            _store(req_pool, first.repeat(counts) + np.arange(num_new), pages)
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
        tails = (c % p).nonzero()[0]
        _map_pages_to_boundary(req_pool, s, c, first_new, n_new, pages, tails, p)
        return num_new
    rows, j, starts = _expand(counts)
    pos = c[rows] + j
    k = (pos - first_new[rows]) // p + (n_new.cumsum() - n_new)[rows]
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
    flat_parts: list[IntArray] = []
    value_parts: list[IntArray] = []
    num_new = pages.size
    if num_new:
        counts = n_new * p
        ends: IntArray = counts.cumsum()
        first = s * width + first_new - (ends - counts)
        flat_parts.append(first.repeat(counts) + np.arange(num_new * p, dtype=np.int64))
        value_parts.append((pages[:, None] * p + np.arange(p, dtype=np.int64)).reshape(-1))
    if tails.size:  # rows whose prefill ended inside a page: the rest of that page first
        ts, tc, tf = s[tails], c[tails], first_new[tails]
        counts = tf - tc
        ends = counts.cumsum()
        offset = np.arange(int(ends[-1])) - (ends - counts).repeat(counts)
        flat_parts.append((ts * width + tc).repeat(counts) + offset)
        value_parts.append((req_pool._last_page[ts] * p + tc % p).repeat(counts) + offset)
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
