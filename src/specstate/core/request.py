"""Requests: validated input, an explicit lifecycle, append-only output and incarnations.

`Req` is the API face of one request, not the hot path (per-request counters live in the
slot-indexed `KvLedger`). It owns the host-settled clock ``seqlen = len(prompt) + len(output)``,
whose only writer is the result processor (`Req.append_outputs`).

Its lifecycle (`specstate.core.status`) has one checked transition function, `Req.transition`
(and `Req.end_many`, the same move for many requests). FINISHED and ABORTED are terminal. A late
result is tagged with the incarnation it was launched for; `Req.check_incarnation` refuses it
after a retraction, and a reused request id is a new `Req` object, so a stale result can never
be applied to a new owner.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Final, Protocol

from specstate.core.errors import InvalidRequest, InvalidTransition, StaleResult
from specstate.core.ownership import OwnershipChecker, Role
from specstate.core.params import RequestLimits, SamplingParams, is_int
from specstate.core.status import TRANSITIONS, FinishReason, FinishState, ReqSnapshot, ReqStatus

__all__ = ["OutputSource", "Req", "TopLogprobs"]

TopLogprobs = tuple[tuple[int, float], ...]
"""One emitted position's most likely tokens, ``(token id, log-probability)``, best first."""


_ABORT: Final = FinishReason.ABORT
_ENDS: Final = frozenset({ReqStatus.FINISHED, ReqStatus.ABORTED})
_FINISHED, _ABORTED = ReqStatus.FINISHED, ReqStatus.ABORTED


class OutputSource(Protocol):
    """Where an admitted request's settled outputs live while it holds a slot.

    The engine keeps the outputs of every admitted request in slot-indexed columns (so a round
    settles the whole batch with a fixed number of array operations); a `Req` attached to a
    source reads its outputs from there and copies them back when it leaves the slot.
    """

    def read_outputs(self, slot: int) -> list[int]:
        """Every settled output token of the request in ``slot``."""
        ...

    def num_outputs(self, slot: int) -> int:
        """How many output tokens the request in ``slot`` has settled."""
        ...

    def read_accept_lengths(self, slot: int) -> list[int]:
        """Accept lengths of the verifies settled since the request took ``slot``."""
        ...

    def read_verified_lengths(self, slot: int) -> list[int]:
        """Drafts each of those verifies verified (its budget, or the round's width)."""
        ...

    def read_logprobs(self, slot: int) -> list[float]:
        """Log-probability of every settled output token of the request in ``slot``."""
        ...

    def read_top_logprobs(
        self, slot: int, start: int = 0, stop: int | None = None
    ) -> list[TopLogprobs]:
        """The top alternatives of the settled outputs ``start:stop`` of the request in
        ``slot``."""
        ...

    def output_counts(self, slots: list[int]) -> list[int]:
        """`num_outputs` of each of ``slots``, in one read."""
        ...

    def leave_rows(
        self, slots: list[int], logprobs: list[bool]
    ) -> tuple[
        list[list[int]],
        list[list[list[int]]],
        list[list[float] | None],
        list[list[TopLogprobs] | None],
    ]:
        """The requests in ``slots`` leave them: per slot, its settled outputs, its verifies
        (``[accept lengths, verified lengths]``), (where ``logprobs`` is set) its
        log-probabilities and (where its request asked for ``top_logprobs``) its top
        alternatives; a result launched before this for one of them is stale."""
        ...


