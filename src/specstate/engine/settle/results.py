"""The ResultProcessor: the only role that settles results into the host clocks.

It owns the settled clock (the `OutputTable` rows behind ``Req.output_ids``) and advances
``kv_committed_len`` by each accepted run, both vectorized over the batch: settling a round is
a fixed number of array operations, whatever the batch size. A row is settled only if its
request still holds the output row the batch was launched for (the row's epoch is unchanged):
a late result for a finished, aborted or retracted request changes nothing (docs/concepts.md).

Rows of a launched batch, in order: first the prefill rows (chunks of requests still
prefilling), then the decode-like rows (every row of a decode round, or the running requests
riding a mixed batch as 1-token extends of their bonus). Per row:

* a prefill chunk that is not the last: nothing (committed was set at prepare);
* the last prefill chunk: append the sampled token (the pending bonus); PREFILL -> RUNNING;
* a decode-like row: commit ``accept_len`` and append the accepted run
  ``next_token_ids[i * stride : i * stride + accept_len]`` — with the stride of the producing
  forward (a mixed tail accepts exactly 1: its bonus's KV is now written).

The result's ``logprobs`` and top logprobs, when present, are appended with the tokens (same
rows, same slices).
For a worker with recurrent state the same settle commits the states (`RecurrentStatePool`): the
decode-like rows by their runs, the completed prefills to their lengths.
A finishing row's detail names its stop token, or its stop sequence.

Settling decides finishes but ends nobody: `Settlement.finished` and `Settlement.finishes` are the
verdicts, and the engine's lifecycle (`specstate.engine.settle.lifecycle`) ends those requests.
Python touches a request only when it finishes, or when its last prefill chunk settles.

Invariant: for a settled decode row, ``committed_after - committed_before == accept_len ==
len(appended run)``; a skipped row's counters and outputs are unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import attrs
import numpy as np
import numpy.typing as npt
import torch

from specstate.core.ledger import ResultProcessorLedgerView
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import Req
from specstate.core.status import FinishReason, FinishState, ReqStatus
from specstate.engine.launch.result_copy import HostResult
from specstate.engine.settle.lifecycle import abort_finish
from specstate.engine.settle.outputs import FinishedRows, IntArray, OutputTable
from specstate.memory.recurrent import RecurrentStatePool

__all__ = ["AcceptMetrics", "ResultProcessor", "RowKind", "Settlement"]

_LENGTH, _STOP = FinishReason.LENGTH, FinishReason.STOP


class RowKind:
    """What a batch row launched (plain string constants; a row has exactly one)."""

    CHUNK = "chunk"
    LAST_CHUNK = "last_chunk"
    MIXED_TAIL = "mixed_tail"
    DECODE = "decode"


@attrs.frozen(kw_only=True)
class Settlement:
    """What settling one result did, and which requests it found finished.

    Attributes:
        finished: the requests that reached a stop or their cap, or met a pending abort,
            in this settlement (verdicts: they are still live until the lifecycle ends them).
        finishes: the finish of each, in the same order.
        num_settled_rows: rows whose tokens were settled.
        num_skipped_rows: rows whose request no longer held the output row launched for.
        live: per row, whether its request still held that row (read only: may be shared).
    """

    finished: tuple[Req, ...]
    finishes: tuple[FinishState, ...]
    num_settled_rows: int
    num_skipped_rows: int
    live: npt.NDArray[np.bool_]


@attrs.frozen(kw_only=True)
class AcceptMetrics:
    """Acceptance statistics over every settled verify.

    Attributes:
        num_verifies: settled verify rows (one per request per speculative round).
        num_accepted_tokens: tokens those verifies accepted, bonus included.
        num_proposed_drafts: draft tokens those verifies verified (each row's verify budget
            or the round's width; fewer where the worker reported it verified fewer).
        histogram: ``(accept_length, count)`` pairs, ascending, nonzero counts only.
        verified_by_position: per draft position ``j`` (0-based), the verifies that verified
            draft ``j``; of those, ``sum(n for length, n in histogram if length > j + 1)``
            accepted it.
    """

    num_verifies: int
    num_accepted_tokens: int
    num_proposed_drafts: int
    histogram: tuple[tuple[int, int], ...]
    verified_by_position: tuple[int, ...] = ()

    @property
    def mean_accept_length(self) -> float:
        """Accepted tokens per verify, bonus included (1.0 without speculation)."""
        return self.num_accepted_tokens / self.num_verifies if self.num_verifies else 0.0

    @property
    def num_correct_drafts(self) -> int:
        """Accepted draft tokens: accepted tokens minus one bonus per verify."""
        return self.num_accepted_tokens - self.num_verifies

    @property
    def num_rejected_drafts(self) -> int:
        """Drafts verified and rejected: the verify work that bought no token."""
        return self.num_proposed_drafts - self.num_correct_drafts


class ResultProcessor:
    """Settles results; the only committer of ``kv_committed_len`` after prefill.

    Args:
        ledger: the result processor's view of the ledger.
        outputs: the output table (the result processor is its only appender).
        checker: the engine's ownership checker (the processor acts as RESULT_PROCESSOR).
        recurrent: a hybrid worker's state records, committed with the KV (None: no state).
    """

    def __init__(
        self,
        *,
        ledger: ResultProcessorLedgerView,
        outputs: OutputTable,
        checker: OwnershipChecker,
        recurrent: RecurrentStatePool | None = None,
    ) -> None:
        self._ledger = ledger
        self._recurrent = recurrent
        self._outputs = outputs
        self._checker = checker
        self._all_live = np.ones(0, dtype=np.bool_)  # read only; the size of the last batch

    def accept_lengths(self, req: Req) -> tuple[int, ...]:
        """Accept length of every settled decode round of ``req``, in order."""
        return req.accept_lengths

    def metrics(self) -> AcceptMetrics:
        """A frozen copy of the acceptance statistics."""
        hist = self._outputs.histogram()
        verifies = int(hist.sum())
        accepted = int((hist * np.arange(hist.size)).sum())
        return AcceptMetrics(
            num_verifies=verifies,
            num_accepted_tokens=accepted,
            num_proposed_drafts=self._outputs.num_verified_drafts,
            histogram=tuple((k, int(v)) for k, v in enumerate(hist.tolist()) if v),
            verified_by_position=tuple(
                v for v in self._outputs.verified_by_position().tolist() if v
            ),
        )

    def settle(
        self,
        *,
        reqs: Sequence[Req],
        slots: torch.Tensor | IntArray,
        epochs: IntArray,
        last_chunk: Sequence[bool],
        verifies: bool,
        result: HostResult,
        abort_reasons: Mapping[Req, str],
        detached: int = -1,
        budgets: IntArray | None = None,
    ) -> Settlement:
        """Settle one result for the batch rows ``reqs`` (see the module docstring).

        Args:
            reqs: the batch's requests, prefill rows first.
            slots: ``[B]`` host request slots of the rows.
            epochs: ``[B]`` each row's output-row epoch when the batch was scheduled.
            last_chunk: one flag per prefill row: its chunk ends the prefill.
            verifies: the decode-like rows are verifies (a decode round, not mixed tails).
            result: the worker's result as host arrays, already checked against the batch.
            abort_reasons: pending user aborts, by request.
            detached: `OutputTable.num_detached` when ``epochs`` were current, or -1; while
                it is unchanged every row is live (no epoch to compare).
            budgets: ``[B]`` a decode round's verify budgets (what each row verified when the
                result does not say), or None.
        """
        b = len(reqs)
        n_prefill = len(last_chunk)
        slots_np = slots if isinstance(slots, np.ndarray) else slots.numpy()
        tokens = result.tokens
        accept = result.accept
        if detached >= 0 and detached == self._outputs.num_detached:
            live, num_live = self._every_row(b), b  # nobody left a row since
        else:
            live = self._outputs.epochs(slots_np) == epochs
            num_live = int(np.count_nonzero(live))
        if n_prefill == 0 and num_live == b:
            decode: IntArray | None = None  # the steady round: every row, no index
            firsts: list[int] = []
        else:
            decode = live[n_prefill:].nonzero()[0] + n_prefill
            firsts = [i for i in range(n_prefill) if last_chunk[i] and live[i]]
        with self._checker.acting(Role.RESULT_PROCESSOR):
            self._commit(slots_np, accept, decode)
            if self._recurrent is not None:
                self._commit_states(self._recurrent, slots_np, accept, decode, firsts)
            rows = decode if decode is None or not firsts else np.concatenate([firsts, decode])
            verified = budgets if result.verified is None else result.verified
            top = None
            if result.top_ids is not None and result.top_values is not None:
                top = (result.top_ids, result.top_values)
            ended = self._append(
                slots_np, tokens, accept, result.logprobs, verified, rows, verifies, n_prefill, top
            )
            for i in firsts:
                if reqs[i].status is ReqStatus.PREFILL:
                    reqs[i].transition(ReqStatus.RUNNING)
            finished, finishes = self._finished(reqs, ended, rows, abort_reasons)
        chunks = (
            sum(1 for i in range(n_prefill) if live[i] and not last_chunk[i]) if n_prefill else 0
        )
        return Settlement(
            finished=tuple(finished),
            finishes=tuple(finishes),
            num_settled_rows=num_live - chunks,  # a non-final chunk settles nothing
            num_skipped_rows=b - num_live,
            live=live,
        )

    def _every_row(self, b: int) -> npt.NDArray[np.bool_]:
        """A read-only ``[b]`` mask of True: kept while the batch size stays (a steady round
        allocates none)."""
        live = self._all_live
        if live.size != b:
            live = np.ones(b, dtype=np.bool_)
            live.flags.writeable = False
            self._all_live = live
        return live

    def _commit(self, slots: IntArray, accept: IntArray, rows: IntArray | None) -> None:
        """Advance committed of the decode-like rows by their runs (one vectorized call)."""
        if rows is not None:
            if rows.size == 0:
                return
            slots, accept = slots[rows], accept[rows]
        self._ledger.advance_committed(slots, accept)

    def _commit_states(
        self,
        pool: RecurrentStatePool,
        slots: IntArray,
        accept: IntArray,
        rows: IntArray | None,
        firsts: list[int],
    ) -> None:
        """The recurrent states follow the KV: runs selected, completed prefills committed."""
        prefilled = self._ledger.host_lengths(slots[firsts])[0] if firsts else slots[:0]
        pool.settle_states(slots, accept, rows, firsts, prefilled)

    def _append(
        self,
        slots: IntArray,
        tokens: IntArray,
        accept: IntArray,
        logprobs: npt.NDArray[np.floating[Any]] | None,
        verified: npt.NDArray[np.integer[Any]] | None,
        rows: IntArray | None,
        verifies: bool,
        n_prefill: int,
        top: tuple[npt.NDArray[np.integer[Any]], npt.NDArray[np.floating[Any]]] | None = None,
    ) -> FinishedRows | None:
        if rows is not None:
            if rows.size == 0:
                return None
            slots, tokens, accept = slots[rows], tokens[rows], accept[rows]
            if logprobs is not None:
                logprobs = logprobs[rows]
            if top is not None:
                top = top[0][rows], top[1][rows]
            if verified is not None:
                verified = verified[rows]
        # Prefill rows append one token and are never verifies; a decode round has none.
        return self._outputs.append_runs(
            slots,
            tokens,
            accept,
            verifies=verifies and n_prefill == 0,
            logprobs=logprobs,
            verified=None if verified is None else verified.astype(np.int64, copy=False),
            top=top,
        )

    def _finished(
        self,
        reqs: Sequence[Req],
        ended: FinishedRows | None,
        rows: IntArray | None,
        abort_reasons: Mapping[Req, str],
    ) -> tuple[list[Req], list[FinishState]]:
        """The rows that reached a stop or their cap, and any with a pending abort; their
        finishes (the lifecycle ends them)."""
        finished: list[Req] = []
        finishes: list[FinishState] = []
        if ended is not None:
            at = ended.rows if rows is None else rows[list(ended.rows)].tolist()
            finished = list(map(reqs.__getitem__, at))
            finishes = _finish_states(finished, ended)
        if abort_reasons:  # rare: a user abort that reached a request with a result in flight
            order = range(len(reqs)) if rows is None else rows.tolist()
            stopped = set(finished)
            for i in order:
                req = reqs[i]
                reason = abort_reasons.get(req)
                if reason is not None and not req.is_finished and req not in stopped:
                    finished.append(req)
                    finishes.append(abort_finish(req, reason))
        return finished, finishes


def _finish_states(reqs: Sequence[Req], ended: FinishedRows) -> list[FinishState]:
    """The finish of each row the output table flagged: its first stop, else the length cap.

    A stop token's detail is the token id; a stop sequence's is ``"stop sequence (a, b, c)"``.
    """
    sequences = ended.stop_sequence or (-1,) * len(reqs)
    return [
        FinishState(reason=_LENGTH, finished_len=req.sampling.max_new_tokens)
        if at < 0
        else FinishState(
            reason=_STOP,
            finished_len=at,
            detail=str(token) if q < 0 else f"stop sequence {req.sampling.stop_sequences[q]}",
        )
        for req, at, token, q in zip(reqs, ended.stop_at, ended.stop_token, sequences, strict=True)
    ]
