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
from specstate.core.ledger import KvLedger, LedgerViews
from specstate.core.ownership import OwnershipChecker
from specstate.core.params import RequestLimits
from specstate.engine.budgets import ConfidenceBudget, VerifyBudgetPolicy, budget_policy
from specstate.engine.capabilities.agreement import AgreementHook, RoundAgreement
from specstate.engine.capabilities.budgets import BudgetGuard, round_planner
from specstate.engine.capabilities.delivery import Deliveries
from specstate.engine.capabilities.draft_guard import DraftGuard
from specstate.engine.capabilities.grammar import GrammarTable
from specstate.engine.capabilities.tracing import ContainedRecorder, TraceHook
from specstate.engine.config import EngineConfig
from specstate.engine.draft_policy import AcceptanceEma, DraftPolicy, PlanRound
from specstate.engine.hooks import RoundHooks
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

__all__ = ["EngineMemory", "EngineParts", "compose"]


@attrs.frozen(kw_only=True)
class EngineParts:
    """Every owner of one engine, as `compose` wired them."""

    memory: EngineMemory
    scheduler: Scheduler
    grammar: GrammarTable
    deliveries: Deliveries
    draft_guard: DraftGuard | None
    budget_guard: BudgetGuard | None
    rounds: RoundPipeline


def compose(
    worker: WorkerProtocol,
    *,
    limits: RequestLimits,
    config: EngineConfig,
    trace: TraceRecorder | None = None,
    draft_policy: DraftPolicy | None = None,
    agreement: RoundAgreement | None = None,
    verify_budget: VerifyBudgetPolicy | None = None,
) -> EngineParts:
    """Build and wire every owner of an engine for ``worker`` (the `specstate.Engine` args).

    Raises:
        InvalidConfig: the worker cannot serve ``config`` (overlap, mixed chunks, an adaptive
            draft length or verify budgets it does not support).
    """
    caps = worker.capabilities
    guard = _draft_guard(caps, config, draft_policy)
    if verify_budget is None and config.verify_budget is not None:
        verify_budget = budget_policy(config.verify_budget, config.cost_profile)
    budgets = _budget_guard(caps, verify_budget)
    if config.overlap and not caps.supports_overlap:
        raise InvalidConfig(f"worker {caps.algorithm!r} does not support the overlap loop")
    if config.mixed_chunk and not caps.supports_mixed_chunk:
        raise InvalidConfig(f"worker {caps.algorithm!r} does not support mixed chunks")
    memory = EngineMemory.build(caps, limits, config)
    planner = round_planner(guard, budgets, num_steps=caps.num_steps)
    scheduler = _scheduler(limits, config, memory, planner)
    worker.attach(
        WorkerMemory(
            req_to_token=memory.allocator.req_to_token,
            ledger=memory.views.worker,
            num_token_slots=memory.num_token_slots,
            device=torch.device(config.device),
            recurrent=None if memory.recurrent is None else memory.recurrent.layout,
            parallel=None if agreement is None else agreement.parallel,
        )
    )
    # The user's recorder is called inside the round: contained, once for every caller
    # (capabilities/tracing.py).
    recorder = None if trace is None else ContainedRecorder(trace)
    grammar = GrammarTable(limits=limits, trace=recorder, mask_threads=config.grammar_mask_threads)
    # What the streams have delivered, per request (capabilities/delivery.py).
    deliveries = Deliveries(memory.outputs, history=config.finished_history)
    tracing = None
    if trace is not None and recorder is not None:
        tracing = _trace_hook(trace, recorder, config, caps, memory, scheduler)
    # The hooks' order is their order at every point: the agreement settles a batch's verdict
    # first; grammar refuses a request before the trace records its submit; the trace records
    # a round before the draft policy observes it (the policy is user code, so it goes last).
    agreed = None if agreement is None else AgreementHook(agreement)
    ordered = (agreed, grammar, tracing, guard, budgets, deliveries)
    hooks = RoundHooks([hook for hook in ordered if hook is not None])
    parts = _round_parts(worker, limits, config, memory, scheduler, trace is not None)
    return EngineParts(
        memory=memory,
        scheduler=scheduler,
        grammar=grammar,
        deliveries=deliveries,
        draft_guard=guard,
        budget_guard=budgets,
        rounds=RoundPipeline(parts=parts, hooks=hooks, config=config),
    )