class Req:
    """One request: prompt, sampling, lifecycle status, incarnation and settled output.

    Build with `Req.new`, which validates everything before any state exists.

    While admitted, the settled outputs live in the engine's slot-indexed columns (an
    `OutputSource`); ``output_ids`` reads them there. Leaving the slot (finish, abort,
    retraction: every `transition` out of PREFILL / RUNNING) copies them back into the request.

    Invariant: ``output_ids`` only grows, and only while the request is live;
    ``incarnation`` increases by one each time the request is retracted.
    """

    __slots__ = (
        "_accept_lengths",
        "_cached_tokens",
        "_checker",
        "_finish",
        "_first_admitted_s",
        "_incarnation",
        "_logprobs",
        "_output_ids",
        "_slot",
        "_source",
        "_status",
        "_top_logprobs",
        "_verified_lengths",
        "prompt_ids",
        "request_id",
        "sampling",
    )

    def __init__(
        self,
        request_id: str,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        checker: OwnershipChecker,
    ) -> None:
        self.request_id: Final = request_id
        self.prompt_ids: Final = prompt_ids
        self.sampling: Final = sampling
        self._checker = checker
        self._output_ids: list[int] = []
        self._accept_lengths: list[int] = []
        self._verified_lengths: list[int] = []
        self._logprobs: list[float] = []
        self._top_logprobs: list[TopLogprobs] = []
        self._source: OutputSource | None = None
        self._slot = 0
        self._status = ReqStatus.WAITING
        self._incarnation = 0
        self._finish: FinishState | None = None
        self._cached_tokens = 0
        self._first_admitted_s: float | None = None

    @classmethod
    def new(
        cls,
        request_id: str,
        prompt_ids: Sequence[int],
        sampling: SamplingParams,
        limits: RequestLimits,
        *,
        checker: OwnershipChecker,
    ) -> Req:
        """Validate and build a WAITING request.

        Raises:
            InvalidRequest: naming the request and every problem found (empty prompt,
                ``max_new_tokens < 1``, token ids outside the vocabulary, a prompt that leaves
                no room in the context, bad sampling values); ``fields`` names their fields.
        """
        prompt, bad_prompt = _read_prompt(prompt_ids)
        if not bad_prompt:
            bad_prompt = _prompt_problems(prompt, limits)
        problems = [("prompt_ids", problem) for problem in bad_prompt]
        if not isinstance(sampling, SamplingParams):
            problems.append(
                ("sampling", f"sampling must be SamplingParams, got {type(sampling).__name__}")
            )
        else:
            problems += sampling.field_problems(limits.vocab_size)
        if not isinstance(request_id, str) or not request_id:
            problems.insert(0, ("request_id", "request id must be a non-empty string"))
        if problems:
            raise InvalidRequest(
                f"request {request_id!r}: " + "; ".join(problem for _, problem in problems),
                fields=[field for field, _ in problems],
            )
        return cls(request_id, prompt, sampling, checker)

    # ------------------------------------------------------------------ reads
    @property
    def status(self) -> ReqStatus:
        """The lifecycle status."""
        return self._status

    @property
    def incarnation(self) -> int:
        """Changes on every retraction; a result launched for an older one is stale."""
        return self._incarnation

    @property
    def output_ids(self) -> Sequence[int]:
        """Settled output tokens (a copy; may extend past a stop, see `emitted_ids`)."""
        if self._source is not None:
            return tuple(self._source.read_outputs(self._slot))
        return tuple(self._output_ids)

    @property
    def num_outputs(self) -> int:
        """``len(output_ids)``, without materialising them."""
        if self._source is not None:
            return self._source.num_outputs(self._slot)
        return len(self._output_ids)

    @property
    def accept_lengths(self) -> tuple[int, ...]:
        """Accept length of every settled verify of this request, in order (bonus included)."""
        if self._source is not None:
            return (*self._accept_lengths, *self._source.read_accept_lengths(self._slot))
        return tuple(self._accept_lengths)

    @property
    def verified_lengths(self) -> tuple[int, ...]:
        """Drafts each settled verify of this request verified, aligned with `accept_lengths`
        (the round's width, or the row's verify budget under a budget policy, or fewer when
        the worker verified fewer)."""
        if self._source is not None:
            return (*self._verified_lengths, *self._source.read_verified_lengths(self._slot))
        return tuple(self._verified_lengths)

    def draft_acceptance(self) -> tuple[tuple[int, int], ...]:
        """Per draft position ``j``, ``(accepted, verified)``: in how many of the request's
        emitted verifies draft ``j`` was verified, and in how many it was accepted (its
        accept length passed ``j + 1``). Positions past the widest verify are left out."""
        accepts = self.emitted_accept_lengths
        verified = self.verified_lengths[: len(accepts)]
        width = max(verified, default=0)
        return tuple(
            (
                sum(1 for a, v in zip(accepts, verified, strict=True) if j < v and a > j + 1),
                sum(1 for v in verified if j < v),
            )
            for j in range(width)
        )

    @property
    def emitted_accept_lengths(self) -> tuple[int, ...]:
        """`accept_lengths` as far as the user saw them: once the request ended, the last
        verify is cut where ``finished_len`` falls (a stop or the cap inside an accepted run),
        so the sum counts only tokens of `emitted_ids` (what a usage report may charge)."""
        accepts = list(self.accept_lengths)
        surplus = 0 if self._finish is None else self.num_outputs - self._finish.finished_len
        while surplus > 0 and accepts:  # the settled tokens past the end, from the last run
            cut = min(surplus, accepts[-1])
            accepts[-1] -= cut
            surplus -= cut
            if accepts[-1] == 0:
                accepts.pop()
        return tuple(accepts)

    @property
    def logprobs(self) -> tuple[float, ...] | None:
        """With ``sampling.logprobs``: the log-probability of every emitted token, aligned
        with `emitted_ids` (under the target's final distribution); else None."""
        if not self.sampling.logprobs:
            return None
        values = self.stored_logprobs()
        end = len(values) if self._finish is None else self._finish.finished_len
        return tuple(values[:end])

    def stored_logprobs(self) -> list[float]:
        """The log-probabilities of every settled output (also past a stop), as stored."""
        if self._source is not None:
            return self._source.read_logprobs(self._slot)
        return list(self._logprobs)

    @property
    def top_logprobs(self) -> tuple[TopLogprobs, ...] | None:
        """With ``sampling.top_logprobs`` above 0: per emitted token (aligned with
        `emitted_ids`), the ``top_logprobs`` most likely tokens of its position and their
        log-probabilities under the same final distribution as `logprobs`, most likely first;
        else None."""
        if not self.sampling.top_logprobs:
            return None
        values = self.stored_top_logprobs()
        end = len(values) if self._finish is None else self._finish.finished_len
        return tuple(values[:end])

    def stored_top_logprobs(self, start: int = 0, stop: int | None = None) -> list[TopLogprobs]:
        """The top alternatives of the settled outputs ``start:stop`` (also past a stop), as
        stored (a streaming reader reads only its new positions)."""
        if self._source is not None:
            return self._source.read_top_logprobs(self._slot, start, stop)
        return self._top_logprobs[start:stop]

    @property
    def cached_tokens(self) -> int:
        """Tokens whose KV the prefix cache supplied at the request's latest admission (a
        retracted request is matched again when re-admitted); 0 before admission."""
        return self._cached_tokens

    @property
    def first_admitted_s(self) -> float | None:
        """`time.monotonic` when the scheduler first admitted the request (a retracted one is
        admitted again later: the first time stays); None while it never was."""
        return self._first_admitted_s

    @property
    def finish(self) -> FinishState | None:
        """How the request ended, or None while it is live."""
        return self._finish

    @property
    def emitted_ids(self) -> tuple[int, ...]:
        """What the user sees: the output up to and including the stop (``finished_len``)."""
        outputs = self.output_ids
        end = len(outputs) if self._finish is None else self._finish.finished_len
        return tuple(outputs[:end])

    @property
    def seqlen(self) -> int:
        """Host-settled clock: ``len(prompt_ids) + len(output_ids)``."""
        return len(self.prompt_ids) + self.num_outputs

    @property
    def is_finished(self) -> bool:
        """True once FINISHED or ABORTED."""
        return self._status in (ReqStatus.FINISHED, ReqStatus.ABORTED)

    def snapshot(self) -> ReqSnapshot:
        """A frozen copy of the request's state."""
        return ReqSnapshot(
            request_id=self.request_id,
            status=self._status,
            incarnation=self._incarnation,
            prompt_len=len(self.prompt_ids),
            output_ids=tuple(self.output_ids),
            finish=self._finish,
        )

    @staticmethod
    def incarnations_of(reqs: Sequence[Req]) -> list[int]:
        """`incarnation` of each of ``reqs`` (one pass, no Python call per request)."""
        return [r._incarnation for r in reqs]

    @staticmethod
    def visible_lens(reqs: Sequence[Req], reasons: frozenset[FinishReason]) -> list[int]:
        """Per request, ``len(prompt_ids) + finish.finished_len`` when it FINISHED with one of
        ``reasons`` (what its user saw), else -1; one pass, no Python call per request."""
        prompts = list(map(len, [r.prompt_ids for r in reqs]))
        return [
            n + r._finish.finished_len
            if r._status is _FINISHED and r._finish is not None and r._finish.reason in reasons
            else -1
            for r, n in zip(reqs, prompts, strict=True)
        ]

    def check_incarnation(self, launched_for: int) -> None:
        """Raise `StaleResult` unless a result launched for ``launched_for`` is current."""
        if launched_for != self._incarnation or self.is_finished:
            raise StaleResult(
                f"request {self.request_id}: result for incarnation {launched_for} refused "
                f"(current incarnation {self._incarnation}, status {self._status.value})"
            )

    # --------------------------------------------------------------- mutators
    def transition(self, target: ReqStatus, *, finish: FinishState | None = None) -> None:
        """Move to ``target``: the one checked transition function.

        FINISHED and ABORTED require ``finish``; no other target accepts one. Entering RETRACTED
        bumps the incarnation.

        Raises:
            InvalidTransition: the move is not in the lifecycle; nothing changes.
        """
        ends = target in _ENDS
        if ends and finish is not None:
            Req._end_all((self,), (target,), (finish,))
            return
        src = self._status
        if target not in TRANSITIONS[src]:
            raise InvalidTransition(
                f"request {self.request_id}: {src.value} -> {target.value} is not allowed"
            )
        if ends != (finish is not None):
            need = "needs a" if ends else "takes no"
            raise InvalidTransition(f"request {self.request_id}: {target.value} {need} finish")
        if target is ReqStatus.RETRACTED:
            Req._leave_all((self,))
            self._incarnation += 1
        self._status = target

    @staticmethod
    def end_many(reqs: Sequence[Req], finishes: Sequence[FinishState]) -> None:
        """End each of ``reqs`` with its finish: ABORTED for an ABORT finish, else FINISHED.

        The move `transition` makes, for many requests at once: every one is checked before
        any changes (`InvalidTransition` naming the first that cannot end, or a request listed
        twice; then nothing changes), and the outputs of those holding an output row are
        copied back in one pass over the rows. No Python call per request on the way but the
        copy of its row.
        """
        Req._end_all(reqs, None, finishes)

    @staticmethod
    def _end_all(
        reqs: Sequence[Req],
        targets: Sequence[ReqStatus] | None,
        finishes: Sequence[FinishState],
    ) -> None:
        if len(finishes) != len(reqs) or len(set(reqs)) != len(reqs):
            names = ", ".join(r.request_id for r in reqs[:4])
            if len(finishes) != len(reqs):
                raise InvalidTransition(
                    f"requests {names}: {len(reqs)} requests to end, {len(finishes)} finishes"
                )
            raise InvalidTransition(f"requests {names}: one request is ended twice")
        if targets is None:
            targets = [_ABORTED if f.reason is _ABORT else _FINISHED for f in finishes]
        source, slots = Req._one_source(reqs)
        counts = [r.num_outputs for r in reqs] if source is None else source.output_counts(slots)
        for req, target, finish, count in zip(reqs, targets, finishes, counts, strict=True):
            if target not in TRANSITIONS[req._status]:
                raise InvalidTransition(
                    f"request {req.request_id}: {req._status.value} -> {target.value} is not "
                    "allowed"
                )
            if not 0 <= finish.finished_len <= count:
                raise InvalidTransition(
                    f"request {req.request_id}: finished_len {finish.finished_len} outside "
                    f"0..{count} settled outputs"
                )
        if source is None:
            Req._leave_all(reqs)
        else:
            Req._leave_rows(reqs, source, slots)
        for req, target, finish in zip(reqs, targets, finishes, strict=True):
            req._status = target
            req._finish = finish

    @staticmethod
    def _one_source(reqs: Sequence[Req]) -> tuple[OutputSource | None, list[int]]:
        """The output source that every one of ``reqs`` is attached to and their slots, or
        (None, []) when some are not attached or their sources differ."""
        source = reqs[0]._source if reqs else None
        if source is None or [r for r in reqs if r._source is not source]:
            return None, []
        return source, [r._slot for r in reqs]

    def record_admission(self, *, cached_tokens: int) -> None:
        """Record how many of its tokens the prefix cache supplied, and, the first time, when
        (scheduler, at admission).

        Raises:
            OwnershipError: the calling thread does not act as the scheduler.
        """
        self._checker.require((Role.SCHEDULER,), counter="cached_tokens", request=self.request_id)
        self._cached_tokens = cached_tokens
        if self._first_admitted_s is None:  # a front door's queue time ends here
            self._first_admitted_s = time.monotonic()

    def attach_outputs(self, source: OutputSource, slot: int) -> None:
        """Keep the settled outputs in ``source``'s ``slot`` from now on (admission).

        The source has already copied ``output_ids`` into the slot; until the request leaves
        the slot (`transition` to FINISHED, ABORTED or RETRACTED), outputs settle there.

        Raises:
            InvalidTransition: the request is already attached, or has ended.
        """
        if self._source is not None or self.is_finished:
            raise InvalidTransition(
                f"request {self.request_id}: cannot attach outputs to slot {slot} "
                f"(status {self._status.value}, attached {self._source is not None})"
            )
        self._source = source
        self._slot = slot

    @staticmethod
    def _leave_all(reqs: Sequence[Req]) -> None:
        """`_leave_rows` for every attached request of ``reqs``, by source."""
        for req in reqs:
            if req._source is not None:
                Req._leave_rows((req,), req._source, [req._slot])

    @staticmethod
    def _leave_rows(reqs: Sequence[Req], source: OutputSource, slots: list[int]) -> None:
        # Copy the outputs and accept lengths back before the slots can be reused; the source
        # marks the slots so that a result still in flight for these requests is skipped.
        outputs, verifies, logprobs, tops = source.leave_rows(
            slots, [r.sampling.logprobs for r in reqs]
        )
        for req, out, (accepted, checked), probs, top in zip(
            reqs, outputs, verifies, logprobs, tops, strict=True
        ):
            req._output_ids = out
            req._accept_lengths += accepted
            req._verified_lengths += checked
            if probs is not None:
                req._logprobs = probs
            if top is not None:
                req._top_logprobs = top
            req._source = None

    def append_outputs(self, tokens: Sequence[int]) -> None:
        """Append an accepted run to the settled output (result processor only).

        Raises:
            OwnershipError: the calling thread does not act as the result processor.
            StaleResult: the request already ended; nothing is appended.
        """
        self._checker.require(
            (Role.RESULT_PROCESSOR,), counter="output_ids", request=self.request_id
        )
        if self.is_finished or self._source is not None:
            where = "an attached" if self._source is not None else f"a {self._status.value}"
            raise StaleResult(
                f"request {self.request_id}: {len(tokens)} tokens for {where} request refused"
            )
        self._output_ids.extend(int(t) for t in tokens)


