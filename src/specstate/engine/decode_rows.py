"""The decode rows own the running batch's per-row columns; a change writes only changed rows.

`DecodeRows` keeps the columns of the requests that decode (slots, sampling tensors, output-row
epochs, ids) from one round to the next, in the pattern of vLLM's persistent ``InputBatch``.
Rows stay where they are: a request that leaves frees its row, a request that joins takes the
lowest free row, and when fewer join than leave, the last rows move down into the remaining
free rows (*condense*), so the batch stays dense::

    round N     [A B C D E]          C and E leave, F joins
    round N+1   [A B F D]            F takes C's row; E's row was the last one: dropped
    round N+2   [A G F D H]          G takes nothing from anyone: B left, G and H joined
                                     (G in B's row, H appended)

Why it is safe under overlap: a batch launched from round N's columns may still be read (its
forward, its isolation snapshot, its settlement) while round N+1 is built. So no column is ever
written in place: a change copies each column once and writes the changed rows into the copy
(copy-on-write), and the batch of round N keeps the tensors it was built with. A round with no
change reuses the columns themselves (and the FutureMap then relays by reference). The cost of
a change is one contiguous copy per column plus work proportional to the rows that changed;
Python touches only the requests that left or joined.

The relay follows the same rows: the batch carries the host copy of its slots, and the
FutureMap reads each row from the write that holds it (`specstate.relay.write_log`), so the
unchanged rows come from the previous round's tensors and only the changed rows move.

Invariant: row ``i`` of every column describes ``reqs[i]``; every running request has exactly
one row after `DecodeRows.columns`; a request that left never keeps its row (a re-admitted
request gets a fresh row with its new slot and epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TypeVar

import attrs
import numpy as np
import torch

from specstate.batch.sampling import SamplingInfo
from specstate.core.request import Req
from specstate.engine.outputs import IntArray
from specstate.relay.future_map import RowPatch

__all__ = ["DecodeColumns", "DecodeRows", "DecodeRowsSnapshot"]

_T = TypeVar("_T")


@attrs.frozen(kw_only=True)
class DecodeColumns:
    """The per-row columns of one set of decoding requests (one row per request, in order)."""

    reqs: tuple[Req, ...]
    slots: torch.Tensor
    slots_host: IntArray  # the same memory as ``slots``
    device_slots: torch.Tensor
    incarnations: tuple[int, ...]
    sampling: SamplingInfo
    epochs: IntArray
    request_ids: tuple[str, ...]


@attrs.frozen(kw_only=True)
class DecodeRowsSnapshot:
    """Counters of a `DecodeRows` owner."""

    num_rows: int
    num_rebuilds: int
    num_patches: int
    num_rows_written: int


class DecodeRows:
    """Owner of the persistent decode rows; see the module docstring.

    Args:
        build: the columns of requests that join (or of every running request, the first
            time); called with the requests in row order.
    """

    def __init__(self, build: Callable[[tuple[Req, ...]], DecodeColumns]) -> None:
        self._build = build
        self._columns: DecodeColumns | None = None
        self._row_of: dict[Req, int] = {}  # a Req hashes by identity
        self._left: list[int] = []  # rows freed since the columns were built
        self._joined: list[Req] = []
        self._num_rebuilds = self._num_patches = self._num_rows_written = 0
        # Since the last decode round's columns (the relay's base): for each row that differs
        # from the base's same row, the base row it copies (moved) or None (joined); and the
        # base rows whose request left. Patches between two rounds compose here.
        self._relayed: DecodeColumns | None = None
        self._origin: dict[int, int | None] = {}
        self._departed: list[int] = []
        self._rebuilt = False
        self._empty: torch.Tensor | None = None
        self._same: tuple[DecodeColumns, RowPatch] | None = None  # the no-change patch

    def join(self, req: Req) -> None:
        """``req`` decodes from the next round on."""
        if self._columns is not None:
            self._joined.append(req)

    def leave(self, req: Req) -> None:
        """``req`` stops decoding (it ended, or was retracted); its row is freed."""
        row = self._row_of.pop(req, None)
        if row is not None:
            self._left.append(row)
        elif req in self._joined:  # joined and left before a round used it
            self._joined.remove(req)

    def columns(self, running: Callable[[], tuple[Req, ...]]) -> DecodeColumns:
        """The columns of the running requests; ``running`` lists them (first build only)."""
        cols = self._columns
        if cols is not None and not self._left and not self._joined:
            return cols
        if cols is None or cols.sampling.accumulator is not None:
            cols = self._rebuild(running())
        else:
            cols = self._patch(cols)
        self._columns = cols
        return cols

    def relay_patch(self, cols: DecodeColumns) -> RowPatch | None:
        """How ``cols`` (about to launch as a decode round) derive from the last round's.

        None when they do not derive from them by one patch (the first round, a rebuild, two
        changes in between): the relay then reads every row from the buffers.
        """
        last, self._relayed = self._relayed, cols
        origin, departed, rebuilt = self._origin, self._departed, self._rebuilt
        self._origin, self._departed, self._rebuilt = {}, [], False
        if last is None or rebuilt:
            return None
        if cols is last:
            return self._unchanged(cols)
        rows = sorted(origin)
        moved = [r for r in rows if origin[r] is not None]
        joined = [r for r in rows if origin[r] is None]
        device = cols.device_slots.device
        rows_host = np.array(moved + joined, dtype=np.int64)
        joined_host = cols.slots_host[np.array(joined, dtype=np.int64)]
        departed_host = np.array(departed, dtype=np.int64)
        return RowPatch(  # device tensors built now, at scheduling: the launch copies nothing
            base=last.device_slots,
            host=cols.slots_host,
            rows=torch.from_numpy(rows_host).to(device),
            rows_host=rows_host,
            num_moved=len(moved),
            moved_from=torch.tensor([origin[r] for r in moved], dtype=torch.int64, device=device),
            joined=torch.from_numpy(joined_host).to(device),
            joined_host=joined_host,
            departed=torch.from_numpy(departed_host).to(device),
            departed_host=departed_host,
        )

    def snapshot(self) -> DecodeRowsSnapshot:
        """The row count and how the columns changed so far."""
        return DecodeRowsSnapshot(
            num_rows=0 if self._columns is None else len(self._columns.reqs),
            num_rebuilds=self._num_rebuilds,
            num_patches=self._num_patches,
            num_rows_written=self._num_rows_written,
        )

    def _rebuild(self, reqs: tuple[Req, ...]) -> DecodeColumns:
        self._num_rebuilds += 1
        self._rebuilt = True
        self._left, self._joined = [], []
        self._row_of = dict(zip(reqs, range(len(reqs)), strict=True))
        return self._build(reqs)

    def _patch(self, cols: DecodeColumns) -> DecodeColumns:
        """Refill freed rows with joiners, condense the rest; copy each column once."""
        n = len(cols.reqs)
        holes = sorted(self._left)
        joiners = tuple(self._joined)
        self._left, self._joined = [], []
        size = n - len(holes) + len(joiners)
        fill = holes[: len(joiners)] + list(range(n, n + max(0, len(joiners) - len(holes))))
        # Condense: the last live rows move down into the free rows below the new size.
        free = set(holes)
        targets = [h for h in holes[len(joiners) :] if h < size]
        sources = [r for r in range(size, n) if r not in free]
        dst = np.array(targets + fill, dtype=np.int64)
        src = np.array(sources, dtype=np.int64)
        self._num_patches += 1
        self._num_rows_written += dst.size
        origin = self._origin
        for row in holes:
            base_row = origin.pop(row, row)
            if base_row is not None:
                self._departed.append(base_row)
        for row, source in zip(targets, sources, strict=True):
            self._row_of[cols.reqs[source]] = row
            origin[row] = origin.pop(source, source)
        for req, row in zip(joiners, fill, strict=True):
            self._row_of[req] = row
            origin[row] = None
        if size == 0:
            return self._build(())
        new = self._build(joiners) if joiners else None
        return _patched(cols, size, dst, src, new)

    def _empty_like(self, cols: DecodeColumns) -> torch.Tensor:
        if self._empty is None or self._empty.device != cols.device_slots.device:
            self._empty = cols.device_slots.new_zeros(0)
        return self._empty

    def _unchanged(self, cols: DecodeColumns) -> RowPatch:
        cached = self._same
        if cached is not None and cached[0] is cols:
            return cached[1]
        empty = self._empty_like(cols)
        none = np.zeros(0, dtype=np.int64)
        patch = RowPatch(
            base=cols.device_slots,
            host=cols.slots_host,
            rows=empty,
            rows_host=none,
            num_moved=0,
            moved_from=empty,
            joined=empty,
            joined_host=none,
            departed=empty,
            departed_host=none,
        )
        self._same = (cols, patch)
        return patch


def _patched(
    cols: DecodeColumns, size: int, dst: IntArray, src: IntArray, new: DecodeColumns | None
) -> DecodeColumns:
    """``cols``' first ``size`` rows, rows ``dst`` set to rows ``src`` then ``new``'s rows."""
    index = torch.from_numpy(src)

    def tensor(old: torch.Tensor, joined: torch.Tensor | None) -> torch.Tensor:
        moved = old.index_select(0, index.to(old.device))
        values = moved if joined is None else torch.cat([moved, joined])
        if size <= old.shape[0]:
            out = old[:size].clone()
        else:
            out = old.new_empty((size, *old.shape[1:]))
            out[: old.shape[0]] = old
        return out.index_copy_(0, torch.from_numpy(dst).to(old.device), values)

    def array(old: IntArray, joined: IntArray | None) -> IntArray:
        out = np.empty(size, dtype=old.dtype)
        keep = min(size, old.size)
        out[:keep] = old[:keep]
        moved = old[src]
        out[dst] = moved if joined is None else np.concatenate([moved, joined])
        return out

    def values(old: tuple[_T, ...], joined: Sequence[_T]) -> tuple[_T, ...]:
        out: list[_T] = list(old[:size])
        out.extend(joined[: max(0, size - len(out))])  # placeholders, overwritten below
        moved = [old[s] for s in src.tolist()]
        for row, value in zip(dst.tolist(), moved + list(joined), strict=True):
            out[row] = value
        return tuple(out)

    slots = tensor(cols.slots, None if new is None else new.slots)
    moved_sampling = cols.sampling.select(
        index.to(cols.sampling.temperatures.device), host_rows=src
    )
    sampling_values = moved_sampling if new is None else moved_sampling.concat(new.sampling)
    device_slots = (
        slots
        if cols.device_slots is cols.slots
        else tensor(cols.device_slots, None if new is None else new.device_slots)
    )
    return DecodeColumns(
        reqs=values(cols.reqs, () if new is None else new.reqs),
        slots=slots,
        slots_host=slots.numpy(),
        device_slots=device_slots,
        incarnations=values(cols.incarnations, () if new is None else new.incarnations),
        sampling=cols.sampling.with_rows(
            size,
            torch.from_numpy(dst),
            sampling_values,
            host_rows=dst,
        ),
        epochs=array(cols.epochs, None if new is None else new.epochs),
        request_ids=values(cols.request_ids, () if new is None else new.request_ids),
    )
