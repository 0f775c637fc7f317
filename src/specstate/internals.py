"""The parts `specstate.Engine` composes, for engine builders who compose their own.

Most users need only the top-level ``specstate`` module. What is here is stable but lower
level: the KV ledger and its typed role views (`KvLedger.views`: one writer per counter), the
slot pools and the KV allocator with its 2x speculative reservation, the prefix cache (a radix
tree of committed KV pages) and the rows' holds on it, the recurrent-state pool of hybrid
models (`RecurrentStatePool`), retraction, the FutureMap relay and its batch helpers, forward
isolation, the CPU/CUDA forward streams, the scheduler's `ScheduleBatch`, and the grammar owner
(`GrammarTable`, with each request's `GrammarState`).
`OwnershipChecker` and `Role` are the run-time half of ownership checking.

The ledger is built only by a composing factory (`specstate.Engine` is one); everyone else
receives a typed view of it. The project's ruff configuration bans importing `KvLedger`
elsewhere.
"""

from __future__ import annotations

from specstate.batch.isolation import ForwardIsolation, ForwardIsolator
from specstate.batch.relay_inputs import resolve_batch_forward_inputs, resolve_batch_seq_lens
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.ledger import (
    AllocatorLedgerView,
    KvLedger,
    KvLedgerSnapshot,
    LedgerBatchSnapshot,
    LedgerReader,
    LedgerViews,
    ResultProcessorLedgerView,
    SchedulerLedgerView,
)
from specstate.core.ownership import OwnershipChecker, Role, RoleScope
from specstate.engine.capabilities.grammar import GrammarSnapshot, GrammarTable
from specstate.grammar.state import GrammarCompiler, GrammarState
from specstate.memory.allocation import KvAllocator
from specstate.memory.deferred import DeferredReleases
from specstate.memory.pages import TokenSlotAllocator
from specstate.memory.prefix_cache import PrefixCache, PrefixMatch
from specstate.memory.prefix_rows import PrefixRows
from specstate.memory.recurrent import RecurrentPoolSnapshot, RecurrentStatePool
from specstate.memory.releases import ReleasedKv
from specstate.memory.retraction import RetractionOutcome, retract_for_decode, retraction_order
from specstate.memory.sizing import DecodeAllocLens, page_aligned_decode_alloc_lens
from specstate.memory.slots import ReqToTokenPool, SlotHandle
from specstate.relay.future_map import (
    ForwardInputs,
    FutureMap,
    MixedTails,
    ResolvedSeqLens,
    Unresolved,
    is_unresolved,
)
from specstate.relay.streams import CpuStream, Stream, make_stream

__all__ = [
    "AllocatorLedgerView",
    "CpuStream",
    "DecodeAllocLens",
    "DeferredReleases",
    "ForwardInputs",
    "ForwardIsolation",
    "ForwardIsolator",
    "FutureMap",
    "GrammarCompiler",
    "GrammarSnapshot",
    "GrammarState",
    "GrammarTable",
    "KvAllocator",
    "KvLedger",
    "KvLedgerSnapshot",
    "LedgerBatchSnapshot",
    "LedgerReader",
    "LedgerViews",
    "MixedTails",
    "OwnershipChecker",
    "PrefixCache",
    "PrefixMatch",
    "PrefixRows",
    "RecurrentPoolSnapshot",
    "RecurrentStatePool",
    "ReleasedKv",
    "ReqToTokenPool",
    "ResolvedSeqLens",
    "ResultProcessorLedgerView",
    "RetractionOutcome",
    "Role",
    "RoleScope",
    "ScheduleBatch",
    "SchedulerLedgerView",
    "SlotHandle",
    "Stream",
    "TokenSlotAllocator",
    "Unresolved",
    "is_unresolved",
    "make_stream",
    "page_aligned_decode_alloc_lens",
    "resolve_batch_forward_inputs",
    "resolve_batch_seq_lens",
    "retract_for_decode",
    "retraction_order",
]
