"""One request's grammar state, and the compiler that builds it (llguidance, ``grammar`` extra).

`GrammarState` owns one request's matcher. Its tokens are the request's outputs as the grammar
has consumed them, in three regions, like a request's KV::

    tokens    t0 .. t(c-1) | t(c) .. t(p-1)        | d1 .. dk
              committed    | accepted by a forward | drafts of the forward now running
              (settled)    | not settled yet       | (rolled back unless the verify keeps them)
              num_committed                          position = len(tokens)

``num_committed`` is the host's clock: only the grammar table advances it, at settlement, by the
tokens the round settled. ``position`` is the forward stream's: only the forward that holds the
request's row moves it (drafts pushed, the rejected ones rolled back with the matcher's own
rollback, the accepted run kept), in stream order, so round N+1's forward starts exactly where
round N's left it, before the host has settled round N. A retracted request's next prefill
rolls the matcher back to ``num_committed``.

The grammar ends when it accepts an end-of-sequence token; an ended matcher is never asked for a
mask again. A state from which no token can follow (the vocabulary cannot spell what the grammar
needs) is a dead end: llguidance then puts the matcher in a permanent error state. A dead end met
on a *rejected* draft is the one case where the matcher is rebuilt by re-parsing its kept tokens
(`GrammarState.rebuild`); a dead end on the accepted path ends the request with `GrammarError`.

Invariant: ``num_committed <= position``; with no forward holding the row, ``tokens`` equals the
request's settled outputs and ``position == num_committed``; the matcher's own history holds
exactly the tokens with ``in_matcher`` set (an end token consumed by a matcher that had already
stopped is not pushed into it, as llguidance does not count it).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Final

import numpy as np
import numpy.typing as npt

from specstate.core.errors import GrammarError, InvalidRequest
from specstate.grammar.spec import Grammar, GrammarVocabulary

if TYPE_CHECKING:
    import llguidance

__all__ = ["GrammarCompiler", "GrammarState", "MaskArray"]

MaskArray = npt.NDArray[np.int32]
"""Packed bitmasks, ``[..., words]`` int32: bit ``t % 32`` of word ``t // 32`` allows token t."""

_JSON_DEFAULTS: Final[dict[str, Any]] = {"whitespace_flexible": False}
"""Compact JSON by default: a random or small model would otherwise pad with whitespace."""


def _import_llguidance() -> Any:
    try:
        import llguidance
    except ImportError:
        raise InvalidRequest(
            "a grammar needs llguidance, which the 'grammar' extra installs: "
            "pip install 'specstate[grammar]'",
            fields=("grammar",),
        ) from None
    return llguidance


class _VocabularyWrapper:
    """What ``llguidance.TokenizerWrapper`` reads: token bytes, EOS, specials, an encoder."""

    def __init__(
        self, vocabulary: GrammarVocabulary, vocab_size: int, eos_token_ids: Sequence[int]
    ) -> None:
        tokens: list[bytes] = []
        specials: list[int] = []
        for i in range(vocab_size):
            token = vocabulary.token_bytes[i] if i < vocabulary.size else None
            if token is None:
                # llguidance marks special tokens with a leading 0xFF byte, which no UTF-8
                # text contains: they never match text.
                tokens.append(b"\xff<|special_%d|>" % i)
                specials.append(i)
            else:
                tokens.append(token)
        self.tokens = tokens
        self.special_token_ids = specials
        self.eos_token_id = eos_token_ids[0]
        self.bos_token_id = None
        self._vocabulary = vocabulary

    def __call__(self, text: str | bytes) -> list[int]:
        data = text if isinstance(text, bytes) else text.encode("utf-8")
        return self._vocabulary.encode(data)


