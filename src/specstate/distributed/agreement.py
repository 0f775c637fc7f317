"""Rank agreement: every rank settles or fails each batch the same way, and checks that it did.

`RankAgreement` is the engine's `RoundAgreement` in a tensor-parallel group. On every settled
batch each rank contributes one status row to an all-gather on the control group::

    [batch id, failed, worker group broken, error length, tokens accepted, digest (4 × int64)]

* the ranks settle different batches: `RankDivergence` (they are out of step);
* no rank failed: the batch is settled; in checking mode the digests of the results (accept
  lengths, tokens, frontier, invalid rows, logprobs, top logprobs, verified lengths, draft
  confidences) must be equal, else `RankDivergence`;
* some rank failed: every rank fails the batch with one `RankFailure` naming the failed ranks
  and the first one's error (its text broadcast from that rank), so the requests end with the
  same detail everywhere. If only some ranks failed, or a worker-group collective failed, the
  ranks' collectives may be out of step: the failure is also *fatal* (`fatal`), and the
  distributed engine stops after the step.

In checking mode `on_launch` also all-gathers, at every step, a digest of the plan (requests,
slots, epochs, incarnations, chunk lengths, draft width; or that nothing launches) before it
launches, so diverged plans never reach the worker's collectives. `LeaderDraftPolicy` makes
the adaptive draft width rank 0's choice.

Invariant: after `on_settle` returns, every rank holds the same answer; a raise (divergence, a
control collective that failed) happens on every rank that can still be reached.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

import numpy as np
import numpy.typing as npt

from specstate.batch.plan import LaunchPlan
from specstate.core.errors import RankDivergence, RankFailure
from specstate.distributed.groups import ControlGroup, RankGroup, WorkerGroup
from specstate.engine.budgets import BudgetRows, SettledBudgets, VerifyBudgetPolicy
from specstate.engine.capabilities.agreement import AgreementSnapshot
from specstate.engine.draft_policy import DraftPolicy
from specstate.engine.launch.result_copy import HostResult

__all__ = ["LeaderDraftPolicy", "RankAgreement", "plan_digest", "result_digest"]

_MAX_ERROR_BYTES: Final = 2000
_DIGEST_WORDS: Final = 4  # 32 bytes of blake2b as int64 words
_NO_DIGEST: Final = np.zeros(_DIGEST_WORDS, dtype=np.int64)


def _words(hasher: hashlib.blake2b) -> npt.NDArray[np.int64]:
    return np.frombuffer(hasher.digest(), dtype=np.int64).copy()


def plan_digest(plan: LaunchPlan, batch_id: int) -> npt.NDArray[np.int64]:
    """A digest of what batch ``batch_id`` asks the worker to do (a fixed number of updates)."""
    batch = plan.batch
    hasher = hashlib.blake2b(digest_size=8 * _DIGEST_WORDS)
    prefill = (batch.prefix_lens, batch.extend_lens, batch.seq_lens_cpu, plan.last_chunk)
    head = f"{batch_id}|{batch.forward_mode.value}|{batch.num_draft_steps}|{prefill}|"
    hasher.update(head.encode())
    hasher.update("\0".join(batch.request_ids).encode())
    hasher.update(np.ascontiguousarray(plan.slots_host).tobytes())
    hasher.update(np.ascontiguousarray(plan.epochs).tobytes())
    hasher.update(np.asarray(batch.incarnations, dtype=np.int64).tobytes())
    budgets = batch.verify_budgets
    hasher.update(b"-" if budgets is None else np.ascontiguousarray(budgets.host).tobytes())
    return _words(hasher)


def _idle_digest(batch_id: int) -> npt.NDArray[np.int64]:
    """The digest of a step that launches nothing after batch ``batch_id``."""
    hasher = hashlib.blake2b(digest_size=8 * _DIGEST_WORDS)
    hasher.update(f"{batch_id}|idle".encode())
    return _words(hasher)


def result_digest(host: HostResult) -> npt.NDArray[np.int64]:
    """A digest of a batch's result as the host will settle it."""
    hasher = hashlib.blake2b(digest_size=8 * _DIGEST_WORDS)
    parts = (
        host.accept,
        host.tokens,
        host.frontier,
        host.invalid,
        host.logprobs,
        host.top_ids,
        host.top_values,
        host.verified,
        host.confidences,
    )
    for part in parts:
        hasher.update(b"-" if part is None else np.ascontiguousarray(part).tobytes())
    return _words(hasher)


