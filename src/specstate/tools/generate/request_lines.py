"""Reads the ``generate`` JSONL requests, strictly: every line is checked before any request runs.

A line with an unknown field or a wrong type or range fails with `InvalidRequest` naming the
file, the line and the field; nothing is converted or silently ignored (a string of digits, a
float or a bool where an integer is expected, JSON's NaN). Ranges the engine knows (an id outside
the vocabulary, a prompt longer than the context) are checked at submit, naming the line too.

To add a request field: its name and default in `FIELDS`, a reader below, and its keyword in
`_sampling_params`.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any, Final

import attrs

from specstate.core.errors import InvalidRequest
from specstate.core.params import SamplingParams
from specstate.grammar.spec import Grammar
from specstate.tools.generate.options import STDIO

__all__ = ["FIELDS", "RequestLine", "parse_line", "read_requests"]

FIELDS: Final = frozenset(
    {
        "id",
        "input_ids",
        "text",
        "max_new_tokens",
        "stop_token_ids",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "speculative",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "min_new_tokens",
        "stop_sequences",
        "logprobs",
        "top_logprobs",
        "grammar",
    }
)
"""Every field a request line may have."""

_MAX_SEED: Final = 2**63
"""A request's seed is an integer in [0, 2^63) (`SamplingParams.seed`)."""
_FLAGS: Final = {"speculative": True, "logprobs": False}
_PENALTIES: Final = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


@attrs.frozen(kw_only=True)
class RequestLine:
    """One parsed request line: where it is, its id, its prompt (ids or text) and parameters.

    Invariant: exactly one of ``input_ids`` and ``text`` is set.
    """

    where: str
    request_id: str
    input_ids: tuple[int, ...] | None
    text: str | None
    params: SamplingParams


def read_requests(path: Path, *, stdin: str | None = None) -> list[RequestLine]:
    """Every request line of ``path``; `InvalidRequest` naming the file, line and field.

    ``path`` ``-`` is standard input, read to its end (named ``<stdin>`` in errors); ``stdin``
    is its text when the caller read it already (a spawned rank has no standard input).
    """
    name = "<stdin>" if str(path) == STDIO else str(path)
    try:
        if str(path) != STDIO:
            text = path.read_text(encoding="utf-8")
        else:
            text = sys.stdin.read() if stdin is None else stdin
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{name}: cannot read the requests ({exc})") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            lines.append(parse_line(raw, f"{name}:{number}"))
    return lines


def parse_line(raw: str, where: str) -> RequestLine:
    """One request object, with exact types: nothing is converted or silently ignored."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}: a request line must be a JSON object")
    unknown = sorted(set(obj) - FIELDS)
    if unknown:
        raise InvalidRequest(f"{where}: unknown fields {unknown} (known: {sorted(FIELDS)})")
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest(f'{where}: "id" must be a non-empty string, got {rid!r}')
    ids, text = _prompt(obj, where)
    params = _sampling_params(obj, where)
    return RequestLine(where=where, request_id=rid, input_ids=ids, text=text, params=params)


def _sampling_params(obj: dict[str, Any], where: str) -> SamplingParams:
    """The request's `SamplingParams` (ranges are checked at submit, naming this line)."""
    cap, stops = _limits(obj, where)
    temperature, top_p, top_k, seed = _distribution(obj, where)
    flags = _flags(obj, where)
    penalties = _penalties(obj, where)
    min_new, sequences = _stops(obj, where)
    return SamplingParams(
        max_new_tokens=cap,
        stop_token_ids=stops,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        min_new_tokens=min_new,
        stop_sequences=sequences,
        repetition_penalty=penalties["repetition_penalty"],
        frequency_penalty=penalties["frequency_penalty"],
        presence_penalty=penalties["presence_penalty"],
        speculative=flags["speculative"],
        logprobs=flags["logprobs"],
        top_logprobs=_top_logprobs(obj, where),
        grammar=_grammar(obj, where),
    )


def _top_logprobs(obj: dict[str, Any], where: str) -> int:
    """``top_logprobs``: an integer (its range, and that it needs ``logprobs``, are checked at
    submit, naming this line)."""
    top = obj.get("top_logprobs", 0)
    if not _is_id(top):
        raise InvalidRequest(f'{where}: "top_logprobs" must be an integer, got {top!r}')
    return int(top)