@attrs.frozen(kw_only=True)
class EngineMemory:
    """The memory owners of one engine, sized from the worker's window and the config."""

    checker: OwnershipChecker
    ledger: KvLedger
    views: LedgerViews
    recurrent: RecurrentStatePool | None
    allocator: KvAllocator
    deferred: DeferredReleases
    outputs: OutputTable
    num_token_slots: int

    @classmethod
    def build(
        cls, caps: WorkerCapabilities, limits: RequestLimits, config: EngineConfig
    ) -> EngineMemory:
        """The ledger (with its role views), the pools, the allocator and the output table."""
        checker = OwnershipChecker(enabled=config.check_ownership)
        window = caps.spec_window(config.page_size)
        # No request outgrows the pool, so a context longer than the pool only wastes rows.
        context = min(limits.max_context_len, config.kv_tokens)
        row_width = context + window.row_headroom + caps.max_accept + config.page_size
        num_pages = config.kv_tokens // config.page_size
        max_requests = config.max_running * 2  # room for requests whose release is deferred
        validate = config.check_invariants
        recurrent = recurrent_pool_for(
            caps.recurrent,
            num_draft_tokens=caps.num_draft_tokens,
            topk=caps.topk,
            num_request_slots=max_requests + 1,
            checker=checker,
            validate=validate,
        )
        ledger = KvLedger(max_requests, row_width, checker=checker, validate=validate)
        views = ledger.views()
        req_pool = ReqToTokenPool(max_requests, row_width, device=config.device)
        token_pool = TokenSlotAllocator(num_pages, config.page_size)
        allocator = KvAllocator(
            ledger=views.allocator,
            req_pool=req_pool,
            token_pool=token_pool,
            validate=validate,
            window=window,
            checker=checker,
            recurrent=recurrent,
            prefix=_prefix_rows(caps, config, req_pool, token_pool),
        )
        outputs = OutputTable(
            max_slots=max_requests,
            max_outputs=context,
            max_run=caps.max_accept,
            eos_token_ids=limits.eos_token_ids,
            checker=checker,
        )
        return cls(
            checker=checker,
            ledger=ledger,
            views=views,
            recurrent=recurrent,
            allocator=allocator,
            deferred=DeferredReleases(allocator),
            outputs=outputs,
            num_token_slots=num_pages * config.page_size,
        )


def _scheduler(
    limits: RequestLimits, config: EngineConfig, memory: EngineMemory, planner: PlanRound
) -> Scheduler:
    """The scheduler, with its admission limits and the draft width of each decode round."""
    return Scheduler(
        config=SchedulerConfig(
            max_running=config.max_running,
            prefill_token_budget=config.chunked_prefill or config.max_prefill_tokens,
            chunked_prefill=config.chunked_prefill is not None,
            vocab_size=limits.vocab_size,
            mixed_chunk=config.mixed_chunk,
            validate=config.check_invariants,
        ),
        allocator=memory.allocator,
        ledger=memory.views.scheduler,
        outputs=memory.outputs,
        checker=memory.checker,
        device=torch.device(config.device),
        releases_pending=lambda: memory.deferred.has_pending,
        plan_round=planner,
    )


def _round_parts(
    worker: WorkerProtocol,
    limits: RequestLimits,
    config: EngineConfig,
    memory: EngineMemory,
    scheduler: Scheduler,
    traced: bool,
) -> RoundParts:
    """The owners the round calls: the result processor, the launcher and the lifecycle."""
    caps = worker.capabilities
    launcher = Launcher(
        worker=worker,
        overlap=config.overlap,
        speculative=caps.speculative,
        max_accept=caps.max_accept,
        vocab_size=limits.vocab_size,
        max_slots=config.max_running * 2 + 1,
        device=torch.device(config.device),
        debug_relay=config.debug_relay,
        req_to_token=memory.allocator.req_to_token,
        checker=memory.checker,
        forward_timeout=config.forward_timeout_s,
        check=config.check_invariants,
        asynchronous=caps.asynchronous,
        traced=traced,
    )
    return RoundParts(
        scheduler=scheduler,
        launcher=launcher,
        results=ResultProcessor(
            ledger=memory.views.result_processor,
            outputs=memory.outputs,
            checker=memory.checker,
            recurrent=memory.recurrent,
        ),
        lifecycle=RequestLifecycle(
            scheduler=scheduler,
            allocator=memory.allocator,
            deferred=memory.deferred,
            finished_history=config.finished_history,
        ),
        deferred=memory.deferred,
        checker=memory.checker,
        ledger=memory.ledger,
        allocator=memory.allocator,
        outputs=memory.outputs,
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


def _budget_guard(
    caps: WorkerCapabilities, policy: VerifyBudgetPolicy | None
) -> BudgetGuard | None:
    """The contained verify-budget policy, or None; refused for a worker that cannot honour it."""
    if policy is None:
        return None
    if not (caps.speculative and caps.supports_verify_budgets and caps.topk == 1):
        raise InvalidConfig(
            f"worker {caps.algorithm!r} does not support per-row verify budgets "
            "(WorkerCapabilities.supports_verify_budgets, a speculating chain)"
        )
    if isinstance(policy, ConfidenceBudget) and not caps.reports_draft_confidences:
        raise InvalidConfig(
            f"worker {caps.algorithm!r} reports no draft confidences "
            "(WorkerCapabilities.reports_draft_confidences), which ConfidenceBudget plans from"
        )
    return BudgetGuard(policy)


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


def _trace_hook(
    trace: TraceRecorder,
    recorder: ContainedRecorder,
    config: EngineConfig,
    caps: WorkerCapabilities,
    memory: EngineMemory,
    scheduler: Scheduler,
) -> TraceHook:
    """Tracing: the trace's header (the config, the worker's speculation) and its hook, which
    records through ``recorder`` (the user's ``trace``, contained)."""
    trace.header = {
        "config": attrs.asdict(config),
        "worker": {
            "algorithm": caps.algorithm,
            "num_draft_tokens": caps.num_draft_tokens,
            "max_accept": caps.max_accept,
        },
    }
    return TraceHook(
        recorder,
        ledger=memory.ledger,
        outputs=memory.outputs,
        scheduler=scheduler,
        allocator=memory.allocator,
    )
