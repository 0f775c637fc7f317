"""The Engine: composes every owner for one worker and runs the normal or the overlap loop.

One `Engine` owns the ledger, the KV allocator, the scheduler, the result processor, the
FutureMap, the forward isolator and the forward stream. Each `step` is one iteration::

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

import attrs
import torch

from specstate.core.errors import InvalidConfig, InvalidRequest, UsageError
from specstate.core.ledger import KvLedger
from specstate.core.ownership import OwnershipChecker
from specstate.core.request import Req, RequestLimits, SamplingParams
from specstate.engine.agreement import RoundAgreement
from specstate.engine.config import EngineConfig, EngineSnapshot, StepReport
from specstate.engine.delivery import Deliveries
from specstate.engine.draft_guard import DraftGuard
from specstate.engine.draft_policy import AcceptanceEma, DraftPolicy
from specstate.engine.intake import check_request
from specstate.engine.invariants import check_engine
from specstate.engine.launch import InFlight, Launcher
from specstate.engine.lifecycle import RequestLifecycle
from specstate.engine.outputs import OutputTable
from specstate.engine.results import ResultProcessor
from specstate.engine.rounds import RoundPipeline
from specstate.engine.scheduler import Scheduler, SchedulerConfig
from specstate.engine.trace import TraceRecorder
from specstate.engine.trace_guard import ContainedRecorder
from specstate.engine.worker import WorkerMemory, WorkerProtocol
from specstate.grammar.table import GrammarTable
from specstate.memory.allocation import DeferredReleases, KvAllocator
from specstate.memory.pools import ReqToTokenPool, TokenSlotAllocator
from specstate.memory.prefix_cache import PrefixCache, PrefixSharing
from specstate.memory.prefix_rows import PrefixRows
from specstate.memory.recurrent import recurrent_pool_for

__all__ = ["Engine", "EngineConfig", "EngineSnapshot", "StepReport"]


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
    ):
        caps = worker.capabilities
        if draft_policy is None and config.adaptive_draft and caps.speculative:
            draft_policy = AcceptanceEma(caps.num_steps)
        guard = None
        if draft_policy is not None:
            if not caps.supports_adaptive_steps:
                raise InvalidConfig(
                    f"worker {caps.algorithm!r} does not support adaptive draft length "
                    "(WorkerCapabilities.supports_adaptive_steps)"
                )
            # The policy is user code inside the round: contained (engine/draft_guard.py).
            guard = DraftGuard(draft_policy, algorithm=caps.algorithm, num_steps=caps.num_steps)
        self._draft_policy = guard
        if config.overlap and not caps.supports_overlap:
            raise InvalidConfig(f"worker {caps.algorithm!r} does not support the overlap loop")
        if config.mixed_chunk and not caps.supports_mixed_chunk:
            raise InvalidConfig(f"worker {caps.algorithm!r} does not support mixed chunks")
        self.config = config
        self.limits = limits
        self.worker = worker
        self.checker = OwnershipChecker(enabled=config.check_ownership)
        window = caps.spec_window(config.page_size)
        # No request outgrows the pool, so a context longer than the pool only wastes rows.
        context = min(limits.max_context_len, config.kv_tokens)
        row_width = context + window.row_headroom + caps.max_accept + config.page_size
        num_pages = config.kv_tokens // config.page_size
        max_requests = config.max_running * 2  # room for requests whose release is deferred
        self.recurrent = recurrent_pool_for(
            caps.recurrent,
            num_draft_tokens=caps.num_draft_tokens,
            topk=caps.topk,
            num_request_slots=max_requests + 1,
            checker=self.checker,
            validate=config.check_invariants,
        )
        self.ledger = KvLedger(
            max_requests, row_width, checker=self.checker, validate=config.check_invariants
        )
        views = self.ledger.views()
        req_pool = ReqToTokenPool(max_requests, row_width, device=config.device)
        token_pool = TokenSlotAllocator(num_pages, config.page_size)
        prefix = None
        # A recurrent state is not checkpointed at cache boundaries: hybrid workers share nothing.
        shares = caps.prefix_sharing is not PrefixSharing.NONE and caps.recurrent is None
        if config.prefix_cache and shares:
            cache = PrefixCache(page_size=config.page_size, sharing=caps.prefix_sharing)
            prefix = PrefixRows(cache, req_pool, token_pool, validate=config.check_invariants)
        self.allocator = KvAllocator(
            ledger=views.allocator,
            req_pool=req_pool,
            token_pool=token_pool,
            validate=config.check_invariants,
            window=window,
            checker=self.checker,
            recurrent=self.recurrent,
            prefix=prefix,
        )
        self.deferred = DeferredReleases(self.allocator)
        self.outputs = OutputTable(
            max_slots=max_requests,
            max_outputs=context,
            max_run=caps.max_accept,
            eos_token_ids=limits.eos_token_ids,
            checker=self.checker,
        )
        # The recorder is called inside the round: contained (engine/trace_guard.py).
        recorder = None if trace is None else ContainedRecorder(trace)
        self.grammar = GrammarTable(
            limits=limits,
            outputs=self.outputs,
            trace=recorder,
            mask_threads=config.grammar_mask_threads,
        )
        device = torch.device(config.device)
        budget = config.chunked_prefill or config.max_prefill_tokens
        self.scheduler = Scheduler(
            config=SchedulerConfig(
                max_running=config.max_running,
                prefill_token_budget=budget,
                chunked_prefill=config.chunked_prefill is not None,
                vocab_size=limits.vocab_size,
                mixed_chunk=config.mixed_chunk,
                validate=config.check_invariants,
            ),
            allocator=self.allocator,
            ledger=views.scheduler,
            outputs=self.outputs,
            checker=self.checker,
            device=device,
            releases_pending=lambda: self.deferred.has_pending,
            draft_policy=guard,
        )
        self.results = ResultProcessor(
            ledger=views.result_processor,
            outputs=self.outputs,
            checker=self.checker,
            num_draft_tokens=caps.num_draft_tokens,
            recurrent=self.recurrent,
        )
        launcher = Launcher(
            worker=worker,
            overlap=config.overlap,
            speculative=caps.speculative,
            max_accept=caps.max_accept,
            vocab_size=limits.vocab_size,
            max_slots=max_requests + 1,
            device=device,
            debug_relay=config.debug_relay,
            req_to_token=self.allocator.req_to_token,
            checker=self.checker,
            forward_timeout=config.forward_timeout_s,
            check=config.check_invariants,
            asynchronous=caps.asynchronous,
        )
        worker.attach(
            WorkerMemory(
                req_to_token=self.allocator.req_to_token,
                ledger=views.worker,
                num_token_slots=num_pages * config.page_size,
                device=device,
                recurrent=None if self.recurrent is None else self.recurrent.layout,
                parallel=None if agreement is None else agreement.parallel,
            )
        )
        self.lifecycle = RequestLifecycle(
            scheduler=self.scheduler,
            allocator=self.allocator,
            deferred=self.deferred,
            finished_history=config.finished_history,
        )
        self.rounds = RoundPipeline(
            config=config,
            launcher=launcher,
            scheduler=self.scheduler,
            results=self.results,
            lifecycle=self.lifecycle,
            deferred=self.deferred,
            ledger=self.ledger,
            allocator=self.allocator,
            outputs=self.outputs,
            checker=self.checker,
            draft_policy=guard,
            trace=recorder,
            grammar=self.grammar,
            agreement=agreement,
        )
        # What the streams have delivered, per request (engine/delivery.py); off until used.
        self.deliveries = Deliveries(self.outputs, history=config.finished_history)
        self._num_generated = 0
        self._driver: int | None = None  # the driving thread's ident, set by the first call
        self._closed = False
        self._trace = recorder
        if trace is not None:
            trace.header = {
                "config": attrs.asdict(config),
                "worker": {
                    "algorithm": caps.algorithm,
                    "num_draft_tokens": caps.num_draft_tokens,
                    "max_accept": caps.max_accept,
                },
            }

    # ---------------------------------------------------------------- requests
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> Req:
        """Validate and queue a request; `InvalidRequest` leaves the engine unchanged."""
        self._check_caller("submit")
        if not isinstance(request_id, str) or not request_id:
            raise InvalidRequest(f"request id must be a non-empty string, got {request_id!r}")
        if self.lifecycle.is_live(request_id):
            raise InvalidRequest(f"request {request_id!r}: a live request already has this id")
        req = Req.new(request_id, prompt_ids, sampling, self.limits, checker=self.checker)
        pool = self.allocator.token_pool
        check_request(
            req,
            self.worker.capabilities,
            self.limits,
            window=self.allocator.window,
            pool_tokens=pool.num_pages * pool.page_size,
            grammar=self.grammar,
        )
        self.lifecycle.register(req)
        self.scheduler.enqueue(req)
        if self._trace is not None:
            self._trace.event(
                "submit",
                request_id,
                self.rounds.num_launched,
                prompt_len=len(req.prompt_ids),
                max_new_tokens=sampling.max_new_tokens,
            )
        return req

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
        return not self.scheduler.has_work and self.rounds.in_flight is None

    def step(self) -> StepReport:
        """One iteration of the configured loop (see the module docstring)."""
        self._check_caller("step")
        rec = self._trace
        started = 0 if rec is None else rec.now()
        rounds = self.rounds
        finished = self.lifecycle.apply_aborts(until_batch=rounds.num_launched)
        rounds.drain()
        plan, outcome = self.scheduler.schedule()  # acts as the scheduler
        retracted = () if outcome is None else tuple(r.request_id for r in outcome.retracted)
        finished += () if outcome is None else tuple(r.request_id for r in outcome.aborted)
        was_in_flight = rounds.in_flight is not None
        finished += rounds.advance(plan, started=started)
        if plan is None and not was_in_flight and not self.scheduler.has_work:
            rounds.drain(rounds.num_launched)  # idle: no batch can read any released KV
        if self.config.check_invariants:
            check_engine(self)
        if rec is not None:
            self._record_events(rec, self.scheduler.admitted, finished, retracted)
        ended = self.lifecycle.remember_ended(finished)
        self.grammar.forget(ended)
        self.deliveries.note_step(ended)
        mode = None if plan is None else plan.batch.forward_mode._value_
        size = 0 if plan is None else plan.batch.batch_size
        return StepReport(
            launched_mode=mode,
            launched_size=size,
            finished=finished,
            retracted=retracted,
            ended=ended,
        )

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
            finished = self.lifecycle.abort_live(reason, until_batch=self.rounds.num_launched)
            if self._trace is not None:
                self._record_events(self._trace, (), finished, ())
            self.deliveries.note_step(self.lifecycle.remember_ended(finished))
        finally:
            self._closed = True
            self.rounds.launcher.close()

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

    def _record_events(
        self,
        rec: TraceRecorder,
        admitted: Sequence[Req],
        finished: tuple[str, ...],
        retracted: tuple[str, ...],
    ) -> None:
        batch = self.rounds.num_launched
        for req in admitted:
            rec.event(
                "admit",
                req.request_id,
                batch,
                fill_tokens=req.seqlen,
                cached_tokens=req.cached_tokens,
            )
        for rid in retracted:
            rec.event("retract", rid, batch)
        for rid in finished:
            finish = self.request(rid).finish
            reason = "" if finish is None else finish.reason.value
            rec.event("abort" if reason == "abort" else "finish", rid, batch, reason)

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- snapshot
    def snapshot(self) -> EngineSnapshot:
        """A frozen summary of the engine's state."""
        pool, prefix = self.allocator.token_pool, self.allocator.prefix
        guard = self._draft_policy
        return EngineSnapshot(
            num_waiting=len(self.scheduler.waiting),
            num_prefilling=len(self.scheduler.prefilling),
            num_running=self.scheduler.num_running,
            num_in_flight=int(self.rounds.in_flight is not None),
            num_open_slots=len(self.ledger.batch_snapshot().entries),
            num_free_pages=self.allocator.available_tokens() // pool.page_size,
            num_pages=pool.num_pages - 1,
            deferred_releases=tuple(self.deferred.pending()),
            quarantined=tuple(self.deferred.held()),
            metrics=self.results.metrics(),
            prefix_cache=None if prefix is None else prefix.snapshot(),
            draft_policy_failure=None if guard is None else guard.snapshot().failure,
        )

    @property
    def in_flight(self) -> InFlight | None:
        """The batch launched and not yet settled (overlap only)."""
        return self.rounds.in_flight
