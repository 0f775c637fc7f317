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

Plain rows: when every row samples with temperature, top-k and top-p only (no penalty, seed,
``min_new_tokens``, logprobs, or ``speculative=False``: `PlainRows`), the slots, epochs and
sampling values live in two packed host arrays, and the columns are views of them (on a device,
one copy each). A change then copies the two arrays and writes the changed rows: a few NumPy
operations, instead of a torch copy and write per column. Any other row takes the general path
(every column patched as tensors). With ``check_invariants``, every patched set of columns is
compared with a fresh build (``decode-rows``).

The relay follows the same rows: the batch carries the host copy of its slots and a
`RowPatch` (where each new row comes from, built here at scheduling), and the FutureMap reads
each row from the write that holds it (`specstate.relay.write_log`): one gather per relayed
tensor from the previous round's write, plus the joined rows from their own prefill's write.

Invariant: row ``i`` of every column describes ``reqs[i]``; every running request has exactly
one row after `DecodeRows.columns`; a request that left never keeps its row (a re-admitted
request gets a fresh row with its new slot and epoch).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import repeat
from typing import Final, TypeVar

import attrs
import numpy as np
import torch

from specstate.core.errors import InvariantViolation
from specstate.core.request import Req
from specstate.engine.schedule.decode_columns import DecodeColumns, PlainRows, plain_columns
from specstate.engine.settle.outputs import IntArray
from specstate.relay.write_log import RowPatch

__all__ = ["DecodeRows", "DecodeRowsSnapshot"]

_T = TypeVar("_T")
_HOST: Final = torch.device("cpu")


@attrs.frozen(kw_only=True)
class DecodeRowsSnapshot:
    """Counters of a `DecodeRows` owner."""

    num_rows: int
    num_rebuilds: int
    num_patches: int
    num_rows_written: int
    num_plain_patches: int = 0
    """Patches of plain rows (one packed host array; `PlainRows`)."""


