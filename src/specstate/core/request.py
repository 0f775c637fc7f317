"""Requests: validated input, an explicit lifecycle, append-only output and incarnations.

`Req` is the API face of one request, not the hot path (per-request counters live in the
slot-indexed `KvLedger`). It owns the host-settled clock ``seqlen = len(prompt) + len(output)``,
whose only writer is the result processor (`Req.append_outputs`).

Lifecycle (one checked transition function, `Req.transition`)::

    WAITING ──> PREFILL ──> RUNNING ──> FINISHED
       │          │ │          │
       │          │ └──────────┼──────> FINISHED   (first token already ends the request)
       │          └─────┬──────┘
       │                v
       │            RETRACTED ──> WAITING        (incarnation += 1 on entering RETRACTED)
       v                │
    ABORTED <───────────┴─── (from WAITING, PREFILL, RUNNING, RETRACTED)

FINISHED and ABORTED are terminal. A late result is tagged with the incarnation it was launched
for; `Req.check_incarnation` refuses it after a retraction, and a reused request id is a new
`Req` object, so a stale result can never be applied to a new owner.
"""

from __future__ import annotations

import enum
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Final, Protocol

import attrs

from specstate.core.errors import InvalidConfig, InvalidRequest, InvalidTransition, StaleResult
from specstate.core.ownership import OwnershipChecker, Role
from specstate.grammar.spec import Grammar, GrammarVocabulary

__all__ = [
    "FinishReason",
    "FinishState",
    "OutputSource",
    "Req",
    "ReqSnapshot",
    "ReqStatus",
    "RequestLimits",
    "SamplingParams",
]


class ReqStatus(enum.Enum):
    """Where a request is in its life. Member order carries no meaning."""

    WAITING = "waiting"
    PREFILL = "prefill"
    RUNNING = "running"
    FINISHED = "finished"
    RETRACTED = "retracted"
    ABORTED = "aborted"

    # Members are singletons compared by identity: hash them by identity too (C-level; the
    # default hashes the name in Python, and every transition looks statuses up).
    __hash__ = object.__hash__


_TRANSITIONS: Final[Mapping[ReqStatus, frozenset[ReqStatus]]] = {
    ReqStatus.WAITING: frozenset({ReqStatus.PREFILL, ReqStatus.ABORTED}),
    ReqStatus.PREFILL: frozenset(
        {ReqStatus.RUNNING, ReqStatus.FINISHED, ReqStatus.RETRACTED, ReqStatus.ABORTED}
    ),
    ReqStatus.RUNNING: frozenset({ReqStatus.FINISHED, ReqStatus.RETRACTED, ReqStatus.ABORTED}),
    ReqStatus.RETRACTED: frozenset({ReqStatus.WAITING, ReqStatus.ABORTED}),
    ReqStatus.FINISHED: frozenset(),
    ReqStatus.ABORTED: frozenset(),
}


class FinishReason(enum.Enum):
    """Why a request ended."""

    STOP = "stop"
    """A stop token (or EOS unless ``ignore_eos``) was emitted; it is included in the output."""
    LENGTH = "length"
    """``max_new_tokens`` outputs were emitted."""
    ABORT = "abort"
    """The user aborted it, or the KV pool could not hold even this one request."""
    ERROR = "error"
    """The worker raised while running a batch that held it."""


@attrs.frozen(kw_only=True)
class FinishState:
    """How a request ended: the reason and how many output tokens the user sees.

    Attributes:
        reason: why it ended.
        finished_len: output tokens the user sees (``Req.emitted_ids``); tokens settled past
            a stop or the cap are cut.
        detail: a human-readable reason (the stop token, the abort message, the error).
        traceback: for an ERROR finish, the worker failure's formatted traceback; else "".
    """

    reason: FinishReason
    finished_len: int
    detail: str = ""
    traceback: str = ""


def _stop_ids(value: Iterable[int]) -> frozenset[int]:
    """A frozenset of the given ids, as given (`SamplingParams.problems` checks their types).

    Raises:
        InvalidRequest: ``value`` is a string, bytes or a single number, not a collection.
    """
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequest(
            f"stop_token_ids must be a collection of token ids, got {type(value).__name__} "
            f"{value!r}"
        )
    return frozenset(value)


