"""specstate: the scheduling state of speculative decoding under overlap scheduling.

An engine team implements one adapter for its model runner (`WorkerProtocol`) and gets, from
specstate, request clocks, KV reservation for the speculative window, the device relay between
iterations, forward isolation, result settlement, retraction, finish handling and invariant
checking, with one owner per counter, checked by mypy, by ``specstate lint`` and at run time.

Two layers:

* ``specstate`` (this module) is what users and worker authors need: `Engine`,
  `EngineConfig`, requests (`SamplingParams`, `RequestLimits`, `Req`, `FinishReason`),
  draft and verify-budget policies (`DraftPolicy`, `AcceptanceEma`, `VerifyBudgetPolicy`,
  `BatchSizeSchedule`, `GoodputBudget`, `ConfidenceBudget`, `CostProfile`, ...), streaming
  (`stream`, `TokenEvent`), the asyncio front door (`AsyncEngine`,
  `RequestStream`), structured output (`Grammar`, `GrammarVocabulary`), the worker interface
  (`WorkerProtocol`, `WorkerCapabilities`, `PrefixSharing`, `WorkerMemory`, `OnPublish`), the
  types a worker sees (`ForwardBatch`, `GenerationBatchResult`, `RelayPayload`,
  `SamplingInfo`, `GrammarRows`, `RowMasks`, and for a hybrid model `RecurrentStateSpec` and
  `RecurrentLayout`), KV memory planning (`kv_tokens_for_budget`, `kv_bytes_for_tokens`,
  `kv_layouts`, `KvLayout`, `requests_that_fit`, `recurrent_state_bytes`), and every error.
* `specstate.internals` holds the parts the engine composes (the ledger and its role views,
  pools, allocator, FutureMap, isolation, streams) for engine builders who compose their own.

The design (three clocks, one owner per counter, the 2x reservation, the publish fence) is
documented in the project's docs, on the "Design" page. Names are imported lazily, so
``import specstate`` (and ``specstate --version``) does not import torch until a name is used.
"""

from __future__ import annotations

import importlib
import warnings
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0.dev0"

if TYPE_CHECKING:
    from specstate.batch.forward_batch import ForwardBatch
    from specstate.batch.forward_mode import ForwardMode
    from specstate.batch.isolation import IsolationError
    from specstate.batch.result import GenerationBatchResult
    from specstate.batch.sampling import PenaltyAccumulator, SamplingInfo
    from specstate.core.errors import (
        DoubleRelease,
        EngineUnavailable,
        ForwardTimeout,
        GrammarError,
        HandoffError,
        HandoffFailed,
        HandoffMismatch,
        HandoffUnsupported,
        InvalidConfig,
        InvalidRequest,
        InvalidTransition,
        InvariantViolation,
        KvPoolExhausted,
        LedgerViolation,
        MalformedRecord,
        OwnershipError,
        QueueFull,
        RankDivergence,
        RankError,
        RankFailure,
        RelayError,
        ReservationExceeded,
        SpecStateError,
        StaleResult,
        UsageError,
        WorkerResultError,
    )
    from specstate.core.ledger import WorkerLedgerView
    from specstate.core.params import RequestLimits, SamplingParams
    from specstate.core.request import Req
    from specstate.core.status import FinishReason, FinishState, ReqSnapshot, ReqStatus
    from specstate.engine.budgets import (
        BatchSizeSchedule,
        BudgetRows,
        ConfidenceBudget,
        CostProfile,
        FixedBudget,
        GoodputBudget,
        SettledBudgets,
        VerifyBudgetPolicy,
    )
    from specstate.engine.config import EngineConfig, EngineSnapshot, StepReport
    from specstate.engine.draft_policy import AcceptanceEma, DraftPolicy
    from specstate.engine.engine import Engine
    from specstate.engine.invariants import check_engine
    from specstate.engine.planning import (
        KvLayout,
        kv_bytes_for_tokens,
        kv_layouts,
        kv_tokens_for_budget,
        recurrent_state_bytes,
        requests_that_fit,
    )
    from specstate.engine.settle.results import AcceptMetrics
    from specstate.engine.stream import TokenEvent, stream
    from specstate.engine.worker import (
        AlgorithmRegistry,
        OnPublish,
        ParallelGroup,
        WorkerCapabilities,
        WorkerMemory,
        WorkerProtocol,
    )
    from specstate.grammar.rows import GrammarRows, RowMasks
    from specstate.grammar.spec import Grammar, GrammarVocabulary
    from specstate.memory.prefix_cache import PrefixCacheSnapshot, PrefixSharing
    from specstate.memory.recurrent_layout import (
        RecurrentGroupSpec,
        RecurrentLayout,
        RecurrentStateSpec,
        StateTensorSpec,
    )
    from specstate.memory.sizing import SpecWindow
    from specstate.relay.future_map import RelayPayload
    from specstate.relay.streams import Event
    from specstate.serving.async_engine import AsyncEngine, AsyncEngineSnapshot
    from specstate.serving.request_stream import RequestStream

