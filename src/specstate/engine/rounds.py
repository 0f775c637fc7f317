"""The round pipeline: the one owner of a step, which reads top-down in `RoundPipeline.step`.

`Engine.step` is this, and nothing else. One step, each line one call down to the owner of its
state (capabilities plug in at the hook points of `specstate.engine.hooks`; N is the batch
launched this step, collected at once in the normal loop, one step later under overlap)::

    aborts      end the requests whose abort was asked for              (RequestLifecycle)
    release     KV of ended requests no launched batch reads any more   (DeferredReleases)
    schedule    N, retracting under KV pressure                         (Scheduler)
    launch      hooks.on_launch, then N on the forward stream           (Launcher)
    collect     N (overlap: N - 1): its result copied and checked once  (Launcher, result_check)
                hooks.on_collect: the batch's verdict
    settle      hooks.on_result: row verdicts; then commit the accepted runs, append the
                outputs, find the finishes — ending nobody                 (ResultProcessor)
    end         every verdict: failed rows, finished requests            (RequestLifecycle)
    release     what the collected batch held for ended requests        (DeferredReleases)
    record      hooks.on_settled (trace, draft policy)
    check       every invariant (``check_invariants``)                  (check_engine)
    report      hooks.on_end                                           -> StepReport

A batch that failed (the worker raised, the result broke the contract, the copy never came)
ends exactly its own rows with ERROR; a row the worker or a capability marked failed ends alone.

Invariant: a batch is collected and settled at most once, in launch order;
``num_retired <= num_launched``; KV of a request that ended while a batch was in flight is
released only after that batch retired; requests end only through the lifecycle.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from operator import attrgetter

import attrs

from specstate.batch.plan import LaunchPlan
from specstate.core.errors import InvariantViolation, LedgerViolation, WorkerResultError
from specstate.core.ledger import LedgerReader
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import Req
from specstate.engine.config import EngineConfig, StepReport
from specstate.engine.hooks import BoolArray, RoundHooks, RowFailure
from specstate.engine.invariants import SettlementProbe, check_engine, check_settlement
from specstate.engine.launch.launcher import Launcher
from specstate.engine.launch.outcome import Collected, InFlightView
from specstate.engine.launch.result_copy import HostResult
from specstate.engine.schedule.scheduler import Scheduler
from specstate.engine.settle.lifecycle import RequestLifecycle
from specstate.engine.settle.outputs import OutputTable
from specstate.engine.settle.results import ResultProcessor, Settlement
from specstate.memory.allocation import KvAllocator
from specstate.memory.deferred import DeferredReleases

__all__ = ["RoundParts", "RoundPipeline"]

_log = logging.getLogger("specstate")
_REQUEST_ID = attrgetter("request_id")


@attrs.frozen(kw_only=True)
class RoundParts:
    """The owners one round calls (the ledger, allocator and output table only to check)."""

    scheduler: Scheduler
    launcher: Launcher
    results: ResultProcessor
    lifecycle: RequestLifecycle
    deferred: DeferredReleases
    checker: OwnershipChecker
    ledger: LedgerReader
    allocator: KvAllocator
    outputs: OutputTable


class RoundPipeline:
    """Owner of the step and of the launch and retire counters; see the module docstring.

    It is also the `EngineView` the invariant checker reads after each step.
    """

    def __init__(self, *, parts: RoundParts, hooks: RoundHooks, config: EngineConfig) -> None:
        self._parts = parts
        self._config = config
        self.hooks = hooks
        self.num_launched = 0
        self.num_retired = 0

    # ------------------------------------------------------------ the step
    def step(self) -> StepReport:
        """One iteration of the configured loop, top-down (module docstring)."""
        for on_step in self.hooks.on_step:
            on_step()
        parts = self._parts
        ended = parts.lifecycle.apply_aborts(until_batch=self.num_launched)
        self._release()
        plan, retraction = parts.scheduler.schedule()
        retracted: tuple[str, ...] = ()
        if retraction is not None:
            retracted = tuple(map(_REQUEST_ID, retraction.retracted))
            ended += parts.lifecycle.end_retraction(retraction, until_batch=self.num_launched)
        busy = parts.launcher.num_in_flight
        collected = self._launch(plan)
        if collected is not None:
            ended += self._settle(collected)
        if plan is None and not busy and not parts.scheduler.has_work:
            self._release(self.num_launched)  # idle: no batch can read any released KV
        if self._config.check_invariants:
            check_engine(self)
        return self._report(plan, ended, retracted)

    def close(self, reason: str) -> StepReport:
        """End every live request with ABORT (``reason``) and stop the forward stream."""
        parts = self._parts
        try:
            ended = parts.lifecycle.abort_live(reason, until_batch=self.num_launched)
            return self._report(None, ended, ())
        finally:
            parts.launcher.close()

    def _report(
        self, plan: LaunchPlan | None, ended: list[Req], retracted: tuple[str, ...]
    ) -> StepReport:
        """Remember the ended requests and tell every capability the step is over."""
        report = StepReport(
            launched_mode=None if plan is None else plan.batch.forward_mode._value_,
            launched_size=0 if plan is None else plan.batch.batch_size,
            finished=tuple(map(_REQUEST_ID, ended)) if ended else (),
            retracted=retracted,
            ended=tuple(ended) if ended else (),
        )
        if ended:
            self._parts.lifecycle.remember_ended(ended)
        for on_end in self.hooks.on_end:
            on_end(report)
        return report

    # -------------------------------------------------------------- launch
    def _launch(self, plan: LaunchPlan | None) -> Collected | None:
        """Launch ``plan`` (if any); the batch this loop settles now, collected, if any.

        Overlap: the batch launched before this one (the host lags one batch). Normal loop:
        ``plan``'s own batch.
        """
        launcher = self._parts.launcher
        batch_id = self.num_launched + (plan is not None)
        for on_launch in self.hooks.on_launch:  # every step, so the ranks stay in step
            on_launch(plan, batch_id)
        if plan is not None:
            self.num_launched = batch_id
            launcher.launch(plan, batch_id=batch_id)
        keep = 1 if self._config.overlap and plan is not None else 0
        return launcher.collect() if launcher.num_in_flight > keep else None

    # -------------------------------------------------------------- settle
    def _settle(self, collected: Collected) -> list[Req]:
        """Settle one collected batch: verdicts, settlement, ends, release, record."""
        queued = collected.queued  # a timed-out stream's batches retire with it, unsettled
        self.num_retired = queued[-1].batch_id if queued else collected.batch_id
        error = collected.error
        for on_collect in self.hooks.on_collect:
            error = on_collect(collected, error)
        settlement = None
        host = collected.host
        if host is not None and error is None:
            ended, settlement = self._settle_rows(collected, host)
        else:
            failure = error or RuntimeError(f"batch {collected.batch_id} has no result")
            if collected.quarantine is not None:
                ended = self._fail_abandoned(collected, failure)
            else:
                ended = self._fail_batch(collected, failure)
        self._release()
        for on_settled in self.hooks.on_settled:
            on_settled(collected, settlement)
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise error  # the batch is contained; the interruption is the caller's to handle
        return ended

    def _settle_rows(self, collected: Collected, host: HostResult) -> tuple[list[Req], Settlement]:
        """A good result: row verdicts, then settlement, then every end it decided."""
        plan = collected.plan
        ended = [] if host.invalid is None else self._fail_invalid_rows(plan, host.invalid)
        if self.hooks.on_result:
            outputs = self._parts.outputs

            def live_rows() -> BoolArray:
                """Rows whose request still holds the output row it was launched with (a row
                ended by a verdict has a new epoch, so this is current after each hook)."""
                live: BoolArray = outputs.epochs(plan.slots_host) == plan.epochs
                return live

            for on_result in self.hooks.on_result:
                failures = on_result(collected, host, live_rows)
                if failures:
                    ended += self._fail_rows(plan, failures)
        check = self._config.check_invariants
        probe = SettlementProbe.take(self, collected) if check else None
        try:
            settlement = self.settle_result(plan, host)
        except LedgerViolation as exc:
            if probe is not None and not probe.live.all():
                # Checking: the ledger refused a write for a row that was not live.
                raise InvariantViolation(
                    "commit-settlement",
                    f"batch {collected.batch_id}: settlement wrote a row whose request ended "
                    f"or was retracted while the batch was in flight ({exc})",
                ) from exc
            raise
        self._parts.lifecycle.finish(
            settlement.finished, settlement.finishes, until_batch=self.num_launched
        )
        if probe is not None:
            check_settlement(self, collected, host, probe)
        return [*ended, *settlement.finished], settlement

    def settle_result(self, plan: LaunchPlan, result: HostResult) -> Settlement:
        """The result processor's settlement of one launched batch's checked result: it
        commits and appends, and returns the finishes it found (nobody is ended here)."""
        return self._parts.results.settle(
            reqs=plan.batch.reqs,
            slots=plan.slots_host,
            epochs=plan.epochs,
            last_chunk=plan.last_chunk,
            verifies=plan.is_decode,
            result=result,
            abort_reasons=self._parts.lifecycle.abort_reasons,
            detached=plan.detached,
            budgets=None if plan.batch.verify_budgets is None else plan.batch.verify_budgets.host,
        )

    # ------------------------------------------------------------- failure
    def _fail_batch(self, collected: Collected, failure: BaseException) -> list[Req]:
        """End every row of a failed batch with ERROR."""
        batch = collected.plan.batch
        ended = self._parts.lifecycle.fail(
            batch.reqs, batch.incarnations, failure, until_batch=self.num_launched
        )
        _log.error(
            "batch %d (%s, %d requests) failed; its requests end with ERROR",
            collected.batch_id,
            batch.forward_mode.value,
            batch.batch_size,
            exc_info=failure,
        )
        return ended

    def _fail_invalid_rows(self, plan: LaunchPlan, mask: BoolArray) -> list[Req]:
        """End the rows the worker marked invalid with ERROR (their tokens are not settled)."""
        if not mask.any():
            return []
        failure = WorkerResultError(
            f"batch {self.num_retired} ({plan.batch.forward_mode.value}): the worker marked the "
            "row invalid (for the reference workers: non-finite logits, raw or after the sampling "
            "controls)"
        )
        return self._fail_rows(plan, [RowFailure(i, failure) for i in mask.nonzero()[0].tolist()])

    def _fail_rows(self, plan: LaunchPlan, failures: Sequence[RowFailure]) -> list[Req]:
        """End each failed row with its error.

        Ending a request changes its output row's epoch, so settlement then skips the row.
        """
        batch, lifecycle = plan.batch, self._parts.lifecycle
        ended: list[Req] = []
        for failure in failures:
            i = failure.row
            for req in lifecycle.fail(
                [batch.reqs[i]],
                [batch.incarnations[i]],
                failure.error,
                until_batch=self.num_launched,
            ):
                _log.error("request %s ended: %s", req.request_id, failure.error)
                ended.append(req)
        return ended

    def _fail_abandoned(self, collected: Collected, error: BaseException) -> list[Req]:
        """A batch whose forward or result copy timed out, and the batches queued behind it.

        Their requests end with ERROR and their KV is quarantined: released only once the
        abandoned stream is past the forward, which may still write it (the queued batch's
        requests may hold pages that a retraction took from the timed-out batch's rows).
        """
        _log.error("%s", error)
        lifecycle, quarantine = self._parts.lifecycle, collected.quarantine
        ended: list[Req] = []
        for flight, failure in ((collected, error), *((q, q.error) for q in collected.queued)):
            batch = flight.plan.batch
            assert failure is not None  # a queued batch always carries its ForwardTimeout
            ended += lifecycle.fail(
                batch.reqs,
                batch.incarnations,
                failure,
                until_batch=self.num_launched,
                quarantine=quarantine,
            )
        return ended

    def report_ended(self, ended: list[Req]) -> StepReport:
        """Tell every capability that ``ended`` ended between steps (`Engine.release_handoff`:
        the grammar table drops their states, streams deliver their ends), and release now the
        KV no launched batch can still read."""
        self._release()
        return self._report(None, ended, ())

    def _release(self, retired: int | None = None) -> None:
        """Release the KV of ended requests that no batch up to ``retired`` can read."""
        parts, until = self._parts, self.num_retired if retired is None else retired
        if parts.deferred.is_due(until):  # most steps release nothing: no role scope
            with parts.checker.acting(Role.SCHEDULER):
                parts.deferred.drain(until)

    # ---------------------------------------------------------- the view
    @property
    def results(self) -> ResultProcessor:
        """The result processor."""
        return self._parts.results

    @property
    def lifecycle(self) -> RequestLifecycle:
        """The request lifecycle."""
        return self._parts.lifecycle

    @property
    def launcher(self) -> Launcher:
        """The launcher (its FutureMap, stream and batches in flight)."""
        return self._parts.launcher

    @property
    def in_flight(self) -> InFlightView | None:
        """The batch launched and not settled yet (overlap), or None."""
        return self._parts.launcher.in_flight

    @property
    def is_idle(self) -> bool:
        """True when nothing waits, runs or is in flight, and no abort is pending (an abort of
        a request parked for a handoff is the next step's work)."""
        parts = self._parts
        return (
            not parts.scheduler.has_work
            and not parts.launcher.num_in_flight
            and not parts.lifecycle.abort_reasons
        )

    @property
    def ledger(self) -> LedgerReader:
        """The KV ledger (read only)."""
        return self._parts.ledger

    @property
    def allocator(self) -> KvAllocator:
        """The KV allocator (read only here)."""
        return self._parts.allocator

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (read only here)."""
        return self._parts.scheduler

    @property
    def deferred(self) -> DeferredReleases:
        """The deferred releases (read only here)."""
        return self._parts.deferred

    @property
    def outputs(self) -> OutputTable:
        """The output table (read only here)."""
        return self._parts.outputs