def _stop_sequences(value: Iterable[Iterable[int]]) -> tuple[tuple[int, ...], ...]:
    """A tuple of token-id tuples, as given (`SamplingParams.problems` checks the entries).

    An entry that is not a collection (a bare number) is kept as is, so that ``problems``
    can name it; a string is not a collection of token ids.

    Raises:
        InvalidRequest: ``value`` is a string, bytes or a single number, not a collection.
    """
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequest(
            f"stop_sequences must be a collection of token-id sequences, got "
            f"{type(value).__name__} {value!r}"
        )
    out: list[tuple[int, ...]] = []
    for entry in value:
        if isinstance(entry, str | bytes) or not isinstance(entry, Iterable):
            out.append(entry)  # type: ignore[arg-type]  # reported by `problems`
        else:
            out.append(tuple(entry))
    return tuple(out)


def _grammar(value: object) -> Grammar | None:
    """A `Grammar`, None, or the request-file form ``{"regex": ...}`` read into a `Grammar`.

    Raises:
        InvalidRequest: a mapping that is not a grammar (naming what is wrong).
    """
    if value is None or isinstance(value, Grammar):
        return value
    if isinstance(value, Mapping):
        try:
            return Grammar.from_json(value)
        except ValueError as exc:
            raise InvalidRequest(f"grammar: {exc}") from None
    return value  # type: ignore[return-value]  # reported by `problems`


