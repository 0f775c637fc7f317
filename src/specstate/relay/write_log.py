"""The write log owns the FutureMap writes kept by reference, and where each slot's value lives.

A relay write (a publish or a stash) is not scattered into the slot-indexed buffers at once: the
log keeps the written tensors and their index tensor as one *entry*. A write that comes with the
host copy of its indices is *stamped*: per slot, the log records which entry holds its latest
value and at which row (``stamp[slot]``, ``row[slot]``; stamp 0 means "in the buffers"). A read
that brings the host copy of its indices then takes each row from wherever its slot's value
lives, without scattering anything::

    entry 7 (decode round N)   rows [A B C D]      stamps A,B,C,D -> 7
    entry 8 (prefill of F)     rows [F]            stamp F -> 8
    read for round N+1         rows [A B F D]      = entry 7's rows [0 1 _ 3], row 2 <- entry 8

So the persistent running batch (rows stay in place, `specstate.engine.schedule.decode_rows`) reads
its unchanged rows from the previous round's tensor and only the changed rows from elsewhere: the
cost is one gather per tensor plus one write of the joined rows into it; with no change at all the
read returns the written tensor itself (no copy). The slots of requests that left the batch
(`RowPatch.departed_host`) are *dead*: their request ended or was retracted, and a slot's next
holder writes it (its prefill) before anything reads it; the read that patches them out only clears
their stamps, so the entry that held them is dropped without a scatter once a later write
supersedes its other rows. Entries are dropped oldest first beyond ``max_entries``; dropping one
scatters only its rows that no later write superseded.

A write without host indices is *unstamped*: the log first moves every earlier entry into the
buffers (order preserved), then keeps the write alone; a read without host indices returns the
newest entry's tensors when it asks for the very same index tensor, and otherwise moves
everything into the buffers and gathers. Either way a read sees exactly what eager writes, in
write order, would have left in the buffers.

Written tensors are never written by the log (a read that changes rows copies first), so the
worker's tensors, the batch that read them and the result that carries them stay as they are.

Invariant: for every slot that is not dead, ``stamp[slot] > 0`` iff its latest write is a
stamped entry still in the log, and that entry holds the value; otherwise the buffers hold it.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

__all__ = ["RowPatch", "WriteLog"]

IntArray = npt.NDArray[np.int64]
Values = tuple[torch.Tensor | None, ...]


@attrs.frozen(kw_only=True, eq=False)
class RowPatch:
    """How a persistent batch's index derives from the previous round's, for the relay.

    Built by the scheduler when it builds the batch (so the device tensors are there before
    the launch, which copies nothing from the host). Row ``i`` of the new index reads row
    ``gather[i]`` of the previous round's write, except the rows ``joined_rows``, which read
    the joined slots' own values.

    Attributes:
        base: the previous round's index tensor (the relay's write for it is the source).
        host: the new index, on the host.
        gather: ``[n]`` device: the ``base`` row each new row reads (any row for a joined
            one); None when nothing changed but rows left at the end (the new rows are the
            first ``n`` of ``base``).
        kept_host: the slots of the rows that read the write of ``base`` (host).
        joined_rows: ``[j]`` device: the rows whose request joined.
        joined: ``[j]`` device: their slots.
        joined_host: ``joined`` on the host.
        departed_host: the slots of ``base`` rows whose request left: their relayed values
            are dead (a slot's next holder writes before anything reads it).
    """

    base: torch.Tensor
    host: IntArray
    gather: torch.Tensor | None
    kept_host: IntArray
    joined_rows: torch.Tensor
    joined: torch.Tensor
    joined_host: IntArray
    departed_host: IntArray


@attrs.frozen
class _Entry:
    """One kept write: its index tensor, its tensors and, when stamped, its host indices."""

    seq: int
    indices: torch.Tensor
    values: Values
    host: IntArray | None
    size: int


class WriteLog:
    """Writes of one buffer group kept by reference; see the module docstring.

    Args:
        max_slots: rows of the buffers (slot indices are ``[0, max_slots)``).
        max_entries: entries kept before the oldest is moved into the buffers.
    """

    def __init__(self, max_slots: int, *, max_entries: int = 4) -> None:
        self._stamp = np.zeros(max_slots, dtype=np.int64)
        self._entries: list[_Entry] = []  # oldest first
        self._max_entries = max_entries
        self._seq = 0

    @property
    def num_entries(self) -> int:
        """Writes kept by reference now."""
        return len(self._entries)

    def newest(self) -> _Entry | None:
        """The latest kept write, if any."""
        return self._entries[-1] if self._entries else None

    # ----------------------------------------------------------------- writes
    def keep(
        self,
        indices: torch.Tensor,
        values: Values,
        host: IntArray | None,
        buffers: Sequence[torch.Tensor | None],
    ) -> None:
        """Keep a write by reference (``values`` carry every buffer that exists)."""
        if self._entries and self._entries[-1].host is None:
            self._drop_oldest(buffers)  # an unstamped entry is kept alone
        if host is None:
            self.flush(buffers)
        self._seq += 1
        size = host.size if host is not None else int(indices.shape[0])
        entry = _Entry(self._seq, indices, values, host, size)
        self._entries.append(entry)
        if host is not None:
            self._stamp[host] = entry.seq
            entries = self._entries
            if len(entries) == 2 and entries[0].host is host:
                del entries[0]  # the same rows as the previous write (a steady batch): all new
            else:
                self._drop_superseded()
        while len(self._entries) > self._max_entries:
            self._drop_oldest(buffers)

    def write_now(
        self,
        indices: torch.Tensor,
        values: Values,
        host: IntArray | None,
        buffers: Sequence[torch.Tensor | None],
    ) -> None:
        """Scatter a write into the buffers at once (the log is emptied first: write order)."""
        self.flush(buffers)
        _scatter(buffers, indices, values)

    def flush(self, buffers: Sequence[torch.Tensor | None]) -> None:
        """Move every kept write into the buffers, oldest first."""
        while self._entries:
            self._drop_oldest(buffers)

    # ------------------------------------------------------------------ reads
    def read(
        self,
        indices: torch.Tensor,
        host: IntArray | None,
        buffers: Sequence[torch.Tensor | None],
    ) -> Values:
        """The latest values of ``indices`` (new tensors, or a kept write's own tensors)."""
        newest = self.newest()
        if newest is not None and newest.indices is indices:
            return newest.values  # the very same rows, nothing written since: by reference
        stamped = newest is None or newest.host is not None
        if host is not None and stamped and not np.count_nonzero(self._stamp[host]):
            return _gather(buffers, indices)  # nothing kept for these slots
        self.flush(buffers)
        return _gather(buffers, indices)

    def read_patched(
        self, indices: torch.Tensor, patch: RowPatch, buffers: Sequence[torch.Tensor | None]
    ) -> Values:
        """The latest values of ``indices``, built from the write of ``patch.base``.

        Rows that kept their place or moved come from that write; joined rows from wherever
        their slot's latest value lives: one gather per buffer, and one write of the joined
        rows into the new tensor. Falls back to `read` when the stamps show that a later write
        touched a kept row (a mixed batch's tails, say).
        """
        newest = self.newest()
        n = patch.host.size
        if (
            newest is not None
            and newest.indices is patch.base
            and patch.gather is None
            and newest.size == n
        ):
            return newest.values  # unchanged rows, nothing written since: by reference
        entries = self._entries
        at = next(
            (i for i in range(len(entries) - 1, -1, -1) if entries[i].indices is patch.base), -1
        )
        base = entries[at] if at >= 0 else None
        if base is None or base.host is None:
            return self.read(indices, patch.host, buffers)
        joined, own_write = None, False
        if patch.joined_host.size:
            joined, own_write = self._joined_values(patch, buffers)
        # The kept rows' latest values are base's unless a later write touched them: nothing
        # was written since but the joiners' own write, else their stamps say.
        later = len(entries) - 1 - at
        untouched = later == 0 or (later == 1 and own_write)
        if not untouched and np.count_nonzero(self._stamp[patch.kept_host] != base.seq):
            return self.read(indices, None, buffers)
        if joined is not None and any(
            (v is None) != (j is None) for v, j in zip(base.values, joined, strict=True)
        ):
            return self.read(indices, None, buffers)  # the joiners' write lacks an extra
        gather = patch.gather
        values: list[torch.Tensor | None] = []
        for k, value in enumerate(base.values):
            if value is None or gather is None:
                values.append(value if value is None or n == base.size else value[:n])
                continue
            more = None if joined is None else joined[k]
            values.append(_patch_rows(value, gather, patch.joined_rows, more))
        self._forget_departed(base, patch)
        return tuple(values)

    def _joined_values(
        self, patch: RowPatch, buffers: Sequence[torch.Tensor | None]
    ) -> tuple[Values, bool]:
        """Each joined slot's latest value: the buffers, then kept writes in write order; and
        whether they are exactly the newest write (the joiners' prefill), in order."""
        stamps = self._stamp[patch.joined_host]
        entry = self._entries[-1] if self._entries else None
        if (
            entry is not None
            and entry.host is not None
            and entry.host.size == stamps.size
            and not np.count_nonzero(stamps != entry.seq)
            and np.array_equal(entry.host, patch.joined_host)
        ):
            return entry.values, True  # the joiners' own write (their prefill), in their order
        sources = np.unique(stamps).tolist()
        out: list[torch.Tensor | None] = (
            list(_gather(buffers, patch.joined)) if sources[0] == 0 else [None] * len(buffers)
        )
        by_seq = {e.seq: e for e in self._entries}
        for seq in sources:
            if seq == 0:
                continue
            entry = by_seq[seq]
            match = entry.indices[None, :] == patch.joined[:, None]  # device only: no host copy
            hit, at = match.any(1), match.to(torch.int8).argmax(1)
            for k, value in enumerate(entry.values):
                if value is None:
                    continue
                got = value.index_select(0, at)
                prev = out[k]
                if prev is None:
                    out[k] = got
                else:
                    cond = hit.view(-1, *([1] * (got.dim() - 1)))
                    out[k] = torch.where(cond, got.to(prev.dtype), prev)
        return tuple(out), False

    def _forget_departed(self, base: _Entry, patch: RowPatch) -> None:
        """The slots of requests that left stop pointing at ``base``: their values are dead,
        so ``base`` is dropped without a scatter once the next write supersedes its kept rows."""
        slots = patch.departed_host
        if slots.size:
            self._stamp[slots[self._stamp[slots] == base.seq]] = 0

    # ---------------------------------------------------------------- helpers
    def discard_newest(self) -> None:
        """Forget the newest entry without moving it (debug mode: a read consumed it)."""
        entry = self._entries.pop()
        if entry.host is not None:
            self._stamp[entry.host[self._stamp[entry.host] == entry.seq]] = 0

    def _drop_oldest(self, buffers: Sequence[torch.Tensor | None]) -> None:
        """Scatter the oldest entry whole, then forget it.

        Rows that a later write superseded are scattered too: their stamps point to that later
        write, so the buffers' value for them is never read before it lands there.
        """
        entry = self._entries.pop(0)
        _scatter(buffers, entry.indices, entry.values)
        if entry.host is not None:
            slots = entry.host
            self._stamp[slots[self._stamp[slots] == entry.seq]] = 0

    def _drop_superseded(self) -> None:
        """Forget kept writes whose every row a later write replaced (nothing to scatter)."""
        keep = []
        for entry in self._entries[:-1]:
            if entry.host is None or np.count_nonzero(self._stamp[entry.host] == entry.seq):
                keep.append(entry)
        keep.append(self._entries[-1])
        self._entries = keep


def _scatter(buffers: Sequence[torch.Tensor | None], indices: torch.Tensor, values: Values) -> None:
    for buf, value in zip(buffers, values, strict=True):
        if buf is not None and value is not None:
            buf[indices] = value.to(buf.dtype)


def _gather(buffers: Sequence[torch.Tensor | None], indices: torch.Tensor) -> Values:
    """Device work: one gather per buffer."""
    return tuple(None if buf is None else buf[indices] for buf in buffers)


def _patch_rows(
    value: torch.Tensor, gather: torch.Tensor, rows: torch.Tensor, joined: torch.Tensor | None
) -> torch.Tensor:
    """Device work: ``value``'s rows at ``gather``, then ``joined`` written at ``rows`` (into
    the new tensor, not shared yet); one gather and at most one scatter."""
    fresh = value.index_select(0, gather)
    if joined is not None:
        fresh.index_copy_(0, rows, joined.to(fresh.dtype))
    return fresh
