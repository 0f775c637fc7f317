"""The ResultProcessor: the only role that settles results into the host clocks.

It owns the settled clock (``Req.append_outputs``) and advances ``kv_committed_len`` by each
accepted run, vectorized over the batch. A row is settled only if its request is still the
incarnation the batch was launched for and has not ended: a late result for a finished, aborted
or retracted request changes nothing (DESIGN.md §1, notes §5).

Per row, by what the batch launched:

* a prefill chunk that is not the last: nothing (committed was set at prepare);
* the last prefill chunk: append the sampled token (the pending bonus);
* a mixed tail (a running request riding as a 1-token extend of its bonus): commit ``+1``
  (its bonus's KV is now written) and append the sampled token;
* a decode round: commit ``accept_len`` and append the accepted run
  ``next_token_ids[i * stride : i * stride + accept_len]`` — with the stride of the producing
  forward.

Invariant: for a settled decode row, ``committed_after - committed_before == accept_len ==
len(appended run)``; a skipped row's counters and outputs are unchanged.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import attrs
import torch

from specstate.batch.result import GenerationBatchResult
from specstate.core.ledger import ResultProcessorLedgerView
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import FinishReason, FinishState, Req, ReqStatus
from specstate.engine.finish import resolve_finish

__all__ = ["AcceptMetrics", "ResultProcessor", "RowKind", "Settlement"]


class RowKind:
    """What a batch row launched (plain string constants; a row has exactly one)."""

    CHUNK = "chunk"
    LAST_CHUNK = "last_chunk"
    MIXED_TAIL = "mixed_tail"
    DECODE = "decode"


@attrs.frozen(kw_only=True)
class Settlement:
    """What settling one result did."""

    finished: tuple[Req, ...]
    num_settled_rows: int
    num_skipped_rows: int
    emitted: tuple[tuple[Req, tuple[int, ...]], ...]


@attrs.frozen(kw_only=True)
class AcceptMetrics:
    """Acceptance statistics over every settled verify."""

    num_verifies: int
    num_accepted_tokens: int
    num_proposed_drafts: int
    histogram: tuple[tuple[int, int], ...]

    @property
    def mean_accept_length(self) -> float:
        """Accepted tokens per verify, bonus included (1.0 without speculation)."""
        return self.num_accepted_tokens / self.num_verifies if self.num_verifies else 0.0

    @property
    def num_correct_drafts(self) -> int:
        """Accepted draft tokens: accepted tokens minus one bonus per verify."""
        return self.num_accepted_tokens - self.num_verifies


class ResultProcessor:
    """Settles results; the only committer of ``kv_committed_len`` after prefill.

    Args:
        ledger: the result processor's view of the ledger.
        checker: the engine's ownership checker (the processor acts as RESULT_PROCESSOR).
        eos_token_ids: the model's end-of-sequence ids.
        num_draft_tokens: verify width D, for the proposed-drafts metric.
    """

    def __init__(
        self,
        *,
        ledger: ResultProcessorLedgerView,
        checker: OwnershipChecker,
        eos_token_ids: frozenset[int],
        num_draft_tokens: int,
    ) -> None:
        self._ledger = ledger
        self._checker = checker
        self._eos = eos_token_ids
        self._drafts_per_verify = max(num_draft_tokens - 1, 0)
        self._hist: Counter[int] = Counter()
        self._per_request: dict[int, list[int]] = {}

    def accept_lengths(self, req: Req) -> tuple[int, ...]:
        """Accept length of every settled decode round of ``req``, in order."""
        return tuple(self._per_request.get(id(req), ()))

    def forget(self, req: Req) -> None:
        """Drop ``req``'s per-request metrics (after its output was collected)."""
        self._per_request.pop(id(req), None)

    def metrics(self) -> AcceptMetrics:
        """A frozen copy of the acceptance statistics."""
        verifies = sum(self._hist.values())
        return AcceptMetrics(
            num_verifies=verifies,
            num_accepted_tokens=sum(k * v for k, v in self._hist.items()),
            num_proposed_drafts=verifies * self._drafts_per_verify,
            histogram=tuple(sorted(self._hist.items())),
        )

    def settle(
        self,
        *,
        reqs: Sequence[Req],
        incarnations: Sequence[int],
        slots: torch.Tensor,
        kinds: Sequence[str],
        result: GenerationBatchResult,
        abort_reasons: dict[int, str],
    ) -> Settlement:
        """Settle one result for the batch rows ``reqs`` (see the module docstring)."""
        live = [
            i
            for i, (r, inc) in enumerate(zip(reqs, incarnations, strict=True))
            if r.incarnation == inc and not r.is_finished and r.status is not ReqStatus.WAITING
        ]
        stride = result.stride
        tokens = result.next_token_ids.tolist()
        accept = result.accept_lens.tolist()
        with self._checker.acting(Role.RESULT_PROCESSOR):
            self._commit(live, slots, kinds, accept)
            emitted, finished = self._append(
                live, reqs, kinds, tokens, accept, stride, abort_reasons
            )
        return Settlement(
            finished=tuple(finished),
            num_settled_rows=len(live),
            num_skipped_rows=len(reqs) - len(live),
            emitted=tuple(emitted),
        )

    def _commit(
        self, live: list[int], slots: torch.Tensor, kinds: Sequence[str], accept: list[int]
    ) -> None:
        """Advance committed for decode rows (by the run) and mixed tails (by 1), vectorized."""
        rows = [i for i in live if kinds[i] in (RowKind.DECODE, RowKind.MIXED_TAIL)]
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64)
        runs = [accept[i] if kinds[i] == RowKind.DECODE else 1 for i in rows]
        self._ledger.advance_committed(slots.index_select(0, index), torch.tensor(runs))

    def _append(
        self,
        live: list[int],
        reqs: Sequence[Req],
        kinds: Sequence[str],
        tokens: list[int],
        accept: list[int],
        stride: int,
        abort_reasons: dict[int, str],
    ) -> tuple[list[tuple[Req, tuple[int, ...]]], list[Req]]:
        emitted: list[tuple[Req, tuple[int, ...]]] = []
        finished: list[Req] = []
        for i in live:
            kind, req = kinds[i], reqs[i]
            if kind == RowKind.CHUNK:
                continue
            n = accept[i] if kind == RowKind.DECODE else 1
            run = tokens[i * stride : i * stride + n]
            if kind == RowKind.DECODE:
                self._hist[n] += 1
                self._per_request.setdefault(id(req), []).append(n)
            before = len(req.output_ids)
            req.append_outputs(run)
            if req.status is ReqStatus.PREFILL:
                req.transition(ReqStatus.RUNNING)
            finish = resolve_finish(
                run,
                num_outputs_before=before,
                params=req.sampling,
                eos_token_ids=self._eos,
                abort_reason=abort_reasons.get(id(req)),
            )
            end = len(req.output_ids) if finish is None else finish.finished_len
            emitted.append((req, tuple(req.output_ids[before:end])))
            if finish is not None:
                self._end(req, finish)
                finished.append(req)
        return emitted, finished

    def _end(self, req: Req, finish: FinishState) -> None:
        target = ReqStatus.ABORTED if finish.reason is FinishReason.ABORT else ReqStatus.FINISHED
        req.transition(target, finish=finish)