class RankAgreement:
    """The engine's `RoundAgreement` in a tensor-parallel group (see the module docstring).

    Args:
        group: this rank's `RankGroup`.
        check: compare a digest of every plan and every result across the ranks.

    Attributes:
        fatal: set (and kept) when a failure leaves the group unable to go on.
        num_checked: digests compared so far (every step's plan, every settled result).
    """

    def __init__(self, group: RankGroup, *, check: bool) -> None:
        self._group = group
        self._check = check
        self.fatal: RankFailure | None = None
        self.num_checked = 0
        self._last_launched = 0
        self._last_settled = 0
        self._num_failed = 0

    def snapshot(self) -> AgreementSnapshot:
        """Where this rank's agreement stands (`AgreementSnapshot`)."""
        return AgreementSnapshot(
            last_launched=self._last_launched,
            last_settled=self._last_settled,
            num_failed=self._num_failed,
            fatal=None if self.fatal is None else str(self.fatal),
        )

    @property
    def parallel(self) -> WorkerGroup:
        """The worker group (`WorkerMemory.parallel`)."""
        return self._group.worker

    @property
    def _control(self) -> ControlGroup:
        return self._group.control

    def on_launch(self, plan: LaunchPlan | None, batch_id: int) -> None:
        """Checking mode: the ranks' plans of this step (None: nothing) must be equal."""
        self._last_launched = batch_id
        if not self._check:
            return
        digest = _idle_digest(batch_id) if plan is None else plan_digest(plan, batch_id)
        rows = self._control.all_gather_ints(digest)
        self.num_checked += 1
        differ = _differing(rows)
        if differ:
            what = "nothing to launch"
            if plan is not None:
                batch = plan.batch
                what = (
                    f"{batch.forward_mode.value}, {batch.batch_size} requests, first "
                    f"{list(batch.request_ids[:4])}"
                )
            raise RankDivergence(
                f"batch {batch_id} ({what} on rank {self._group.rank}): rank(s) {differ} "
                "planned it differently from rank 0"
            )

    def on_settle(
        self,
        batch_id: int,
        plan: LaunchPlan,
        host: HostResult | None,
        error: BaseException | None,
    ) -> BaseException | None:
        """The error every rank settles batch ``batch_id`` with (see the module docstring)."""
        failed = error is not None or host is None
        text = b""
        if failed:
            text = f"{type(error).__name__}: {error}".encode()[:_MAX_ERROR_BYTES]
        digest = _NO_DIGEST
        accepted = 0
        if not failed and host is not None:
            accepted = int(host.accept.sum())
            if self._check:
                digest = result_digest(host)
        broken = int(self.parallel.failure is not None)
        status = np.array(
            [batch_id, int(failed), broken, len(text), accepted, *digest], dtype=np.int64
        )
        rows = self._control.all_gather_ints(status)
        if (rows[:, 0] != batch_id).any():  # a rank settles another batch: out of step
            raise RankDivergence(
                f"batch {batch_id}: the ranks settle batches {rows[:, 0].tolist()} at once"
            )
        rows = rows[:, 1:]
        self._last_settled = batch_id
        if rows[:, 0].any():
            self._num_failed += 1
            agreed = self._agree_on_failure(batch_id, rows, text)
            if isinstance(error, KeyboardInterrupt | SystemExit):
                return error  # this rank fails the batch with it and re-raises it
            return agreed
        if self._check:
            self.num_checked += 1
            differ = _differing(rows[:, 4:])
            if differ:
                counts = ", ".join(f"rank {r}: {n}" for r, n in enumerate(rows[:, 3].tolist()))
                raise RankDivergence(
                    f"batch {batch_id} ({plan.batch.forward_mode.value}, "
                    f"{plan.batch.batch_size} requests): rank(s) {differ} settled a different "
                    f"result from rank 0 (tokens accepted: {counts})"
                )
        return None

    def _agree_on_failure(
        self, batch_id: int, rows: npt.NDArray[np.int64], text: bytes
    ) -> RankFailure:
        """One failure for every rank: the failed ranks and the first one's error."""
        failed = np.flatnonzero(rows[:, 0]).tolist()
        broken = np.flatnonzero(rows[:, 1]).tolist()
        # The cause: a rank whose own worker failed, not one that waited for it in vain.
        first = next((r for r in failed if r not in broken), failed[0])
        detail = self._control.broadcast_bytes_from(first, text, int(rows[first, 2]))
        failure = RankFailure(
            f"batch {batch_id} failed on rank(s) {failed} of {len(rows)}; every rank fails "
            f"it (rank {first}: {detail.decode(errors='replace')})"
        )
        if len(failed) < len(rows) or broken:
            why = f"worker group broken on rank(s) {broken}" if broken else "not on every rank"
            self.fatal = self.fatal or RankFailure(
                f"{failure} — the tensor-parallel group cannot go on ({why}: the ranks' "
                "collectives may be out of step)"
            )
        return failure


