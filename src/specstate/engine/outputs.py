"""The output table: the settled outputs of every admitted request, in slot-indexed columns.

The result processor owns it. Each admitted request holds one row, indexed by its request-pool
slot (the same index as the KV ledger), from admission until it finishes, aborts or is
retracted::

    row of slot s          0                      lengths[s]             width
    tokens                 | settled outputs ...  | (scratch: a run may be written past
                                                   |  the length; it is never read)
    caps[s]                max_new_tokens           stops[s, :]  stop ids, EOS, -1 padding
    accepts[:rounds[s], s] accept length of every verify settled in this slot (stored
                           round-major, so one round's writes for a batch are close)
    epochs[s]              bumped when the request leaves the slot: a batch launched before
                           that carries the old epoch and its row is skipped at settlement

Settling a round is a fixed number of array operations for the whole batch (`append_runs`):
scatter every accepted run, advance the lengths, find the first stop token and the length cap
per row with masks, record the accept lengths. Python touches a request only when it finishes
(`Req.transition` copies its row back) or when someone reads its ``output_ids``.

The columns are NumPy arrays: this is host-only state (never read by a device), and on a CPU
one NumPy operation costs about a microsecond where a torch operation costs three to five, which
is most of a round's fixed cost. Results arrive as torch tensors and are read through
``Tensor.numpy()`` (no copy on the host).

Invariant: a row is open exactly while its request is attached (admitted, not yet ended or
retracted); ``lengths[s]`` equals that request's ``len(output_ids)``; ``epochs[s]`` changes
whenever a request leaves ``s``.
"""

from __future__ import annotations

from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import InvalidConfig, LedgerViolation
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import Req

__all__ = ["FinishedRows", "OutputTable"]

IntArray = npt.NDArray[np.int64]
_NO_STOP: Final = -1
_NEVER: Final = np.iinfo(np.int64).max


