"""The GrammarTable: the owner of every request's grammar state, a capability of the round.

One `GrammarState` per live request that asked for a grammar, from submit to its end. The table
meets the round at four of its hook points (`specstate.engine.hooks`)::

    on_submit  compile(req)            a grammar that does not compile is refused with
                                       `InvalidRequest` naming the request and the error
    on_launch  attach(plan)            the batch's `GrammarRows` (ForwardBatch.grammar), or none
    on_result  row verdicts            before the result processor: the rows whose forward met
                                       a dead end or broke the grammar contract fail (the
                                       round ends them); the committed position of the others
                                       advances by exactly the tokens the round settles
                                       (checked against what the forward kept)
    on_end     forget(reqs)            ended requests leave the table

A batch with no grammar row costs nothing beyond a dictionary lookup per row at launch; an engine
whose requests never asked for a grammar costs nothing at all. The grammar library (llguidance)
is imported on the first compile.

Invariant (``check``, after every step with ``check_invariants``): every live request with a
grammar has a state and no other request has one; an admitted request's ``num_committed``
equals its settled outputs; a running request with no batch in flight holds a matcher exactly at
its outputs (``position == num_committed``, the same tokens), not ended, and its matcher is in
llguidance's error state only at a recorded dead end (the request ends at its next round).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import attrs

from specstate.core.errors import GrammarError, InvalidRequest, InvariantViolation
from specstate.core.params import RequestLimits
from specstate.core.request import Req
from specstate.core.status import ReqStatus
from specstate.engine.hooks import LiveRows, RoundHook, RowFailure
from specstate.grammar.rows import GrammarRows
from specstate.grammar.state import GrammarCompiler, GrammarState

if TYPE_CHECKING:
    import llguidance

    from specstate.batch.plan import LaunchPlan
    from specstate.engine.config import StepReport
    from specstate.engine.hooks import EngineView
    from specstate.engine.launch.outcome import Collected
    from specstate.engine.launch.result_copy import HostResult
    from specstate.engine.trace import TraceRecorder

__all__ = ["GrammarSnapshot", "GrammarTable"]

_log = logging.getLogger("specstate")


@attrs.frozen(kw_only=True)
class GrammarSnapshot:
    """The grammar table at one instant.

    Attributes:
        num_requests: live requests with a grammar.
        committed: ``(request id, committed position)`` of each, in submission order.
        num_masks: token masks computed (one per row and position).
        num_prefetched_masks: masks a forward used that the previous forward had built (the
            first position of a round, built right after the previous round's accepted run).
        num_rollbacks: times a row's rejected drafts were rolled back (one per row and round).
        num_rolled_back_tokens: draft tokens rolled back.
        num_pruned_drafts: drafts the grammar refused (proposed without masks, e.g. n-gram).
        num_rebuilds: matchers rebuilt after a dead end on a rejected draft.
        num_dead_ends: requests ended because no token could follow.
        num_violations: requests ended because a forward broke the grammar contract.
    """

    num_requests: int
    committed: tuple[tuple[str, int], ...]
    num_masks: int
    num_prefetched_masks: int
    num_rollbacks: int
    num_rolled_back_tokens: int
    num_pruned_drafts: int
    num_rebuilds: int
    num_dead_ends: int
    num_violations: int


class GrammarTable(RoundHook):
    """Owner of the grammar state of every request; see the module docstring.

    Args:
        limits: the model's vocabulary size, EOS ids and grammar vocabulary (None: grammars are
            refused at submit).
        trace: the engine's trace recorder; grammar steps become ``grammar-*`` spans.
        mask_threads: threads of llguidance's parallel mask executor; 1 builds the masks one
            request after the other (each call releases the interpreter lock).
    """

    def __init__(
        self,
        *,
        limits: RequestLimits,
        trace: TraceRecorder | None = None,
        mask_threads: int = 1,
    ) -> None:
        vocabulary = limits.grammar_vocabulary
        self._compiler = (
            None
            if vocabulary is None
            else GrammarCompiler(
                vocabulary, vocab_size=limits.vocab_size, eos_token_ids=limits.eos_token_ids
            )
        )
        self._trace = trace
        self._mask_threads = mask_threads
        self._executor: llguidance.LLExecutor | None = None
        self._states: dict[Req, GrammarState] = {}
        # The last decode round's rows, keyed by its (persistent) request tuple.
        self._rows_cache: tuple[Any, ...] | None = None
        self._counts = dict.fromkeys(
            ("masks", "prefetched", "rollbacks", "rolled_back_tokens", "pruned_drafts", "rebuilds"),
            0,
        )
        self._dead_ends = 0
        self._violations = 0

    # ----------------------------------------------------------------- submit
    def on_submit(self, req: Req) -> None:
        """Compile ``req``'s grammar (`compile`)."""
        self.compile(req)

    def compile(self, req: Req) -> None:
        """Compile ``req``'s grammar (if any) and keep its state (intake, at submit).

        Raises:
            InvalidRequest: no grammar vocabulary, the grammar library is missing, or the
                grammar does not compile (naming the request and the library's error).
        """
        grammar = req.sampling.grammar
        if grammar is None:
            return
        rid = req.request_id
        if self._compiler is None:
            raise InvalidRequest(
                f"request {rid!r}: a grammar needs the tokenizer's vocabulary "
                "(RequestLimits(grammar_vocabulary=...)); this engine has none",
                fields=("grammar",),
            )
        try:
            text, matcher = self._compiler.compile(grammar)
        except ValueError as exc:
            raise InvalidRequest(
                f"request {rid!r}: grammar {grammar.describe()} does not compile: {exc}",
                fields=("grammar",),
            ) from None
        self._states[req] = GrammarState(
            request_id=rid, grammar=grammar, text=text, matcher=matcher, compiler=self._compiler
        )

    def state(self, req: Req) -> GrammarState | None:
        """``req``'s grammar state, if it has one (tests and the checker read it)."""
        return self._states.get(req)

    # ----------------------------------------------------------------- launch
    def on_launch(self, plan: LaunchPlan | None, batch_id: int) -> None:
        """Give ``plan``'s batch its `GrammarRows` when a row samples under a grammar.

        A decode round of the same running batch as the previous one (the scheduler keeps it
        persistent) reuses that round's row lists: a steady round costs no per-row work here.
        """
        if not self._states or plan is None:
            return
        batch = plan.batch
        n_prefill = len(plan.last_chunk)
        cached = self._rows_cache
        if n_prefill == 0 and cached is not None and cached[0] is batch.reqs:
            rows, states, owners, incarnations = cached[1:]
            resume: Sequence[int | None] = [None] * len(rows)
        else:
            rows, states, owners, incarnations, resume = self._rows_of(plan)
            if n_prefill == 0:
                self._rows_cache = (batch.reqs, rows, states, owners, incarnations)
        if not rows:
            return
        assert self._compiler is not None  # a state exists only once a grammar compiled
        batch.grammar = GrammarRows(
            batch_rows=rows,
            states=states,
            resume=resume,
            owners=owners,
            incarnations=incarnations,
            executor=self._get_executor(),
            mask_words=self._compiler.mask_words,
            traced=self._trace is not None,
        )

    def _rows_of(self, plan: LaunchPlan) -> tuple[Any, ...]:
        """The grammar rows of ``plan``: batch rows, states, requests, incarnations, resumes."""
        batch = plan.batch
        n_prefill = len(plan.last_chunk)
        rows: list[int] = []
        states: list[GrammarState] = []
        owners: list[Req] = []
        incarnations: list[int] = []
        resume: list[int | None] = []
        for i, req in enumerate(batch.reqs):
            state = self._states.get(req)
            if state is None or (i < n_prefill and not plan.last_chunk[i]):
                continue  # no grammar, or a chunk whose sampled token is never kept
            rows.append(i)
            states.append(state)
            owners.append(req)
            incarnations.append(batch.incarnations[i])
            resume.append(state.num_committed if i < n_prefill else None)
        return rows, states, owners, incarnations, resume

    def _get_executor(self) -> llguidance.LLExecutor | None:
        if self._executor is None and self._mask_threads > 1:
            import llguidance

            self._executor = llguidance.LLExecutor(self._mask_threads)
        return self._executor

    # ----------------------------------------------------------------- settle
    def on_result(
        self, flight: Collected, host: HostResult, live_rows: LiveRows
    ) -> Sequence[RowFailure]:
        """Before the result processor settles ``flight``: the grammar rows that fail; commit
        the others (see the module docstring)."""
        plan = flight.plan
        view = plan.batch.grammar
        if view is None:
            return ()
        live = live_rows()
        rec = self._trace
        started = 0 if rec is None else rec.now()
        batch = plan.batch
        failed: list[RowFailure] = []
        outcomes = view.outcome()
        seen = {out.row for out in outcomes}
        for i in view.batch_rows:
            if live[i] and i not in seen:  # a row the forward never took into account
                self._violations += 1
                failed.append(
                    _failure(
                        i,
                        f"request {batch.reqs[i].request_id}: the forward did not use its "
                        "grammar (ForwardBatch.grammar) for this row",
                    )
                )
        for out in outcomes:
            i = out.row
            if not live[i]:
                continue  # the request ended or was retracted while the batch was in flight
            req = batch.reqs[i]
            state = self._states[req]
            settled = _grammar_run(host.tokens[i, : int(host.accept[i])].tolist(), state)
            if out.failure is None and out.tokens != settled:
                self._violations += 1
                failed.append(
                    _failure(
                        i,
                        f"request {req.request_id}: the forward's grammar kept {list(out.tokens)} "
                        f"but the round settles {list(settled)}",
                    )
                )
            elif out.failure is not None:
                if out.dead_end:
                    self._dead_ends += 1
                else:
                    self._violations += 1
                failed.append(_failure(i, out.failure))
            else:
                state.num_committed += len(settled)
        self._add_stats(view)
        if rec is not None:
            from specstate.engine.trace import FORWARD, HOST

            for name, start, end in view.spans:
                rec.span(FORWARD, name, flight.batch_id, start, end)
            rec.span(HOST, "grammar-settle", flight.batch_id, started, rec.now())
        return failed

    def _add_stats(self, view: GrammarRows) -> None:
        stats = view.stats()
        for name in self._counts:
            self._counts[name] += getattr(stats, name)

    # -------------------------------------------------------------------- end
    def on_end(self, report: StepReport) -> None:
        """The step's ended requests leave the table (their matchers are dropped)."""
        if self._states:
            for req in report.ended:
                if self._states.pop(req, None) is not None:
                    self._rows_cache = None  # its rows may name an ended request's state

    # ------------------------------------------------------------------ check
    def check(self, view: EngineView) -> None:
        """The invariants of the module docstring (`InvariantViolation` names the first broken)."""
        sched = view.scheduler
        arriving = [r for r, _ in sched.arriving]  # handed-off requests: not admitted yet
        live = [*sched.waiting, *arriving, *sched.prefilling, *sched.running, *sched.parked]
        with_grammar = {r for r in live if r.sampling.grammar is not None}
        for req in with_grammar - self._states.keys():
            _fail_check("grammar-records", f"request {req.request_id}: a grammar but no state")
        for req in self._states.keys() - with_grammar:
            if not req.is_finished:
                _fail_check("grammar-records", f"request {req.request_id}: a state but not live")
        flight = view.in_flight
        busy = set() if flight is None else {id(r) for r in flight.plan.batch.reqs}
        for req in [*sched.prefilling, *sched.running, *sched.parked]:
            state = self._states.get(req)
            if state is None:
                continue
            if state.num_committed != req.num_outputs:
                _fail_check(
                    "grammar-committed",
                    f"request {req.request_id}: grammar committed {state.num_committed} but "
                    f"{req.num_outputs} outputs settled",
                )
            if req.status is ReqStatus.RUNNING and id(req) not in busy:
                self._check_idle(req, state)

    @staticmethod
    def _check_idle(req: Req, state: GrammarState) -> None:
        """A running request with nothing in flight: its matcher sits exactly at its outputs."""
        outputs = list(req.output_ids)
        if state.tokens != outputs or state.position != state.num_committed:
            _fail_check(
                "grammar-position",
                f"request {req.request_id}: matcher at {state.position} tokens "
                f"{state.tokens[-6:]} but {len(outputs)} outputs ending {outputs[-6:]} settled "
                "with no batch in flight",
            )
        # A dead end found by looking ahead ends the request at its next round; an error state
        # nobody recorded (a dead end on a draft that was not rebuilt) is a broken matcher.
        if state.ended or (state.is_error() and state.dead is None):
            _fail_check(
                "grammar-position",
                f"request {req.request_id}: running with an ended or broken matcher "
                f"(ended {state.ended}, error {state.is_error()})",
            )

    # --------------------------------------------------------------- snapshot
    def snapshot(self) -> GrammarSnapshot:
        """A frozen copy of the table's state and counters."""
        return GrammarSnapshot(
            num_requests=len(self._states),
            committed=tuple((s.request_id, s.num_committed) for s in self._states.values()),
            num_masks=self._counts["masks"],
            num_prefetched_masks=self._counts["prefetched"],
            num_rollbacks=self._counts["rollbacks"],
            num_rolled_back_tokens=self._counts["rolled_back_tokens"],
            num_pruned_drafts=self._counts["pruned_drafts"],
            num_rebuilds=self._counts["rebuilds"],
            num_dead_ends=self._dead_ends,
            num_violations=self._violations,
        )


def _grammar_run(run: list[int], state: GrammarState) -> tuple[int, ...]:
    """The part of a settled run the grammar consumes: up to and including its first end token."""
    eos = state.eos_token_ids
    for k, token in enumerate(run):
        if token in eos:
            return tuple(run[: k + 1])
    return tuple(run)


def _failure(row: int, message: str) -> RowFailure:
    """Row ``row`` fails with a `GrammarError` (logged: the request ends with it)."""
    return RowFailure(row, GrammarError(message))


def _fail_check(invariant: str, message: str) -> None:
    raise InvariantViolation(invariant, message)
