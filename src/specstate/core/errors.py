"""The exception tree: every error specstate raises on purpose is a `SpecStateError`.

Each message names the request (or slot) and the numbers involved, so an off-by-one can be read
from the message alone ("request r7: commit of 5 tokens would pass allocated 12 (committed 9)").
An operation that raises leaves the state it was asked to change exactly as it was.

::

    SpecStateError
    ├── InvalidRequest          bad input at submission: empty prompt, bad max_new_tokens,
    │                           token id outside the vocabulary, prompt longer than the context
    ├── InvalidConfig           inconsistent engine / memory / worker configuration
    ├── InvalidTransition       a request lifecycle change the state machine does not allow
    ├── InvariantViolation      a relation between clocks, owners or pools does not hold
    │                           (the invariant checker, ``check_invariants``; names it)
    ├── OwnershipError          a counter mutated by a role that does not own it (run-time check)
    ├── LedgerViolation         a ledger change that would break
    │   │                       0 <= protected <= committed <= allocated <= row width
    │   └── ReservationExceeded a commit or write past the reserved (allocated) KV slots
    ├── KvPoolExhausted         the KV pool cannot satisfy an allocation (nothing was taken)
    ├── DoubleRelease           KV or a request slot released twice, or by a stale generation
    ├── StaleResult             a result for an old incarnation of a request (refused)
    ├── RelayError              FutureMap misuse: consume-once violation, unresolved read
    ├── WorkerResultError       a worker result that breaks the forward contract (its batch fails)
    ├── ForwardTimeout          a forward that did not finish within ``forward_timeout_s``
    ├── GrammarError            a request's grammar reached a dead end (no token can follow),
    │                           or a forward broke the grammar contract (its request ends)
    ├── UsageError              an engine used against its contract: after close, from a second
    │                           thread
    ├── QueueFull               an `AsyncEngine`'s waiting queue is full (nothing was queued;
    │                           retry later)
    ├── EngineUnavailable       an `AsyncEngine` whose engine can no longer step (a forward
    │                           timed out, its driver thread died): open streams end with it
    ├── HandoffError            a prefill → decode handoff of a request could not go on
    │   ├── HandoffMismatch     a record this engine cannot serve (page size, dtype, model digest,
    │   │                       algorithm, ...): refused before anything was written
    │   ├── MalformedRecord     a record that does not decode: truncated, corrupted, wrong version
    │   ├── HandoffUnsupported  a worker or request whose state does not cross (yet)
    │   └── HandoffFailed       the other side failed or went silent during a transfer
    └── RankError               the ranks of a tensor-parallel group stopped agreeing
        ├── RankDivergence      two ranks planned or settled a round differently (checking mode)
        └── RankFailure         a rank failed, died or wedged; its batch fails on every rank
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "DoubleRelease",
    "EngineUnavailable",
    "ForwardTimeout",
    "GrammarError",
    "HandoffError",
    "HandoffFailed",
    "HandoffMismatch",
    "HandoffUnsupported",
    "InvalidConfig",
    "InvalidRequest",
    "InvalidTransition",
    "InvariantViolation",
    "KvPoolExhausted",
    "LedgerViolation",
    "MalformedRecord",
    "OwnershipError",
    "QueueFull",
    "RankDivergence",
    "RankError",
    "RankFailure",
    "RelayError",
    "ReservationExceeded",
    "SpecStateError",
    "StaleResult",
    "UsageError",
    "WorkerResultError",
]


class SpecStateError(Exception):
    """Root of every error specstate raises on purpose."""


class InvalidRequest(SpecStateError, ValueError):
    """A request was rejected at submission; no state changed.

    Attributes:
        fields: the request fields the refusal is about, as `Engine.submit` takes them
            (``"request_id"``, ``"prompt_ids"``, or a `SamplingParams` field such as
            ``"max_new_tokens"``), in the order the message names them; empty when none is. A
            server maps them to the fields of its own protocol.
    """

    def __init__(self, message: str = "", *, fields: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.fields: tuple[str, ...] = tuple(dict.fromkeys(fields))


class InvalidConfig(SpecStateError, ValueError):
    """A configuration is inconsistent (sizes, page size, capabilities)."""


class InvalidTransition(SpecStateError):
    """A request lifecycle transition that the state machine does not allow."""


class InvariantViolation(SpecStateError):
    """A relation between the engine's clocks, owners or pools does not hold.

    Attributes:
        invariant: the name of the relation (``ledger-order``, ``steady-state``, ...: the
            invariant checker's docs list them).
    """

    def __init__(self, invariant: str, message: str) -> None:
        super().__init__(f"[{invariant}] {message}")
        self.invariant = invariant


class OwnershipError(SpecStateError):
    """A counter was mutated by a role that does not own it."""


class LedgerViolation(SpecStateError):
    """A ledger change would break the ordering invariant; the ledger is unchanged."""


class ReservationExceeded(LedgerViolation):
    """A commit or a device write would pass the reserved (allocated) KV slots."""


class KvPoolExhausted(SpecStateError):
    """The KV pool cannot satisfy an allocation; nothing was allocated."""


class DoubleRelease(SpecStateError):
    """KV pages or a request slot were released twice, or through a stale generation."""


class StaleResult(SpecStateError):
    """A result arrived for an old incarnation of a request and was refused."""


class RelayError(SpecStateError):
    """FutureMap misuse: a consume-once violation or a read of an unresolved entry."""


class WorkerResultError(SpecStateError):
    """A worker result broke the forward contract; its batch fails, the engine keeps serving."""


class ForwardTimeout(SpecStateError):
    """A forward did not finish in time; its batch fails and its stream is abandoned."""


class GrammarError(SpecStateError):
    """A request's grammar cannot go on (a dead end), or a forward broke the grammar contract.

    The request ends with ``FinishReason.ERROR``; the engine keeps serving.
    """


class UsageError(SpecStateError):
    """An engine was used against its contract (after `close`, or from a second thread)."""


class QueueFull(SpecStateError):
    """An `AsyncEngine` refused a request: its waiting queue is full; nothing was queued."""


class EngineUnavailable(SpecStateError):
    """An `AsyncEngine` whose engine can no longer step (a forward timed out, or its driver
    thread died): every open stream ends with this error and new requests are refused.
    ``__cause__`` is the failure."""


class HandoffError(SpecStateError):
    """A prefill → decode handoff of a request could not go on (`specstate.handoff`)."""


class HandoffMismatch(HandoffError):
    """A decode engine cannot serve a handoff record; nothing was written.

    Attributes:
        field: the compatibility field that differs (``page_size``, ``dtype``,
            ``model_digest``, ``algorithm``, ...).
        expected: this engine's value.
        found: the record's value.
    """

    def __init__(self, message: str, *, field: str, expected: object, found: object) -> None:
        super().__init__(message)
        self.field = field
        self.expected = expected
        self.found = found


class MalformedRecord(HandoffError):
    """A handoff record that does not decode (truncated, corrupted, an unknown version)."""


class HandoffUnsupported(HandoffError):
    """A worker, or a request, whose state cannot be handed off (nothing was exported)."""


class HandoffFailed(HandoffError):
    """The other side of a transfer failed, closed, or did not answer in time."""


class RankError(SpecStateError):
    """The ranks of a tensor-parallel group stopped agreeing (`specstate.distributed`)."""


class RankDivergence(RankError):
    """Two ranks planned or settled a round differently; the group cannot go on."""


class RankFailure(RankError):
    """A rank's batch failed, or a rank died or wedged (a collective failed or timed out)."""
