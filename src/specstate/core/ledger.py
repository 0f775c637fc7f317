"""The KV ledger: the host's per-slot record of what each request's KV row holds.

The ledger owns three counters per request slot, stored as slot-indexed int64 tensors (struct of
arrays) so a whole batch is settled with a few vectorized ops::

    req_to_token row of one request (positions, half-open ranges)

    0                protected            committed                 allocated      row width
    |--- prefix -----|---- own, valid KV ----|---- reserved (spec) -----|---- unused ---|
      owned by the     confirmed by the        slots held for drafts and
      prefix cache     target model            the in-flight verify

Owners (docs/design.md, "The owner map"; one writer per counter):

* ``cache_protected_len`` — the scheduler (prefix match); reset to 0 at release.
* ``kv_committed_len`` — the scheduler sets it to the extend end (prefill / chunk);
  the result processor advances it by each accepted run; reset to 0 at release.
* ``kv_allocated_len`` — the allocator grows it (never shrinks while the request lives);
  reset to 0 at release.

Invariant: for every open slot, after every mutation,
``0 <= cache_protected_len <= kv_committed_len <= kv_allocated_len <= row_width``; closed
slots hold zeros. A mutation that would break this raises `LedgerViolation` (or its subclass
`ReservationExceeded` for a commit past the reservation) and changes nothing.

Each role gets a Protocol-typed view with only its mutators (`LedgerViews`); the concrete
`KvLedger` also checks the active role at run time through its `OwnershipChecker`.
"""

from __future__ import annotations

from typing import Final, Protocol

import attrs
import numpy as np
import numpy.typing as npt
import torch

from specstate.core.errors import LedgerViolation, ReservationExceeded
from specstate.core.ownership import OwnershipChecker, Role

__all__ = [
    "AllocatorLedgerView",
    "KvLedger",
    "KvLedgerSnapshot",
    "LedgerBatchSnapshot",
    "LedgerReader",
    "LedgerViews",
    "ResultProcessorLedgerView",
    "SchedulerLedgerView",
    "WorkerLedgerView",
]

_INDEX_DTYPE: Final = torch.int64
HostArray = npt.NDArray[np.int64]
Counts = torch.Tensor | HostArray
"""Slots or lengths: a CPU int64 tensor, or a host int64 array (the per-round hot path)."""


def _host(x: Counts) -> HostArray:
    return x if isinstance(x, np.ndarray) else x.numpy()


def _tensor(x: Counts) -> torch.Tensor:
    return torch.from_numpy(x) if isinstance(x, np.ndarray) else x


@attrs.frozen(kw_only=True)
class KvLedgerSnapshot:
    """One request's ledger entry at one instant."""

    slot: int
    request_id: str
    cache_protected_len: int
    kv_committed_len: int
    kv_allocated_len: int
    row_width: int

    @property
    def num_reserved_tokens(self) -> int:
        """Slots reserved beyond the committed KV: ``allocated - committed``."""
        return self.kv_allocated_len - self.kv_committed_len


@attrs.frozen(kw_only=True)
class LedgerBatchSnapshot:
    """Every open slot's entry at one instant, in slot order."""

    row_width: int
    entries: tuple[KvLedgerSnapshot, ...]

    def for_request(self, request_id: str) -> KvLedgerSnapshot:
        """The entry of ``request_id``; `KeyError` if it holds no slot."""
        for entry in self.entries:
            if entry.request_id == request_id:
                return entry
        raise KeyError(request_id)

    @property
    def is_empty(self) -> bool:
        """True when no slot is open (the idle state)."""
        return not self.entries


