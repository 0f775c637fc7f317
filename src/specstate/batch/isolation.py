"""Forward isolation: a worker's changes to the schedule batch never outlive its forward.

The `ForwardIsolator` (scheduler-owned, one per engine) wraps every worker call. Before the
worker runs it takes a *shallow* snapshot of the batch's field bindings and hands the worker a
forward-only copy of the sampling state; on exit — also on exceptions — every binding is put
back by identity. Worker-internal modes (TARGET_VERIFY, DRAFT_EXTEND), verify inputs, temporary
lengths: whatever the worker rebound is rolled back. Only the next-iteration contract is then
recommitted, explicitly, by the scheduler (docs/design.md, "The four boundaries").

A shallow snapshot restores bindings, not contents: it cannot undo an in-place write to a tensor.
That is why nobody writes a scheduler-owned tensor in place (prepare/filter/merge rebind). With
``check`` on (the engine's ``check_invariants``), the scope records the version counter of every
tensor the batch holds (its fields, its sampling state and its relay payload) on entry and
raises `IsolationError` naming the ``isolation`` invariant and the field if one moved on exit:
a worker wrote a scheduler-owned tensor in place.

Under overlap, the device may still read tensors of iteration N while the host rebinds fields
for N+1. A two-slot keep-alive ring pins each isolated batch, its snapshot and the result's
keep-alive refs for two iterations, so the device memory is not recycled under the stream::

    iteration   N-1            N              N+1
    ring slot   [0] = N-1      [1] = N        [0] = N+1 (N-1 released here)

Invariant: after the scope exits, every declared field of the batch (speculative) or its
sampling state (non-speculative) is bound to the very object it was bound to on entry;
attributes that are not declared fields are never touched; non-overlap never writes the ring.
"""

from __future__ import annotations

from types import TracebackType

import attrs
import torch

from specstate.batch.sampling import SamplingInfo
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.errors import SpecStateError
from specstate.relay.future_map import RelayPayload

__all__ = ["ForwardIsolation", "ForwardIsolator", "IsolationError", "KeepAliveRing", "RingEntry"]


class IsolationError(SpecStateError):
    """Misuse of forward isolation: re-entry, nesting on the same batch, or reuse."""


@attrs.frozen
class RingEntry:
    """What one ring slot pins: the batch, its bindings at entry, and the result's refs."""

    batch: ScheduleBatch
    bindings: dict[str, object]
    refs: list[object]


class KeepAliveRing:
    """Pins the last ``size`` isolated batches (and what they reference) under overlap."""

    def __init__(self, size: int = 2) -> None:
        self._slots: list[RingEntry | None] = [None] * size
        self._cursor = -1

    def record(self, batch: ScheduleBatch, bindings: dict[str, object]) -> RingEntry:
        """Pin ``batch`` in the next slot, releasing the oldest entry."""
        self._cursor = (self._cursor + 1) % len(self._slots)
        entry = RingEntry(batch, bindings, [])
        self._slots[self._cursor] = entry
        return entry

    def entries(self) -> tuple[RingEntry | None, ...]:
        """The slots, in slot order (None for an empty slot)."""
        return tuple(self._slots)


class ForwardIsolation:
    """One isolated forward over one batch: single-use and non-reentrant."""

    def __init__(self, isolator: ForwardIsolator, batch: ScheduleBatch, *, speculative: bool):
        self._isolator = isolator
        self._batch = batch
        self._speculative = speculative
        self._state = "new"
        self._bindings: dict[str, object] = {}
        self._entry: RingEntry | None = None
        self._versions: list[tuple[str, torch.Tensor, int]] = []  # check: tensors on entry

    def __enter__(self) -> ForwardIsolation:
        if self._state != "new":
            raise IsolationError(f"forward isolation is single-use (already {self._state})")
        self._isolator._claim(self._batch)
        self._state = "active"
        batch = self._batch
        if self._isolator.check:
            self._versions = [(name, t, t._version) for name, t in _tensors(batch)]
        if self._speculative:
            self._bindings = batch.field_bindings()
        else:
            self._bindings = {"sampling_info": batch.sampling_info}
        batch.sampling_info = batch.sampling_info.copy_for_forward()
        if self._isolator.overlap:
            # NOTE: after the swap, so the forward-only sampling copy is pinned too.
            self._entry = self._isolator.ring.record(batch, self._bindings)
        return self

    def keep_alive(self, refs: tuple[object, ...]) -> None:
        """Pin a result's keep-alive refs with this batch (no-op without overlap)."""
        if self._state != "active":
            raise IsolationError("keep_alive outside an active forward isolation")
        if self._entry is not None:
            self._entry.refs.extend(refs)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        try:
            self._batch.restore_fields(self._bindings)
        finally:
            self._state = "closed"
            self._isolator._release(self._batch)
        if exc is None:  # NOTE: never mask the exception already in flight
            for name, tensor, version in self._versions:
                if tensor._version != version:
                    raise IsolationError(
                        f"[isolation] the scheduler-owned tensor {name} of a batch of "
                        f"{self._batch.batch_size} requests was written in place inside the "
                        f"forward (version {version} -> {tensor._version})"
                    )


class ForwardIsolator:
    """Scheduler-owned factory of forward isolations; owns the keep-alive ring.

    Args:
        overlap: whether the engine overlaps scheduling with the forward (enables the ring).
    """

    def __init__(self, *, overlap: bool, check: bool = False) -> None:
        self.overlap = overlap
        self.check = check
        self.ring = KeepAliveRing()
        self._active: set[int] = set()

    def forward_isolation(self, batch: ScheduleBatch, *, speculative: bool) -> ForwardIsolation:
        """A single-use scope isolating one forward over ``batch``."""
        return ForwardIsolation(self, batch, speculative=speculative)

    def _claim(self, batch: ScheduleBatch) -> None:
        if id(batch) in self._active:
            raise IsolationError(
                f"batch of {batch.batch_size} requests is already inside a forward isolation"
            )
        self._active.add(id(batch))

    def _release(self, batch: ScheduleBatch) -> None:
        self._active.discard(id(batch))


def _tensors(batch: ScheduleBatch) -> list[tuple[str, torch.Tensor]]:
    """Every tensor the batch holds: its fields, its sampling state, its relay payload."""
    found: list[tuple[str, torch.Tensor]] = []
    for name, value in batch.field_bindings().items():
        if isinstance(value, torch.Tensor):
            found.append((name, value))
        elif isinstance(value, SamplingInfo | RelayPayload):
            for field in attrs.fields(type(value)):
                inner = getattr(value, field.name)
                if isinstance(inner, torch.Tensor):
                    found.append((f"{name}.{field.name}", inner))
    return found
