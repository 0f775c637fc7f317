"""What the invariant checker and the capabilities' checks read of an engine: a narrow view.

`check_engine` and every `RoundHook.check` take an `EngineView`, not the `Engine`: the owners a
check reads (never writes), the round's counters and its capabilities. `specstate.Engine` and its
round pipeline both provide it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from specstate.core.ledger import LedgerReader
    from specstate.engine.hooks import RoundHooks
    from specstate.engine.launch.outcome import InFlightView
    from specstate.engine.schedule.scheduler import Scheduler
    from specstate.engine.settle.outputs import OutputTable
    from specstate.memory.allocation import KvAllocator
    from specstate.memory.releases import DeferredReleases

__all__ = ["EngineView"]


class EngineView(Protocol):
    """The owners and counters of one engine, read only."""

    @property
    def ledger(self) -> LedgerReader:
        """The KV ledger."""
        ...

    @property
    def allocator(self) -> KvAllocator:
        """The KV allocator (pools, prefix cache, recurrent state rows)."""
        ...

    @property
    def scheduler(self) -> Scheduler:
        """The scheduler (waiting, prefilling and running requests)."""
        ...

    @property
    def deferred(self) -> DeferredReleases:
        """The releases that wait for launched batches (or quarantined behind a timeout)."""
        ...

    @property
    def outputs(self) -> OutputTable:
        """The output table."""
        ...

    @property
    def hooks(self) -> RoundHooks:
        """The engine's capabilities."""
        ...

    @property
    def in_flight(self) -> InFlightView | None:
        """The batch launched and not settled yet (overlap), or None."""
        ...

    @property
    def num_launched(self) -> int:
        """Batches launched so far."""
        ...

    @property
    def num_retired(self) -> int:
        """Batches settled (or given up on) so far."""
        ...

    @property
    def is_idle(self) -> bool:
        """Nothing waits, runs or is in flight."""
        ...
