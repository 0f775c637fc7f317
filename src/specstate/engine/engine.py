"""The Engine: composes every owner for one worker and runs the normal or the overlap loop.

One `Engine` owns the ledger, the KV allocator, the scheduler, the result processor, the
FutureMap, the forward isolator and the forward stream. Each `step` is one iteration::

    normal:   schedule N -> launch N -> settle N
    overlap:  schedule N+1 (host lags one batch) -> launch N+1 on the stream -> settle N

A launched batch runs on the forward stream (a real worker thread on a CPU): resolve its relay
values behind the publish fence, isolate it, call the worker with ``on_publish``, publish and
stash the next round's inputs, then record the result copy event. The host settles a batch only
after that event. A request that ends while a later batch is in flight keeps its KV until that
batch retires (`DeferredReleases`).

Threading: one thread drives an engine — `submit`, `abort`, `step`, `run_until_idle`,
`generate` and `close` all come from the thread that first called one of them; a call from
another thread raises `UsageError` and changes nothing (the forward stream's own thread is the
engine's, not a caller). After `close`, every call but `close` raises `UsageError`.

Invariant: after every `step`, with ``check_invariants`` on, `check_engine` holds: the ledger is
ordered, the pools balance, every open slot belongs to exactly one live or deferred request,
and every running request that has no result in flight satisfies ``seqlen == committed + 1``.
"""

from __future__ import annotations

import logging
import math
import threading
import traceback
from collections import deque
from collections.abc import Sequence

import attrs
import numpy as np
import numpy.typing as npt
import torch

from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.errors import (
    ForwardTimeout,
    InvalidConfig,
    InvalidRequest,
    LedgerViolation,
    UsageError,
    WorkerResultError,
)
from specstate.core.ledger import KvLedger
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.request import (
    FinishReason,
    FinishState,
    Req,
    ReqStatus,
    RequestLimits,
    SamplingParams,
)
from specstate.engine.device_check import device_problems
from specstate.engine.draft_policy import AcceptanceEma, DraftPolicy
from specstate.engine.invariants import (
    InvariantViolation,
    SettlementProbe,
    check_engine,
    check_settlement,
)
from specstate.engine.launch import InFlight, Launcher
from specstate.engine.outputs import OutputTable
from specstate.engine.result_check import check_sampling_rows
from specstate.engine.result_copy import HostResult
from specstate.engine.results import AcceptMetrics, ResultProcessor, Settlement
from specstate.engine.scheduler import LaunchPlan, Scheduler, SchedulerConfig
from specstate.engine.trace import FORWARD, HOST, TraceRecorder
from specstate.engine.worker import WorkerCapabilities, WorkerMemory, WorkerProtocol
from specstate.memory.allocation import DeferredReleases, KvAllocator
from specstate.memory.pools import ReqToTokenPool, TokenSlotAllocator

__all__ = ["Engine", "EngineConfig", "EngineSnapshot", "StepReport"]

