"""specstate: the scheduling state of speculative decoding under overlap scheduling.

An engine implements one adapter for its model runner and gets, from specstate, request clocks,
KV reservation for the speculative window, the device relay between iterations, forward
isolation, result settlement and invariant checking, with one owner per counter, checked by
mypy, by `specstate lint` and at run time. See DESIGN.md and docs/ for the model.
"""

from __future__ import annotations

from specstate.core.errors import (
    DoubleRelease,
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

__version__ = "0.1.0.dev0"

__all__ = [
    "AllocatorLedgerView",
    "DoubleRelease",
    "FinishReason",
    "FinishState",
    "InvalidConfig",
    "InvalidRequest",
    "InvalidTransition",
    "KvLedger",
    "KvLedgerSnapshot",
    "KvPoolExhausted",
    "LedgerBatchSnapshot",
    "LedgerReader",
    "LedgerViews",
    "LedgerViolation",
    "OwnershipChecker",
    "OwnershipError",
    "RelayError",
    "Req",
    "ReqSnapshot",
    "ReqStatus",
    "RequestLimits",
    "ReservationExceeded",
    "ResultProcessorLedgerView",
    "Role",
    "RoleScope",
    "SamplingParams",
    "SchedulerLedgerView",
    "SpecStateError",
    "StaleResult",
    "WorkerLedgerView",
    "__version__",
]
