"""Grammar values: what a request's output must match, and the vocabulary it is matched in.

`Grammar` names one constraint on a request's output: a JSON schema, a regular expression, or a
context-free grammar in EBNF (GBNF) or Lark syntax. `GrammarVocabulary` says which bytes each
token id stands for, so that a grammar over text becomes a mask over token ids; special tokens
(BOS, EOS, padding) stand for no text. Both are frozen, hashable values; no grammar library is
imported here (`specstate.engine.capabilities.grammar` compiles them, with the ``grammar`` extra).

The request-file and server form of a grammar is a JSON object with exactly one key::

    {"json_schema": {...}}    {"regex": "[0-9]+"}    {"ebnf": "root ::= ..."}    {"lark": "..."}
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final, Literal

import attrs

from specstate.core.errors import InvalidConfig

__all__ = ["GRAMMAR_KINDS", "Grammar", "GrammarKind", "GrammarVocabulary"]

GrammarKind = Literal["json_schema", "regex", "ebnf", "lark"]
GRAMMAR_KINDS: Final[tuple[GrammarKind, ...]] = ("json_schema", "regex", "ebnf", "lark")
"""The grammar kinds, in the order the docs list them."""


@attrs.frozen
class Grammar:
    """A constraint on a request's output: the output must be a string of this grammar.

    Build one with `json_schema`, `regex`, `ebnf` or `lark` (or `from_json`, the request-file
    form). The output ends when the grammar accepts the end-of-sequence token, which it allows
    only where the grammar is complete; a complete grammar that cannot go on forces it.

    Attributes:
        kind: ``"json_schema"``, ``"regex"``, ``"ebnf"`` (GBNF or Lark syntax) or ``"lark"``.
        source: the grammar text (a JSON schema as JSON text, its key order kept: the order
            of ``properties`` is the order the output lists them).
    """

    kind: str
    source: str

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | str) -> Grammar:
        """Output that is one JSON value of ``schema`` (a mapping, or its JSON text).

        Compact by default (no whitespace between tokens); a schema's ``"x-guidance"``
        object (llguidance's JSON options, e.g. ``{"whitespace_flexible": true}``) overrides it.
        """
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json_schema", text)

    @classmethod
    def regex(cls, pattern: str) -> Grammar:
        """Output that matches ``pattern`` whole (Rust ``regex`` syntax, anchored)."""
        return cls("regex", pattern)

    @classmethod
    def ebnf(cls, text: str) -> Grammar:
        """Output of the context-free grammar ``text``: GBNF (``root ::= ...``) or Lark."""
        return cls("ebnf", text)

    @classmethod
    def lark(cls, text: str) -> Grammar:
        """Output of the Lark grammar ``text`` (llguidance's Lark dialect, ``start: ...``)."""
        return cls("lark", text)

    @classmethod
    def from_json(cls, value: object) -> Grammar:
        """The request-file form: an object with exactly one of the kinds as its key.

        Raises:
            ValueError: ``value`` is not such an object (the message names what it got).
        """
        if not isinstance(value, Mapping) or len(value) != 1:
            raise ValueError(
                f"a grammar is an object with exactly one key of {list(GRAMMAR_KINDS)}, "
                f"got {value!r:.80}"
            )
        ((kind, body),) = value.items()
        if kind == "json_schema" and isinstance(body, Mapping | str):
            return cls.json_schema(body)
        if kind in GRAMMAR_KINDS and kind != "json_schema" and isinstance(body, str):
            return cls(kind, body)
        want = "an object or a string" if kind == "json_schema" else "a string"
        if kind not in GRAMMAR_KINDS:
            raise ValueError(f"unknown grammar kind {kind!r} (known: {list(GRAMMAR_KINDS)})")
        raise ValueError(f"grammar {kind!r} must be {want}, got {type(body).__name__}")

    def to_json(self) -> dict[str, Any]:
        """The request-file form (`from_json` reads it back)."""
        if self.kind == "json_schema":
            return {"json_schema": json.loads(self.source)}
        return {self.kind: self.source}

    def problems(self) -> list[str]:
        """What is wrong with this value before compiling it (kind, text); compile errors
        are found at submit, where the vocabulary is known."""
        if self.kind not in GRAMMAR_KINDS:
            return [f"grammar kind must be one of {list(GRAMMAR_KINDS)}, got {self.kind!r}"]
        if not isinstance(self.source, str) or not self.source:
            return [f"grammar {self.kind} source must be a non-empty string"]
        if self.kind == "json_schema":
            try:
                parsed = json.loads(self.source)
            except ValueError as exc:
                return [f"grammar json_schema is not JSON ({exc})"]
            if not isinstance(parsed, dict | bool):
                return [f"grammar json_schema must be a JSON object, got {type(parsed).__name__}"]
        return []

    def describe(self) -> str:
        """A short label for messages: the kind and the first characters of the source."""
        text = " ".join(str(self.source).split())
        return f"{self.kind} {text[:40]!r}{'...' if len(text) > 40 else ''}"


def _token_bytes(value: Iterable[bytes | None]) -> tuple[bytes | None, ...]:
    return tuple(value)


@attrs.frozen(kw_only=True)
class GrammarVocabulary:
    """The bytes each token id stands for: what a grammar needs to mask token ids.

    Token ``i`` stands for ``token_bytes[i]``; None marks a special token (BOS, EOS, padding,
    control tokens) that matches no text. Ids past the end of ``token_bytes`` (a model's padded
    vocabulary) are special too. The end of a grammar is the model's EOS
    (``RequestLimits.eos_token_ids``), which must be special here.

    Attributes:
        token_bytes: one entry per token id: its bytes, or None for a special token.
    """

    token_bytes: tuple[bytes | None, ...] = attrs.field(converter=_token_bytes)

    def __attrs_post_init__(self) -> None:
        """Refuse entries that are neither bytes nor None, and empty byte strings.

        Raises:
            InvalidConfig: naming the first ids that are wrong.
        """
        bad = [
            i
            for i, t in enumerate(self.token_bytes)
            if not (t is None or (isinstance(t, bytes) and t))
        ]
        if bad:
            raise InvalidConfig(
                f"GrammarVocabulary: token_bytes entries must be non-empty bytes or None "
                f"(special); ids {bad[:8]} are not"
            )

    @classmethod
    def byte_level(cls, vocab_size: int, *, num_bytes: int = 256) -> GrammarVocabulary:
        """A byte-level vocabulary: ids ``0 .. num_bytes - 1`` are those byte values, every
        other id below ``vocab_size`` is special (the embedded model's vocabulary)."""
        return cls(token_bytes=[bytes([i]) if i < num_bytes else None for i in range(vocab_size)])

    @classmethod
    def from_tokens(cls, tokens: Sequence[bytes | str | None]) -> GrammarVocabulary:
        """One entry per id: bytes, a string (its UTF-8 bytes), or None for a special token."""
        return cls(token_bytes=[t.encode("utf-8") if isinstance(t, str) else t for t in tokens])

    @classmethod
    def from_tokenizer_json(
        cls, path: str | Path, *, vocab_size: int, special_ids: Iterable[int] = ()
    ) -> GrammarVocabulary:
        """The vocabulary of a Hugging Face ``tokenizer.json`` (byte-level BPE or
        SentencePiece-style) for a model of ``vocab_size`` ids; ``special_ids`` (the model's
        EOS and BOS) are special. See `specstate.grammar.tokenizer_json`.

        Raises:
            InvalidConfig: the file cannot be read or its tokens cannot be spelled as bytes.
        """
        from specstate.grammar.tokenizer_json import token_bytes_from_tokenizer_json

        return cls(
            token_bytes=token_bytes_from_tokenizer_json(
                path, vocab_size=vocab_size, special_ids=special_ids
            )
        )

    @property
    def size(self) -> int:
        """Token ids described (``len(token_bytes)``)."""
        return len(self.token_bytes)

    def special_ids(self) -> tuple[int, ...]:
        """The ids of the special tokens, ascending."""
        return tuple(i for i, t in enumerate(self.token_bytes) if t is None)

    def encode(self, data: bytes) -> list[int]:
        """Greedy longest-match token ids of ``data`` (bytes no token covers are skipped)."""
        table: dict[bytes, int] = {}
        for i, t in enumerate(self.token_bytes):
            if t is not None and t not in table:
                table[t] = i
        longest = max((len(t) for t in table), default=1)
        out: list[int] = []
        i = 0
        while i < len(data):
            for n in range(min(longest, len(data) - i), 0, -1):
                token = table.get(data[i : i + n])
                if token is not None:
                    out.append(token)
                    i += n
                    break
            else:
                i += 1
        return out

    def decode(self, ids: Iterable[int]) -> bytes:
        """The bytes of ``ids`` (special and unknown ids contribute nothing)."""
        out = bytearray()
        for i in ids:
            if 0 <= i < len(self.token_bytes):
                token = self.token_bytes[i]
                if token is not None:
                    out += token
        return bytes(out)