class GrammarCompiler:
    """Compiles grammars for one model's vocabulary (one llguidance tokenizer, built lazily).

    Compiling one of the ``max_cached`` grammars compiled most recently copies its matcher
    instead of compiling it again.

    Args:
        vocabulary: the bytes of every token id.
        vocab_size: the model's vocabulary size (ids past the vocabulary's end are special).
        eos_token_ids: the model's end-of-sequence ids: a grammar ends by accepting one.
        max_cached: compiled grammars kept (least recently used dropped first).
    """

    def __init__(
        self,
        vocabulary: GrammarVocabulary,
        *,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        max_cached: int = 256,
    ) -> None:
        self._vocabulary = vocabulary
        self._vocab_size = vocab_size
        self._eos = tuple(sorted(eos_token_ids))
        self._tokenizer: llguidance.LLTokenizer | None = None
        self._compiled: OrderedDict[Grammar, tuple[str, llguidance.LLMatcher]] = OrderedDict()
        self._max_cached = max_cached
        self._lock = threading.Lock()  # rebuilds run on the forward stream, compiles on the host

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        """The ids that end a grammar."""
        return self._eos

    @property
    def mask_words(self) -> int:
        """Words of one packed bitmask: ``ceil(vocab_size / 32)``."""
        return (self._vocab_size + 31) // 32

    def tokenizer(self) -> llguidance.LLTokenizer:
        """The llguidance tokenizer of the vocabulary (built on first use)."""
        with self._lock:
            if self._tokenizer is None:
                llg = _import_llguidance()
                wrapper = _VocabularyWrapper(self._vocabulary, self._vocab_size, self._eos)
                self._tokenizer = llg.LLTokenizer(
                    llg.TokenizerWrapper(wrapper),
                    n_vocab=self._vocab_size,
                    eos_token=list(self._eos),
                )
            return self._tokenizer

    def compile(self, grammar: Grammar) -> tuple[str, llguidance.LLMatcher]:
        """The compiled grammar text and a fresh matcher at its start.

        Raises:
            ValueError: the grammar does not compile (the message is llguidance's, first lines).
        """
        with self._lock:
            known = self._compiled.get(grammar)
            if known is not None:
                self._compiled.move_to_end(grammar)
        if known is not None:
            return known[0], known[1].deep_copy()
        llg = _import_llguidance()
        tokenizer = self.tokenizer()
        text = _grammar_text(llg, grammar)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(text, tokenizer)
        if is_error:
            raise ValueError(_first_lines(messages[0] if messages else "invalid grammar"))
        matcher = llg.LLMatcher(tokenizer, text, log_level=0)
        if matcher.is_error():
            raise ValueError(_first_lines(matcher.get_error()))
        with self._lock:
            self._compiled[grammar] = (text, matcher.deep_copy())
            while len(self._compiled) > self._max_cached:
                self._compiled.popitem(last=False)
        return text, matcher

    def matcher(self, text: str) -> llguidance.LLMatcher:
        """A fresh matcher of an already compiled grammar text (for a rebuild)."""
        llg = _import_llguidance()
        matcher: llguidance.LLMatcher = llg.LLMatcher(self.tokenizer(), text, log_level=0)
        return matcher


def _grammar_text(llg: Any, grammar: Grammar) -> str:
    """llguidance's grammar text of ``grammar`` (not validated yet)."""
    if grammar.kind == "json_schema":
        text: str = llg.LLMatcher.grammar_from_json_schema(grammar.source, defaults=_JSON_DEFAULTS)
        return text
    if grammar.kind == "regex":
        return str(llg.LLMatcher.grammar_from_regex(grammar.source))
    if grammar.kind == "lark":
        return str(llg.LLMatcher.grammar_from_lark(grammar.source))
    return str(llg.grammar_from("ebnf", grammar.source))


def _first_lines(message: str, lines: int = 4) -> str:
    """The head of a (possibly very long) llguidance message."""
    head = [line for line in message.strip().splitlines() if line.strip()][:lines]
    return " / ".join(line.strip() for line in head)


