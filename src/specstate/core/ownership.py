"""Roles and the run-time ownership check: each counter has one writer, and this says who acts.

Ownership of every counter is enforced three ways (docs/ownership.md):

1. **Static.** Each role is handed a Protocol-typed view exposing only its mutators
   (`specstate.core.ledger.WorkerLedgerView` has no ``advance_committed``), and value types are
   frozen attrs classes, so mypy rejects a write by the wrong role.
2. **Lint.** `specstate lint` walks Python ASTs and reports writes to tracked counters outside
   the owner scopes (`specstate.tools.lint`).
3. **Run time.** An `OwnershipChecker` records which `Role` the current thread acts as; every
   mutator of an owner asks it, and in checking mode a write by any other role raises
   `OwnershipError` naming the role, the counter and the request.

The checker is an explicit object composed by the engine and passed to every owner; there is no
module-level state. The active role is per thread, because the CPU stream runs worker code on
its own thread while the scheduler thread keeps acting as the scheduler.

Example::

    checker = OwnershipChecker(enabled=True)
    with checker.acting(Role.RESULT_PROCESSOR):
        ledger.advance_committed(slots, accept_lens)  # allowed
    ledger.advance_committed(slots, accept_lens)       # OwnershipError: no role is acting
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterable
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import Final

import attrs

from specstate.core.errors import OwnershipError

__all__ = ["OwnershipChecker", "Role", "RoleScope"]


class Role(enum.Enum):
    """The owners of scheduling state. Member order carries no meaning."""

    SCHEDULER = "scheduler"
    """Admission, batching, prepare-for-extend (sets committed to the extend end), prefix match."""
    ALLOCATOR = "allocator"
    """KV memory: opens and closes ledger slots, grows the reservation (`kv_allocated_len`)."""
    WORKER = "worker"
    """The engine's model runner: reads everything, writes no scheduler counter."""
    RESULT_PROCESSOR = "result_processor"
    """Settles results: the only role that advances `kv_committed_len` and appends outputs."""
    FUTURE_MAP = "future_map"
    """The device relay: writes next-iteration inputs, never a host counter."""


class _RoleStack(threading.local):
    """Per-thread stack of the roles entered through `OwnershipChecker.acting`."""

    def __init__(self) -> None:
        self.roles: list[Role] = []


@attrs.define
class OwnershipChecker:
    """Says which role the calling thread acts as, and refuses writes by the wrong one.

    With ``enabled=False`` every check passes and costs one attribute read; engines run
    that way in production, tests run with checking on.

    Invariant: the active role of a thread is the innermost `acting` scope it is inside;
    outside every scope no role is active and, when enabled, every guarded write is refused.
    """

    enabled: bool = True
    _stack: _RoleStack = attrs.field(factory=_RoleStack, init=False, repr=False)

    @property
    def active_role(self) -> Role | None:
        """The role the calling thread acts as now, or None outside every scope."""
        roles = self._stack.roles
        return roles[-1] if roles else None

    def acting(self, role: Role) -> AbstractContextManager[object]:
        """A single-use context manager in which the calling thread acts as ``role``.

        With checking off nothing is recorded: a shared no-op context is returned (the
        per-round hot path enters several scopes, and every check passes anyway).
        """
        if not self.enabled:
            return _NO_SCOPE
        return RoleScope(self, role)

    def require(self, owners: Iterable[Role], *, counter: str, request: str) -> None:
        """Raise `OwnershipError` unless the active role is one of ``owners``.

        Args:
            owners: the roles allowed to write ``counter``.
            counter: the counter about to be written, for the message.
            request: the request (or requests) whose counter it is, for the message.
        """
        if not self.enabled:
            return
        active = self.active_role
        allowed = frozenset(owners)
        if active in allowed:
            return
        names = ", ".join(sorted(r.value for r in allowed))
        who = "no role" if active is None else f"role {active.value!r}"
        raise OwnershipError(f"request {request}: {who} may not write {counter} (owned by {names})")

    def _push(self, role: Role) -> None:
        self._stack.roles.append(role)

    def _pop(self, role: Role) -> None:
        roles = self._stack.roles
        if not roles or roles[-1] is not role:
            top = roles[-1].value if roles else "none"
            raise OwnershipError(
                f"role scopes closed out of order: closing {role.value}, top {top}"
            )
        roles.pop()


class RoleScope:
    """Single-use, non-reentrant scope in which the calling thread acts as one role.

    Scopes nest (the scheduler may act as the allocator inside its own scope) and must close in
    the reverse order they opened, on the thread that opened them.
    """

    __slots__ = ("_checker", "_role", "_state")

    def __init__(self, checker: OwnershipChecker, role: Role) -> None:
        self._checker = checker
        self._role = role
        self._state = "new"

    def __enter__(self) -> Role:
        if self._state != "new":
            raise OwnershipError(f"role scope for {self._role.value} is single-use ({self._state})")
        self._state = "entered"
        self._checker._push(self._role)
        return self._role

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._state = "closed"
        self._checker._pop(self._role)


_NO_SCOPE: Final[AbstractContextManager[object]] = nullcontext()
"""The scope `OwnershipChecker.acting` returns with checking off (nullcontext is reusable)."""
