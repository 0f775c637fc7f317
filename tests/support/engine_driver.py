"""Test-only: step an engine to idle with the invariant checker after every step."""

from __future__ import annotations

import attrs

from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine


@attrs.frozen(kw_only=True)
class DriveLog:
    """What happened while driving: retractions and deferred releases seen, steps taken."""

    steps: int
    retracted: tuple[str, ...]
    deferred: frozenset[str]


def run_checked(engine: Engine, *, max_steps: int = 1000) -> DriveLog:
    """Step until idle, checking every invariant after each step; fail past ``max_steps``."""
    retracted: list[str] = []
    deferred: set[str] = set()
    for steps in range(max_steps + 1):
        if engine.is_idle:
            return DriveLog(steps=steps, retracted=tuple(retracted), deferred=frozenset(deferred))
        retracted.extend(engine.step().retracted)
        deferred.update(engine.snapshot().deferred_releases)
        check_engine(engine)
    raise AssertionError(f"engine not idle after {max_steps} steps")
