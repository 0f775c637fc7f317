"""The capability through which a multi-rank engine keeps every rank's rounds in agreement.

`RoundAgreement` is the protocol a tensor-parallel group implements; `AgreementHook` plugs it into
the round at two hook points of every batch (`specstate.engine.hooks`), and the engine hands its
``parallel`` group to the worker (`WorkerMemory.parallel`)::

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

from typing import TYPE_CHECKING, Protocol, runtime_checkable

import attrs

from specstate.batch.plan import LaunchPlan
from specstate.core.errors import InvariantViolation
from specstate.engine.hooks import RoundHook
from specstate.engine.launch.result_copy import HostResult
from specstate.engine.worker import ParallelGroup

if TYPE_CHECKING:
    from specstate.engine.hooks import EngineView
    from specstate.engine.launch.outcome import Collected

__all__ = ["AgreementHook", "AgreementSnapshot", "RoundAgreement"]


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


class AgreementHook(RoundHook):
    """Plugs a `RoundAgreement` into the round: every launch point, every collected batch.

    Invariant (``rank-agreement``, `check`): after a step the agreement saw the engine's last
    launch point and agreed on every retired batch before it was settled.
    """

    def __init__(self, agreement: RoundAgreement) -> None:
        self.agreement = agreement

    def on_launch(self, plan: LaunchPlan | None, batch_id: int) -> None:
        """Every step: the ranks agree on what launches (`RoundAgreement.on_launch`)."""
        self.agreement.on_launch(plan, batch_id)

    def on_collect(self, flight: Collected, error: BaseException | None) -> BaseException | None:
        """Every rank settles, or fails, the batch the same way (`RoundAgreement.on_settle`).

        A batch with no result (it failed, or timed out) keeps this rank's own error when the
        ranks agree it has none to settle.
        """
        verdict = self.agreement.on_settle(flight.batch_id, flight.plan, flight.host, error)
        return verdict if verdict is not None or flight.host is not None else error

    def check(self, view: EngineView) -> None:
        """``rank-agreement``: every launch point and every retired batch passed the agreement."""
        snap = self.agreement.snapshot()
        retired = view.num_retired
        # An abandoned forward retires the batch queued behind it unsettled (its KV quarantined).
        settled = snap.last_settled == retired or (
            snap.last_settled == retired - 1 and bool(view.deferred.held())
        )
        if snap.last_launched != view.num_launched or not settled:
            raise InvariantViolation(
                "rank-agreement",
                f"the agreement saw launch point {snap.last_launched} and settled batch "
                f"{snap.last_settled}; the engine launched {view.num_launched} and retired "
                f"{retired}",
            )
