"""Stop sequences of the output table's rows: stored at admission, matched at settlement.

`StopSequences` owns the sequence columns of every row (``seqs[s, q, :]``: stop sequence ``q``
of slot ``s``, left-aligned; ``lens[s, q]`` its length; ``last[s, q]`` its last token, -1
padding). It costs nothing while no open row has a sequence (``num_rows``). Otherwise one mask
finds the accepted tokens that end some row's sequence, and only those candidates are compared
with the stored outputs: a sequence may span rounds, retractions, or end inside a run.
"""

from __future__ import annotations

from typing import Final

import numpy as np
import numpy.typing as npt

__all__ = ["StopSequences"]

IntArray = npt.NDArray[np.int64]

NO_STOP: Final = -1
"""Padding of the stop columns (no token id is negative)."""
NEVER: Final = np.iinfo(np.int64).max
"""An output length no row reaches: "no stop here"."""


class StopSequences:
    """The stop-sequence columns of ``size`` output rows (see the module docstring).

    Attributes:
        num_rows: open rows with at least one stop sequence (0: `match` is never needed).
    """

    def __init__(self, size: int) -> None:
        self._tokens = np.zeros((size, 1, 1), dtype=np.int64)
        self._lens = np.zeros((size, 1), dtype=np.int64)
        self._last = np.full((size, 1), NO_STOP, dtype=np.int64)
        self._has = np.zeros(size, dtype=np.bool_)
        self.num_rows = 0

    def open(self, slot: int, sequences: tuple[tuple[int, ...], ...]) -> None:
        """Store ``slot``'s stop sequences (admission); widen the columns when needed."""
        self._last[slot] = NO_STOP
        self._lens[slot] = 0
        if not sequences:
            return
        count, longest = len(sequences), max(len(seq) for seq in sequences)
        have_count, have_len = self._lens.shape[1], self._tokens.shape[2]
        if count > have_count or longest > have_len:  # rare: widen once
            count, longest = max(count, have_count), max(longest, have_len)
            tokens = np.zeros((self._tokens.shape[0], count, longest), dtype=np.int64)
            tokens[:, :have_count, :have_len] = self._tokens
            lens = np.zeros((self._lens.shape[0], count), dtype=np.int64)
            lens[:, :have_count] = self._lens
            last = np.full((self._last.shape[0], count), NO_STOP, dtype=np.int64)
            last[:, :have_count] = self._last
            self._tokens, self._lens, self._last = tokens, lens, last
        for q, seq in enumerate(sequences):
            self._tokens[slot, q, : len(seq)] = seq
            self._lens[slot, q] = len(seq)
            self._last[slot, q] = seq[-1]
        self._has[slot] = True
        self.num_rows += 1

    def close(self, slots: IntArray) -> None:
        """The rows ``slots`` (distinct) close: their sequences no longer match."""
        self.num_rows -= int(self._has[slots].sum())
        self._has[slots] = False
        self._last[slots] = NO_STOP

    def match(
        self,
        slots: IntArray,
        run: IntArray,
        before: IntArray,
        accepted: npt.NDArray[np.bool_],
        outputs: IntArray,
        width: int,
        min_new: IntArray | None,
    ) -> tuple[IntArray, IntArray] | None:
        """Per row, the earliest stop-sequence end in this run (``finished_len``) and which
        sequence, or None when no sequence completes.

        ``run`` is ``[n, k]`` (already stored in ``outputs``, the flat output table of rows
        ``width`` wide, after each row's ``before`` outputs); ``accepted`` masks its accepted
        tokens. Only accepted tokens equal to the last token of one of their row's sequences
        are candidates; each candidate is compared with the stored outputs (this run included).
        With ``min_new`` (per slot), a sequence counts only when it ends at output
        ``min_new_tokens`` or later.
        """
        last = self._last[slots]  # [n, q]
        cand = (run[:, :, None] == last[:, None, :]) & accepted[:, :, None]
        if not np.count_nonzero(cand):
            return None
        row, step, which = np.nonzero(cand)
        slot = slots[row]
        end = before[row] + step  # output index of the candidate's last token
        length = self._lens[slot, which]
        start = end - length + 1
        ok = start >= 0  # a sequence lies inside the output
        if min_new is not None:
            ok &= end >= min_new[slot]
        offsets = np.arange(self._tokens.shape[2])
        inside = offsets < length[:, None]
        index = slot[:, None] * width + np.clip(start[:, None] + offsets, 0, width - 1)
        ok &= ((outputs[index] == self._tokens[slot, which]) | ~inside).all(axis=1)
        if not ok.any():
            return None
        row, end, which = row[ok], end[ok] + 1, which[ok]
        order = np.lexsort((which, end, row))  # per row: the earliest end, then the first listed
        row, end, which = row[order], end[order], which[order]
        first = np.flatnonzero(np.r_[True, row[1:] != row[:-1]])
        stop_at = np.full(run.shape[0], NEVER, dtype=np.int64)
        index_of = np.full(run.shape[0], -1, dtype=np.int64)
        stop_at[row[first]] = end[first]
        index_of[row[first]] = which[first]
        return stop_at, index_of