_log = logging.getLogger("specstate")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """How the engine runs. Sizes are in tokens unless named otherwise.

    Attributes:
        overlap: run the overlap loop (one-batch lookahead) instead of the normal loop.
        page_size: KV page size P.
        kv_tokens: KV token slots in the pool (rounded down to whole pages).
        max_running: most requests admitted at once.
        chunked_prefill: tokens per prefill forward; a longer prompt is split in chunks.
            None: a prompt is prefilled whole (the budget is then ``max_prefill_tokens``).
        max_prefill_tokens: token budget of one prefill forward without chunking.
        mixed_chunk: running requests ride in prefill batches as 1-token extends of their
            pending bonus (late-bound from the FutureMap; the result commits ``+1``).
        check_invariants: run `check_engine` after every step (on in tests).
        check_ownership: run-time ownership checks on every counter write (on in tests).
        debug_relay: FutureMap consume-once checks and poisoned buffers.
        device: where batch tensors live (the worker's device).
        finished_history: how many ended requests `Engine.request` still finds by id; older
            ones are forgotten (the `Req` objects returned by `submit` stay valid), so a
            long-running engine holds bounded memory.
        forward_timeout_s: fail a batch whose forward (and result copy) is not done this many
            seconds after the host starts waiting for it: its requests, and those of a batch
            queued behind it, end with `FinishReason.ERROR` (`ForwardTimeout`); the stream is
            abandoned for a fresh one and their KV is quarantined until the abandoned forward
            returns. None (the default): wait forever. The forward then runs on a stream even
            in the normal loop.
        adaptive_draft: choose the draft steps of every decode round with the shipped
            `AcceptanceEma` policy (from the batch size and recent acceptance; speculation
            switches off when drafts are rarely accepted, and back on after a probe). Needs a
            worker that declares ``supports_adaptive_steps``; ignored for a worker that does
            not speculate. ``Engine(draft_policy=...)`` takes a policy of your own instead.
    """

    overlap: bool = True
    page_size: int = 1
    kv_tokens: int = 8192
    max_running: int = 32
    chunked_prefill: int | None = None
    max_prefill_tokens: int = 4096
    mixed_chunk: bool = False
    check_invariants: bool = False
    check_ownership: bool = False
    debug_relay: bool = False
    device: str = "cpu"
    finished_history: int = 10_000
    forward_timeout_s: float | None = None
    adaptive_draft: bool = False

    def __attrs_post_init__(self) -> None:
        """Refuse wrong types and sizes at once, naming every field that is wrong."""
        flags = (
            "overlap",
            "mixed_chunk",
            "check_invariants",
            "check_ownership",
            "debug_relay",
            "adaptive_draft",
        )
        problems = [
            f"{name} must be a bool, got {getattr(self, name)!r}"
            for name in flags
            if not isinstance(getattr(self, name), bool)
        ]
        for name, low in (("page_size", 1), ("max_running", 1), ("max_prefill_tokens", 1)):
            value = getattr(self, name)
            if not _is_count(value, low):
                problems.append(f"{name} must be an integer >= {low}, got {value!r}")
        if _is_count(self.page_size, 1) and not _is_count(self.kv_tokens, 2 * self.page_size):
            problems.append(
                f"kv_tokens must be an integer >= 2 pages ({2 * self.page_size}), "
                f"got {self.kv_tokens!r}"
            )
        if not _is_count(self.finished_history, 0):
            problems.append(
                f"finished_history must be an integer >= 0, got {self.finished_history!r}"
            )
        timeout = self.forward_timeout_s
        if timeout is not None and not (
            isinstance(timeout, int | float)
            and not isinstance(timeout, bool)
            and math.isfinite(timeout)
            and timeout > 0
        ):
            problems.append(
                f"forward_timeout_s must be None or a finite number > 0, got {timeout!r}"
            )
        if self.chunked_prefill is not None and not _is_count(self.chunked_prefill, 1):
            problems.append(
                f"chunked_prefill must be None or an integer >= 1, got {self.chunked_prefill!r}"
            )
        problems.extend(device_problems(self.device))
        if problems:
            raise InvalidConfig("EngineConfig: " + "; ".join(problems))


