"""specstate: the scheduling state of speculative decoding under overlap scheduling.

An engine implements one adapter for its model runner and gets, from specstate, request clocks,
KV reservation for the speculative window, the device relay between iterations, forward
isolation, result settlement and invariant checking, with one owner per counter, checked by
mypy, by `specstate lint` and at run time. See DESIGN.md and docs/ for the model.
"""

from __future__ import annotations

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.batch.sampling import PenaltyAccumulator, SamplingInfo
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.errors import (
    DoubleRelease,
    ForwardTimeout,
    InvalidConfig,
    InvalidRequest,
    InvalidTransition,
    KvPoolExhausted,
    LedgerViolation,
    OwnershipError,
    RelayError,
    ReservationExceeded,
    SpecStateError,
    StaleResult,
    UsageError,
    WorkerResultError,
)
from specstate.core.ledger import (
    AllocatorLedgerView,
    KvLedger,
    KvLedgerSnapshot,
    LedgerBatchSnapshot,
    LedgerReader,
    LedgerViews,
    ResultProcessorLedgerView,
    SchedulerLedgerView,
    WorkerLedgerView,
)
from specstate.core.ownership import OwnershipChecker, Role, RoleScope
from specstate.core.request import (
    FinishReason,
    FinishState,
    Req,
    ReqSnapshot,
    ReqStatus,
    RequestLimits,
    SamplingParams,
)
from specstate.engine.engine import Engine, EngineConfig, EngineSnapshot, StepReport
from specstate.engine.finish import resolve_finish
from specstate.engine.invariants import InvariantViolation, check_engine
from specstate.engine.results import AcceptMetrics
from specstate.engine.worker import (
    AlgorithmRegistry,
    OnPublish,
    WorkerCapabilities,
    WorkerMemory,
    WorkerProtocol,
)
from specstate.memory.allocation import DeferredReleases, KvAllocator, ReleasedKv
from specstate.memory.pools import (
    ReqToTokenPool,
    SlotHandle,
    TokenSlotAllocator,
)
from specstate.memory.retraction import RetractionOutcome, retract_for_decode, retraction_order
from specstate.memory.sizing import (
    DecodeAllocLens,
    SpecWindow,
    page_aligned_decode_alloc_lens,
)
from specstate.relay.batch_relay import resolve_batch_forward_inputs, resolve_batch_seq_lens
from specstate.relay.future_map import (
    ForwardInputs,
    FutureMap,
    MixedTails,
    RelayPayload,
    ResolvedSeqLens,
    Unresolved,
    is_unresolved,
)
from specstate.relay.isolation import ForwardIsolation, ForwardIsolator, IsolationError
from specstate.relay.streams import CpuStream, Event, Stream, make_stream

__version__ = "0.1.0.dev0"

__all__ = [
    "AcceptMetrics",
    "AlgorithmRegistry",
    "AllocatorLedgerView",
    "CpuStream",
    "DecodeAllocLens",
    "DeferredReleases",
    "DoubleRelease",
    "Engine",
    "EngineConfig",
    "EngineSnapshot",
    "Event",
    "FinishReason",
    "FinishState",
    "ForwardBatch",
    "ForwardInputs",
    "ForwardIsolation",
    "ForwardIsolator",
    "ForwardMode",
    "ForwardTimeout",
    "FutureMap",
    "GenerationBatchResult",
    "InvalidConfig",
    "InvalidRequest",
    "InvalidTransition",
    "InvariantViolation",
    "IsolationError",
    "KvAllocator",
    "KvLedger",
    "KvLedgerSnapshot",
    "KvPoolExhausted",
    "LedgerBatchSnapshot",
    "LedgerReader",
    "LedgerViews",
    "LedgerViolation",
    "MixedTails",
    "OnPublish",
    "OwnershipChecker",
    "OwnershipError",
    "PenaltyAccumulator",
    "RelayError",
    "RelayPayload",
    "ReleasedKv",
    "Req",
    "ReqSnapshot",
    "ReqStatus",
    "ReqToTokenPool",
    "RequestLimits",
    "ReservationExceeded",
    "ResolvedSeqLens",
    "ResultProcessorLedgerView",
    "RetractionOutcome",
    "Role",
    "RoleScope",
    "SamplingInfo",
    "SamplingParams",
    "ScheduleBatch",
    "SchedulerLedgerView",
    "SlotHandle",
    "SpecStateError",
    "SpecWindow",
    "StaleResult",
    "StepReport",
    "Stream",
    "TokenSlotAllocator",
    "Unresolved",
    "UsageError",
    "WorkerCapabilities",
    "WorkerLedgerView",
    "WorkerMemory",
    "WorkerProtocol",
    "WorkerResultError",
    "__version__",
    "check_engine",
    "is_unresolved",
    "make_stream",
    "page_aligned_decode_alloc_lens",
    "resolve_batch_forward_inputs",
    "resolve_batch_seq_lens",
    "resolve_finish",
    "retract_for_decode",
    "retraction_order",
]