def _differing(rows: npt.NDArray[np.int64]) -> list[int]:
    """Ranks whose row differs from rank 0's."""
    return np.flatnonzero((rows != rows[0]).any(axis=1)).tolist()


class LeaderDraftPolicy:
    """A `DraftPolicy` whose every choice is rank 0's, broadcast on the control group.

    Every rank's inner policy observes the same rounds and is asked the same questions, so it
    stays in the same state; only rank 0's answer is used (a policy need not be deterministic).
    """

    def __init__(self, inner: DraftPolicy, control: ControlGroup) -> None:
        self._inner = inner
        self._control = control

    @property
    def max_steps(self) -> int:
        """The inner policy's widest round."""
        return self._inner.max_steps

    def choose(self, batch_size: int) -> int:
        """Rank 0's choice for a decode round of ``batch_size`` rows."""
        mine = self._inner.choose(batch_size)
        return self._control.broadcast_ints([mine])[0]

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Hand the settled round to the inner policy."""
        self._inner.observe(num_steps, accept_lens)


class LeaderBudgetPolicy:
    """A `VerifyBudgetPolicy` whose every plan is rank 0's, broadcast on the control group.

    As `LeaderDraftPolicy`: every rank's inner policy observes the same settled rounds and is
    asked for the same rows, so it stays in the same state; only rank 0's budgets are used
    (a policy need not be deterministic), and the checking mode's plan digest covers them.
    """

    def __init__(self, inner: VerifyBudgetPolicy, control: ControlGroup) -> None:
        self._inner = inner
        self._control = control

    def plan(self, rows: BudgetRows) -> npt.NDArray[np.int64]:
        """Rank 0's budgets for these rows.

        Every rank takes part in the broadcast whatever its own policy does: a plan that
        raises or is malformed is sent as budgets of -1, which every rank's guard refuses, so
        the policy is disabled on every rank alike (the exception is then re-raised here).
        """
        failure: BaseException | None = None
        try:
            mine = np.asarray(self._inner.plan(rows))
        except BaseException as exc:  # the guard above decides; the ranks must stay in step
            failure, mine = exc, np.zeros(0, dtype=np.int64)
        if failure is not None or mine.shape != (rows.batch_size,) or mine.dtype.kind not in "iu":
            mine = np.full(rows.batch_size, -1, dtype=np.int64)  # refused by every guard
        got = self._control.broadcast_ints(mine.astype(np.int64).tolist())
        if failure is not None:
            raise failure
        return np.asarray(got, dtype=np.int64)

    def observe(self, settled: SettledBudgets) -> None:
        """Hand the settled round to the inner policy."""
        self._inner.observe(settled)

    def forget(self, request_ids: Sequence[str]) -> None:
        """The ended requests leave the inner policy."""
        self._inner.forget(request_ids)
