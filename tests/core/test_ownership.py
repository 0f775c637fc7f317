"""The run-time ownership check: roles are per thread, scopes are single-use and nest."""

from __future__ import annotations

import threading

import pytest

from specstate import OwnershipError
from specstate.internals import OwnershipChecker, Role


def test_require_passes_only_for_an_owner(checker: OwnershipChecker) -> None:
    """The active role must be one of the owners; message names role, counter and request."""
    with (
        checker.acting(Role.WORKER),
        pytest.raises(OwnershipError, match=r"request r1: role 'worker' may not write kv"),
    ):
        checker.require((Role.RESULT_PROCESSOR,), counter="kv_committed_len", request="r1")
    with checker.acting(Role.RESULT_PROCESSOR):
        checker.require((Role.RESULT_PROCESSOR,), counter="kv_committed_len", request="r1")


def test_no_role_is_refused_when_enabled(checker: OwnershipChecker) -> None:
    """Outside every scope a guarded write is refused."""
    with pytest.raises(OwnershipError, match="no role may not write x"):
        checker.require((Role.SCHEDULER,), counter="x", request="r2")


def test_disabled_checker_allows_everything() -> None:
    """With checking off the check is a no-op."""
    OwnershipChecker(enabled=False).require((Role.SCHEDULER,), counter="x", request="r")


def test_scopes_nest_and_restore(checker: OwnershipChecker) -> None:
    """The innermost scope is active; leaving it restores the outer role."""
    seen = []
    with checker.acting(Role.SCHEDULER):
        with checker.acting(Role.ALLOCATOR):
            seen.append(checker.active_role)
        seen.append(checker.active_role)
    seen.append(checker.active_role)
    assert seen == [Role.ALLOCATOR, Role.SCHEDULER, None]


def test_scope_is_single_use(checker: OwnershipChecker) -> None:
    """Entering the same scope twice raises a real exception."""
    scope = checker.acting(Role.WORKER)
    with scope:
        pass
    with pytest.raises(OwnershipError, match="single-use"), scope:
        pass


def test_scope_restores_on_exception(checker: OwnershipChecker) -> None:
    """An exception inside a scope still pops the role."""
    with pytest.raises(RuntimeError), checker.acting(Role.WORKER):
        raise RuntimeError("boom")
    assert checker.active_role is None


def test_roles_are_per_thread(checker: OwnershipChecker) -> None:
    """A role entered on one thread is not active on another (the CPU stream thread)."""
    seen: list[Role | None] = []
    with checker.acting(Role.SCHEDULER):
        thread = threading.Thread(target=lambda: seen.append(checker.active_role))
        thread.start()
        thread.join()
        assert checker.active_role is Role.SCHEDULER
    assert seen == [None]