class DecodeRows:
    """Owner of the persistent decode rows; see the module docstring.

    Args:
        build: the columns of requests that join (or of every running request, the first
            time); called with the requests in row order.
        plain: the host values of requests that join, or None when one of them is not plain
            (its columns then come from ``build``); None: never patch host values.
        device: where the columns' device tensors live.
        reference: checking mode: the columns of a set of requests built from scratch; every
            patched set of columns is compared with it (``decode-rows``).
    """

    def __init__(
        self,
        build: Callable[[tuple[Req, ...]], DecodeColumns],
        plain: Callable[[tuple[Req, ...]], PlainRows | None] | None = None,
        device: torch.device | None = None,
        *,
        reference: Callable[[tuple[Req, ...]], DecodeColumns] | None = None,
    ) -> None:
        self._build = build
        self._reference = reference
        self._plain = plain
        self._device = torch.device("cpu") if device is None else device
        self._columns: DecodeColumns | None = None
        self._row_of: dict[Req, int] = {}  # a Req hashes by identity
        self._left: list[int] = []  # rows freed since the columns were built
        self._joined: list[Req] = []
        self._num_rebuilds = self._num_patches = self._num_rows_written = 0
        self._num_plain_patches = 0
        # Since the last decode round's columns (the relay's base): for each row that differs
        # from the base's same row, the base row it copies (moved) or None (joined); and the
        # base rows whose request left. Patches between two rounds compose here.
        self._relayed: DecodeColumns | None = None
        self._origin: dict[int, int | None] = {}
        self._departed: list[int] = []
        self._rebuilt = False
        self._same: tuple[DecodeColumns, RowPatch] | None = None  # the no-change patch

    def join(self, req: Req) -> None:
        """``req`` decodes from the next round on."""
        if self._columns is not None:
            self._joined.append(req)

    def leave(self, req: Req) -> None:
        """``req`` stops decoding (it ended, or was retracted); its row is freed."""
        self.leave_many((req,))

    def leave_many(self, reqs: Sequence[Req]) -> None:
        """`leave` for several requests (their rows found in one C loop)."""
        rows = list(map(self._row_of.pop, reqs, repeat(None)))
        self._left.extend([row for row in rows if row is not None])
        if None in rows:  # rare: some joined and left before a round used them
            for req, row in zip(reqs, rows, strict=True):
                if row is None and req in self._joined:
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
            if self._reference is not None:
                _check_columns(cols, self._reference(cols.reqs))
        self._columns = cols
        return cols

    def running_slots(self, slot_of: Callable[[Req], int]) -> IntArray | None:
        """The host slots of the requests the next round decodes (the rows left out, the
        joiners added), without patching the columns; None before the first build."""
        cols = self._columns
        if cols is None:
            return None
        slots = cols.slots_host
        if self._left:
            slots = _without(slots, np.array(self._left, dtype=np.int64))
        if self._joined:
            joined = np.array([slot_of(r) for r in self._joined], dtype=np.int64)
            slots = np.concatenate([slots, joined])
        return slots

    def relay_patch(self, cols: DecodeColumns) -> RowPatch | None:
        """How ``cols`` (about to launch as a decode round) derive from the last round's.

        None when they do not derive from them by one patch (the first round, a rebuild): the
        relay then reads every row from the buffers.
        """
        last, self._relayed = self._relayed, cols
        origin, departed, rebuilt = self._origin, self._departed, self._rebuilt
        self._origin, self._departed, self._rebuilt = {}, [], False
        if last is None or rebuilt:
            return None
        if cols is last:
            return self._unchanged(cols)
        if not origin:  # rows left at the end only: the first rows of the base write
            return _prefix_patch(last, cols, last.slots_host[departed])
        # Row i of the new round reads row gather[i] of the base write (joined rows: their own).
        gather = np.arange(len(cols.reqs), dtype=np.int64)
        joined = sorted([row for row, source in origin.items() if source is None])
        moved = {row: source for row, source in origin.items() if source is not None}
        gather[list(moved)] = list(moved.values())
        joined_rows = np.array(joined, dtype=np.int64)
        gather[joined_rows] = 0
        joined_host = cols.slots_host[joined_rows]
        gather_t, rows_t, joined_t = _on_device(
            (gather, joined_rows, joined_host), cols.device_slots.device
        )
        return RowPatch(  # device tensors built now, at scheduling: the launch copies nothing
            base=last.device_slots,
            host=cols.slots_host,
            gather=gather_t,
            kept_host=_without(cols.slots_host, joined_rows) if joined else cols.slots_host,
            joined_rows=rows_t,
            joined=joined_t,
            joined_host=joined_host,
            departed_host=last.slots_host[departed],
        )

    def snapshot(self) -> DecodeRowsSnapshot:
        """The row count and how the columns changed so far."""
        return DecodeRowsSnapshot(
            num_rows=0 if self._columns is None else len(self._columns.reqs),
            num_rebuilds=self._num_rebuilds,
            num_patches=self._num_patches,
            num_rows_written=self._num_rows_written,
            num_plain_patches=self._num_plain_patches,
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
        self._num_patches += 1
        self._num_rows_written += len(targets) + len(fill)
        origin = self._origin
        # Where each row's relay value came from (None: a joiner's own); C-level loops.
        self._departed += [r for r in map(origin.pop, holes, holes) if r is not None]
        if targets:  # rows that moved down (sources and targets are disjoint)
            self._row_of.update(zip(map(cols.reqs.__getitem__, sources), targets, strict=True))
            origin.update(zip(targets, list(map(origin.pop, sources, sources)), strict=True))
        for req, row in zip(joiners, fill, strict=True):
            self._row_of[req] = row
            origin[row] = None
        if size == 0:
            return self._build(())
        if cols.plain is not None and self._plain is not None:
            new_plain = self._plain(joiners) if joiners else _NO_ROWS
            if new_plain is not None:
                self._num_plain_patches += 1
                return self._patched_plain(cols, cols.plain, size, targets, sources, fill,
                                           joiners, new_plain)  # fmt: skip
        dst = np.array(targets + fill, dtype=np.int64)
        src = np.array(sources, dtype=np.int64)
        new = self._build(joiners) if joiners else None
        return _patched(cols, size, dst, src, new)

    def _patched_plain(
        self,
        cols: DecodeColumns,
        old: PlainRows,
        size: int,
        targets: list[int],
        sources: list[int],
        fill: list[int],
        joiners: tuple[Req, ...],
        new: PlainRows,
    ) -> DecodeColumns:
        """Plain rows: the host values patched (one copy each, the changed columns written)."""
        keep = min(size, old.size)
        rows = PlainRows.empty(size)
        ints, floats = rows.ints, rows.floats
        old_ints, old_floats = old.ints, old.floats
        ints[:, :keep] = old_ints[:, :keep]
        floats[:, :keep] = old_floats[:, :keep]
        if targets:
            ints[:, targets] = old_ints[:, sources]
            floats[:, targets] = old_floats[:, sources]
        if fill:
            ints[:, fill] = new.ints
            floats[:, fill] = new.floats
        reqs, incs, ids = cols.reqs, cols.incarnations, cols.request_ids
        out_reqs, out_incs, out_ids = list(reqs[:keep]), list(incs[:keep]), list(ids[:keep])
        for row, source in zip(targets, sources, strict=True):
            out_reqs[row], out_incs[row], out_ids[row] = reqs[source], incs[source], ids[source]
        for row, req, inc in zip(fill, joiners, Req.incarnations_of(joiners), strict=True):
            if row < keep:
                out_reqs[row], out_incs[row], out_ids[row] = req, inc, req.request_id
            else:  # appended rows come in row order
                out_reqs.append(req)
                out_incs.append(inc)
                out_ids.append(req.request_id)
        return plain_columns(
            tuple(out_reqs),
            tuple(out_incs),
            tuple(out_ids),
            rows,
            self._device,
        )

    def _unchanged(self, cols: DecodeColumns) -> RowPatch:
        cached = self._same
        if cached is not None and cached[0] is cols:
            return cached[1]
        patch = _prefix_patch(cols, cols, np.zeros(0, dtype=np.int64))
        self._same = (cols, patch)
        return patch


def _on_device(arrays: tuple[IntArray, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """1-D host ``arrays`` as tensors on ``device``: views of the arrays on the host, else
    views of one host-to-device copy of them all."""
    if device == _HOST:
        return tuple(map(torch.from_numpy, arrays))
    moved = torch.from_numpy(np.concatenate(arrays)).to(device)
    ends = np.cumsum([a.size for a in arrays]).tolist()
    return tuple(moved[start:end] for start, end in zip([0, *ends], ends, strict=False))


def _prefix_patch(base: DecodeColumns, cols: DecodeColumns, departed: IntArray) -> RowPatch:
    """``cols`` are the first rows of ``base`` (all of them, or fewer: the last rows left):
    no gather, nobody joined; ``departed`` are the slots of the requests that left."""
    empty = cols.device_slots[:0]  # a view with no rows: nothing allocated or launched
    return RowPatch(
        base=base.device_slots,
        host=cols.slots_host,
        gather=None,
        kept_host=cols.slots_host,
        joined_rows=empty,
        joined=empty,
        joined_host=np.zeros(0, dtype=np.int64),
        departed_host=departed,
    )


def _without(values: IntArray, rows: IntArray) -> IntArray:
    """``values`` without the entries at ``rows`` (a mask: `np.delete` costs far more)."""
    keep = np.ones(values.size, dtype=np.bool_)
    keep[rows] = False
    return values[keep]


_NO_ROWS: Final = PlainRows.empty(0)


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


_NEUTRAL: Final = {
    "frequency_penalties": 0.0,
    "repetition_penalties": 1.0,
    "presence_penalties": 0.0,
    "min_new_tokens": 0,
    "seeds": -1,
    "speculative": True,
}


def _check_columns(cols: DecodeColumns, ref: DecodeColumns) -> None:
    """``decode-rows`` (checking mode): patched columns equal the columns built from scratch.

    Compares the slots, incarnations, ids, epochs and every per-row sampling value that
    decides a token (a missing optional tensor counts as its neutral value).
    """
    problems = []
    if cols.reqs != ref.reqs or cols.incarnations != ref.incarnations:
        problems.append("requests or incarnations")
    if cols.request_ids != ref.request_ids:
        problems.append("request ids")
    for name, got, want in (
        ("slots", cols.slots_host, ref.slots_host),
        ("slots tensor", cols.slots.numpy(), ref.slots_host),
        ("device slots", cols.device_slots.cpu().numpy(), ref.slots_host),
        ("epochs", cols.epochs, ref.epochs),
    ):
        if not np.array_equal(got, want):
            problems.append(name)
    a, b = cols.sampling, ref.sampling
    for name in ("temperatures", "top_ks", "top_ps", *_NEUTRAL):
        x, y = getattr(a, name), getattr(b, name)
        if x is None and y is None:
            continue
        rows = len(cols.reqs)
        x = torch.full((rows,), _NEUTRAL[name]) if x is None else x.cpu()
        y = torch.full((rows,), _NEUTRAL[name]) if y is None else y.cpu()
        if not torch.equal(x.to(torch.float64), y.to(torch.float64)):
            problems.append(f"sampling.{name}")
    if b.greedy_host is not None and a.greedy_host not in (None, b.greedy_host):
        problems.append("sampling.greedy_host")
    spec = [True] * len(cols.reqs) if a.speculative_host is None else a.speculative_host.tolist()
    if (
        spec != [r.sampling.speculative for r in cols.reqs]
        or (b.logprobs and not a.logprobs)
        or b.top_logprobs > a.top_logprobs
    ):
        problems.append("sampling.speculative_host, logprobs or top_logprobs")
    if problems:
        raise InvariantViolation(
            "decode-rows",
            f"patched decode rows of {len(cols.reqs)} requests differ from a fresh build in "
            f"{', '.join(problems)}",
        )
