"""A request's parameters and the model's limits, validated where they enter.

`SamplingParams` says how one request decodes (length, stops, sampling, penalties, seeds,
logprobs, speculation, grammar); `RequestLimits` says what the model accepts (vocabulary,
context, EOS ids, the grammar vocabulary). Both are frozen values: a wrong field is refused at
construction or at `Engine.submit` with `InvalidRequest` / `InvalidConfig` naming the field and
the value, and every number a sampler later computes in float32 must fit one.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from typing import Final

import attrs

from specstate.core.errors import InvalidConfig, InvalidRequest
from specstate.grammar.spec import Grammar, GrammarVocabulary

__all__ = ["MAX_TOP_LOGPROBS", "RequestLimits", "SamplingParams", "is_int"]

MAX_TOP_LOGPROBS: Final = 20
"""The most alternatives `SamplingParams.top_logprobs` may ask for (OpenAI's limit)."""


def _stop_ids(value: Iterable[int]) -> frozenset[int]:
    """A frozenset of the given ids, as given (`SamplingParams.problems` checks their types).

    Raises:
        InvalidRequest: ``value`` is a string, bytes or a single number, not a collection.
    """
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequest(
            f"stop_token_ids must be a collection of token ids, got {type(value).__name__} "
            f"{value!r}",
            fields=("stop_token_ids",),
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
            f"{type(value).__name__} {value!r}",
            fields=("stop_sequences",),
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
            raise InvalidRequest(f"grammar: {exc}", fields=("grammar",)) from None
    return value  # type: ignore[return-value]  # reported by `problems`


def is_int(value: object) -> bool:
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
        top_logprobs: with ``logprobs``, also record the ``top_logprobs`` most likely tokens
            of every emitted position and their log-probabilities, under the same final
            distribution (`Req.top_logprobs`, aligned with `Req.emitted_ids`; most likely
            first, ties by token id). An integer in ``[0, MAX_TOP_LOGPROBS]`` (20) and at most
            the vocabulary; 0 records none. A token a sampled request's top-k / top-p filter
            removed has log-probability ``-inf``.
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
    top_logprobs: int = 0
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
        return [message for _, message in self.field_problems(vocab_size)]

    def field_problems(self, vocab_size: int) -> list[tuple[str, str]]:
        """`problems`, each after the name of the field it is about."""
        found = []
        if not is_int(self.max_new_tokens) or self.max_new_tokens <= 0:
            found.append(
                (
                    "max_new_tokens",
                    f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}",
                )
            )
        not_ids = [t for t in self.stop_token_ids if not is_int(t)]
        if not_ids:
            found.append(
                (
                    "stop_token_ids",
                    f"stop_token_ids must be integers, got {sorted(map(repr, not_ids))}",
                )
            )
        bad_stop = sorted(t for t in self.stop_token_ids if is_int(t) and not 0 <= t < vocab_size)
        if bad_stop:
            found.append(
                (
                    "stop_token_ids",
                    f"stop_token_ids {bad_stop} outside the vocabulary [0, {vocab_size})",
                )
            )
        for name in ("ignore_eos", "speculative", "logprobs"):
            if not isinstance(getattr(self, name), bool):
                found.append((name, f"{name} must be a bool, got {getattr(self, name)!r}"))
        greedy = self.temperature == 0 and not isinstance(self.temperature, bool)
        if not greedy and not _in_f32(self.temperature, low=_F32_TINY):
            found.append(
                (
                    "temperature",
                    f"temperature must be a finite number >= 0, got {self.temperature!r:.40} (0 "
                    f"for greedy, else in [{_F32_TINY:.3g}, {_F32_MAX:.3g}]: the sampler computes "
                    "in float32)",
                )
            )
        if self.top_k is not None and (not is_int(self.top_k) or self.top_k < 1):
            found.append(("top_k", f"top_k must be an integer >= 1 or None, got {self.top_k!r}"))
        if not _is_finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            found.append(("top_p", f"top_p must be a number in (0, 1], got {self.top_p!r:.40}"))
        if not _in_f32(self.repetition_penalty, low=_F32_TINY):
            found.append(
                (
                    "repetition_penalty",
                    f"repetition_penalty must be a finite number > 0, got "
                    f"{self.repetition_penalty!r:.40} (in [{_F32_TINY:.3g}, {_F32_MAX:.3g}]: "
                    "float32)",
                )
            )
        for name in ("frequency_penalty", "presence_penalty"):
            if not _in_f32(getattr(self, name), low=-_F32_MAX):
                found.append(
                    (
                        name,
                        f"{name} must be a finite number, got {getattr(self, name)!r:.40} (in "
                        f"[{-_F32_MAX:.3g}, {_F32_MAX:.3g}]: float32)",
                    )
                )
        if not is_int(self.min_new_tokens) or self.min_new_tokens < 0:
            found.append(
                (
                    "min_new_tokens",
                    f"min_new_tokens must be an integer >= 0, got {self.min_new_tokens!r}",
                )
            )
        elif is_int(self.max_new_tokens) and self.min_new_tokens > self.max_new_tokens:
            found.append(
                (
                    "min_new_tokens",
                    f"min_new_tokens {self.min_new_tokens} exceeds max_new_tokens "
                    f"{self.max_new_tokens}",
                )
            )
        found += [
            ("stop_sequences", m) for m in _sequence_problems(self.stop_sequences, vocab_size)
        ]
        if self.seed is not None and (not is_int(self.seed) or not 0 <= self.seed < 2**63):
            found.append(
                ("seed", f"seed must be None or an integer in [0, 2**63), got {self.seed!r}")
            )
        found += self._top_logprobs_problems(vocab_size)
        found += self._grammar_problems()
        return found

    def _top_logprobs_problems(self, vocab_size: int) -> list[tuple[str, str]]:
        """``top_logprobs`` an integer in ``[0, min(MAX_TOP_LOGPROBS, vocab_size)]``, set
        only with ``logprobs``."""
        top = self.top_logprobs
        limit = min(MAX_TOP_LOGPROBS, vocab_size)
        if not is_int(top) or not 0 <= top <= limit:
            return [
                (
                    "top_logprobs",
                    f"top_logprobs must be an integer in [0, {limit}] (at most "
                    f"{MAX_TOP_LOGPROBS} and the vocabulary size {vocab_size}), got {top!r:.40}",
                )
            ]
        if top and self.logprobs is not True:
            return [("top_logprobs", f"top_logprobs={top} needs logprobs=True")]
        return []

    def _grammar_problems(self) -> list[tuple[str, str]]:
        """What is wrong with ``grammar`` and its combination with the other fields (the field
        to change first: the grammar itself, or the field a grammar rules out)."""
        if self.grammar is None:
            return []
        if not isinstance(self.grammar, Grammar):
            return [
                ("grammar", f"grammar must be a Grammar or None, got {type(self.grammar).__name__}")
            ]
        found = [("grammar", problem) for problem in self.grammar.problems()]
        if self.ignore_eos is True:
            found.append(
                (
                    "ignore_eos",
                    "a grammar ends with the end-of-sequence token: ignore_eos must be False",
                )
            )
        if is_int(self.min_new_tokens) and self.min_new_tokens > 0:
            found.append(
                (
                    "min_new_tokens",
                    "a grammar decides where the output may end: min_new_tokens must be 0, got "
                    f"{self.min_new_tokens}",
                )
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
        elif not all(is_int(t) for t in seq):
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
        if not is_int(self.vocab_size) or not 1 <= self.vocab_size <= _MAX_VOCAB:
            problems.append(
                f"vocab_size must be an integer >= 1 and at most 2**40, got {self.vocab_size!r:.40}"
            )
        if not is_int(self.max_context_len) or self.max_context_len < 2:
            problems.append(
                f"max_context_len must be an integer >= 2, got {self.max_context_len!r}"
            )
        bad = sorted(
            repr(t)
            for t in self.eos_token_ids
            if not is_int(t) or (is_int(self.vocab_size) and not 0 <= t < self.vocab_size)
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
        if is_int(self.vocab_size) and vocabulary.size > self.vocab_size:
            found.append(
                f"grammar_vocabulary describes {vocabulary.size} tokens, more than vocab_size "
                f"{self.vocab_size}"
            )
        if not self.eos_token_ids:
            found.append("a grammar_vocabulary needs eos_token_ids: a grammar ends with one")
        text = sorted(
            t
            for t in self.eos_token_ids
            if is_int(t) and 0 <= t < vocabulary.size and vocabulary.token_bytes[t] is not None
        )
        if text:
            found.append(f"eos_token_ids {text} stand for text in grammar_vocabulary")
        return found