def _is_int(value: object) -> bool:
    """An integer that is not a bool (True is not a token id or a count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_finite(value: object) -> bool:
    """A finite real number that is not a bool (an int too large for a float is not)."""
    if not isinstance(value, numbers.Real) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(float(value))
    except OverflowError:  # an int beyond the float range, e.g. 10**400
        return False


# The sampler computes in float32: a value outside these bounds becomes inf or 0 there.
_F32_MAX: Final = 3.4028234663852886e38
_F32_TINY: Final = 1.1754943508222875e-38  # the smallest positive normal float32
_MAX_VOCAB: Final = 2**40


def _in_f32(value: object, *, low: float) -> bool:
    """A finite number in ``[low, float32 max]`` (``low`` may be negative)."""
    return isinstance(value, numbers.Real) and _is_finite(value) and low <= float(value) <= _F32_MAX


@attrs.frozen(kw_only=True)
class SamplingParams:
    """How to sample one request. ``temperature == 0`` means greedy.

    The logits of every position a request scores are processed in this order (docs/engine.md,
    "Sampling controls"): repetition penalty, frequency and presence penalties, the
    ``min_new_tokens`` mask; then temperature, top-k and top-p for a sampled request. With
    speculation, verify position ``j`` is processed with the tokens before it, drafts
    ``d1 .. dj`` included: exactly what one-token-at-a-time decoding would see.

    Attributes:
        max_new_tokens: the cap on output tokens (>= 1).
        stop_token_ids: tokens that end the request (included in the output), in addition to
            the model's EOS ids.
        ignore_eos: when True, the model's EOS ids do not end the request.
        temperature: 0 for greedy (argmax), else the softmax temperature, a float32 number
            (at least ``1.18e-38``: a smaller one would be 0 to the sampler).
        top_k: sample among the ``top_k`` most likely tokens; None (or a value at least the
            vocabulary size) for the whole vocabulary.
        top_p: nucleus sampling mass in (0, 1]; 1.0 disables it.
        speculative: False: the request rides a speculative batch with zero drafts and
            accepts exactly one token per round (its output is unchanged; only its speed).
        repetition_penalty: Hugging Face semantics (> 0, 1.0 disables it): the logit of every
            token present in prompt + output so far is divided by it when positive,
            multiplied by it when negative. Like every float field, it must be a float32
            number; a processed logit that overflows stays the most (or least) likely token.
        frequency_penalty: OpenAI semantics: ``frequency_penalty * count`` is subtracted from
            the logit of each token, ``count`` its occurrences in the output so far.
        presence_penalty: OpenAI semantics: subtracted from the logit of every token that
            occurs in the output so far.
        min_new_tokens: before this many output tokens, the request's stop tokens (its
            ``stop_token_ids`` and, unless ``ignore_eos``, the EOS ids) get logit -inf, as
            Hugging Face's ``MinNewTokensLengthLogitsProcessor`` does; and no stop — token or
            sequence — ends the request before it: a stop counts only when its last token is
            output number ``min_new_tokens + 1`` or later. Stop sequences are not masked.
        stop_sequences: token-id sequences that end the request at the first complete
            occurrence inside the output (which may span rounds or sit inside one accepted
            run); the matched sequence is included in the output, like a stop token.
        seed: per-request randomness for a sampled request: the token at each position is a
            function of ``(seed, position)`` and the target's distribution there, so the
            request emits the same tokens whatever its batch mates, the loop, retractions or
            the drafter. None: the worker's own random source.
        logprobs: record the log-probability of every emitted token under the target's final
            distribution (after the penalties, and after temperature / top-k / top-p for a
            sampled request); `Req.logprobs` holds them, aligned with `Req.emitted_ids`.
        grammar: the output must be a string of this `Grammar` (a JSON schema, a regular
            expression, an EBNF or Lark grammar; or its request-file form
            ``{"json_schema": ...}``): every token is drawn from the target's distribution
            masked to what the grammar allows, and the request ends when the grammar accepts
            an end-of-sequence token (a stop, included in the output). Needs
            ``ignore_eos=False`` and ``min_new_tokens=0`` (the grammar decides where the
            output may end).
    """

    max_new_tokens: int = 128
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_stop_ids)
    ignore_eos: bool = False
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float = 1.0
    speculative: bool = True
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_new_tokens: int = 0
    stop_sequences: tuple[tuple[int, ...], ...] = attrs.field(default=(), converter=_stop_sequences)
    seed: int | None = None
    logprobs: bool = False
    grammar: Grammar | None = attrs.field(default=None, converter=_grammar)

    @property
    def is_greedy(self) -> bool:
        """True when sampling is argmax (``temperature == 0``)."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, frequency or presence penalty changes the logits."""
        return (
            self.repetition_penalty != 1.0
            or self.frequency_penalty != 0.0
            or self.presence_penalty != 0.0
        )

    def problems(self, vocab_size: int) -> list[str]:
        """Every way these parameters are invalid for a vocabulary of ``vocab_size``."""
        found = []
        if not _is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            found.append(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        not_ids = [t for t in self.stop_token_ids if not _is_int(t)]
        if not_ids:
            found.append(f"stop_token_ids must be integers, got {sorted(map(repr, not_ids))}")
        bad_stop = sorted(t for t in self.stop_token_ids if _is_int(t) and not 0 <= t < vocab_size)
        if bad_stop:
            found.append(f"stop_token_ids {bad_stop} outside the vocabulary [0, {vocab_size})")
        for name in ("ignore_eos", "speculative", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                found.append(f"{name} must be a bool, got {getattr(self, name)!r}")
        greedy = self.temperature == 0 and not isinstance(self.temperature, bool)
        if not greedy and not _in_f32(self.temperature, low=_F32_TINY):
            found.append(
                f"temperature must be a finite number >= 0, got {self.temperature!r:.40} (0 for "
                f"greedy, else in [{_F32_TINY:.3g}, {_F32_MAX:.3g}]: the sampler computes in "
                "float32)"
            )
        if self.top_k is not None and (not _is_int(self.top_k) or self.top_k < 1):
            found.append(f"top_k must be an integer >= 1 or None, got {self.top_k!r}")
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            found.append(f"top_p must be a number in (0, 1], got {self.top_p!r:.40}")
        if not _in_f32(self.repetition_penalty, low=_F32_TINY):
            found.append(
                f"repetition_penalty must be a finite number > 0, got "
                f"{self.repetition_penalty!r:.40} (in [{_F32_TINY:.3g}, {_F32_MAX:.3g}]: float32)"
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not _in_f32(getattr(self, name), low=-_F32_MAX):
                found.append(
                    f"{name} must be a finite number, got {getattr(self, name)!r:.40} (in "
                    f"[{-_F32_MAX:.3g}, {_F32_MAX:.3g}]: float32)"
                )
        if not _is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            found.append(f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}")
        elif _is_int(self.max_new_tokens) and self.min_new_tokens > self.max_new_tokens:
            found.append(
                f"min_new_tokens {self.min_new_tokens} exceeds max_new_tokens {self.max_new_tokens}"
            )
        found += _sequence_problems(self.stop_sequences, vocab_size)
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < 2**63):
            found.append(f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
        found += self._grammar_problems()
        return found

    def _grammar_problems(self) -> list[str]:
        """What is wrong with ``grammar`` and its combination with the other fields."""
        if self.grammar is None:
            return []
        if not isinstance(self.grammar, Grammar):
            return [f"grammar must be a Grammar or None, got {type(self.grammar).__name__}"]
        found = self.grammar.problems()
        if self.ignore_eos is True:
            found.append("a grammar ends with the end-of-sequence token: ignore_eos must be False")
        if _is_int(self.min_new_tokens) and self.min_new_tokens > 0:
            found.append(
                "a grammar decides where the output may end: min_new_tokens must be 0, got "
                f"{self.min_new_tokens}"
            )
        return found


def _sequence_problems(sequences: tuple[tuple[int, ...], ...], vocab_size: int) -> list[str]:
    """What is wrong with ``stop_sequences``: entries that are not non-empty id sequences."""
    found = []
    for i, seq in enumerate(sequences):
        if not isinstance(seq, tuple):
            found.append(
                f"stop_sequences[{i}] must be a sequence of token ids, got "
                f"{type(seq).__name__} {seq!r:.40}"
            )
        elif not seq:
            found.append(f"stop_sequences[{i}] is empty")
        elif not all(_is_int(t) for t in seq):
            found.append(f"stop_sequences[{i}] must hold integer token ids, got {seq!r:.60}")
        elif not all(0 <= t < vocab_size for t in seq):
            found.append(
                f"stop_sequences[{i}] {seq!r:.60} has ids outside the vocabulary [0, {vocab_size})"
            )
    return found


@attrs.frozen(kw_only=True)
class RequestLimits:
    """What the model accepts: its vocabulary, context length and end-of-sequence ids.

    Attributes:
        vocab_size: token ids are in ``[0, vocab_size)``.
        max_context_len: prompt plus output may not exceed it.
        eos_token_ids: ids that end a request unless it sets ``ignore_eos``.
        grammar_vocabulary: the bytes each token id stands for, which a request's
            ``grammar`` is compiled against; None: requests with a grammar are refused. Its
            EOS ids must be special tokens (they end a grammar).
    """

    vocab_size: int
    max_context_len: int
    eos_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_stop_ids)
    grammar_vocabulary: GrammarVocabulary | None = None

    def __attrs_post_init__(self) -> None:
        """Refuse limits no request could meet, or EOS ids the model cannot emit."""
        problems = []
        if not _is_int(self.vocab_size) or not 1 <= self.vocab_size <= _MAX_VOCAB:
            problems.append(
                f"vocab_size must be an integer >= 1 and at most 2**40, got {self.vocab_size!r:.40}"
            )
        if not _is_int(self.max_context_len) or self.max_context_len < 2:
            problems.append(
                f"max_context_len must be an integer >= 2, got {self.max_context_len!r}"
            )
        bad = sorted(
            repr(t)
            for t in self.eos_token_ids
            if not _is_int(t) or (_is_int(self.vocab_size) and not 0 <= t < self.vocab_size)
        )
        if bad:
            problems.append(f"eos_token_ids {bad} are not ids in [0, {self.vocab_size!r})")
        problems += self._vocabulary_problems()
        if problems:
            raise InvalidConfig("RequestLimits: " + "; ".join(problems))

    def _vocabulary_problems(self) -> list[str]:
        vocabulary = self.grammar_vocabulary
        if vocabulary is None:
            return []
        if not isinstance(vocabulary, GrammarVocabulary):
            return [
                f"grammar_vocabulary must be a GrammarVocabulary, got {type(vocabulary).__name__}"
            ]
        found = []
        if _is_int(self.vocab_size) and vocabulary.size > self.vocab_size:
            found.append(
                f"grammar_vocabulary describes {vocabulary.size} tokens, more than vocab_size "
                f"{self.vocab_size}"
            )
        if not self.eos_token_ids:
            found.append("a grammar_vocabulary needs eos_token_ids: a grammar ends with one")
        text = sorted(
            t
            for t in self.eos_token_ids
            if _is_int(t) and 0 <= t < vocabulary.size and vocabulary.token_bytes[t] is not None
        )
        if text:
            found.append(f"eos_token_ids {text} stand for text in grammar_vocabulary")
        return found


@attrs.frozen(kw_only=True)
class ReqSnapshot:
    """One request at one instant, for tests, traces and users.

    Attributes:
        request_id: the id given to `Engine.submit`.
        status: its lifecycle state.
        incarnation: how many times it was retracted.
        prompt_len: prompt tokens.
        output_ids: every settled output token.
        finish: how it ended, or None while it runs.
    """

    request_id: str
    status: ReqStatus
    incarnation: int
    prompt_len: int
    output_ids: tuple[int, ...]
    finish: FinishState | None

    @property
    def seqlen(self) -> int:
        """Host-settled clock: ``prompt_len + len(output_ids)``."""
        return self.prompt_len + len(self.output_ids)


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

    def read_logprobs(self, slot: int) -> list[float]:
        """Log-probability of every settled output token of the request in ``slot``."""
        ...

    def detach(self, slot: int) -> None:
        """The request leaves ``slot``: a result launched before this for it is stale."""
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
        "_incarnation",
        "_logprobs",
        "_output_ids",
        "_slot",
        "_source",
        "_status",
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
        self._logprobs: list[float] = []
        self._source: OutputSource | None = None
        self._slot = 0
        self._status = ReqStatus.WAITING
        self._incarnation = 0
        self._finish: FinishState | None = None
        self._cached_tokens = 0

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
                no room in the context, bad sampling values).
        """
        prompt, problems = _read_prompt(prompt_ids)
        if not problems:
            problems = _prompt_problems(prompt, limits)
        if not isinstance(sampling, SamplingParams):
            problems.append(f"sampling must be SamplingParams, got {type(sampling).__name__}")
        else:
            problems += sampling.problems(limits.vocab_size)
        if not isinstance(request_id, str) or not request_id:
            problems.insert(0, "request id must be a non-empty string")
        if problems:
            raise InvalidRequest(f"request {request_id!r}: " + "; ".join(problems))
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
    def cached_tokens(self) -> int:
        """Tokens whose KV the prefix cache supplied at the request's latest admission (a
        retracted request is matched again when re-admitted); 0 before admission."""
        return self._cached_tokens

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
        src = self._status
        if target not in _TRANSITIONS[src]:
            raise InvalidTransition(
                f"request {self.request_id}: {src.value} -> {target.value} is not allowed"
            )
        ends = target in (ReqStatus.FINISHED, ReqStatus.ABORTED)
        if ends != (finish is not None):
            need = "needs a" if ends else "takes no"
            raise InvalidTransition(f"request {self.request_id}: {target.value} {need} finish")
        if finish is not None and not 0 <= finish.finished_len <= self.num_outputs:
            raise InvalidTransition(
                f"request {self.request_id}: finished_len {finish.finished_len} outside "
                f"0..{self.num_outputs} settled outputs"
            )
        if target in (ReqStatus.FINISHED, ReqStatus.ABORTED, ReqStatus.RETRACTED):
            self._leave_slot()
        if target is ReqStatus.RETRACTED:
            self._incarnation += 1
        self._status = target
        self._finish = finish

    def record_admission(self, *, cached_tokens: int) -> None:
        """Record how many of its tokens the prefix cache supplied (scheduler, at admission).

        Raises:
            OwnershipError: the calling thread does not act as the scheduler.
        """
        self._checker.require((Role.SCHEDULER,), counter="cached_tokens", request=self.request_id)
        self._cached_tokens = cached_tokens

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

    def _leave_slot(self) -> None:
        # Copy the outputs and accept lengths back before the slot can be reused; the source
        # marks the slot so that a result still in flight for this request is skipped.
        source = self._source
        if source is None:
            return
        self._output_ids = source.read_outputs(self._slot)
        self._accept_lengths.extend(source.read_accept_lengths(self._slot))
        if self.sampling.logprobs:
            self._logprobs = source.read_logprobs(self._slot)
        source.detach(self._slot)
        self._source = None

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
    bad = [(i, t) for i, t in enumerate(items) if not _is_int(t)]
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