# Each public name and the module that defines it (imported on first use).
_EXPORTS: dict[str, str] = {
    "ForwardBatch": "specstate.batch.forward_batch",
    "ForwardMode": "specstate.batch.forward_mode",
    "GenerationBatchResult": "specstate.batch.result",
    "PenaltyAccumulator": "specstate.batch.sampling",
    "SamplingInfo": "specstate.batch.sampling",
    "DoubleRelease": "specstate.core.errors",
    "EngineUnavailable": "specstate.core.errors",
    "ForwardTimeout": "specstate.core.errors",
    "GrammarError": "specstate.core.errors",
    "HandoffError": "specstate.core.errors",
    "HandoffFailed": "specstate.core.errors",
    "HandoffMismatch": "specstate.core.errors",
    "HandoffUnsupported": "specstate.core.errors",
    "InvalidConfig": "specstate.core.errors",
    "InvalidRequest": "specstate.core.errors",
    "InvalidTransition": "specstate.core.errors",
    "KvPoolExhausted": "specstate.core.errors",
    "LedgerViolation": "specstate.core.errors",
    "MalformedRecord": "specstate.core.errors",
    "OwnershipError": "specstate.core.errors",
    "QueueFull": "specstate.core.errors",
    "RankDivergence": "specstate.core.errors",
    "RankError": "specstate.core.errors",
    "RankFailure": "specstate.core.errors",
    "RelayError": "specstate.core.errors",
    "ReservationExceeded": "specstate.core.errors",
    "SpecStateError": "specstate.core.errors",
    "StaleResult": "specstate.core.errors",
    "UsageError": "specstate.core.errors",
    "WorkerResultError": "specstate.core.errors",
    "WorkerLedgerView": "specstate.core.ledger",
    "FinishReason": "specstate.core.status",
    "FinishState": "specstate.core.status",
    "Req": "specstate.core.request",
    "ReqSnapshot": "specstate.core.status",
    "ReqStatus": "specstate.core.status",
    "RequestLimits": "specstate.core.params",
    "SamplingParams": "specstate.core.params",
    "BatchSizeSchedule": "specstate.engine.budgets",
    "BudgetRows": "specstate.engine.budgets",
    "ConfidenceBudget": "specstate.engine.budgets",
    "CostProfile": "specstate.engine.budgets",
    "FixedBudget": "specstate.engine.budgets",
    "GoodputBudget": "specstate.engine.budgets",
    "SettledBudgets": "specstate.engine.budgets",
    "VerifyBudgetPolicy": "specstate.engine.budgets",
    "AcceptanceEma": "specstate.engine.draft_policy",
    "DraftPolicy": "specstate.engine.draft_policy",
    "Engine": "specstate.engine.engine",
    "EngineConfig": "specstate.engine.config",
    "EngineSnapshot": "specstate.engine.config",
    "StepReport": "specstate.engine.config",
    "InvariantViolation": "specstate.core.errors",
    "check_engine": "specstate.engine.invariants",
    "AcceptMetrics": "specstate.engine.settle.results",
    "TokenEvent": "specstate.engine.stream",
    "stream": "specstate.engine.stream",
    "AlgorithmRegistry": "specstate.engine.worker",
    "OnPublish": "specstate.engine.worker",
    "ParallelGroup": "specstate.engine.worker",
    "WorkerCapabilities": "specstate.engine.worker",
    "WorkerMemory": "specstate.engine.worker",
    "WorkerProtocol": "specstate.engine.worker",
    "RecurrentGroupSpec": "specstate.memory.recurrent_layout",
    "RecurrentLayout": "specstate.memory.recurrent_layout",
    "RecurrentStateSpec": "specstate.memory.recurrent_layout",
    "StateTensorSpec": "specstate.memory.recurrent_layout",
    "GrammarRows": "specstate.grammar.rows",
    "RowMasks": "specstate.grammar.rows",
    "Grammar": "specstate.grammar.spec",
    "GrammarVocabulary": "specstate.grammar.spec",
    "PrefixCacheSnapshot": "specstate.memory.prefix_cache",
    "PrefixSharing": "specstate.memory.prefix_cache",
    "KvLayout": "specstate.engine.planning",
    "kv_bytes_for_tokens": "specstate.engine.planning",
    "kv_layouts": "specstate.engine.planning",
    "kv_tokens_for_budget": "specstate.engine.planning",
    "recurrent_state_bytes": "specstate.engine.planning",
    "requests_that_fit": "specstate.engine.planning",
    "SpecWindow": "specstate.memory.sizing",
    "RelayPayload": "specstate.relay.future_map",
    "IsolationError": "specstate.batch.isolation",
    "Event": "specstate.relay.streams",
    "AsyncEngine": "specstate.serving.async_engine",
    "AsyncEngineSnapshot": "specstate.serving.async_engine",
    "RequestStream": "specstate.serving.request_stream",
}

