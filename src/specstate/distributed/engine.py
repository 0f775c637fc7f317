"""One rank's engine of a tensor-parallel group: rank 0 takes the requests, every rank steps alike.

Every rank runs the same `Engine` (scheduler, ledger, relay, settlement) over its shard of the
model, and every rank makes the same scheduling decisions because it sees the same inputs.
Those that are not deterministic across processes come from one place, rank 0::

    submits, aborts and their order   rank 0 takes them; every step opens with rank 0's commands
                                      (the command group), applied by every rank, in order,
                                      before it steps
    when to step, when to stop        rank 0 (`step`, `close`); the followers `follow`
    the adaptive draft width          rank 0's choice, broadcast (`LeaderDraftPolicy`)
    the verify budgets                rank 0's plan, broadcast (`LeaderBudgetPolicy`)
    sampling draws                    the worker's generator, seeded with rank 0's seed at attach
    n-gram drafts                     rank 0's, broadcast by the worker
    tokens and accept lengths         every rank computes them from bit-identical logits (the
                                      LM head is replicated, the all-reduce is ordered)
    a failed batch                    agreed on every settled batch (`RankAgreement`)

With ``check_agreement`` every plan and every result is also compared across the ranks, and the
first difference raises `RankDivergence` on every rank.

Failure: a rank whose step raises `RankError` (a divergence, a failure that leaves the group
unable to go on, a peer that died or did not answer within the group's timeouts) breaks the
engine on that rank: the step raises, and every later call but `close` raises `UsageError`.

A `DistributedEngine` is an `Engine` (``run_until_idle``, ``generate``, ``snapshot``,
``request`` are the engine's own, driven through the overridden ``submit``, ``abort`` and
``step``), so code written for an `Engine` drives rank 0 unchanged.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Final

from specstate.core.errors import InvalidRequest, RankDivergence, RankError, UsageError
from specstate.core.params import RequestLimits, SamplingParams
from specstate.core.request import Req
from specstate.distributed.agreement import LeaderBudgetPolicy, LeaderDraftPolicy, RankAgreement
from specstate.distributed.groups import RankGroup
from specstate.engine.budgets import VerifyBudgetPolicy, budget_policy
from specstate.engine.config import EngineConfig, StepReport
from specstate.engine.draft_policy import AcceptanceEma, DraftPolicy
from specstate.engine.engine import Engine
from specstate.engine.trace import TraceRecorder
from specstate.engine.worker import WorkerProtocol

__all__ = ["DistributedEngine"]

_STEP: Final = 1
_CLOSE: Final = 2
_Command = tuple[str, str, object, object]
"""``("submit", id, prompt, sampling)`` or ``("abort", id, reason, None)``."""


class DistributedEngine(Engine):
    """One rank's `Engine` in a tensor-parallel group (see the module docstring).

    Build one on every rank with the same worker options, limits and config. On rank 0 (the
    leader) it is an `Engine`: ``submit``, ``abort``, ``step``, ``run_until_idle``,
    ``generate``, ``close`` act on every rank. On every other rank call `follow`, which steps
    whenever rank 0 does and returns when rank 0 closes; the leader's calls raise `UsageError`
    there. After a `RankError` (or anything else a step raised) every call but ``close``
    raises `UsageError`.

    Args:
        worker: this rank's worker; it gets the group at attach (`WorkerMemory.parallel`).
        group: this rank's `RankGroup`.
        limits: request limits (the same on every rank).
        config: engine options (the same on every rank).
        check_agreement: compare a digest of every plan and result across the ranks.
        draft_policy: an adaptive draft policy (every rank's; rank 0's choices are used).
        trace: a trace recorder for this rank's engine.
    """

    def __init__(
        self,
        worker: WorkerProtocol,
        *,
        group: RankGroup,
        limits: RequestLimits,
        config: EngineConfig,
        check_agreement: bool = False,
        draft_policy: DraftPolicy | None = None,
        trace: TraceRecorder | None = None,
        verify_budget: VerifyBudgetPolicy | None = None,
    ) -> None:
        caps = worker.capabilities
        if draft_policy is None and config.adaptive_draft and caps.speculative:
            draft_policy = AcceptanceEma(caps.num_steps)
        if draft_policy is not None:
            draft_policy = LeaderDraftPolicy(draft_policy, group.control)
        if verify_budget is None and config.verify_budget is not None:
            verify_budget = budget_policy(config.verify_budget, config.cost_profile)
        if verify_budget is not None:  # every rank takes rank 0's budgets
            verify_budget = LeaderBudgetPolicy(verify_budget, group.control)
        self.group = group
        self.agreement = RankAgreement(group, check=check_agreement)
        self._pending: list[_Command] = []
        self._broken: BaseException | None = None
        self._stopped = False
        super().__init__(
            worker,
            limits=limits,
            config=config,
            trace=trace,
            draft_policy=draft_policy,
            agreement=self.agreement,
            verify_budget=verify_budget,
        )

    @property
    def rank(self) -> int:
        """This engine's rank."""
        return self.group.rank

    @property
    def is_leader(self) -> bool:
        """True on rank 0, which takes requests and drives the steps."""
        return self.group.is_leader

    # ------------------------------------------------------------- the leader
    def submit(self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams) -> Req:
        """Leader: validate and queue a request; every rank queues it at the next step."""
        self._usable("submit", leader=True)
        req = super().submit(request_id, prompt_ids, sampling)
        self._pending.append(("submit", request_id, tuple(prompt_ids), sampling))
        return req

    def abort(self, request_id: str, reason: str = "aborted by user") -> bool:
        """Leader: abort a live request on every rank at the next step; True if it was live."""
        self._usable("abort", leader=True)
        live = super().abort(request_id, reason)
        if live:
            self._pending.append(("abort", request_id, reason, None))
        return live

    def step(self) -> StepReport:
        """Leader: one step on every rank (the followers apply this step's commands first)."""
        self._usable("step", leader=True)
        commands, self._pending = self._pending, []
        self._send(_STEP, commands)
        return self._step()

    # ------------------------------------------------------------ a follower
    def follow(self) -> int:
        """Follower: step whenever rank 0 does, until rank 0 closes; the number of steps."""
        self._usable("follow", leader=False)
        steps = 0
        while True:
            kind, commands = self._receive()
            if kind == _CLOSE:
                return steps
            self._apply(commands)
            self._step()
            steps += 1

    def _apply(self, commands: list[_Command]) -> None:
        """Rank 0's commands of this step, in its order (a refusal here is a divergence)."""
        for name, request_id, value, sampling in commands:
            if name == "abort":
                super().abort(request_id, str(value))
                continue
            try:
                if not isinstance(value, tuple) or not isinstance(sampling, SamplingParams):
                    raise InvalidRequest(f"malformed submit command {name!r}")
                super().submit(request_id, value, sampling)
            except InvalidRequest as exc:
                self._broken = RankDivergence(
                    f"rank {self.rank}: request {request_id!r}, accepted by rank 0, was "
                    f"refused here ({exc})"
                )
                raise self._broken from exc

    # ----------------------------------------------------------------- both
    def close(self, reason: str = "engine closed") -> None:
        """Leader: tell the followers to stop; every rank: close its engine, ending its live
        requests with ABORT (``reason``) the same way on every rank. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        try:
            if self.is_leader and self._broken is None:
                self._send(_CLOSE, [])
        except RankError:
            pass  # a follower is gone already: nothing to tell it
        finally:
            super().close(reason)

    def __enter__(self) -> DistributedEngine:
        return self

    # ------------------------------------------------------------- internals
    def _usable(self, call: str, *, leader: bool) -> None:
        if self._broken is not None:
            raise UsageError(
                f"DistributedEngine.{call}() on rank {self.rank}: the engine is broken "
                f"({type(self._broken).__name__}: {self._broken})"
            )
        if self._stopped:
            raise UsageError(f"DistributedEngine.{call}() after close()")
        if leader != self.is_leader:
            who = "rank 0" if leader else "a follower (rank > 0)"
            raise UsageError(f"DistributedEngine.{call}() is for {who}, not rank {self.rank}")

    def _step(self) -> StepReport:
        try:
            report = super().step()
        except BaseException as exc:
            # NOTE: whatever it was, this rank has left the lock step: the others will time out.
            self._broken = exc
            raise
        if self.agreement.fatal is not None:
            self._broken = self.agreement.fatal
            raise self.agreement.fatal
        return report

    def _send(self, kind: int, commands: list[_Command]) -> None:
        payload = pickle.dumps(commands) if commands else b""
        try:
            self.group.commands.broadcast_ints([kind, len(payload)])
            self.group.commands.broadcast_bytes_from(0, payload, len(payload))
        except RankError as exc:
            self._broken = exc
            raise

    def _receive(self) -> tuple[int, list[_Command]]:
        try:
            kind, size = self.group.commands.broadcast_ints([0, 0])
            payload = self.group.commands.broadcast_bytes_from(0, b"", size)
        except RankError as exc:
            self._broken = exc
            raise
        # NOTE: pickle from rank 0 of the same job, a trusted peer (never a network client).
        commands: list[_Command] = pickle.loads(payload) if size else []
        return kind, commands