class LedgerReader(Protocol):
    """Read access to the ledger, which every role has. Returned tensors are fresh copies."""

    @property
    def row_width(self) -> int:
        """Width of a `req_to_token` row: the largest legal ``kv_allocated_len``."""
        ...

    def committed(self, slots: torch.Tensor) -> torch.Tensor:
        """``kv_committed_len`` of ``slots`` (a new int64 tensor)."""
        ...

    def allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """``kv_allocated_len`` of ``slots`` (a new int64 tensor)."""
        ...

    def protected(self, slots: torch.Tensor) -> torch.Tensor:
        """``cache_protected_len`` of ``slots`` (a new int64 tensor)."""
        ...

    def host_lengths(
        self, slots: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(kv_committed_len, kv_allocated_len)`` of ``slots`` as new host arrays."""
        ...

    def host_protected(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``cache_protected_len`` of ``slots`` as a new host array."""
        ...

    def snapshot(self, slot: int) -> KvLedgerSnapshot:
        """The frozen entry of one open slot."""
        ...

    def batch_snapshot(self) -> LedgerBatchSnapshot:
        """The frozen entries of every open slot."""
        ...


class WorkerLedgerView(LedgerReader, Protocol):
    """What a worker sees of the ledger: reads only."""


class SchedulerLedgerView(LedgerReader, Protocol):
    """The scheduler's view: prefix protection and the extend commit."""

    def set_protected(self, slot: int, num_tokens: int) -> None:
        """Set ``cache_protected_len`` of one slot (prefix match)."""
        ...

    def commit_extend(self, slots: torch.Tensor, extend_ends: torch.Tensor) -> None:
        """Set ``kv_committed_len`` to the end of this extend (prefill or chunk)."""
        ...


class AllocatorLedgerView(LedgerReader, Protocol):
    """The allocator's view: opening and closing slots, growing the reservation."""

    def open_slot(self, slot: int, request_id: str) -> None:
        """Start the entry of ``request_id`` in a closed slot, all counters 0."""
        ...

    def grow_allocated(self, slots: Counts, new_allocated: Counts) -> None:
        """Raise ``kv_allocated_len`` of ``slots`` to ``new_allocated`` (never lowers it)."""
        ...

    def close_slot(self, slot: int) -> KvLedgerSnapshot:
        """End the entry of one slot, zeroing its counters; returns the entry as it was."""
        ...

    def close_slots(self, slots: torch.Tensor) -> None:
        """End the entries of several open slots at once, zeroing their counters."""
        ...


class ResultProcessorLedgerView(LedgerReader, Protocol):
    """The result processor's view: the only way to advance ``kv_committed_len``."""

    def advance_committed(self, slots: Counts, num_tokens: Counts) -> None:
        """Add each accepted run's length to ``kv_committed_len`` (vectorized)."""
        ...


@attrs.frozen(kw_only=True)
class LedgerViews:
    """One typed view per role, all backed by the same `KvLedger`."""

    scheduler: SchedulerLedgerView
    allocator: AllocatorLedgerView
    worker: WorkerLedgerView
    result_processor: ResultProcessorLedgerView
    future_map: LedgerReader


class KvLedger:
    """Slot-indexed owner of ``cache_protected_len``, ``kv_committed_len``, ``kv_allocated_len``.

    Slots are request-pool slots ``1..max_slots``; slot 0 is the padding row and never opens.
    Counters live on the host (CPU tensors, shared with NumPy views for the per-round hot
    path): the ledger is host state, never device state.

    With ``validate=False`` (production) the per-round mutators check only what a bad result
    could break — a commit past the reservation, a negative run, a shrinking reservation — with
    one vectorized comparison; the per-row checks (closed or repeated slots, the full ordering)
    run when ``validate`` is on (tests, ``check_invariants``).

    Invariant: see the module docstring; every mutator validates the change first and writes
    only if it is legal, so a raised error leaves the ledger unchanged.
    """

    def __init__(
        self,
        max_slots: int,
        row_width: int,
        *,
        checker: OwnershipChecker,
        validate: bool = True,
    ) -> None:
        if max_slots < 1 or row_width < 1:
            raise LedgerViolation(
                f"ledger needs max_slots >= 1 and row_width >= 1, got {max_slots}, {row_width}"
            )
        size = max_slots + 1
        self._row_width = row_width
        self._checker = checker
        self._cache_protected = torch.zeros(size, dtype=_INDEX_DTYPE)
        self._kv_committed = torch.zeros(size, dtype=_INDEX_DTYPE)
        self._kv_allocated = torch.zeros(size, dtype=_INDEX_DTYPE)
        # NumPy views of the same memory: one host op costs ~1 µs here, a torch op ~4 µs.
        self._kv_committed_host = self._kv_committed.numpy()
        self._kv_allocated_host = self._kv_allocated.numpy()
        self._cache_protected_host = self._cache_protected.numpy()
        self._is_open = torch.zeros(size, dtype=torch.bool)
        self._is_open_host = self._is_open.numpy()
        self._request_ids: list[str | None] = [None] * size
        self._validate = validate

    # ------------------------------------------------------------------ reads
    @property
    def row_width(self) -> int:
        """Width of a `req_to_token` row: the largest legal ``kv_allocated_len``."""
        return self._row_width

    @property
    def max_slots(self) -> int:
        """Number of request slots (slot 0, the padding row, excluded)."""
        return len(self._request_ids) - 1

    def committed(self, slots: torch.Tensor) -> torch.Tensor:
        """``kv_committed_len`` of ``slots`` (a new int64 tensor)."""
        return self._kv_committed.index_select(0, slots)

    def allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """``kv_allocated_len`` of ``slots`` (a new int64 tensor)."""
        return self._kv_allocated.index_select(0, slots)

    def protected(self, slots: torch.Tensor) -> torch.Tensor:
        """``cache_protected_len`` of ``slots`` (a new int64 tensor)."""
        return self._cache_protected.index_select(0, slots)

    def host_lengths(
        self, slots: npt.NDArray[np.int64]
    ) -> tuple[npt.NDArray[np.int64], npt.NDArray[np.int64]]:
        """``(kv_committed_len, kv_allocated_len)`` of ``slots`` as new host arrays."""
        return self._kv_committed_host[slots], self._kv_allocated_host[slots]

    def host_protected(self, slots: npt.NDArray[np.int64]) -> npt.NDArray[np.int64]:
        """``cache_protected_len`` of ``slots`` as a new host array."""
        return self._cache_protected_host[slots]

    def is_open(self, slot: int) -> bool:
        """True when ``slot`` holds a live request's entry."""
        return 0 < slot < len(self._request_ids) and self._request_ids[slot] is not None

    def request_id(self, slot: int) -> str:
        """The request holding ``slot``; `LedgerViolation` if the slot is closed."""
        rid = self._request_ids[slot] if 0 < slot < len(self._request_ids) else None
        if rid is None:
            raise LedgerViolation(f"slot {slot} holds no request")
        return rid

    def snapshot(self, slot: int) -> KvLedgerSnapshot:
        """The frozen entry of one open slot."""
        return KvLedgerSnapshot(
            slot=slot,
            request_id=self.request_id(slot),
            cache_protected_len=int(self._cache_protected[slot]),
            kv_committed_len=int(self._kv_committed[slot]),
            kv_allocated_len=int(self._kv_allocated[slot]),
            row_width=self._row_width,
        )

    def batch_snapshot(self) -> LedgerBatchSnapshot:
        """The frozen entries of every open slot, in slot order."""
        slots = [s for s, rid in enumerate(self._request_ids) if rid is not None]
        return LedgerBatchSnapshot(
            row_width=self._row_width, entries=tuple(self.snapshot(s) for s in slots)
        )

    def views(self) -> LedgerViews:
        """The typed view each role is handed."""
        return LedgerViews(
            scheduler=self, allocator=self, worker=self, result_processor=self, future_map=self
        )

    # --------------------------------------------------------------- mutators
    def open_slot(self, slot: int, request_id: str) -> None:
        """Start the entry of ``request_id`` in a closed slot, all counters 0 (allocator)."""
        self._checker.require((Role.ALLOCATOR,), counter="ledger slot", request=request_id)
        if not 0 < slot < len(self._request_ids):
            raise LedgerViolation(
                f"request {request_id}: slot {slot} outside 1..{len(self._request_ids) - 1}"
            )
        holder = self._request_ids[slot]
        if holder is not None:
            raise LedgerViolation(f"request {request_id}: slot {slot} is held by {holder}")
        self._request_ids[slot] = request_id
        self._is_open[slot] = True

    def close_slot(self, slot: int) -> KvLedgerSnapshot:
        """End one slot's entry, zeroing its counters; returns the entry as it was (allocator)."""
        before = self.snapshot(slot)
        self._checker.require((Role.ALLOCATOR,), counter="ledger slot", request=before.request_id)
        self._cache_protected[slot] = 0
        self._kv_committed[slot] = 0
        self._kv_allocated[slot] = 0
        self._is_open[slot] = False
        self._request_ids[slot] = None
        return before

    def close_slots(self, slots: torch.Tensor) -> None:
        """End several open slots' entries, zeroing their counters (allocator); vectorized.

        Raises:
            LedgerViolation: a slot is closed or out of range; nothing changes.
        """
        if self._checker.enabled:
            self._checker.require(
                (Role.ALLOCATOR,), counter="ledger slot", request=self._names(slots)
            )
        if slots.numel() == 0:
            return
        if self._validate:
            self._require_open(slots, slots)
        s = slots.numpy()
        self._cache_protected_host[s] = 0
        self._kv_committed_host[s] = 0
        self._kv_allocated_host[s] = 0
        self._is_open_host[s] = False
        ids = self._request_ids
        for slot in s.tolist():
            ids[slot] = None

    def set_protected(self, slot: int, num_tokens: int) -> None:
        """Set ``cache_protected_len`` of one slot after a prefix match (scheduler)."""
        rid = self.request_id(slot)
        self._checker.require((Role.SCHEDULER,), counter="cache_protected_len", request=rid)
        committed = int(self._kv_committed[slot])
        if not 0 <= num_tokens <= committed:
            raise LedgerViolation(
                f"request {rid}: cache_protected_len {num_tokens} outside 0..committed {committed}"
            )
        self._cache_protected[slot] = num_tokens

    def commit_extend(self, slots: torch.Tensor, extend_ends: torch.Tensor) -> None:
        """Set ``kv_committed_len`` to the end of this extend (scheduler, prepare-for-extend).

        The extend's KV slots must already be allocated; committed never moves backwards.
        """
        self._checker.require(
            (Role.SCHEDULER,), counter="kv_committed_len", request=self._names(slots)
        )
        self._require_open(slots, extend_ends)
        old = self._kv_committed.index_select(0, slots)
        self._check_not_below(slots, extend_ends, old, "kv_committed_len")
        self._check_order(slots, committed=extend_ends)
        self._kv_committed.index_copy_(0, slots, extend_ends)

    def advance_committed(self, slots: Counts, num_tokens: Counts) -> None:
        """Add each accepted run's length to ``kv_committed_len`` (result processor only).

        Raises:
            ReservationExceeded: a commit would pass ``kv_allocated_len``; nothing changes.
            LedgerViolation: a negative run length, a closed or duplicated slot.
        """
        if self._checker.enabled:
            self._checker.require(
                (Role.RESULT_PROCESSOR,),
                counter="kv_committed_len",
                request=self._names(_tensor(slots)),
            )
        if not self._validate:
            s, n = _host(slots), _host(num_tokens)
            if s.shape == n.shape:
                new_host = self._kv_committed_host[s] + n
                # A closed slot has allocated 0, so it fails this check too.
                if not np.count_nonzero((n < 0) | (new_host > self._kv_allocated_host[s])):
                    self._kv_committed_host[s] = new_host
                    return
        slots, num_tokens = _tensor(slots), _tensor(num_tokens)
        self._require_open(slots, num_tokens)
        zeros = torch.zeros_like(num_tokens)
        self._check_not_below(slots, num_tokens, zeros, "committed run length")
        new = self._kv_committed.index_select(0, slots) + num_tokens
        self._check_order(slots, committed=new, delta=num_tokens)
        self._kv_committed.index_copy_(0, slots, new)

    def grow_allocated(self, slots: Counts, new_allocated: Counts) -> None:
        """Raise ``kv_allocated_len`` of ``slots`` to ``new_allocated`` (allocator only).

        The reservation never shrinks while the request lives; equal values are a no-op.
        """
        if self._checker.enabled:
            self._checker.require(
                (Role.ALLOCATOR,), counter="kv_allocated_len", request=self._names(_tensor(slots))
            )
        if not self._validate:
            s, new_host = _host(slots), _host(new_allocated)
            if s.shape == new_host.shape:
                bad = (new_host < self._kv_allocated_host[s]) | (new_host > self._row_width)
                if not np.count_nonzero(bad):
                    self._kv_allocated_host[s] = new_host
                    return
        slots, new_allocated = _tensor(slots), _tensor(new_allocated)
        self._require_open(slots, new_allocated)
        old = self._kv_allocated.index_select(0, slots)
        self._check_not_below(slots, new_allocated, old, "kv_allocated_len")
        self._check_order(slots, allocated=new_allocated)
        self._kv_allocated.index_copy_(0, slots, new_allocated)

    # ------------------------------------------------------------- validation
    def _names(self, slots: torch.Tensor) -> str:
        ids = [
            str(self._request_ids[s]) for s in slots.tolist()[:4] if 0 <= s < len(self._request_ids)
        ]
        more = "" if slots.numel() <= 4 else f" (+{slots.numel() - 4} more)"
        return ", ".join(ids) + more

    def _require_open(self, slots: torch.Tensor, values: torch.Tensor) -> None:
        if slots.dim() != 1 or values.shape != slots.shape:
            raise LedgerViolation(
                f"slots {tuple(slots.shape)} and values {tuple(values.shape)} must be equal 1-D"
            )
        if slots.numel() == 0:
            return
        in_range = (slots > 0) & (slots < len(self._request_ids))
        if not bool(in_range.all()):
            bad = int(slots[~in_range][0])
            raise LedgerViolation(f"slot {bad} outside 1..{len(self._request_ids) - 1}")
        is_open = self._is_open.index_select(0, slots)
        if not bool(is_open.all()):
            raise LedgerViolation(f"slot {int(slots[~is_open][0])} holds no request")
        if torch.unique(slots).numel() != slots.numel():
            raise LedgerViolation(f"duplicate slots in one batch update: {slots.tolist()}")

    def _check_not_below(
        self, slots: torch.Tensor, new: torch.Tensor, floor: torch.Tensor, what: str
    ) -> None:
        below = new < floor
        if bool(below.any()):
            i = int(below.nonzero()[0, 0])
            slot = int(slots[i])
            raise LedgerViolation(
                f"request {self._request_ids[slot]}: {what} would move from {int(floor[i])} "
                f"down to {int(new[i])}"
            )

    def _check_order(
        self,
        slots: torch.Tensor,
        *,
        committed: torch.Tensor | None = None,
        allocated: torch.Tensor | None = None,
        delta: torch.Tensor | None = None,
    ) -> None:
        """Raise unless the candidate counters keep the ordering invariant for ``slots``."""
        prot = self._cache_protected.index_select(0, slots)
        comm = self._kv_committed.index_select(0, slots) if committed is None else committed
        alloc = self._kv_allocated.index_select(0, slots) if allocated is None else allocated
        ok = (prot <= comm) & (comm <= alloc) & (alloc <= self._row_width)
        if bool(ok.all()):
            return
        i = int((~ok).nonzero()[0, 0])
        rid = self._request_ids[int(slots[i])]
        c, a, p = int(comm[i]), int(alloc[i]), int(prot[i])
        if delta is not None and c > a:
            raise ReservationExceeded(
                f"request {rid}: commit of {int(delta[i])} tokens would pass allocated {a} "
                f"(committed {c - int(delta[i])})"
            )
        if committed is not None and c > a:
            raise ReservationExceeded(f"request {rid}: committed {c} would pass allocated {a}")
        raise LedgerViolation(
            f"request {rid}: 0 <= protected {p} <= committed {c} <= allocated {a} "
            f"<= row width {self._row_width} would not hold"
        )
