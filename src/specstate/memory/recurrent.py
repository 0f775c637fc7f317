"""The recurrent-state pool: where each request's recurrent state lives, and who commits it.

A hybrid model (Mamba2, gated delta net, short convolution layers beside attention) carries, per
request and per recurrent layer, a fixed-size state that cannot be truncated like KV: after a
verify of ``D`` tokens the state must be the one after exactly the accepted tokens. This module
owns the host record of which state is committed. The worker owns the state buffers (as it owns
its KV caches) and writes them; specstate owns the indices, exactly as it owns ``req_to_token``:
the layout (`specstate.memory.recurrent_layout`) is the value both sides share.

Layout (`RecurrentLayout`): request slot ``s`` owns ``C`` consecutive *state rows*, and the
state after a request has absorbed ``p`` tokens lives in row ``s * C + p % C``::

    rows of slot s      s*C + 0    s*C + 1   s*C + 2    ...   s*C + C-1
    a verify at S       S+D ckpt   read S    S+1 ckpt   ...   S+D-1 ckpt   (C = D + 1, S % C = 1)

A forward over positions ``[P, P + n)`` of a row reads its start state from ``row(P)`` (the
zero state when ``P == 0``) and writes the state after each token it absorbs to
``row(p + 1)`` (an extend needs only its last one). A verify at ``S`` therefore leaves the
checkpoint of every possible accept length ``a`` in ``row(S + a)``, and ``C = D + 1`` rows
mean none of them aliases the start row ``row(S)``, which a worker may still be reading.

Selection is keyed by the request's slot and its committed length, never by a batch row: the
committed state is ``row(kv_committed_len)``. No state is copied at acceptance, and there is no
second pointer that could go stale (the vLLM bug class of a zero-draft step reading a stale
state): every forward, drafting or not, chunk or verify, reads the row of its own frontier.

The N / N+1 timeline under overlap (the host settles N after launching N+1)::

    host     | schedule N+1 (frontier Unresolved) | launch N+1 | wait N | settle N: commit +a |
    forward  | N: read row(S), verify S..S+D-1, write row(S+1..S+D), PUBLISH S+a, draft-extend |
             |                          N+1: resolve S' = S+a -> read row(S') ... write row(S'+j) |

The device selects the accepted checkpoint through the relay: N+1's frontier is the published
``S + a``, so N+1 starts from ``row(S + a)`` behind the publish fence, without the host. The
host record (`RecurrentStatePool`) advances at settlement, by the result processor, to the
same length; the invariant checker verifies that it agrees with the KV ledger's committed
length, and that every request holding a KV slot holds exactly one state record.

Invariant: the open records are exactly the open KV slots; a running request's
``recurrent_committed_len == kv_committed_len`` (a prefilling one's is 0: its partial state is
carried on the device from chunk to chunk); ``row(slot, committed)`` is the only row of the slot
that a later forward reads before writing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

import attrs
import numpy as np
import numpy.typing as npt

from specstate.core.errors import DoubleRelease, InvalidConfig, LedgerViolation
from specstate.core.ownership import OwnershipChecker, Role
from specstate.memory.recurrent_layout import RecurrentLayout, RecurrentStateSpec, rows_per_request

__all__ = ["NoRecurrentState", "RecurrentPoolSnapshot", "RecurrentStatePool", "recurrent_pool_for"]

IntArray = npt.NDArray[np.int64]
_CLOSED: Final = -1
_COUNTER: Final = "recurrent_committed_len"


@attrs.frozen(kw_only=True)
class RecurrentPoolSnapshot:
    """Frozen statistics of a `RecurrentStatePool`."""

    rows_per_request: int
    num_request_slots: int
    num_open: int
    bytes_per_request: int


class RecurrentStatePool:
    """The host record of committed recurrent states, one per request slot.

    A record opens when a hybrid request takes a KV slot (the allocator) and closes with it
    (finish, abort, retraction: the state is discarded; a retracted request re-prefills from
    the zero state, with a new incarnation). Only the result processor commits: when the last
    chunk of a prefill settles (the state of the whole prefill) and, for every decode-like row
    it settles, by the accepted run. Every mutator is vectorized and asks the ownership checker
    for its role.

    Args:
        spec: the worker's declared state shapes.
        layout: the rows handed to the worker.
        checker: the engine's ownership checker.
        validate: per-row checks (open, current incarnation, no repeats) on every commit.
    """

    def __init__(
        self,
        *,
        spec: RecurrentStateSpec,
        layout: RecurrentLayout,
        checker: OwnershipChecker,
        validate: bool = True,
    ) -> None:
        self.spec = spec
        self.layout = layout
        self._checker = checker
        self._validate = validate
        n = layout.num_request_slots
        self._recurrent_committed = np.zeros(n, dtype=np.int64)
        self._incarnation = np.full(n, _CLOSED, dtype=np.int64)
        self._request_ids: list[str | None] = [None] * n

    # ------------------------------------------------------------------ reads
    def is_open(self, slot: int) -> bool:
        """True while ``slot`` holds a request's state record."""
        return bool(self._incarnation[slot] != _CLOSED)

    def open_slots(self) -> list[int]:
        """The slots with an open record, ascending."""
        return np.flatnonzero(self._incarnation != _CLOSED).tolist()

    def holder(self, slot: int) -> tuple[str, int] | None:
        """``(request id, incarnation)`` of ``slot``'s record, or None when closed."""
        rid = self._request_ids[slot]
        return None if rid is None else (rid, int(self._incarnation[slot]))

    def committed_lengths(self, slots: IntArray) -> IntArray:
        """Tokens the committed states of ``slots`` have absorbed (a new host array)."""
        return self._recurrent_committed[slots]

    def committed_rows(self, slots: IntArray) -> IntArray:
        """The rows holding the committed states of ``slots`` (host)."""
        c = self.layout.rows_per_request
        rows: IntArray = slots * c + self._recurrent_committed[slots] % c
        return rows

    def snapshot(self) -> RecurrentPoolSnapshot:
        """Frozen statistics."""
        return RecurrentPoolSnapshot(
            rows_per_request=self.layout.rows_per_request,
            num_request_slots=self.layout.num_request_slots,
            num_open=int(np.count_nonzero(self._incarnation != _CLOSED)),
            bytes_per_request=self.layout.rows_per_request * self.spec.bytes_per_row,
        )

    # --------------------------------------------------------------- mutators
    def open_state(self, slot: int, request_id: str, incarnation: int) -> None:
        """Open ``slot``'s record for ``request_id`` at length 0 (allocator, at admission).

        Nothing is committed until the prefill completes: the state of a partial prefill is
        carried from chunk to chunk on the device (each chunk starts from the row of its
        prefix), and committed when the last chunk settles.
        """
        self._checker.require((Role.ALLOCATOR,), counter="recurrent state", request=request_id)
        if not 0 < slot < self.layout.num_request_slots or self.is_open(slot):
            held = self.holder(slot) if 0 <= slot < self.layout.num_request_slots else None
            raise LedgerViolation(
                f"request {request_id}: state record of slot {slot} cannot open (held: {held})"
            )
        self._request_ids[slot] = request_id
        self._incarnation[slot] = incarnation
        self._recurrent_committed[slot] = 0

    def close_states(self, slots: IntArray) -> None:
        """Close the records of ``slots`` (allocator, with the KV release): states discarded.

        Raises:
            DoubleRelease: a record is not open; nothing is closed.
        """
        if self._checker.enabled:
            names = self._names(slots)
            self._checker.require((Role.ALLOCATOR,), counter="recurrent state", request=names)
        if slots.size == 0:
            return
        closed = self._incarnation[slots] == _CLOSED
        if bool(closed.any()):
            raise DoubleRelease(f"state records of slots {slots[closed].tolist()} are not open")
        self._incarnation[slots] = _CLOSED
        self._recurrent_committed[slots] = 0
        ids = self._request_ids
        for slot in slots.tolist():
            ids[slot] = None

    def commit_states(self, slots: IntArray, accept_lens: IntArray) -> None:
        """Advance each committed state by its accepted run (result processor, at settlement).

        The state after ``committed + a`` tokens is the checkpoint the verify left in
        ``row(committed + a)``: committing selects it. One vectorized add.

        Raises:
            LedgerViolation: (validating) a closed or repeated record, or a run < 0.
        """
        if self._checker.enabled:
            names = self._names(slots)
            self._checker.require((Role.RESULT_PROCESSOR,), counter=_COUNTER, request=names)
        if self._validate:
            self._require_open(slots, accept_lens)
            if bool((accept_lens < 0).any()):
                raise LedgerViolation(f"negative accepted run in {accept_lens.tolist()}")
        self._recurrent_committed[slots] += accept_lens

    def commit_prefilled(self, slots: IntArray, lengths: IntArray) -> None:
        """Commit the states of completed prefills (result processor, when the last chunk
        settles): ``lengths`` are the prefilled token counts.

        Raises:
            LedgerViolation: (validating) a closed or repeated record, or a record that already
                committed something (a prefill completes once per incarnation).
        """
        if self._checker.enabled:
            names = self._names(slots)
            self._checker.require((Role.RESULT_PROCESSOR,), counter=_COUNTER, request=names)
        if self._validate:
            self._require_open(slots, lengths)
            done = self._recurrent_committed[slots] != 0
            if bool(done.any()):
                i = int(np.flatnonzero(done)[0])
                raise LedgerViolation(
                    f"request {self._request_ids[int(slots[i])]}: prefill committed twice "
                    f"(recurrent_committed_len already {int(self._recurrent_committed[slots[i]])})"
                )
        self._recurrent_committed[slots] = lengths

    def settle_states(
        self,
        slots: IntArray,
        accept_lens: IntArray,
        decode_rows: IntArray | None,
        prefilled_rows: Sequence[int],
        prefilled_lengths: IntArray,
    ) -> None:
        """One settlement's commits (result processor): the decode-like rows by their runs
        (``decode_rows`` None: every row, the steady round), the completed prefills to their
        lengths. A fixed number of array operations."""
        if decode_rows is None:
            self.commit_states(slots, accept_lens)
        elif decode_rows.size:
            self.commit_states(slots[decode_rows], accept_lens[decode_rows])
        if prefilled_rows:
            self.commit_prefilled(slots[list(prefilled_rows)], prefilled_lengths)

    # ------------------------------------------------------------- validation
    def _require_open(self, slots: IntArray, values: IntArray) -> None:
        if slots.shape != values.shape or slots.ndim != 1:
            raise LedgerViolation(
                f"slots {slots.shape} and values {values.shape} must be equal 1-D"
            )
        if slots.size == 0:
            return
        if int(slots.min()) < 1 or int(slots.max()) >= self.layout.num_request_slots:
            raise LedgerViolation(
                f"state slots outside 1..{self.layout.num_request_slots - 1}: {slots.tolist()}"
            )
        closed = self._incarnation[slots] == _CLOSED
        if bool(closed.any()):
            raise LedgerViolation(f"state records of slots {slots[closed].tolist()} are not open")
        if np.unique(slots).size != slots.size:
            raise LedgerViolation(f"a slot repeats in one state commit: {slots.tolist()}")

    def _names(self, slots: IntArray | Sequence[int]) -> str:
        ids = self._request_ids
        shown = [str(ids[s]) for s in list(slots)[:4] if 0 <= s < len(ids)]
        more = len(slots) - 4
        return ", ".join(shown) + (f" (+{more} more)" if more > 0 else "")


class NoRecurrentState:
    """The allocator's recurrent-state owner for a worker that keeps no recurrent state: a
    request slot opens and closes no record (the allocator has no branch for it)."""

    def open_state(self, slot: int, request_id: str, incarnation: int) -> None:
        """No record to open."""

    def close_states(self, slots: IntArray) -> None:
        """No record to close."""


def recurrent_pool_for(
    spec: RecurrentStateSpec | None,
    *,
    num_draft_tokens: int,
    topk: int,
    num_request_slots: int,
    checker: OwnershipChecker,
    validate: bool,
) -> RecurrentStatePool | None:
    """The pool for a worker's declared state (None without one), sized from its window.

    Raises:
        InvalidConfig: a recurrent worker that drafts trees (``topk > 1``): a state follows one
            chain of tokens, and a tree's nodes would each need their own.
    """
    if spec is None:
        return None
    if topk != 1:
        raise InvalidConfig(
            f"a worker with recurrent state drafts chains only (topk 1), got topk {topk}"
        )
    layout = RecurrentLayout(
        rows_per_request=rows_per_request(num_draft_tokens), num_request_slots=num_request_slots
    )
    return RecurrentStatePool(spec=spec, layout=layout, checker=checker, validate=validate)