def _read_prompt(prompt_ids: object) -> tuple[tuple[int, ...], list[str]]:
    """The prompt as Python ints, or the problems that prevent reading it.

    A prompt is a sequence of integer token ids (a list, a tuple, a range, or a 1-D integer
    tensor or array); a string is not a sequence of token ids, and a bool is not a token id.
    """
    if hasattr(prompt_ids, "tolist") and hasattr(prompt_ids, "dtype"):  # a tensor or array
        kind = str(prompt_ids.dtype)
        if "int" not in kind or getattr(prompt_ids, "ndim", 1) != 1:
            return (), [f"prompt must be a 1-D integer tensor or array, got {kind}"]
        prompt_ids = prompt_ids.tolist()
    if isinstance(prompt_ids, str | bytes) or not isinstance(prompt_ids, Iterable):
        return (), [
            f"prompt must be a sequence of token ids, got {type(prompt_ids).__name__} "
            f"{prompt_ids!r:.40}"
        ]
    items = list(prompt_ids)
    bad = [(i, t) for i, t in enumerate(items) if not is_int(t)]
    if bad:
        i, t = bad[0]
        return (), [
            f"{len(bad)} prompt entries are not integer token ids, first at {i}: "
            f"{type(t).__name__} {t!r:.20}"
        ]
    return tuple(int(t) for t in items), []


def _prompt_problems(prompt: tuple[int, ...], limits: RequestLimits) -> list[str]:
    found = []
    if not prompt:
        found.append("prompt is empty")
    bad = [t for t in prompt if not 0 <= t < limits.vocab_size]
    if bad:
        found.append(
            f"{len(bad)} prompt token ids outside the vocabulary [0, {limits.vocab_size}), "
            f"first {bad[0]}"
        )
    if len(prompt) >= limits.max_context_len:
        found.append(
            f"prompt of {len(prompt)} tokens leaves no room in a context of "
            f"{limits.max_context_len}"
        )
    return found
