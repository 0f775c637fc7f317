"""The round pipeline: launches batches and settles each result, top-down, in one place.

`RoundPipeline` owns the batches in flight (none, or one under overlap) and the launch and
retire counters. Settling one launched batch is one short sequence of calls, each down to the
owner of its state::

    wait      the forward stream ran the batch (or the forward timeout fired: abandon it)
    check     the result copy, its values, its per-row sampling flags      (result_check)
    settle    commit the accepted runs, append outputs, find finishes      (ResultProcessor)
    finish    end the finished and failed requests                         (RequestLifecycle)
    release   drain the KV of requests no launched batch reads any more    (DeferredReleases)
    record    the round's trace row and spans                              (TraceRecorder)
    observe   the draft policy sees the round at the width it launched     (draft_guard)

A batch that failed (the worker raised, the result broke the contract, the copy never came)
ends exactly its own rows with ERROR; a row the worker marked invalid ends alone.

Invariant: a batch is settled at most once, in launch order; ``num_retired <= num_launched``;
KV of a request that ended while a batch was in flight is released only after that batch retired.
"""

from __future__ import annotations

import logging
from operator import attrgetter

import numpy as np
import numpy.typing as npt

from specstate.core.errors import ForwardTimeout, LedgerViolation, WorkerResultError
from specstate.core.ledger import LedgerReader
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import Req
from specstate.engine.agreement import RoundAgreement
from specstate.engine.config import EngineConfig
from specstate.engine.draft_policy import DraftPolicy
from specstate.engine.invariants import InvariantViolation, SettlementProbe, check_settlement
from specstate.engine.launch import InFlight, Launcher
from specstate.engine.lifecycle import RequestLifecycle
from specstate.engine.outputs import OutputTable
from specstate.engine.result_check import check_sampling_rows
from specstate.engine.result_copy import HostResult
from specstate.engine.results import ResultProcessor, Settlement
from specstate.engine.scheduler import LaunchPlan, Scheduler
from specstate.engine.trace import FORWARD, HOST, TraceRecorder
from specstate.grammar.table import GrammarTable
from specstate.memory.allocation import DeferredReleases, KvAllocator

__all__ = ["RoundPipeline"]

_log = logging.getLogger("specstate")
_REQUEST_ID = attrgetter("request_id")


