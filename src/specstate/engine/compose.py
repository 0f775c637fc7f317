"""The composition root: builds every owner of one engine and wires the capabilities into its round.

`compose` is the one place an engine's owners are made and handed to each other (the ledger's
role views to their roles, the capabilities to the round's hook points); `specstate.Engine`
calls it and keeps what it returns. No owner builds another.

What is composed, bottom to top::

    checker · ledger (role views) · recurrent state rows
    pools → allocator (+ prefix cache) → deferred releases · output table
    scheduler · result processor · launcher (FutureMap, isolation, stream) · lifecycle
    capabilities: rank agreement · grammar · trace · draft policy guard · stream deliveries
    round pipeline (the step), its hooks in that order
"""

from __future__ import annotations

import attrs
import torch

from specstate.core.errors import InvalidConfig
from specstate.core.ledger import KvLedger
from specstate.core.ownership import OwnershipChecker
from specstate.core.params import RequestLimits
from specstate.engine.capabilities.agreement import AgreementHook, RoundAgreement
from specstate.engine.capabilities.delivery import Deliveries
from specstate.engine.capabilities.draft_guard import DraftGuard
from specstate.engine.capabilities.grammar import GrammarTable
from specstate.engine.capabilities.tracing import ContainedRecorder, TraceHook
from specstate.engine.config import EngineConfig
from specstate.engine.draft_policy import AcceptanceEma, DraftPolicy, full_width
from specstate.engine.hooks import RoundHook, RoundHooks
from specstate.engine.launch.launcher import Launcher
from specstate.engine.rounds import RoundParts, RoundPipeline
from specstate.engine.schedule.scheduler import Scheduler, SchedulerConfig
from specstate.engine.settle.lifecycle import RequestLifecycle
from specstate.engine.settle.outputs import OutputTable
from specstate.engine.settle.results import ResultProcessor
from specstate.engine.trace import TraceRecorder
from specstate.engine.worker import WorkerCapabilities, WorkerMemory, WorkerProtocol
from specstate.memory.allocation import KvAllocator
from specstate.memory.deferred import DeferredReleases
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.prefix_cache import PrefixCache, PrefixSharing
from specstate.memory.prefix_rows import PrefixRows
from specstate.memory.recurrent import RecurrentStatePool, recurrent_pool_for
from specstate.memory.slots import ReqToTokenPool

__all__ = ["EngineParts", "compose"]


@attrs.frozen(kw_only=True)
class EngineParts:
    """Every owner of one engine, as `compose` wired them."""

    checker: OwnershipChecker
    ledger: KvLedger
    recurrent: RecurrentStatePool | None
    allocator: KvAllocator
    deferred: DeferredReleases
    outputs: OutputTable
    scheduler: Scheduler
    results: ResultProcessor
    lifecycle: RequestLifecycle
    grammar: GrammarTable
    deliveries: Deliveries
    draft_guard: DraftGuard | None
    rounds: RoundPipeline


