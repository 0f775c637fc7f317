"""The Engine: the public face of one worker's scheduling state, in the normal or overlap loop.

One `Engine` holds the owners `specstate.engine.compose.compose` builds for its worker (the
ledger, the KV allocator, the scheduler, the result processor, the launcher with its FutureMap,
isolator and forward stream, the lifecycle, the capabilities) and exposes the public API; each
`step` is one call to the round pipeline (`specstate.engine.rounds`), one iteration::

    normal:   schedule N -> launch N -> settle N
    overlap:  schedule N+1 (host lags one batch) -> launch N+1 on the stream -> settle N

A launched batch runs on the forward stream (a real worker thread on a CPU, unless the worker
only enqueues: `WorkerCapabilities.asynchronous`): resolve its relay values behind the publish
fence, isolate it, call the worker with ``on_publish``, publish and stash the next round's
inputs, then record the result copy event. The host settles a batch only after that event.
A request that ends while a later batch is in flight keeps its KV until that batch retires
(`DeferredReleases`).

Threading: one thread drives an engine — `submit`, `abort`, `step`, `run_until_idle`,
`generate` and `close` all come from the thread that first called one of them; a call from
another thread raises `UsageError` and changes nothing (the forward stream's own thread is the
engine's, not a caller). After `close`, every call but `close` raises `UsageError`.

Invariant: after every `step`, with ``check_invariants`` on, `check_engine` holds: the ledger is
ordered, the pools balance, every open slot belongs to exactly one live or deferred request,
and every running request that has no result in flight satisfies ``seqlen == committed + 1``.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from specstate.core.errors import InvalidConfig, InvalidRequest, UsageError
from specstate.core.params import RequestLimits, SamplingParams
from specstate.core.request import Req
from specstate.engine.budgets import VerifyBudgetPolicy
from specstate.engine.capabilities.agreement import RoundAgreement
from specstate.engine.compose import compose
from specstate.engine.config import EngineConfig, EngineSnapshot, StepReport
from specstate.engine.draft_policy import DraftPolicy
from specstate.engine.handoff import HandoffDesk
from specstate.engine.hooks import RoundHooks
from specstate.engine.launch.outcome import InFlightView
from specstate.engine.schedule.intake import check_request
from specstate.engine.trace import TraceRecorder
from specstate.engine.worker import WorkerProtocol
from specstate.handoff.record import CompatibilityDescriptor, HandoffRecord

__all__ = ["Engine"]


class Engine:
    """Drives one `WorkerProtocol` with specstate's scheduling state.

    The engine replaces a server's scheduler loop, KV pool and ``req_to_token`` layout: it owns
    the ledger, the KV allocator, the scheduler, the result processor, the FutureMap, the
    forward isolator and the forward stream; the worker only runs forwards. Each `step` is one
    iteration: ``schedule N -> launch N -> settle N`` (normal loop) or ``schedule N+1 -> launch
    N+1 on the forward stream -> settle N`` (overlap loop, ``EngineConfig(overlap=True)``).

    Use: ``submit`` requests, then ``step`` (or ``run_until_idle``, ``generate``, or
    `specstate.stream`) until they finish; read ``Req.emitted_ids`` and ``Req.finish``;
    ``close`` when done (the engine is also a context manager).

    Threading: one thread drives an engine; a call from another thread raises `UsageError`
    and changes nothing. After ``close``, every call but ``close`` raises `UsageError`.

    Invariant: after every ``step`` with ``check_invariants`` on, `check_engine` holds (the
    ledger is ordered, the pools balance, every open slot belongs to exactly one live or
    deferred request, and every idle running request has ``seqlen == committed + 1``).

    Args:
        worker: the model runner.
        limits: the model's vocabulary, context length and EOS ids (request validation).
        config: loop and memory options.
        trace: a recorder of spans, rounds and events (`specstate.engine.trace`); None, the
            default, records nothing and costs nothing.
        draft_policy: picks the draft steps of each decode round
            (`specstate.engine.draft_policy`); it sees every settled decode round once, with
            the width that round was launched with. Default: `AcceptanceEma` when
            ``config.adaptive_draft``, else none (the worker's ``num_steps`` every round).
        verify_budget: plans each decode round's per-row verify budgets from settled
            history (`specstate.engine.budgets`: `BatchSizeSchedule`, `GoodputBudget`,
            `ConfidenceBudget`, ...); the reservation then follows each row's budget. For a
            worker that declares ``supports_verify_budgets``. None: every row verifies the
            round's width.
        agreement: one rank's engine of a tensor-parallel group
            (`specstate.distributed.DistributedEngine` builds it): the worker gets its group
            and every batch is agreed on with the other ranks. None: a single-rank engine.
    """

    def __init__(
        self,
        worker: WorkerProtocol,
        *,
        limits: RequestLimits,
        config: EngineConfig,
        trace: TraceRecorder | None = None,
        draft_policy: DraftPolicy | None = None,
        agreement: RoundAgreement | None = None,
        verify_budget: VerifyBudgetPolicy | None = None,
    ):
        parts = compose(
            worker,
            limits=limits,
            config=config,
            trace=trace,
            draft_policy=draft_policy,
            agreement=agreement,
            verify_budget=verify_budget,
        )
        self.config = config
        self.limits = limits
        self.worker = worker
        memory = parts.memory
        self.checker = memory.checker
        self.ledger = memory.ledger
        self.recurrent = memory.recurrent
        self.allocator = memory.allocator
        self.deferred = memory.deferred
        self.outputs = memory.outputs
        self.scheduler = parts.scheduler
        self.rounds = parts.rounds
        self.results = self.rounds.results
        self.lifecycle = self.rounds.lifecycle
        self.grammar = parts.grammar
        self.deliveries = parts.deliveries
        self._draft_guard = parts.draft_guard
        self._budget_guard = parts.budget_guard
        self._handoff = HandoffDesk(
            worker=worker,
            config=config,
            limits=limits,
            scheduler=self.scheduler,
            lifecycle=self.lifecycle,
            allocator=self.allocator,
            ledger=self.ledger,
            launcher=self.rounds.launcher,
            recurrent=self.recurrent,
        )
        self._num_generated = 0
        self._driver: int | None = None  # the driving thread's ident, set by the first call
        self._closed = False

    # ---------------------------------------------------------------- requests
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> Req:
        """Validate and queue a request; `InvalidRequest` leaves the engine unchanged."""
        self._check_caller("submit")
        req = self._new_request(request_id, prompt_ids, sampling)
        self.lifecycle.register(req)
        self.scheduler.enqueue(req)
        return req

    def _new_request(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> Req:
        """A validated WAITING request the submit hooks accepted (not registered yet)."""
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(
                f"request id must be a non-empty string, got {request_id!r}",
                fields=("request_id",),
            )
        if self.lifecycle.is_live(request_id):
            raise InvalidRequest(
                f"request {request_id!r}: a live request already has this id",
                fields=("request_id",),
            )
        req = Req.new(request_id, prompt_ids, sampling, self.limits, checker=self.checker)
        pool = self.allocator.token_pool
        check_request(
            req,
            self.worker.capabilities,
            self.limits,
            window=self.allocator.window,
            pool_tokens=pool.num_pages * pool.page_size,
        )
        for on_submit in self.rounds.hooks.on_submit:  # grammar compiles (or refuses), trace
            on_submit(req)
        return req

    # ----------------------------------------------------------------- handoff
    def handoff_descriptor(self) -> CompatibilityDescriptor:
        """What a record must match to be admitted here (`specstate.handoff`).

        Raises:
            HandoffUnsupported: the worker does not hand off.
        """
        return self._handoff.descriptor()

    def submit_prefill(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> Req:
        """The prefill role: `submit` a request that is *parked* after its prefill and first
        token, for `export_handoff`, instead of decoding here (docs/handoff.md).

        Raises:
            InvalidRequest: as `submit`.
            HandoffUnsupported: the worker does not hand off (checked first).
        """
        self._check_caller("submit_prefill")
        self._handoff.descriptor()
        req = self._new_request(request_id, prompt_ids, sampling)
        self.lifecycle.register(req)
        self.scheduler.mark_handoff(req)
        self.scheduler.enqueue(req)
        return req

    def export_handoff(self, request_id: str) -> HandoffRecord:
        """The record of a parked request (its first token settled); it stays parked, its
        pages held, until `release_handoff`.

        Raises:
            UsageError: the request is not parked here, or its prefill has not settled.
            HandoffUnsupported: the worker or the request cannot hand off.
        """
        self._check_caller("export_handoff")
        return self._handoff.export(request_id)

    def release_handoff(self, request_id: str, *, error: str | None = None) -> Req:
        """End a parked request: acknowledged by the decode side (``error`` None: it finishes
        with `FinishReason.HANDED_OFF`) or failed there (`FinishReason.ERROR`, ``error`` its
        detail). Its pages are freed as soon as no launched batch can read them (now, when
        none is in flight).

        Raises:
            UsageError: the request is not parked here.
        """
        self._check_caller("release_handoff")
        req = self._handoff.release(request_id, error=error, until_batch=self.rounds.num_launched)
        self.rounds.report_ended([req])
        return req

    def admit_handoff(self, record: HandoffRecord) -> Req:
        """The decode role: admit a handed-off request; it joins the running batch after one
        import batch that writes its state into this engine's pages (no prefill, no drafter
        prefill). Checked first, nothing written on a refusal.

        Raises:
            HandoffMismatch: the record's descriptor differs from `handoff_descriptor`.
            HandoffUnsupported: the worker does not hand off, or the record is not one this
                engine admits (module `specstate.engine.handoff`).
            InvalidRequest: as `submit` (a live request has this id, a bad prompt).
        """
        self._check_caller("admit_handoff")
        self._handoff.check_arrival(record)
        req = self._new_request(record.request_id, record.prompt_ids, record.sampling)
        self.lifecycle.register(req)
        self.scheduler.enqueue_arrival(req, record)
        self._handoff.admitted()
        return req

    def handoff_ready(self) -> tuple[str, ...]:
        """Ids of the parked requests whose first token has settled and that were not exported
        yet: what `export_handoff` can take now."""
        return self._handoff.ready()

    @property
    def handoff_counts(self) -> tuple[int, int]:
        """(records exported, records admitted) so far."""
        return self._handoff.num_exported, self._handoff.num_imported

    def abort(self, request_id: str, reason: str = "aborted by user") -> bool:
        """Abort a live request; True if it was live. Applied at the next step."""
        self._check_caller("abort")
        return self.lifecycle.request_abort(request_id, reason)

    def request(self, request_id: str) -> Req:
        """The latest request submitted under ``request_id`` (`KeyError` if unknown)."""
        req = self.lifecycle.find(request_id)
        if req is None:
            raise KeyError(request_id)
        return req

    # -------------------------------------------------------------------- loop
    @property
    def is_idle(self) -> bool:
        """True when nothing waits, runs or is in flight."""
        return self.rounds.is_idle

    def step(self) -> StepReport:
        """One iteration of the configured loop (`RoundPipeline.step`, top-down)."""
        self._check_caller("step")
        return self.rounds.step()

    def run_until_idle(self, *, max_steps: int = 100_000) -> None:
        """Step until idle; `InvalidConfig` if that takes more than ``max_steps`` steps."""
        for _ in range(max_steps):
            if self.is_idle:
                return
            self.step()
        raise InvalidConfig(f"engine not idle after {max_steps} steps")

    def generate(
        self, prompts: Sequence[Sequence[int]], sampling: SamplingParams
    ) -> list[tuple[int, ...]]:
        """Run ``prompts`` to completion; the emitted tokens of each, in order."""
        first = self._num_generated
        self._num_generated += len(prompts)
        reqs = [self.submit(f"generate-{first + i}", p, sampling) for i, p in enumerate(prompts)]
        self.run_until_idle()
        return [r.emitted_ids for r in reqs]

    def close(self, reason: str = "engine closed") -> None:
        """End every live request with `FinishReason.ABORT` (``reason``), stop the forward
        stream; later calls (but `close`) raise `UsageError`.

        A request waiting, prefilling or running when the engine closes would otherwise never
        finish; its ``finish`` says why it ended, and a `stream` still delivers that event.
        """
        if self._closed:
            return
        self._check_caller("close")
        try:
            self.rounds.close(reason)
        finally:
            self._closed = True

    @property
    def is_closed(self) -> bool:
        """True after `close`."""
        return self._closed

    def _check_caller(self, call: str) -> None:
        """Refuse a call after `close` or from a thread other than the driving one."""
        if self._closed:
            raise UsageError(f"Engine.{call}() after close()")
        me = threading.get_ident()
        if self._driver is None:
            self._driver = me
        elif me != self._driver:
            raise UsageError(
                f"Engine.{call}() from thread {threading.current_thread().name!r}: one thread "
                f"drives an engine (thread id {self._driver} made the first call)"
            )

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- snapshot
    def snapshot(self) -> EngineSnapshot:
        """A frozen summary of the engine's state."""
        pool, prefix = self.allocator.token_pool, self.allocator.prefix
        guard = self._draft_guard
        return EngineSnapshot(
            num_waiting=len(self.scheduler.waiting),
            num_prefilling=len(self.scheduler.prefilling),
            num_running=self.scheduler.num_running,
            num_in_flight=self.rounds.launcher.num_in_flight,
            num_open_slots=len(self.ledger.batch_snapshot().entries),
            num_free_pages=self.allocator.available_tokens() // pool.page_size,
            num_pages=pool.num_pages - 1,
            deferred_releases=tuple(self.deferred.pending()),
            quarantined=tuple(self.deferred.held()),
            metrics=self.results.metrics(),
            prefix_cache=None if prefix is None else prefix.snapshot(),
            draft_policy_failure=None if guard is None else guard.snapshot().failure,
            verify_budget=None if self._budget_guard is None else self._budget_guard.snapshot(),
        )

    # ---------------------------------------------------------- the view
    @property
    def in_flight(self) -> InFlightView | None:
        """The batch launched and not settled yet (overlap only)."""
        return self.rounds.in_flight

    @property
    def hooks(self) -> RoundHooks:
        """The engine's capabilities, by hook point (`specstate.engine.hooks`)."""
        return self.rounds.hooks

    @property
    def num_launched(self) -> int:
        """Batches launched so far."""
        return self.rounds.num_launched

    @property
    def num_retired(self) -> int:
        """Batches settled (or given up on) so far."""
        return self.rounds.num_retired
