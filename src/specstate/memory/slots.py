"""Request slots: `ReqToTokenPool` owns the rows of ``req_to_token`` and which request holds one.

A request claims a slot (`ReqToTokenPool.alloc`, a `SlotHandle` with the slot's generation) and
its row maps its positions to token slots; the row functions of `specstate.memory.pools`
(`grow_rows`, `free_rows`, `map_prefix`) are the only writers of the rows. ``req_to_token``
lives where the worker reads it; a host copy of it, the slots in use, their generations and the
page each row last mapped are host arrays.

Invariant:
    Slot 0 is padding: never handed out, so padded batch rows read and write it harmlessly. A
    slot's generation increments on every free, so a stale handle is refused.
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import torch
from torch import Tensor

from specstate.core.errors import DoubleRelease, InvalidConfig, KvPoolExhausted, LedgerViolation
from specstate.memory.host_arrays import IntArray, has_duplicates

__all__ = ["ReqToTokenPool", "ReqToTokenPoolSnapshot", "SlotHandle"]

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