@attrs.frozen(kw_only=True)
class FinishedRows:
    """Rows of one `OutputTable.append_runs` call whose request reached a stop or its cap.

    Attributes:
        rows: positions (in the call's row order) of the finishing requests.
        stop_at: per finishing row, ``len(outputs)`` up to and including its first stop token,
            or -1 when the length cap ended it.
        stop_token: the stop token, or -1.
    """

    rows: tuple[int, ...]
    stop_at: tuple[int, ...]
    stop_token: tuple[int, ...]


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
        # Accept lengths by round, transposed ([round, slot], int16): the rows of a persistent
        # batch are at similar rounds, so one round's writes land close together.
        self._accepts = np.zeros((self._width, size), dtype=np.int16)
        self._output_tokens_flat = self._output_tokens.reshape(
            -1
        )  # views: flat indices are the fast path
        self._output_lengths = np.zeros(size, dtype=np.int64)
        self._rounds = np.zeros(size, dtype=np.int64)
        self._caps = np.zeros(size, dtype=np.int64)
        self._stops = np.full((size, max(1, len(self._eos))), _NO_STOP, dtype=np.int64)
        self._epochs = np.zeros(size, dtype=np.int64)
        self._holders: list[Req | None] = [None] * size
        self._steps = np.arange(max_run, dtype=np.int64)
        self._histogram = np.zeros(max_run + 1, dtype=np.int64)

    # ------------------------------------------------------------------ reads
    def read_outputs(self, slot: int) -> list[int]:
        """Every settled output of the request in ``slot``."""
        n = int(self._output_lengths[slot])
        out: list[int] = self._output_tokens[slot, :n].tolist()
        return out

    def all_lengths(self) -> IntArray:
        """Settled output counts of every slot, as a new array (slot 0 is padding)."""
        return self._output_lengths.copy()

    def lengths(self, slots: IntArray) -> IntArray:
        """Settled output counts of ``slots`` as a new array (a finished row keeps its last)."""
        return self._output_lengths[slots]

    def num_outputs(self, slot: int) -> int:
        """How many outputs the request in ``slot`` has settled."""
        return int(self._output_lengths[slot])

    def read_accept_lengths(self, slot: int) -> list[int]:
        """Accept lengths of the verifies settled in ``slot`` since it opened."""
        out: list[int] = self._accepts[: int(self._rounds[slot]), slot].tolist()
        return out

    def epochs(self, slots: IntArray) -> IntArray:
        """The current epoch of ``slots`` (a new array): a batch keeps it to detect staleness."""
        return self._epochs[slots]

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
        self._stops[slot] = _NO_STOP
        self._stops[slot, : len(stops)] = sorted(stops)
        req.attach_outputs(self, slot)
        self._holders[slot] = req

    def detach(self, slot: int) -> None:
        """The request leaves ``slot`` (called by `Req.transition`); bumps the slot's epoch."""
        self._holders[slot] = None
        self._epochs[slot] += 1

    def append_runs(
        self, slots: IntArray, tokens: IntArray, accept: IntArray, *, verifies: bool
    ) -> FinishedRows | None:
        """Append row ``i``'s run ``tokens[i, :accept[i]]`` to ``slots[i]``; find who finished.

        ``tokens`` is ``[n, stride]``; only its first ``max_run`` columns can be accepted.
        With ``verifies``, each row's accept length is recorded as one settled verify.
        Returns None when nobody reached a stop or the cap (the common case), else the rows
        that did, with where their first stop lies.
        """
        if self._checker.enabled:
            self._checker.require((Role.RESULT_PROCESSOR,), counter="output_ids", request="batch")
        width = min(tokens.shape[1], self._max_run)
        run = tokens[:, :width]
        steps = self._steps[:width]
        before = self._output_lengths[slots]
        after = before + accept
        base = slots * self._width
        # Whole runs are stored (the tail past ``accept`` is scratch beyond the new length).
        self._output_tokens_flat[(base + before)[:, None] + steps] = run
        self._output_lengths[slots] = after
        if verifies:
            rounds = self._rounds[slots]
            self._accepts[rounds, slots] = accept
            self._rounds[slots] = rounds + 1
            self._histogram += np.bincount(accept, minlength=self._histogram.size)
        stops = self._stops[slots]
        if stops.shape[1] == 1:  # the common case: one stop id (EOS) per row
            hit = run == stops
        else:
            hit = (run[:, :, None] == stops[:, None, :]).any(axis=2)
        hit &= steps < accept[:, None]
        caps = self._caps[slots]
        capped = after >= caps
        if not (np.count_nonzero(hit) or np.count_nonzero(capped)):
            return None  # nobody stops or reaches the cap: the steady round ends here
        return self._finished_rows(run, hit, before, caps, capped)

    @staticmethod
    def _finished_rows(
        run: IntArray,
        hit: npt.NDArray[np.bool_],
        before: IntArray,
        caps: IntArray,
        capped: npt.NDArray[np.bool_],
    ) -> FinishedRows | None:
        """The rows that end, and where: the first stop token unless it lies past the cap."""
        first = hit.argmax(axis=1)
        stop_at = np.where(hit.any(axis=1), before + first + 1, _NEVER)
        is_stop = stop_at <= caps
        ends = is_stop | capped
        if not ends.any():
            return None  # a stop past the cap of a row that has not reached it: impossible
        rows = np.flatnonzero(ends)
        stop = is_stop[rows]
        return FinishedRows(
            rows=tuple(rows.tolist()),
            stop_at=tuple(np.where(stop, stop_at[rows], -1).tolist()),
            stop_token=tuple(np.where(stop, run[rows, first[rows]], -1).tolist()),
        )

    def _ensure_stop_width(self, n: int) -> None:
        have = self._stops.shape[1]
        if n > have:  # rare: a request with more stop ids than any before; widen once
            wider = np.full((self._stops.shape[0], n), _NO_STOP, dtype=np.int64)
            wider[:, :have] = self._stops
            self._stops = wider
