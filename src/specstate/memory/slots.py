"""Request slots: `ReqToTokenPool` owns the rows of ``req_to_token`` and which request holds one.

A request claims a slot (`ReqToTokenPool.alloc`, a `SlotHandle` with the slot's generation) and
its row maps its positions to token slots of the paged allocator (`specstate.memory.pages`):
`ReqToTokenPool.grow_rows`, `free_rows` and `map_prefix` are the only writers of the rows, and
take or give back the pages they map. Token slot id = ``page * P + offset``; position ``pos`` of
a row sits at offset ``pos % P`` of one of its pages::

    req_to_token[slot]   pos: 0  1  2  3 | 4  5  6  7 | 8  9  .  . | .  .
                       page:  [  17      ] [  4       ] [  9 ... ]  (row pages, any order)
                       slot:  68 69 70 71  16 17 18 19  36 37 ...

Placement: ``req_to_token`` lives where the worker reads it; everything the host decides alone —
a host copy of the table, the slots in use, their generations and the page each row last mapped
— is host arrays. Growing a batch of rows is computed on the host with a fixed number of array
operations and written into the table with one indexed store; it never reads the table back (no
device-to-host transfer).

Invariant:
    Slot 0 (and page 0, token slots ``0..P-1``) is padding: never handed out, so padded batch
    rows and padded positions read and write it harmlessly. A slot's generation increments on
    every free, so a stale handle is refused. Row contents are written only through the row
    methods, and only at the positions they are asked to map.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from specstate.core.errors import DoubleRelease, InvalidConfig, KvPoolExhausted, LedgerViolation
from specstate.memory.host_arrays import Indices, IntArray, has_duplicates, host_index
from specstate.memory.pages import TokenSlotAllocator

__all__ = ["ReqToTokenPool", "ReqToTokenPoolSnapshot", "SlotHandle"]

_I64 = torch.int64
_SUM = np.add.reduce
"""A sum in C (``ndarray.sum`` goes through a Python-level wrapper first)."""


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
    _table_flat: Tensor = attrs.field(repr=False)  # the table viewed flat, for the stores
    _row_width: int = attrs.field(repr=False)

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
        self._table_flat = self._req_to_token.view(-1)
        self._row_width = row_width
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
        """The table; read it (gather views from it), write it only through the row methods."""
        return self._req_to_token

    @property
    def max_requests(self) -> int:
        """Usable request slots (row 0 excluded)."""
        return self._req_to_token.shape[0] - 1

    @property
    def row_width(self) -> int:
        """Positions per row."""
        return self._row_width

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

    def grow_rows(
        self,
        allocator: TokenSlotAllocator,
        slots: Indices,
        cur: Indices,
        nxt: Indices,
        *,
        validate: bool = True,
    ) -> int:
        """Map positions ``[cur, nxt)`` of each row to token slots of ``allocator``'s pages; return
        the new pages taken.

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
            self._check_rows(s, c, n)
            self._check_tail_pages(allocator, s, c)
        counts = n - c
        if p == 1:  # every position is a new page, taken in row order
            num_new = int(_SUM(counts))
            pages = allocator.take_pages(num_new)  # raises before any change
            if num_new:
                # Row b's positions [c, n) are flat [base_b + c_b, ...): one repeat and one range.
                ends: IntArray = counts.cumsum()
                first = s * self.row_width + c - (ends - counts)
                self._store(first.repeat(counts) + np.arange(num_new), pages)
            return num_new
        grows = counts > 0
        if not grows.all():  # rows with nothing to map take no part
            s, c, n, counts = s[grows], c[grows], n[grows], counts[grows]
        first_new = _ceil_page(c, p)  # first position that needs a new page
        n_new = (_ceil_page(n, p) - first_new) // p
        num_new = int(_SUM(n_new))
        pages = allocator.take_pages(num_new)  # raises before any change
        if s.size == 0:
            return 0
        if not np.count_nonzero(n % p):
            # A decode reservation ends on a page boundary: whole new pages, and the rest of the
            # started page of the rows that just prefilled.
            tails = (c % p).nonzero()[0]
            self._map_pages_to_boundary(s, c, first_new, n_new, pages, tails, p)
            return num_new
        rows, j, starts = _expand(counts)
        pos = c[rows] + j
        k = (pos - first_new[rows]) // p + (n_new.cumsum() - n_new)[rows]
        fresh = pos >= first_new[rows]
        page = np.where(
            fresh,
            pages[np.clip(k, 0, max(num_new - 1, 0))] if num_new else 0,
            self._last_page[s][rows],
        )
        values = page * p + pos % p
        flat = (s * self.row_width)[rows] + pos
        self._store(flat, values)
        self._last_page[s] = values[starts + counts - 1] // p
        return num_new

    def _map_pages_to_boundary(
        self,
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
        width = self.row_width
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
            value_parts.append((self._last_page[ts] * p + tc % p).repeat(counts) + offset)
        if not flat_parts:
            return
        flat = flat_parts[0] if len(flat_parts) == 1 else np.concatenate(flat_parts)
        values = value_parts[0] if len(value_parts) == 1 else np.concatenate(value_parts)
        # NOTE: the last-page mirror is not updated: every row now ends on a page boundary, and
        # the mirror is read only for a row that ends inside a page, which only the
        # position-by-position path leaves (and sets).
        self._store(flat, values)

    def _store(self, flat: IntArray, values: IntArray) -> None:
        """Write ``values`` at flat positions of ``req_to_token``: one indexed store.

        On a device, the host copy is written too and the indices and values travel in one
        host-to-device copy; the store is enqueued on the host's current stream, which the forward
        stream waits for before the next forward (the input fence).
        """
        self._table_host[flat] = values
        if self._mirrored:
            self._store_device(np.concatenate([flat, values]), flat.size)

    def _store_device(self, both: IntArray, n: int) -> None:
        """The device side of `_store`: one host-to-device copy of the flat positions and
        values (``both[:n]``, ``both[n:]``) and one indexed store into the table."""
        flat = self._table_flat
        moved = torch.from_numpy(both).to(flat.device)
        flat.index_copy_(0, moved[:n], moved[n:])

    def free_rows(
        self,
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
        before `free`; the row contents are left as they are (stale, never read).
        Returns the number of pages freed. Raises `DoubleRelease` (a page already free; with
        ``validate`` also one listed twice) or, with ``validate``, `LedgerViolation` (bad rows or
        ranges), with nothing changed.
        """
        p = allocator.page_size
        s, lo, hi = host_index(slots), host_index(start), host_index(stop)
        if validate:
            self._check_rows(s, lo, hi)
        first = _ceil_page(lo, p)
        table, width = self._table_host, self.row_width
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

    def map_prefix(self, allocator: TokenSlotAllocator, slot: int, pages: IntArray) -> int:
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
        self._check_rows(np.array([slot]), np.zeros(1, dtype=np.int64), np.array([n]))
        values = (pages[:, None] * p + np.arange(p, dtype=np.int64)).reshape(-1)
        self._store(slot * self.row_width + np.arange(n, dtype=np.int64), values)
        self._last_page[slot] = int(pages[-1])
        return n

    def _check_tail_pages(
        self, allocator: TokenSlotAllocator, slots: IntArray, cur: IntArray
    ) -> None:
        """Debug: the host's last-page mirror agrees with the table and names an owned page."""
        p = allocator.page_size
        reused = cur % p != 0
        if not reused.any():
            return
        s, c = slots[reused], cur[reused]
        mapped = self._table_host[s * self.row_width + c - 1]
        tail = self._last_page[s]
        bad = (mapped // p != tail) | (tail == 0) | allocator.are_free(tail)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            raise LedgerViolation(
                f"request slot {int(s[i])}: position {int(c[i]) - 1} maps to page "
                f"{int(mapped[i]) // p} (host mirror {int(tail[i])}), which is free, padding or "
                f"disagrees; allocated length {int(c[i])} is wrong"
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


def _ceil_page(x: IntArray, p: int) -> IntArray:
    return x if p == 1 else -(-x // p) * p


def _expand(counts: IntArray) -> tuple[IntArray, IntArray, IntArray]:
    """For ``counts[b]`` items per row: (row of each item, index within its row, row starts)."""
    starts = counts.cumsum() - counts
    rows = np.arange(counts.size).repeat(counts)
    return rows, np.arange(rows.size) - starts[rows], starts