__all__ = [
    "AcceptMetrics",
    "AcceptanceEma",
    "AlgorithmRegistry",
    "AsyncEngine",
    "AsyncEngineSnapshot",
    "BatchSizeSchedule",
    "BudgetRows",
    "ConfidenceBudget",
    "CostProfile",
    "DoubleRelease",
    "DraftPolicy",
    "Engine",
    "EngineConfig",
    "EngineSnapshot",
    "EngineUnavailable",
    "Event",
    "FinishReason",
    "FinishState",
    "FixedBudget",
    "ForwardBatch",
    "ForwardMode",
    "ForwardTimeout",
    "GenerationBatchResult",
    "GoodputBudget",
    "Grammar",
    "GrammarError",
    "GrammarRows",
    "GrammarVocabulary",
    "HandoffError",
    "HandoffFailed",
    "HandoffMismatch",
    "HandoffUnsupported",
    "InvalidConfig",
    "InvalidRequest",
    "InvalidTransition",
    "InvariantViolation",
    "IsolationError",
    "KvLayout",
    "KvPoolExhausted",
    "LedgerViolation",
    "MalformedRecord",
    "OnPublish",
    "OwnershipError",
    "ParallelGroup",
    "PenaltyAccumulator",
    "PrefixCacheSnapshot",
    "PrefixSharing",
    "QueueFull",
    "RankDivergence",
    "RankError",
    "RankFailure",
    "RecurrentGroupSpec",
    "RecurrentLayout",
    "RecurrentStateSpec",
    "RelayError",
    "RelayPayload",
    "Req",
    "ReqSnapshot",
    "ReqStatus",
    "RequestLimits",
    "RequestStream",
    "ReservationExceeded",
    "RowMasks",
    "SamplingInfo",
    "SamplingParams",
    "SettledBudgets",
    "SpecStateError",
    "SpecWindow",
    "StaleResult",
    "StateTensorSpec",
    "StepReport",
    "TokenEvent",
    "UsageError",
    "VerifyBudgetPolicy",
    "WorkerCapabilities",
    "WorkerLedgerView",
    "WorkerMemory",
    "WorkerProtocol",
    "WorkerResultError",
    "__version__",
    "check_engine",
    "kv_bytes_for_tokens",
    "kv_layouts",
    "kv_tokens_for_budget",
    "recurrent_state_bytes",
    "requests_that_fit",
    "stream",
]

if not TYPE_CHECKING:  # mypy sees the imports above; at run time names load on first use

    def __getattr__(name: str) -> Any:
        module = _EXPORTS.get(name)
        if module is not None:
            value = getattr(importlib.import_module(module), name)
            globals()[name] = value  # later lookups skip this function
            return value
        if name.startswith("__"):  # probes for dunders never load the internals
            raise AttributeError(f"module 'specstate' has no attribute {name!r}")
        internals = importlib.import_module("specstate.internals")
        if name in internals.__all__:  # exported here before 0.1.0; goes away in 0.2
            warnings.warn(
                f"specstate.{name} moved to specstate.internals.{name}; "
                "the top-level alias goes away in 0.2",
                DeprecationWarning,
                stacklevel=2,
            )
            return getattr(internals, name)
        raise AttributeError(f"module 'specstate' has no attribute {name!r}")

    def __dir__() -> list[str]:
        return sorted(set(globals()) | set(__all__))