class GrammarState:
    """One request's matcher, committed position and stream position (module docstring).

    Args:
        request_id: for messages.
        grammar: what the request asked for (for messages).
        text: the compiled grammar (for a rebuild).
        matcher: a fresh matcher at the grammar's start.
        compiler: builds a new matcher for a rebuild.
    """

    def __init__(
        self,
        *,
        request_id: str,
        grammar: Grammar,
        text: str,
        matcher: llguidance.LLMatcher,
        compiler: GrammarCompiler,
    ) -> None:
        self.request_id = request_id
        self.grammar = grammar
        self._text = text
        self._matcher = matcher
        self._compiler = compiler
        self._eos = frozenset(compiler.eos_token_ids)
        self.tokens: list[int] = []  # stream-owned (see the module docstring)
        self._in_matcher: list[bool] = []
        self.num_committed = 0  # host-owned: the grammar table advances it at settlement
        self.ended = False  # the last token is an end token the grammar accepted
        self.dead: str | None = None  # why no token can follow ``tokens``, once known
        self.version = 0  # bumped by every change of position (keys the prefetched mask)
        self.prefetched: tuple[int, MaskArray] | None = None  # (version, mask) for the next step
        self.num_rebuilds = 0

    # ------------------------------------------------------------------ reads
    @property
    def position(self) -> int:
        """Tokens the matcher has consumed (stream clock)."""
        return len(self.tokens)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        """The tokens that end the grammar."""
        return self._eos

    @property
    def is_active(self) -> bool:
        """True while a token can still follow: the grammar neither ended nor hit a dead end."""
        return not self.ended and self.dead is None

    def matcher_for_mask(self) -> llguidance.LLMatcher:
        """The matcher, to compute the mask of the next token.

        Raises:
            GrammarError: the grammar ended (a terminated matcher is never asked for a mask)
                or is at a dead end.
        """
        if not self.is_active:
            why = "ended" if self.ended else f"is at a dead end ({self.dead})"
            raise GrammarError(
                f"request {self.request_id}: a mask was asked after output {self.position}, "
                f"but its grammar {why}"
            )
        return self._matcher

    def is_error(self) -> bool:
        """True when the matcher is in llguidance's (permanent) error state."""
        return bool(self._matcher.is_error())

    def error_text(self) -> str:
        """llguidance's error, first lines."""
        return _first_lines(self._matcher.get_error())

    # --------------------------------------------------------------- mutators
    def push(self, token: int) -> None:
        """Consume ``token``, which the current mask allows (stream side).

        An end token ends the grammar; if the matcher had already stopped (only an end token
        could follow), llguidance does not record it, so neither is it pushed into the matcher.

        Raises:
            GrammarError: the matcher refused the token (the caller did not check the mask).
        """
        if token in self._eos and self._matcher.is_stopped():
            pushed = False
        else:
            if not self._matcher.consume_token(token):
                raise GrammarError(
                    f"request {self.request_id}: token {token} refused by its grammar after "
                    f"output {self.position} ({self.error_text()})"
                )
            pushed = True
        self.tokens.append(token)
        self._in_matcher.append(pushed)
        self.ended = token in self._eos
        self.version += 1

    def rollback(self, num_tokens: int) -> int:
        """Undo the last ``num_tokens`` pushes with the matcher's rollback; the tokens undone.

        A matcher that a dead end on a draft put in its error state cannot roll back: it is
        rebuilt from the tokens it keeps (`rebuild`).
        """
        if num_tokens <= 0:
            return 0
        keep = len(self.tokens) - num_tokens
        if keep < 0:
            raise GrammarError(
                f"request {self.request_id}: rollback of {num_tokens} tokens past the start "
                f"(position {self.position})"
            )
        undo = sum(self._in_matcher[keep:])
        if self._matcher.is_error() or not self._matcher.rollback(undo):
            self.rebuild(keep)
            return num_tokens
        del self.tokens[keep:]
        del self._in_matcher[keep:]
        self.ended = bool(self.tokens) and self.tokens[-1] in self._eos
        self.version += 1
        return num_tokens

    def rebuild(self, num_tokens: int) -> None:
        """A fresh matcher that consumed the first ``num_tokens`` tokens (a re-parse).

        Only after a dead end on a rejected draft: llguidance's error state is permanent.
        """
        kept = self.tokens[:num_tokens]
        self._matcher = self._compiler.matcher(self._text)
        self.tokens, self._in_matcher = [], []
        self.ended = False
        for token in kept:
            self.push(token)
        self.version += 1
        self.num_rebuilds += 1

    def mark_dead(self, where: int) -> str:
        """Record that no token can follow output ``where``; the message the request ends with."""
        reason = self.error_text() or "no token of the vocabulary is allowed"
        self.dead = (
            f"request {self.request_id}: dead end of its grammar {self.grammar.describe()} "
            f"after output {where}: no token can follow ({reason})"
        )
        return self.dead
