"""The output table: the settled outputs of every admitted request, in slot-indexed columns.

The result processor owns it. Each admitted request holds one row, indexed by its request-pool
slot (the same index as the KV ledger), from admission until it finishes, aborts or is
retracted::

    row of slot s          0                      lengths[s]             width
    tokens                 | settled outputs ...  | (scratch: a run may be written past
                                                   |  the length; it is never read)
    caps[s]                max_new_tokens           stops[s, :]  stop ids, EOS, -1 padding
    logprobs[s, :]         one float per settled output (written only for a result with them)
    top[s]                 ([width, k] ids, [width, k] values) per settled output, only for a
                           request that asked for ``top_logprobs=k`` (a table of its own)
    min_new[s]             min_new_tokens; the stop sequences: `StopSequences`
    accepts[:rounds[s], s] accept length of every verify settled in this slot (stored
                           round-major, so one round's writes for a batch are close)
    epochs[s]              bumped when the request leaves the slot: a batch launched before
                           that carries the old epoch and its row is skipped at settlement

Settling a round is a fixed number of array operations for the whole batch (`append_runs`):
scatter every accepted run, advance the lengths, find the first stop token and the length cap
per row with masks, record the accept lengths. Stop sequences cost nothing while no open row
has one (`specstate.engine.settle.stop_sequences`). A stop — token or sequence — counts only
when its last token is output ``min_new_tokens`` (0-based) or later. Python touches a request
only when it finishes (`Req.end_many` copies its row back) or when someone reads its
``output_ids``.

The columns are NumPy arrays: this is host-only state (never read by a device), and on a CPU
one NumPy operation costs about a microsecond where a torch operation costs three to five, which
is most of a round's fixed cost. Results arrive as torch tensors and are read through
``Tensor.numpy()`` (no copy on the host).

Invariant: a row is open exactly while its request is attached (admitted, not yet ended or
retracted); ``lengths[s]`` equals that request's ``len(output_ids)``; ``epochs[s]`` changes
whenever a request leaves ``s``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Final

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import InvalidConfig, LedgerViolation
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import Req, TopLogprobs
from specstate.engine.settle.stop_sequences import NEVER, NO_STOP, StopSequences

__all__ = ["FinishedRows", "OutputTable"]

IntArray = npt.NDArray[np.int64]
_FEW_ROWS: Final = 16
"""Up to this many grown rows, a streaming read slices each row (a few µs in all); beyond, it
gathers every run at once (fixed cost about 8 µs, then well under a µs per row)."""


@attrs.frozen(kw_only=True)
class FinishedRows:
    """Rows of one `OutputTable.append_runs` call whose request reached a stop or its cap.

    Attributes:
        rows: positions (in the call's row order) of the finishing requests.
        stop_at: per finishing row, ``len(outputs)`` up to and including its first stop (token
            or the last token of a stop sequence), or -1 when the length cap ended it.
        stop_token: the stop token (a sequence's last token), or -1.
        stop_sequence: per finishing row, the index in ``stop_sequences`` of the sequence that
            ended it, or -1 (a stop token, or the cap); empty when no row has sequences.
    """

    rows: tuple[int, ...]
    stop_at: tuple[int, ...]
    stop_token: tuple[int, ...]
    stop_sequence: tuple[int, ...] = ()


class OutputTable:
    """Slot-indexed outputs, caps, stop ids and accept lengths; see the module docstring.

    Args:
        max_slots: request slots (slot 0, the padding row, never opens).
        max_outputs: the most output tokens a request can settle (its context).
        max_run: the longest accepted run one round may append (``max_accept``).
        eos_token_ids: the model's end-of-sequence ids (stop tokens unless ``ignore_eos``).
        checker: the engine's ownership checker.
    """

    def __init__(
        self,
        *,
        max_slots: int,
        max_outputs: int,
        max_run: int,
        eos_token_ids: frozenset[int],
        checker: OwnershipChecker,
    ) -> None:
        if max_slots < 1 or max_outputs < 1 or max_run < 1:
            raise InvalidConfig(
                f"output table needs positive sizes, got slots {max_slots}, outputs "
                f"{max_outputs}, run {max_run}"
            )
        size = max_slots + 1
        self._width = max_outputs + 2 * max_run
        self._max_run = max_run
        self._eos = tuple(sorted(eos_token_ids))
        self._checker = checker
        # np.zeros maps untouched pages lazily: a wide table costs only the rows it uses.
        self._output_tokens = np.zeros((size, self._width), dtype=np.int64)
        # Per settled verify, by round, transposed ([what, round, slot], int16): the accept
        # length ([0]) and the drafts verified ([1]); the rows of a persistent batch are at
        # similar rounds, so one round's writes land close together, and a row's two lists
        # come out in one slice.
        self._verifies = np.zeros((2, self._width, size), dtype=np.int16)
        self._output_tokens_flat = self._output_tokens.reshape(
            -1
        )  # views: flat indices are the fast path
        self._output_lengths = np.zeros(size, dtype=np.int64)
        self._rounds = np.zeros(size, dtype=np.int64)
        self._caps = np.zeros(size, dtype=np.int64)
        self._stops = np.full((size, max(1, len(self._eos))), NO_STOP, dtype=np.int64)
        self._epochs = np.zeros(size, dtype=np.int64)
        self._openings = np.zeros(size, dtype=np.int64)  # times each row was opened
        self._output_logprobs = np.zeros((size, self._width), dtype=np.float32)
        self._output_logprobs_flat = self._output_logprobs.reshape(-1)
        # Only the rows whose request asked for top_logprobs: their ids and values.
        self._top: dict[int, tuple[IntArray, npt.NDArray[np.float32]]] = {}
        self._min_new = np.zeros(size, dtype=np.int64)
        self._num_min_rows = 0  # open rows with min_new_tokens > 0
        self._sequences = StopSequences(size)
        self._holders: list[Req | None] = [None] * size
        self._steps = np.arange(max_run, dtype=np.int64)
        self._histogram = np.zeros(max_run + 1, dtype=np.int64)
        self._num_verified_drafts = 0  # drafts every settled verify verified, summed
        self._verified_by_position = np.zeros(max_run, dtype=np.int64)  # verifies per draft j
        self._num_opened = 0  # rows opened so far (`_row_constants` keys on it)
        self._num_detached = 0  # requests that left a row so far (each bumped an epoch)
        self._constants: tuple[IntArray, int, IntArray, IntArray, IntArray] | None = None

    # ------------------------------------------------------------------ reads
    def read_outputs(self, slot: int) -> list[int]:
        """Every settled output of the request in ``slot``."""
        n = int(self._output_lengths[slot])
        out: list[int] = self._output_tokens[slot, :n].tolist()
        return out

    def read_outputs_since(self, slot: int, start: int) -> list[int]:
        """The settled outputs of ``slot`` from output ``start`` on (a streaming reader's new
        tokens: the cost is the tokens read, not the request's length)."""
        n = int(self._output_lengths[slot])
        out: list[int] = self._output_tokens[slot, start:n].tolist()
        return out

    def read_all_since(self, seen: IntArray) -> Iterator[tuple[Req, list[int]]]:
        """What a streaming reader takes after a step: each attached request whose settled
        outputs grew since ``seen`` (an earlier `all_lengths`), with its outputs from
        ``seen[slot]`` on, in slot order. One comparison and one gather for the whole table;
        the Python per changed request is a list slice. A slot whose count fell (it changed
        hands) or that no request holds (it ended: read it from the request) is skipped.

        Beyond 16 grown rows the pairs are made one at a time as the reader iterates: a reader
        that sends each run and drops it leaves no garbage behind, where a list of a pair per
        request would put a thousand young objects before Python's collector every round of a
        large batch (each collection then walks them all). Up to 16, each row is sliced at once
        (cheaper than the gather's index arrays).
        """
        now = self._output_lengths
        slots = (now > seen).nonzero()[0]
        if not slots.size:
            return iter(())
        if slots.size <= _FEW_ROWS:  # a slice per row is cheaper than the index arrays
            table, holders = self._output_tokens, self._holders
            return iter(
                [
                    (req, table[slot, a:b].tolist())
                    for slot, a, b in zip(
                        slots.tolist(), seen[slots].tolist(), now[slots].tolist(), strict=True
                    )
                    if (req := holders[slot]) is not None
                ]
            )
        start = seen[slots]
        counts = now[slots] - start
        ends = counts.cumsum()
        # Run k's tokens sit at flat positions (row start + seen) + [0, counts[k]).
        first = slots * self._width + start - (ends - counts)
        flat = first.repeat(counts) + np.arange(int(ends[-1]))
        tokens: list[int] = self._output_tokens_flat[flat].tolist()
        bounds = ends.tolist()
        return _runs(list(map(self._holders.__getitem__, slots.tolist())), tokens, bounds)

    def all_lengths(self) -> IntArray:
        """Settled output counts of every slot, as a new array (slot 0 is padding)."""
        return self._output_lengths.copy()

    def all_openings(self) -> IntArray:
        """How many times each row was opened, indexed by slot (a copy): a row whose count
        changed has a new holder, whatever its length says."""
        return self._openings.copy()

    def lengths(self, slots: IntArray) -> IntArray:
        """Settled output counts of ``slots`` as a new array (a finished row keeps its last)."""
        return self._output_lengths[slots]

    def num_outputs(self, slot: int) -> int:
        """How many outputs the request in ``slot`` has settled."""
        return int(self._output_lengths[slot])

    def output_counts(self, slots: list[int]) -> list[int]:
        """How many outputs the request in each of ``slots`` has settled."""
        counts: list[int] = self._output_lengths[slots].tolist()
        return counts

    def read_accept_lengths(self, slot: int) -> list[int]:
        """Accept lengths of the verifies settled in ``slot`` since it opened."""
        out: list[int] = self._verifies[0, : int(self._rounds[slot]), slot].tolist()
        return out

    def read_verified_lengths(self, slot: int) -> list[int]:
        """Drafts verified by each verify settled in ``slot`` since it opened."""
        out: list[int] = self._verifies[1, : int(self._rounds[slot]), slot].tolist()
        return out

    def read_logprobs(self, slot: int) -> list[float]:
        """Log-probabilities of the settled outputs of ``slot`` (0.0 where none was given)."""
        n = int(self._output_lengths[slot])
        out: list[float] = self._output_logprobs[slot, :n].tolist()
        return out

    def read_top_logprobs(
        self, slot: int, start: int = 0, stop: int | None = None
    ) -> list[TopLogprobs]:
        """The top alternatives of the settled outputs ``start:stop`` of ``slot`` (none for a
        row whose request did not ask for them)."""
        table = self._top.get(slot)
        if table is None:
            return []
        n = int(self._output_lengths[slot])
        return _top_pairs(table, min(n, n if stop is None else stop), start)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The model's EOS ids (stop tokens of every row that does not ignore EOS)."""
        return frozenset(self._eos)

    def epochs(self, slots: IntArray) -> IntArray:
        """The current epoch of ``slots`` (a new array): a batch keeps it to detect staleness."""
        return self._epochs[slots]

    @property
    def num_verified_drafts(self) -> int:
        """Drafts verified by every verify settled so far (rejected ones included)."""
        return self._num_verified_drafts

    def verified_by_position(self) -> IntArray:
        """Per draft position ``j``: settled verifies that verified draft ``j`` (a copy)."""
        return self._verified_by_position.copy()

    @property
    def num_detached(self) -> int:
        """How many times a request left a row (every epoch bump): a batch that read its
        epochs at this count has no stale row while the count is unchanged."""
        return self._num_detached

    def histogram(self) -> IntArray:
        """Settled verifies per accept length (index = accept length), a copy."""
        return self._histogram.copy()

    def is_open(self, slot: int) -> bool:
        """True while a request is attached to ``slot``."""
        return self._holders[slot] is not None

    def holder(self, slot: int) -> Req | None:
        """The request attached to ``slot``, if any."""
        return self._holders[slot]

    def open_rows(self) -> list[int]:
        """Every slot with an attached request (debug and the invariant checker)."""
        return [s for s, req in enumerate(self._holders) if req is not None]

    # --------------------------------------------------------------- mutators
    def open_row(self, slot: int, req: Req) -> None:
        """Attach ``req`` to ``slot`` at admission: copy its outputs, cap and stop ids in.

        A re-admitted (retracted) request brings the outputs it settled before; its accept
        lengths so far stay on the request.

        Raises:
            LedgerViolation: the slot is out of range or held by another request.
        """
        self._checker.require(
            (Role.SCHEDULER, Role.RESULT_PROCESSOR), counter="output row", request=req.request_id
        )
        if not 0 < slot < len(self._holders) or self._holders[slot] is not None:
            holder = self._holders[slot] if 0 < slot < len(self._holders) else None
            raise LedgerViolation(
                f"request {req.request_id}: output row {slot} is out of range or held by "
                f"{None if holder is None else holder.request_id}"
            )
        outputs = req.output_ids
        stops = set(req.sampling.stop_token_ids)
        if not req.sampling.ignore_eos:
            stops.update(self._eos)
        self._ensure_stop_width(len(stops))
        self._output_tokens[slot, : len(outputs)] = outputs
        self._output_lengths[slot] = len(outputs)
        self._rounds[slot] = 0
        self._caps[slot] = req.sampling.max_new_tokens
        self._stops[slot] = NO_STOP
        self._stops[slot, : len(stops)] = sorted(stops)
        if req.sampling.logprobs:
            self._output_logprobs[slot, : len(outputs)] = req.stored_logprobs()[: len(outputs)]
        if req.sampling.top_logprobs:
            self._open_top(slot, req.sampling.top_logprobs, req.stored_top_logprobs())
        self._min_new[slot] = req.sampling.min_new_tokens
        if req.sampling.min_new_tokens > 0:
            self._num_min_rows += 1
        self._sequences.open(slot, req.sampling.stop_sequences)
        req.attach_outputs(self, slot)
        self._holders[slot] = req
        self._openings[slot] += 1
        self._num_opened += 1

    def _store_top(
        self,
        slots: IntArray,
        before: IntArray,
        top: tuple[npt.NDArray[np.integer[Any]], npt.NDArray[np.floating[Any]]],
        width: int,
    ) -> None:
        """Whole runs of ``top`` into the tables of the rows that have one (past a run:
        scratch beyond the new length, like the tokens)."""
        ids, values = top
        for i in np.flatnonzero(np.isin(slots, list(self._top))).tolist():
            table = self._top[int(slots[i])]
            k, at = table[0].shape[1], int(before[i])
            table[0][at : at + width] = ids[i, :width, :k]
            table[1][at : at + width] = values[i, :width, :k]

    def _open_top(self, slot: int, k: int, stored: list[TopLogprobs]) -> None:
        """A top-logprobs table for ``slot`` (``k`` per output), with ``stored`` copied in."""
        ids = np.zeros((self._width, k), dtype=np.int64)
        values = np.zeros((self._width, k), dtype=np.float32)
        for n, pairs in enumerate(stored[: self._width]):
            ids[n] = [t for t, _ in pairs]
            values[n] = [v for _, v in pairs]
        self._top[slot] = (ids, values)

    def detach(self, slot: int) -> None:
        """The request leaves ``slot`` and its outputs are dropped (`leave_rows` for one row,
        its lists discarded); bumps the slot's epoch."""
        self.leave_rows([slot], [False])

    def leave_rows(
        self, slots: list[int], logprobs: list[bool]
    ) -> tuple[
        list[list[int]],
        list[list[list[int]]],
        list[list[float] | None],
        list[list[TopLogprobs] | None],
    ]:
        """The requests in ``slots`` (distinct, open) leave them (called by `Req.end_many` and
        `Req.transition`): their outputs, their verifies (``[accept lengths, verified
        lengths]``), the log-probabilities of the rows flagged in ``logprobs`` and the top
        alternatives of the rows with a top-logprobs table, as Python lists; each slot's
        epoch is bumped.

        One slice of each row (a row's outputs are contiguous: faster than one gather of every
        row's positions through index arrays, whatever the number of rows).
        """
        s = np.array(slots, dtype=np.int64)
        lengths, rounds = self._output_lengths[s].tolist(), self._rounds[s].tolist()
        tokens, verifies = self._output_tokens, self._verifies
        outputs = [tokens[k, :n].tolist() for k, n in zip(slots, lengths, strict=True)]
        settled = [verifies[:, :n, k].tolist() for k, n in zip(slots, rounds, strict=True)]
        chosen: list[list[float] | None] = [None] * len(slots)
        if True in logprobs:  # rare: only requests that asked for them
            for i, wanted in enumerate(logprobs):
                if wanted:
                    chosen[i] = self._output_logprobs[slots[i], : lengths[i]].tolist()
        tops: list[list[TopLogprobs] | None] = [None] * len(slots)
        if self._top:  # rare: only requests that asked for them
            for i, slot in enumerate(slots):
                table = self._top.pop(slot, None)
                if table is not None:
                    tops[i] = _top_pairs(table, lengths[i])
        for slot in slots:
            self._holders[slot] = None
        self._epochs[s] += 1
        self._num_detached += len(slots)
        if self._num_min_rows:
            self._num_min_rows -= int((self._min_new[s] > 0).sum())
            self._min_new[s] = 0
        if self._sequences.num_rows:
            self._sequences.close(s)
        return outputs, settled, chosen, tops

    def append_runs(
        self,
        slots: IntArray,
        tokens: IntArray,
        accept: IntArray,
        *,
        verifies: bool,
        logprobs: npt.NDArray[np.floating[Any]] | None = None,
        verified: IntArray | None = None,
        top: tuple[npt.NDArray[np.integer[Any]], npt.NDArray[np.floating[Any]]] | None = None,
    ) -> FinishedRows | None:
        """Append row ``i``'s run ``tokens[i, :accept[i]]`` to ``slots[i]``; find who finished.

        ``tokens`` is ``[n, stride]``; only its first ``max_run`` columns can be accepted.
        With ``verifies``, each row's accept length is recorded as one settled verify, with the
        drafts it verified (``verified``; None: ``stride - 1``, the round's width).
        ``logprobs`` (``[n, stride]``, aligned with ``tokens``) are stored with the tokens,
        and so are ``top`` (ids and values, ``[n, stride, K]``) for the rows that asked for
        them (their first ``top_logprobs`` columns).
        Returns None when nobody reached a stop or the cap (the common case), else the rows
        that did, with where their first stop lies.
        """
        if self._checker.enabled:
            self._checker.require((Role.RESULT_PROCESSOR,), counter="output_ids", request="batch")
        width = min(tokens.shape[1], self._max_run)
        run = tokens[:, :width]
        steps = self._steps[:width]
        base, stops, caps = self._row_constants(slots)
        before = self._output_lengths[slots]
        after = before + accept
        # Whole runs are stored (the tail past ``accept`` is scratch beyond the new length).
        at = (base + before)[:, None] + steps
        self._output_tokens_flat[at] = run
        if logprobs is not None:
            self._output_logprobs_flat[at] = logprobs[:, :width]
        if top is not None and self._top:
            self._store_top(slots, before, top, width)
        self._output_lengths[slots] = after
        if verifies:
            rounds = self._rounds[slots]
            self._verifies[0, rounds, slots] = accept
            drafts = tokens.shape[1] - 1
            if verified is None:  # every row verified the round's width
                self._verifies[1, rounds, slots] = drafts
                self._num_verified_drafts += drafts * slots.size
                self._verified_by_position[:drafts] += slots.size
            else:
                self._verifies[1, rounds, slots] = verified
                self._num_verified_drafts += int(verified.sum())
                self._verified_by_position[:drafts] += (
                    verified[:, None] > self._steps[:drafts]
                ).sum(axis=0)
            self._rounds[slots] = rounds + 1
            self._histogram += np.bincount(accept, minlength=self._histogram.size)
        hit = run == stops[:, :1]  # the common case: one stop id (EOS) per row
        for q in range(1, stops.shape[1]):  # a few more (a reduction along them is slower)
            hit |= run == stops[:, q : q + 1]
        stopped = 0
        if np.count_nonzero(hit):  # some stop id in the run: is it in the accepted part?
            hit &= steps < accept[:, None]
            if self._num_min_rows:  # a stop counts only at output min_new_tokens or later
                hit &= (before[:, None] + steps) >= self._min_new[slots][:, None]
            stopped = int(np.count_nonzero(hit))
        matched = None
        if self._sequences.num_rows:
            matched = self._sequences.match(
                slots,
                run,
                before,
                steps < accept[:, None],
                self._output_tokens_flat,
                self._width,
                self._min_new if self._num_min_rows else None,
            )
        capped = after >= caps
        if not (stopped or np.count_nonzero(capped) or matched is not None):
            return None  # nobody stops or reaches the cap: the steady round ends here
        return self._finished_rows(run, hit, before, caps, capped, matched)

    def _row_constants(self, slots: IntArray) -> tuple[IntArray, IntArray, IntArray]:
        """``slots``' flat row starts, stop ids and caps; kept while the same slots array (a
        persistent batch) comes back and no row was opened since (only `open_row` changes
        them)."""
        kept = self._constants
        if kept is not None and kept[0] is slots and kept[1] == self._num_opened:
            return kept[2], kept[3], kept[4]
        base, stops, caps = slots * self._width, self._stops[slots], self._caps[slots]
        self._constants = (slots, self._num_opened, base, stops, caps)
        return base, stops, caps

    def _finished_rows(
        self,
        run: IntArray,
        hit: npt.NDArray[np.bool_],
        before: IntArray,
        caps: IntArray,
        capped: npt.NDArray[np.bool_],
        matched: tuple[IntArray, IntArray] | None,
    ) -> FinishedRows | None:
        """The rows that end, and where: the first stop unless it lies past the cap.

        The candidate rows (a stop hit, a sequence end, the cap) are found vectorized; each is
        then resolved in Python (a finish is an event of its request, and there are few).
        """
        width = run.shape[1]
        first_hit: dict[int, int] = {}
        hits: list[int] = hit.ravel().nonzero()[0].tolist()  # row order: first hits first
        for flat in hits:
            row, col = divmod(flat, width)
            first_hit.setdefault(row, col)
        candidates = set(first_hit)
        candidates.update(capped.nonzero()[0].tolist())
        seq_at = seq_index = None
        if matched is not None:
            candidates.update((matched[0] < NEVER).nonzero()[0].tolist())
            seq_at, seq_index = matched
        found: list[tuple[int, int, int, int]] = []  # (row, stop at, stop token, sequence)
        for row in sorted(candidates):
            start = int(before[row])
            at, token, sequence = NEVER, -1, -1
            col = first_hit.get(row)
            if col is not None:
                at, token = start + col + 1, int(run[row, col])
            if seq_at is not None and seq_index is not None and int(seq_at[row]) < at:
                at = int(seq_at[row])
                token = int(run[row, min(max(at - start - 1, 0), width - 1)])
                sequence = int(seq_index[row])
            is_stop = at <= int(caps[row])
            if not (is_stop or capped[row]):
                continue  # a stop past the cap of a row that has not reached it
            found.append((row, at, token, sequence) if is_stop else (row, -1, -1, -1))
        if not found:
            return None
        rows, stop_at, stop_token, stop_sequence = zip(*found, strict=True)
        return FinishedRows(
            rows=rows,
            stop_at=stop_at,
            stop_token=stop_token,
            stop_sequence=() if matched is None else stop_sequence,
        )

    def _ensure_stop_width(self, n: int) -> None:
        have = self._stops.shape[1]
        if n > have:  # rare: a request with more stop ids than any before; widen once
            wider = np.full((self._stops.shape[0], n), NO_STOP, dtype=np.int64)
            wider[:, :have] = self._stops
            self._stops = wider


def _top_pairs(
    table: tuple[IntArray, npt.NDArray[np.float32]], n: int, start: int = 0
) -> list[TopLogprobs]:
    """Positions ``start:n`` of a top-logprobs table as ``(id, logprob)`` pairs."""
    ids, values = table[0][start:n].tolist(), table[1][start:n].tolist()
    return [tuple(zip(i, v, strict=True)) for i, v in zip(ids, values, strict=True)]


def _runs(
    holders: list[Req | None], tokens: list[int], bounds: list[int]
) -> Iterator[tuple[Req, list[int]]]:
    """`OutputTable.read_all_since`'s pairs (the rows' holders when it was called), made as
    they are taken."""
    a = 0
    for req, b in zip(holders, bounds, strict=True):
        if req is not None:
            yield req, tokens[a:b]
        a = b