def _is_count(value: object, low: int) -> bool:
    """An integer (not a bool) of at least ``low``."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@attrs.frozen(kw_only=True)
class StepReport:
    """What one step did.

    Attributes:
        launched_mode: the forward mode of the batch launched, or None.
        launched_size: its number of requests.
        finished: ids of the requests that ended (finished, aborted, failed) in this step.
        retracted: ids of the requests retracted in this step.
        ended: the `Req` objects of ``finished``, in the same order (they stay valid after
            the engine forgets them, see ``EngineConfig.finished_history``).
    """

    launched_mode: str | None
    launched_size: int
    finished: tuple[str, ...]
    retracted: tuple[str, ...]
    ended: tuple[Req, ...] = ()


@attrs.frozen(kw_only=True)
class EngineSnapshot:
    """The engine at one instant (`Engine.snapshot`).

    Attributes:
        num_waiting: requests queued for admission (new or retracted).
        num_prefilling: admitted requests whose prompt is not fully prefilled yet.
        num_running: requests decoding.
        num_in_flight: batches launched and not settled yet (0 or 1 under overlap).
        num_open_slots: request slots holding a live or deferred request.
        num_free_pages: KV pages free in the token pool.
        num_pages: KV pages in the token pool.
        deferred_releases: requests that ended while a batch was in flight; their KV is
            released when that batch retires.
        quarantined: requests whose KV is held until an abandoned forward stream drains
            (after a `ForwardTimeout`).
        metrics: acceptance statistics so far.
    """

    num_waiting: int
    num_prefilling: int
    num_running: int
    num_in_flight: int
    num_open_slots: int
    num_free_pages: int
    num_pages: int
    deferred_releases: tuple[str, ...]
    quarantined: tuple[str, ...]
    metrics: AcceptMetrics


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
    """

    def __init__(
        self,
        worker: WorkerProtocol,
        *,
        limits: RequestLimits,
        config: EngineConfig,
        trace: TraceRecorder | None = None,
        draft_policy: DraftPolicy | None = None,
    ):
        caps = worker.capabilities
        if draft_policy is None and config.adaptive_draft and caps.speculative:
            draft_policy = AcceptanceEma(caps.num_steps)
        if draft_policy is not None:
            if not caps.supports_adaptive_steps:
                raise InvalidConfig(
                    f"worker {caps.algorithm!r} does not support adaptive draft length "
                    "(WorkerCapabilities.supports_adaptive_steps)"
                )
            if draft_policy.max_steps > caps.num_steps:
                raise InvalidConfig(
                    f"draft policy may choose {draft_policy.max_steps} steps; worker "
                    f"{caps.algorithm!r} drafts at most {caps.num_steps}"
                )
        self._draft_policy = draft_policy
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
        self.ledger = KvLedger(
            max_requests, row_width, checker=self.checker, validate=config.check_invariants
        )
        views = self.ledger.views()
        self.allocator = KvAllocator(
            ledger=views.allocator,
            req_pool=ReqToTokenPool(max_requests, row_width, device=config.device),
            token_pool=TokenSlotAllocator(num_pages, config.page_size),
            validate=config.check_invariants,
            window=window,
            checker=self.checker,
        )
        self.deferred = DeferredReleases(self.allocator)
        self.outputs = OutputTable(
            max_slots=max_requests,
            max_outputs=context,
            max_run=caps.max_accept,
            eos_token_ids=limits.eos_token_ids,
            checker=self.checker,
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
            ),
            allocator=self.allocator,
            ledger=views.scheduler,
            outputs=self.outputs,
            checker=self.checker,
            device=device,
            releases_pending=lambda: self.deferred.has_pending,
            draft_policy=draft_policy,
        )
        self.results = ResultProcessor(
            ledger=views.result_processor,
            outputs=self.outputs,
            checker=self.checker,
            num_draft_tokens=caps.num_draft_tokens,
        )
        self._launcher = Launcher(
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
        )
        worker.attach(
            WorkerMemory(
                req_to_token=self.allocator.req_to_token,
                ledger=views.worker,
                num_token_slots=num_pages * config.page_size,
                device=device,
            )
        )
        self._requests: dict[str, Req] = {}
        self._ended: deque[Req] = deque()  # ended requests still findable, oldest first
        self._aborts: dict[Req, str] = {}  # pending user aborts (a Req hashes by identity)
        self._in_flight: InFlight | None = None
        self._num_launched = 0
        self._num_retired = 0
        self._num_generated = 0
        self._driver: int | None = None  # the driving thread's ident, set by the first call
        self._closed = False
        self._trace = trace
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
        if request_id in self._requests and not self._requests[request_id].is_finished:
            raise InvalidRequest(f"request {request_id!r}: a live request already has this id")
        req = Req.new(request_id, prompt_ids, sampling, self.limits, checker=self.checker)
        caps = self.worker.capabilities
        if sampling.temperature > 0 and not caps.supports_sampling:
            raise InvalidRequest(
                f"request {request_id!r}: temperature {sampling.temperature} asks for sampling, "
                f"but worker {caps.algorithm!r} is greedy-only (its capabilities do not declare "
                "supports_sampling)"
            )
        unsupported = _unsupported_controls(sampling, caps)
        if unsupported:
            raise InvalidRequest(
                f"request {request_id!r}: worker {caps.algorithm!r} does not support "
                + "; ".join(unsupported)
            )
        if len(req.prompt_ids) + sampling.max_new_tokens > self.limits.max_context_len:
            raise InvalidRequest(
                f"request {request_id!r}: prompt of {len(req.prompt_ids)} tokens plus "
                f"max_new_tokens {sampling.max_new_tokens} exceeds the context of "
                f"{self.limits.max_context_len}"
            )
        window = self.allocator.window
        p = window.page_size
        need = -(-(len(req.prompt_ids) + sampling.max_new_tokens + window.reserve) // p) * p + p
        capacity = self.allocator.token_pool.num_pages * p - p
        if need > capacity:
            raise InvalidRequest(
                f"request {request_id!r}: needs up to {need} KV tokens (prompt "
                f"{len(req.prompt_ids)}, max_new_tokens {sampling.max_new_tokens}, reserve "
                f"{window.reserve}) but the pool holds {capacity}"
            )
        self._requests[request_id] = req
        self.scheduler.enqueue(req)
        if self._trace is not None:
            self._trace.event(
                "submit",
                request_id,
                self._num_launched,
                prompt_len=len(req.prompt_ids),
                max_new_tokens=sampling.max_new_tokens,
            )
        return req

    def abort(self, request_id: str, reason: str = "aborted by user") -> bool:
        """Abort a live request; True if it was live. Applied at the next step."""
        self._check_caller("abort")
        req = self._requests.get(request_id)
        if req is None or req.is_finished:
            return False
        self._aborts[req] = reason
        return True

    def request(self, request_id: str) -> Req:
        """The latest request submitted under ``request_id``."""
        return self._requests[request_id]

    # -------------------------------------------------------------------- loop
    @property
    def is_idle(self) -> bool:
        """True when nothing waits, runs or is in flight."""
        return not self.scheduler.has_work and self._in_flight is None

    def step(self) -> StepReport:
        """One iteration of the configured loop (see the module docstring)."""
        self._check_caller("step")
        rec = self._trace
        started = 0 if rec is None else rec.now()
        finished = self._apply_aborts()
        self._drain(self._num_retired)
        with self.checker.acting(Role.SCHEDULER):
            plan, outcome = self.scheduler.schedule()
        retracted = () if outcome is None else tuple(r.request_id for r in outcome.retracted)
        finished += () if outcome is None else tuple(r.request_id for r in outcome.aborted)
        launched = None
        if plan is not None:
            self._num_launched += 1
            if rec is not None:
                rec.span(HOST, "schedule", self._num_launched, started, rec.now())
            launched = self._launcher.launch(
                plan, batch_id=self._num_launched, traced=rec is not None
            )
        previous, self._in_flight = self._in_flight, launched
        if self.config.overlap:
            if previous is not None:
                finished += self._settle(previous)
        elif launched is not None:
            self._in_flight = None
            finished += self._settle(launched)
        if launched is None and previous is None and not self.scheduler.has_work:
            self._drain(self._num_launched)
        if self.config.check_invariants:
            check_engine(self)
        if rec is not None:
            self._record_events(rec, finished, retracted)
        ended = tuple(self._requests[rid] for rid in finished)
        self._remember_ended(finished)
        mode = None if plan is None else plan.batch.forward_mode.value
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

    def close(self) -> None:
        """Stop the forward stream; later calls (but `close`) raise `UsageError`."""
        if self._closed:
            return
        self._check_caller("close")
        self._closed = True
        self._launcher.close()

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

    # ----------------------------------------------------------------- settle
    def _settle(self, flight: InFlight) -> tuple[str, ...]:
        rec = self._trace
        waited = 0 if rec is None else rec.now()
        timeout = self.config.forward_timeout_s
        result, error = flight.wait(timeout)
        if flight.timed_out and timeout is not None:
            return self._abandon(flight, timeout, "forward")
        if self._in_flight is not None and self._in_flight is not flight:
            # Overlap: the next forward's launch runs on the stream now; let it reach the
            # worker before this thread's settlement competes with it for the interpreter.
            self._in_flight.wait_started()
        # The worker's own copy event, if it keeps one (a no-op when synchronous).
        if result is not None and not result.wait_copied(timeout):
            return self._abandon(flight, timeout or 0.0, "result copy")
        host = None
        if error is None and result is not None:
            try:  # the round's one device-to-host copy (a view on the host CPU), checked
                host = self._launcher.host_result(flight, timeout)
                if host is not None:  # per-row speculation and logprobs, against the batch
                    check_sampling_rows(
                        host,
                        flight.plan.batch.sampling_info,
                        request_ids=flight.plan.batch.request_ids,
                        decode=flight.plan.is_decode,
                        num_draft_steps=flight.plan.batch.num_draft_steps,
                    )
            except WorkerResultError as exc:
                error = exc
            else:
                if host is None:
                    return self._abandon(flight, timeout or 0.0, "result copy")
        plan = flight.plan
        self._num_retired = flight.batch_id
        settling = 0
        if rec is not None:
            settling = rec.now()
            rec.span(HOST, "wait", flight.batch_id, waited, settling)
        settlement = None
        if error is not None or host is None:
            failure = error if error is not None else RuntimeError("no result")
            ended = self._fail_batch(plan.batch.reqs, plan.batch.incarnations, failure)
            _log.error(
                "batch %d (%s, %d requests) failed; its requests end with ERROR",
                flight.batch_id,
                plan.batch.forward_mode.value,
                plan.batch.batch_size,
                exc_info=failure,
            )
        else:
            ended = [] if host.invalid is None else self._fail_invalid_rows(plan, host.invalid)
            probe = SettlementProbe.take(self, flight) if self.config.check_invariants else None
            if self._draft_policy is not None and plan.batch.num_draft_steps is not None:
                self._observe_round(plan.batch, host)
            try:
                settlement = self._settle_result(plan, host)
            except LedgerViolation as exc:
                if probe is not None and not probe.live.all():
                    # Checking: the ledger refused a write for a row that was not live.
                    raise InvariantViolation(
                        "commit-settlement",
                        f"batch {flight.batch_id}: settlement wrote a row whose request ended "
                        f"or was retracted while the batch was in flight ({exc})",
                    ) from exc
                raise
            ended += settlement.finished
            if probe is not None:
                check_settlement(self, flight, host, probe)
        for req in ended:
            self._end(req)
        self._drain(self._num_retired)
        if rec is not None:
            if host is not None and settlement is not None:
                self._record_round(rec, flight, host, settlement)
            rec.span(HOST, "settle", flight.batch_id, settling, rec.now())
            _record_forward(rec, flight)
        if isinstance(error, KeyboardInterrupt | SystemExit):
            raise error  # the batch is contained; the interruption is the caller's to handle
        return tuple(r.request_id for r in ended)

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
            running=self.scheduler.num_running,
            free_pages=self.allocator.token_pool.available_pages(),
            rows=rows,
        )

    def _record_events(
        self, rec: TraceRecorder, finished: tuple[str, ...], retracted: tuple[str, ...]
    ) -> None:
        batch = self._num_launched
        for rid in retracted:
            rec.event("retract", rid, batch)
        for rid in finished:
            finish = self._requests[rid].finish
            reason = "" if finish is None else finish.reason.value
            rec.event("abort" if reason == "abort" else "finish", rid, batch, reason)

    def _abandon(self, flight: InFlight, timeout: float, what: str) -> tuple[str, ...]:
        """Fail a batch that did not finish in time, and the batch queued behind it.

        The stream is abandoned (a fresh one runs later launches) and the queued batch never
        runs. The requests of both batches are quarantined: their KV is released only once the
        abandoned stream is past the forward, which may still write it (the queued batch's
        requests may hold pages that a retraction took from the timed-out batch's rows).
        """
        queued = self._in_flight if self._in_flight not in (None, flight) else None
        flights = [flight] if queued is None else [flight, queued]
        drained = self._launcher.abandon(flights)
        self._in_flight = None
        self._num_retired = flights[-1].batch_id
        error = flight.timeout_error(timeout, what)
        _log.error("%s", error)
        ended = self._fail_batch(flight.plan.batch.reqs, flight.plan.batch.incarnations, error)
        if queued is not None:
            behind = ForwardTimeout(
                f"batch {queued.batch_id} was queued behind batch {flight.batch_id}, whose "
                f"{what} timed out; it never ran"
            )
            ended += self._fail_batch(
                queued.plan.batch.reqs, queued.plan.batch.incarnations, behind
            )
        for req in ended:
            self.scheduler.drop(req)
            self._aborts.pop(req, None)
            if self.allocator.holds_slot(req):
                self.deferred.hold(req, until=drained)
        self._drain(self._num_retired)
        return tuple(r.request_id for r in ended)

    def _observe_round(self, batch: ScheduleBatch, host: HostResult) -> None:
        """Hand the draft policy a settled round once, at the width it was launched with.

        Only rows that drafted count: not rows the worker marked invalid, and not requests
        with ``speculative=False`` (they accept one token whatever the drafts).
        """
        assert self._draft_policy is not None and batch.num_draft_steps is not None
        drafted = np.ones(host.batch_size, dtype=np.bool_)
        if host.invalid is not None:
            drafted &= ~host.invalid
        if batch.sampling_info.speculative_host is not None:
            drafted &= batch.sampling_info.speculative_host
        accepted = host.accept[drafted].astype(np.int64)
        self._draft_policy.observe(batch.num_draft_steps, accepted)

    def _settle_result(self, plan: LaunchPlan, result: HostResult) -> Settlement:
        """The result processor's settlement of one launched batch's result."""
        return self.results.settle(
            reqs=plan.batch.reqs,
            slots=plan.slots_host,
            epochs=plan.epochs,
            last_chunk=plan.last_chunk,
            verifies=plan.is_decode,
            result=result,
            abort_reasons=self._aborts,
        )

    def _fail_invalid_rows(self, plan: LaunchPlan, mask: npt.NDArray[np.bool_]) -> list[Req]:
        """End the rows the worker marked invalid with ERROR (their tokens are not settled).

        Ending a request changes its output row's epoch, so settlement then skips the row.
        """
        if not mask.any():
            return []
        batch = plan.batch
        rows = np.flatnonzero(mask).tolist()
        failure = WorkerResultError(
            f"batch {self._num_retired} ({batch.forward_mode.value}): the worker marked the "
            "row invalid (for the reference workers: non-finite logits)"
        )
        ended = self._fail_batch(
            [batch.reqs[i] for i in rows], [batch.incarnations[i] for i in rows], failure
        )
        for req in ended:
            _log.error("request %s ended: %s", req.request_id, failure)
        return ended

    def _fail_batch(
        self, reqs: Sequence[Req], incarnations: Sequence[int], error: BaseException
    ) -> list[Req]:
        ended = []
        trace = "".join(traceback.format_exception(error))
        for req, inc in zip(reqs, incarnations, strict=True):
            if req.incarnation != inc or req.is_finished or req.status is ReqStatus.WAITING:
                continue
            finish = FinishState(
                reason=FinishReason.ERROR,
                finished_len=min(req.num_outputs, req.sampling.max_new_tokens),
                detail=f"{type(error).__name__}: {error}",
                traceback=trace,
            )
            req.transition(ReqStatus.FINISHED, finish=finish)
            ended.append(req)
        return ended

    def _end(self, req: Req) -> None:
        """Forget an ended request; release its KV once no launched batch can read it."""
        self.scheduler.drop(req)
        self._aborts.pop(req, None)
        if self.allocator.holds_slot(req):
            self.deferred.defer(req, until_batch=self._num_launched)

    def _remember_ended(self, request_ids: tuple[str, ...]) -> None:
        """Keep the last ``finished_history`` ended requests findable; forget older ones."""
        for rid in request_ids:
            self._ended.append(self._requests[rid])
        while len(self._ended) > self.config.finished_history:
            old = self._ended.popleft()
            if self._requests.get(old.request_id) is old:  # not a live reuse of the id
                del self._requests[old.request_id]

    def _drain(self, retired: int) -> None:
        with self.checker.acting(Role.SCHEDULER):
            self.deferred.drain(retired)

    def _apply_aborts(self) -> tuple[str, ...]:
        """End every request with a pending abort (a result in flight for it will be skipped)."""
        ended: list[str] = []
        if not self._aborts:
            return ()
        for req in list(self.scheduler.waiting):
            reason = self._aborts.get(req)
            if reason is not None:
                req.transition(ReqStatus.ABORTED, finish=Scheduler.abort_finish(req, reason))
                self.scheduler.drop(req)
                self._aborts.pop(req)
                ended.append(req.request_id)
        for req in [*self.scheduler.prefilling, *self.scheduler.running]:
            reason = self._aborts.get(req)
            if reason is not None:
                req.transition(ReqStatus.ABORTED, finish=Scheduler.abort_finish(req, reason))
                self._end(req)
                ended.append(req.request_id)
        return tuple(ended)

    # ---------------------------------------------------------------- snapshot
    def snapshot(self) -> EngineSnapshot:
        """A frozen summary of the engine's state."""
        pool = self.allocator.token_pool
        return EngineSnapshot(
            num_waiting=len(self.scheduler.waiting),
            num_prefilling=len(self.scheduler.prefilling),
            num_running=self.scheduler.num_running,
            num_in_flight=int(self._in_flight is not None),
            num_open_slots=len(self.ledger.batch_snapshot().entries),
            num_free_pages=pool.available_pages(),
            num_pages=pool.num_pages - 1,
            deferred_releases=tuple(self.deferred.pending()),
            quarantined=tuple(self.deferred.held()),
            metrics=self.results.metrics(),
        )

    @property
    def in_flight(self) -> InFlight | None:
        """The batch launched and not yet settled (overlap only)."""
        return self._in_flight


def _unsupported_controls(sampling: SamplingParams, caps: WorkerCapabilities) -> list[str]:
    """The sampling controls ``sampling`` uses that the worker does not declare, with values."""
    found = []
    if not sampling.speculative and caps.speculative and not caps.supports_per_request_speculation:
        found.append("speculative=False (per-request speculation)")
    if sampling.has_penalties and not caps.supports_penalties:
        found.append(
            f"penalties (repetition_penalty={sampling.repetition_penalty}, "
            f"frequency_penalty={sampling.frequency_penalty}, "
            f"presence_penalty={sampling.presence_penalty})"
        )
    if sampling.min_new_tokens and not caps.supports_min_new_tokens:
        found.append(f"min_new_tokens={sampling.min_new_tokens}")
    if sampling.seed is not None and sampling.temperature > 0 and not caps.supports_seeds:
        found.append(f"seed={sampling.seed}")
    if sampling.logprobs and not caps.supports_logprobs:
        found.append("logprobs=True")
    return found


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