class RoundPipeline:
    """Owner of the batches in flight; launches and settles them (see the module docstring).

    The ledger, allocator and output table are held for the settlement checks and the trace
    (read only); every write goes through the owner named in the module docstring.
    """

    def __init__(
        self,
        *,
        config: EngineConfig,
        launcher: Launcher,
        scheduler: Scheduler,
        results: ResultProcessor,
        lifecycle: RequestLifecycle,
        deferred: DeferredReleases,
        ledger: LedgerReader,
        allocator: KvAllocator,
        outputs: OutputTable,
        checker: OwnershipChecker,
        draft_policy: DraftPolicy | None,
        trace: TraceRecorder | None,
        grammar: GrammarTable | None = None,
        agreement: RoundAgreement | None = None,
    ) -> None:
        self.launcher = launcher
        self.ledger = ledger
        self.allocator = allocator
        self.outputs = outputs
        self._config = config
        self._scheduler = scheduler
        self._results = results
        self._lifecycle = lifecycle
        self._deferred = deferred
        self._checker = checker
        self._draft_policy = draft_policy
        self._trace = trace
        self._grammar = grammar
        self._agreement = agreement  # multi-rank mode: the ranks agree on every batch
        self.in_flight: InFlight | None = None
        self.num_launched = 0
        self.num_retired = 0

    @property
    def agreement(self) -> RoundAgreement | None:
        """The multi-rank agreement this pipeline calls, or None (read only)."""
        return self._agreement

    # ---------------------------------------------------------------- launch
    def advance(self, plan: LaunchPlan | None, *, started: int = 0) -> tuple[str, ...]:
        """Launch ``plan`` (if any) and settle what this loop settles now; the ended ids.

        Overlap: the batch launched before this one is settled (the host lags one batch).
        Normal loop: ``plan``'s own batch is settled at once.
        """
        launched = None
        if self._agreement is not None:  # every step: the ranks agree on what launches
            self._agreement.on_launch(plan, self.num_launched + (plan is not None))
        if plan is not None:
            self.num_launched += 1
            rec = self._trace
            if rec is not None:
                rec.span(HOST, "schedule", self.num_launched, started, rec.now())
            if self._grammar is not None:  # the batch's grammar view (ForwardBatch.grammar)
                self._grammar.attach(plan)
            launched = self.launcher.launch(
                plan, batch_id=self.num_launched, traced=rec is not None
            )
        previous, self.in_flight = self.in_flight, launched
        if self._config.overlap:
            return () if previous is None else self.settle(previous)
        if launched is not None:
            self.in_flight = None
            return self.settle(launched)
        return ()

    def drain(self, retired: int | None = None) -> None:
        """Release the KV of ended requests that no batch up to ``retired`` can read."""
        with self._checker.acting(Role.SCHEDULER):
            self._deferred.drain(self.num_retired if retired is None else retired)

    # ---------------------------------------------------------------- settle
    def settle(self, flight: InFlight) -> tuple[str, ...]:
        """Settle one launched batch (module docstring); the ids of the requests it ended."""
        rec = self._trace
        waited = 0 if rec is None else rec.now()
        timeout = self._config.forward_timeout_s
        result, error = flight.wait(timeout)
        if flight.timed_out and timeout is not None:
            return self._abandon(flight, timeout, "forward")
        if self.in_flight is not None and self.in_flight is not flight:
            # Overlap: the next forward's launch runs on the stream now; let it reach the
            # worker before this thread's settlement competes with it for the interpreter.
            self.in_flight.wait_started()
        # The worker's own copy event, if it keeps one (a no-op when synchronous).
        if result is not None and not result.wait_copied(timeout):
            return self._abandon(flight, timeout or 0.0, "result copy")
        host = None
        if error is None and result is not None:
            try:
                host = self._checked_host_result(flight, timeout)
            except WorkerResultError as exc:
                error = exc
            else:
                if host is None:
                    return self._abandon(flight, timeout or 0.0, "result copy")
        self.num_retired = flight.batch_id
        if self._agreement is not None:  # every rank settles, or fails, the batch the same way
            error = self._agreement.on_settle(flight.batch_id, flight.plan, host, error)
        settling = 0
        if rec is not None:
            settling = rec.now()
            rec.span(HOST, "wait", flight.batch_id, waited, settling)
        settlement = None
        if error is not None or host is None:
            ended = self._fail(flight, error if error is not None else RuntimeError("no result"))
        else:
            ended, settlement = self._settle_rows(flight, host)
        self._lifecycle.end_many(ended, until_batch=self.num_launched)
        self.drain()
        if rec is not None:
            if host is not None and settlement is not None:
                self._record_round(rec, flight, host, settlement)
            rec.span(HOST, "settle", flight.batch_id, settling, rec.now())
            _record_forward(rec, flight)
        if settlement is not None and flight.plan.batch.num_draft_steps is not None:
            self._observe_round(flight.plan, host)  # last: the round is settled whatever it does
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise error  # the batch is contained; the interruption is the caller's to handle
        return tuple(map(_REQUEST_ID, ended))

    def _checked_host_result(self, flight: InFlight, timeout: float | None) -> HostResult | None:
        """The round's one device-to-host copy (a view on the host CPU), checked; None: late."""
        host = self.launcher.host_result(flight, timeout)
        if host is not None:  # per-row speculation and logprobs, against the batch
            batch = flight.plan.batch
            check_sampling_rows(
                host,
                batch.sampling_info,
                request_ids=batch.request_ids,
                decode=flight.plan.is_decode,
                num_draft_steps=batch.num_draft_steps,
            )
        return host

    def _settle_rows(self, flight: InFlight, host: HostResult) -> tuple[list[Req], Settlement]:
        """Observe, settle and check one good result; the requests it ended."""
        plan = flight.plan
        ended = [] if host.invalid is None else self._fail_invalid_rows(plan, host.invalid)
        if self._grammar is not None:  # grammar dead ends and contract breaks; commit the rest
            ended += self._grammar.settle(flight, host, self._lifecycle)
        probe = SettlementProbe.take(self, flight) if self._config.check_invariants else None
        try:
            settlement = self.settle_result(plan, host)
        except LedgerViolation as exc:
            if probe is not None and not probe.live.all():
                # Checking: the ledger refused a write for a row that was not live.
                raise InvariantViolation(
                    "commit-settlement",
                    f"batch {flight.batch_id}: settlement wrote a row whose request ended "
                    f"or was retracted while the batch was in flight ({exc})",
                ) from exc
            raise
        if probe is not None:
            check_settlement(self, flight, host, probe)
        return [*ended, *settlement.finished], settlement

    def settle_result(self, plan: LaunchPlan, result: HostResult) -> Settlement:
        """The result processor's settlement of one launched batch's checked result."""
        return self._results.settle(
            reqs=plan.batch.reqs,
            slots=plan.slots_host,
            epochs=plan.epochs,
            last_chunk=plan.last_chunk,
            verifies=plan.is_decode,
            result=result,
            abort_reasons=self._lifecycle.abort_reasons,
            detached=plan.detached,
        )

    def _observe_round(self, plan: LaunchPlan, host: HostResult | None) -> None:
        """Hand the draft policy a settled round once, at the width it was launched with.

        Only rows that drafted count: not rows the worker marked invalid, and not requests
        with ``speculative=False`` (they accept one token whatever the drafts). Called after
        the round settled, ended its requests and released their KV: the policy is user code
        (`specstate.engine.draft_guard` contains it), and nothing it does changes the round.
        """
        batch = plan.batch
        if self._draft_policy is None or host is None or batch.num_draft_steps is None:
            return
        drafted = np.ones(host.batch_size, dtype=np.bool_)
        if host.invalid is not None:
            drafted &= ~host.invalid
        if batch.sampling_info.speculative_host is not None:
            drafted &= batch.sampling_info.speculative_host
        accepted = host.accept[drafted].astype(np.int64)
        self._draft_policy.observe(batch.num_draft_steps, accepted)

    # ---------------------------------------------------------------- failure
    def _fail(self, flight: InFlight, failure: BaseException) -> list[Req]:
        """End every row of a failed batch with ERROR."""
        batch = flight.plan.batch
        ended = self._lifecycle.fail(batch.reqs, batch.incarnations, failure)
        _log.error(
            "batch %d (%s, %d requests) failed; its requests end with ERROR",
            flight.batch_id,
            batch.forward_mode.value,
            batch.batch_size,
            exc_info=failure,
        )
        return ended

    def _fail_invalid_rows(self, plan: LaunchPlan, mask: npt.NDArray[np.bool_]) -> list[Req]:
        """End the rows the worker marked invalid with ERROR (their tokens are not settled).

        Ending a request changes its output row's epoch, so settlement then skips the row.
        """
        if not mask.any():
            return []
        batch = plan.batch
        rows = np.flatnonzero(mask).tolist()
        failure = WorkerResultError(
            f"batch {self.num_retired} ({batch.forward_mode.value}): the worker marked the "
            "row invalid (for the reference workers: non-finite logits, raw or after the sampling "
            "controls)"
        )
        ended = self._lifecycle.fail(
            [batch.reqs[i] for i in rows], [batch.incarnations[i] for i in rows], failure
        )
        for req in ended:
            _log.error("request %s ended: %s", req.request_id, failure)
        return ended

    def _abandon(self, flight: InFlight, timeout: float, what: str) -> tuple[str, ...]:
        """Fail a batch that did not finish in time, and the batch queued behind it.

        The stream is abandoned (a fresh one runs later launches) and the queued batch never
        runs. The requests of both batches are quarantined: their KV is released only once the
        abandoned stream is past the forward, which may still write it (the queued batch's
        requests may hold pages that a retraction took from the timed-out batch's rows).
        """
        queued = self.in_flight if self.in_flight not in (None, flight) else None
        flights = [flight] if queued is None else [flight, queued]
        drained = self.launcher.abandon(flights)
        self.in_flight = None
        self.num_retired = flights[-1].batch_id
        error: BaseException = flight.timeout_error(timeout, what)
        if self._agreement is not None:
            error = self._agreement.on_settle(flight.batch_id, flight.plan, None, error) or error
        _log.error("%s", error)
        batch = flight.plan.batch
        ended = self._lifecycle.fail(batch.reqs, batch.incarnations, error)
        if queued is not None:
            behind = ForwardTimeout(
                f"batch {queued.batch_id} was queued behind batch {flight.batch_id}, whose "
                f"{what} timed out; it never ran"
            )
            batch = queued.plan.batch
            ended += self._lifecycle.fail(batch.reqs, batch.incarnations, behind)
        for req in ended:
            self._lifecycle.quarantine(req, until=drained)
        self.drain()
        return tuple(map(_REQUEST_ID, ended))

    # ---------------------------------------------------------------- record
    def _record_round(
        self, rec: TraceRecorder, flight: InFlight, host: HostResult, settlement: Settlement
    ) -> None:
        """One round of the trace: a handful of array copies, no per-request Python."""
        plan = flight.plan
        slots = plan.slots_host
        committed, allocated = self.ledger.host_lengths(slots)
        accept = np.array(host.accept, dtype=np.int64)
        last = np.maximum(accept, 1) - 1
        rows = {
            "id": plan.batch.request_ids,
            "incarnation": plan.batch.incarnations,
            "settled": settlement.live.copy(),
            "frontier_in": np.array(host.seq_lens, dtype=np.int64),
            "frontier_out": None if host.frontier is None else np.array(host.frontier),
            "accept": accept,
            "bonus": host.tokens[np.arange(accept.size), last].astype(np.int64),
            "committed": committed,
            "allocated": allocated,
            "protected": self.ledger.host_protected(slots),
            "outputs": self.outputs.lengths(slots),
        }
        rec.round(
            batch=flight.batch_id,
            mode=plan.batch.forward_mode.value,
            verify=plan.is_decode,
            at_ns=rec.now(),
            running=self._scheduler.num_running,
            free_pages=self.allocator.token_pool.available_pages(),
            rows=rows,
        )


def _record_forward(rec: TraceRecorder, flight: InFlight) -> None:
    """The forward track of a batch from its closure's clock marks (read after it ran)."""
    marks = flight.marks
    if not marks:
        return
    if len(marks) == 4:  # start, worker called, worker returned, end
        start, called, returned, end = marks
        rec.span(FORWARD, "resolve", flight.batch_id, start, called)
        rec.span(FORWARD, "forward", flight.batch_id, called, returned)
        rec.span(FORWARD, "post", flight.batch_id, returned, end)
    else:  # the closure failed before or inside the worker
        rec.span(FORWARD, "failed", flight.batch_id, marks[0], marks[-1])
    if flight.publish_ns:
        rec.publish(flight.batch_id, flight.publish_ns)