def compose(
    worker: WorkerProtocol,
    *,
    limits: RequestLimits,
    config: EngineConfig,
    trace: TraceRecorder | None = None,
    draft_policy: DraftPolicy | None = None,
    agreement: RoundAgreement | None = None,
) -> EngineParts:
    """Build and wire every owner of an engine for ``worker`` (the `specstate.Engine` args).

    Raises:
        InvalidConfig: the worker cannot serve ``config`` (overlap, mixed chunks, an adaptive
            draft length it does not support).
    """
    caps = worker.capabilities
    guard = _draft_guard(caps, config, draft_policy)
    if config.overlap and not caps.supports_overlap:
        raise InvalidConfig(f"worker {caps.algorithm!r} does not support the overlap loop")
    if config.mixed_chunk and not caps.supports_mixed_chunk:
        raise InvalidConfig(f"worker {caps.algorithm!r} does not support mixed chunks")
    checker = OwnershipChecker(enabled=config.check_ownership)
    window = caps.spec_window(config.page_size)
    # No request outgrows the pool, so a context longer than the pool only wastes rows.
    context = min(limits.max_context_len, config.kv_tokens)
    row_width = context + window.row_headroom + caps.max_accept + config.page_size
    num_pages = config.kv_tokens // config.page_size
    max_requests = config.max_running * 2  # room for requests whose release is deferred
    recurrent = recurrent_pool_for(
        caps.recurrent,
        num_draft_tokens=caps.num_draft_tokens,
        topk=caps.topk,
        num_request_slots=max_requests + 1,
        checker=checker,
        validate=config.check_invariants,
    )
    ledger = KvLedger(max_requests, row_width, checker=checker, validate=config.check_invariants)
    views = ledger.views()
    req_pool = ReqToTokenPool(max_requests, row_width, device=config.device)
    token_pool = TokenSlotAllocator(num_pages, config.page_size)
    allocator = KvAllocator(
        ledger=views.allocator,
        req_pool=req_pool,
        token_pool=token_pool,
        validate=config.check_invariants,
        window=window,
        checker=checker,
        recurrent=recurrent,
        prefix=_prefix_rows(caps, config, req_pool, token_pool),
    )
    deferred = DeferredReleases(allocator)
    outputs = OutputTable(
        max_slots=max_requests,
        max_outputs=context,
        max_run=caps.max_accept,
        eos_token_ids=limits.eos_token_ids,
        checker=checker,
    )
    # The recorder is called inside the round: contained (capabilities/tracing.py).
    recorder = None if trace is None else ContainedRecorder(trace)
    grammar = GrammarTable(limits=limits, trace=recorder, mask_threads=config.grammar_mask_threads)
    device = torch.device(config.device)
    budget = config.chunked_prefill or config.max_prefill_tokens
    scheduler = Scheduler(
        config=SchedulerConfig(
            max_running=config.max_running,
            prefill_token_budget=budget,
            chunked_prefill=config.chunked_prefill is not None,
            vocab_size=limits.vocab_size,
            mixed_chunk=config.mixed_chunk,
            validate=config.check_invariants,
        ),
        allocator=allocator,
        ledger=views.scheduler,
        outputs=outputs,
        checker=checker,
        device=device,
        releases_pending=lambda: deferred.has_pending,
        draft_width=full_width if guard is None else guard.choose,
    )
    results = ResultProcessor(
        ledger=views.result_processor,
        outputs=outputs,
        checker=checker,
        num_draft_tokens=caps.num_draft_tokens,
        recurrent=recurrent,
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
        req_to_token=allocator.req_to_token,
        checker=checker,
        forward_timeout=config.forward_timeout_s,
        check=config.check_invariants,
        asynchronous=caps.asynchronous,
        traced=recorder is not None,
    )
    worker.attach(
        WorkerMemory(
            req_to_token=allocator.req_to_token,
            ledger=views.worker,
            num_token_slots=num_pages * config.page_size,
            device=device,
            recurrent=None if recurrent is None else recurrent.layout,
            parallel=None if agreement is None else agreement.parallel,
        )
    )
    lifecycle = RequestLifecycle(
        scheduler=scheduler,
        allocator=allocator,
        deferred=deferred,
        finished_history=config.finished_history,
    )
    # What the streams have delivered, per request (capabilities/delivery.py).
    deliveries = Deliveries(outputs, history=config.finished_history)
    # The hooks' order is their order at every point: the agreement settles a batch's verdict
    # first; grammar refuses a request before the trace records its submit; the trace records
    # a round before the draft policy observes it (the policy is user code, so it goes last).
    hooks: list[RoundHook] = [] if agreement is None else [AgreementHook(agreement)]
    hooks.append(grammar)
    if recorder is not None:
        hooks.append(
            TraceHook(
                recorder, ledger=ledger, outputs=outputs, scheduler=scheduler, allocator=allocator
            )
        )
        _trace_header(trace, config, caps)
    if guard is not None:
        hooks.append(guard)
    hooks.append(deliveries)
    parts = RoundParts(
        scheduler=scheduler,
        launcher=launcher,
        results=results,
        lifecycle=lifecycle,
        deferred=deferred,
        checker=checker,
        ledger=ledger,
        allocator=allocator,
        outputs=outputs,
    )
    return EngineParts(
        checker=checker,
        ledger=ledger,
        recurrent=recurrent,
        allocator=allocator,
        deferred=deferred,
        outputs=outputs,
        scheduler=scheduler,
        results=results,
        lifecycle=lifecycle,
        grammar=grammar,
        deliveries=deliveries,
        draft_guard=guard,
        rounds=RoundPipeline(parts=parts, hooks=RoundHooks(hooks), config=config),
    )


def _draft_guard(
    caps: WorkerCapabilities, config: EngineConfig, policy: DraftPolicy | None
) -> DraftGuard | None:
    """The contained draft policy (`AcceptanceEma` with ``adaptive_draft``), or None."""
    if policy is None and config.adaptive_draft and caps.speculative:
        policy = AcceptanceEma(caps.num_steps)
    if policy is None:
        return None
    if not caps.supports_adaptive_steps:
        raise InvalidConfig(
            f"worker {caps.algorithm!r} does not support adaptive draft length "
            "(WorkerCapabilities.supports_adaptive_steps)"
        )
    # The policy is user code inside the round: contained (capabilities/draft_guard.py).
    return DraftGuard(policy, algorithm=caps.algorithm, num_steps=caps.num_steps)


def _prefix_rows(
    caps: WorkerCapabilities,
    config: EngineConfig,
    req_pool: ReqToTokenPool,
    token_pool: TokenSlotAllocator,
) -> PrefixRows | None:
    """The rows' holds on a prefix cache, when the config asks and the worker shares KV."""
    # A recurrent state is not checkpointed at cache boundaries: hybrid workers share nothing.
    shares = caps.prefix_sharing is not PrefixSharing.NONE and caps.recurrent is None
    if not (config.prefix_cache and shares):
        return None
    cache = PrefixCache(page_size=config.page_size, sharing=caps.prefix_sharing)
    return PrefixRows(cache, req_pool, token_pool, validate=config.check_invariants)


def _trace_header(
    trace: TraceRecorder | None, config: EngineConfig, caps: WorkerCapabilities
) -> None:
    """The trace's header: the engine's config and the worker's speculation."""
    if trace is not None:
        trace.header = {
            "config": attrs.asdict(config),
            "worker": {
                "algorithm": caps.algorithm,
                "num_draft_tokens": caps.num_draft_tokens,
                "max_accept": caps.max_accept,
            },
        }