def _grammar(obj: dict[str, Any], where: str) -> Grammar | None:
    """The ``grammar`` field: one of ``{"json_schema": ...}``, ``{"regex": ...}``,
    ``{"ebnf": ...}``, ``{"lark": ...}`` (compiled at submit, naming this line)."""
    if obj.get("grammar") is None:
        return None
    try:
        return Grammar.from_json(obj["grammar"])
    except ValueError as exc:
        raise InvalidRequest(f'{where}: "grammar": {exc}') from None


def _limits(obj: dict[str, Any], where: str) -> tuple[int, list[int]]:
    """``max_new_tokens`` and ``stop_token_ids``."""
    cap = obj.get("max_new_tokens", 128)
    if not _is_id(cap):
        raise InvalidRequest(f'{where}: "max_new_tokens" must be an integer, got {cap!r}')
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(_is_id(t) for t in stops):
        raise InvalidRequest(
            f'{where}: "stop_token_ids" must be a list of integers, got {stops!r:.60}'
        )
    return cap, stops


def _distribution(obj: dict[str, Any], where: str) -> tuple[float, float, int | None, int | None]:
    """``temperature``, ``top_p``, ``top_k`` and ``seed``."""
    temperature = obj.get("temperature", 0.0)
    if not _is_number(temperature) or temperature < 0:
        raise InvalidRequest(
            f'{where}: "temperature" must be a number >= 0 (0: greedy), got {temperature!r}'
        )
    top_p = obj.get("top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f'{where}: "top_p" must be a number in (0, 1], got {top_p!r}')
    top_k = obj.get("top_k")
    if top_k is not None and (not _is_id(top_k) or top_k < 1):
        raise InvalidRequest(f'{where}: "top_k" must be an integer >= 1 or null, got {top_k!r}')
    seed = obj.get("seed")
    if seed is not None and (not _is_id(seed) or not 0 <= seed < _MAX_SEED):
        raise InvalidRequest(f'{where}: "seed" must be an integer in [0, 2^63), got {seed!r}')
    return float(temperature), float(top_p), top_k, seed


def _flags(obj: dict[str, Any], where: str) -> dict[str, bool]:
    """The boolean fields (``speculative``, ``logprobs``)."""
    flags = {name: obj.get(name, default) for name, default in _FLAGS.items()}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidRequest(f'{where}: "{name}" must be true or false, got {value!r}')
    return flags


def _penalties(obj: dict[str, Any], where: str) -> dict[str, float]:
    """The three penalties, as floats."""
    penalties = {name: obj.get(name, default) for name, default in _PENALTIES.items()}
    for name, value in penalties.items():
        if not _is_number(value):
            raise InvalidRequest(f'{where}: "{name}" must be a number, got {value!r}')
    return {name: float(value) for name, value in penalties.items()}


def _stops(obj: dict[str, Any], where: str) -> tuple[int, tuple[tuple[int, ...], ...]]:
    """``min_new_tokens`` and ``stop_sequences``."""
    min_new = obj.get("min_new_tokens", 0)
    if not _is_id(min_new):
        raise InvalidRequest(f'{where}: "min_new_tokens" must be an integer, got {min_new!r}')
    sequences = obj.get("stop_sequences", [])
    if not isinstance(sequences, list) or not all(
        isinstance(q, list) and q and all(_is_id(t) for t in q) for q in sequences
    ):
        raise InvalidRequest(
            f'{where}: "stop_sequences" must be a list of non-empty lists of integers, '
            f"got {sequences!r:.60}"
        )
    return min_new, tuple(tuple(q) for q in sequences)


def _prompt(obj: dict[str, Any], where: str) -> tuple[tuple[int, ...] | None, str | None]:
    """``input_ids`` or ``text``: exactly one of them."""
    if "text" in obj:
        text = obj["text"]
        if "input_ids" in obj:
            raise InvalidRequest(f'{where}: give "input_ids" or "text", not both')
        if not isinstance(text, str):
            raise InvalidRequest(f'{where}: "text" must be a string, got {text!r:.60}')
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f'{where}: "text" is not valid Unicode ({exc.reason})') from None
        return None, text
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not all(_is_id(t) for t in ids):
        raise InvalidRequest(
            f'{where}: "input_ids" must be a list of integers (or give "text"), got {ids!r:.60}'
        )
    return tuple(ids), None


def _is_id(value: object) -> bool:
    """A JSON integer (JSON true/false are bools, and 1e400 is a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite JSON number (not a bool; Python's JSON reads NaN and Infinity, refused here;
    an integer too large for a float, such as 1 followed by 400 zeros, is refused too)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False
