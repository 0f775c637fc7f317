"""The seam through which a multi-rank engine keeps every rank's rounds in agreement.

`RoundAgreement` is one hook object that the `RoundPipeline` calls at two points of every
batch, and whose ``parallel`` group the engine hands to its worker (`WorkerMemory.parallel`)::

    schedule N ──▶ on_launch(plan, N) ──▶ launch N ──▶ ... wait N ──▶ on_settle(N, ...) ──▶ settle N
    (a step that launches nothing still calls on_launch(None, N - 1))

`on_launch` sees the plan before anything of it reaches the worker; `on_settle` sees the
batch's result (or its error) before anything of it is settled, and returns the error every
rank settles the batch with. `specstate.distributed.RankAgreement` implements it over
``torch.distributed``; a single-rank engine has none and pays nothing.

Invariant: both hooks are called from the thread that drives the engine (`on_launch` once per
step, `on_settle` once per batch, in launch order); a hook that raises leaves the batch unsettled
(the engine must not be stepped on).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import attrs

from specstate.engine.result_copy import HostResult
from specstate.engine.scheduler import LaunchPlan
from specstate.engine.worker import ParallelGroup

__all__ = ["AgreementSnapshot", "RoundAgreement"]


@attrs.frozen(kw_only=True)
class AgreementSnapshot:
    """Where a rank's agreement stands (`RoundAgreement.snapshot`).

    Attributes:
        last_launched: the batch id of the last launch point (the last batch launched).
        last_settled: the last batch agreed on before its settlement (0: none yet).
        num_failed: batches every rank failed together.
        fatal: the failure that stopped the group, or None.

    Invariant (``rank-agreement`` in `specstate.engine.invariants`): after a step,
    ``last_launched`` is the engine's launched count and ``last_settled`` its retired count
    (one less when an abandoned forward took the batch queued behind it).
    """

    last_launched: int
    last_settled: int
    num_failed: int
    fatal: str | None


@runtime_checkable
class RoundAgreement(Protocol):
    """Keeps the ranks of a tensor-parallel group in agreement, round by round."""

    @property
    def parallel(self) -> ParallelGroup | None:
        """The group the worker computes in (`WorkerMemory.parallel`)."""
        ...

    def snapshot(self) -> AgreementSnapshot:
        """Where this rank's agreement stands."""
        ...

    def on_launch(self, plan: LaunchPlan | None, batch_id: int) -> None:
        """At every step's launch point: ``plan`` launches as batch ``batch_id`` next.

        None: this step launches nothing (``batch_id`` is the last batch launched), so the
        ranks stay in step even when one of them would launch and another would not.

        Raises:
            RankDivergence: the ranks planned the batch differently (checking mode).
            RankFailure: the ranks could not be reached.
        """
        ...

    def on_settle(
        self,
        batch_id: int,
        plan: LaunchPlan,
        host: HostResult | None,
        error: BaseException | None,
    ) -> BaseException | None:
        """The error every rank settles batch ``batch_id`` with (None: settle ``host``).

        ``error`` is this rank's own (the worker raised, the result broke the contract, the
        forward timed out); the answer is the same on every rank.

        Raises:
            RankDivergence: the ranks' results differ (checking mode).
            RankFailure: the ranks could not be reached.
        """
        ...
