"""The OpenAI completions protocol: a request body checked into engine terms, and error bodies.

Owner of what ``POST /v1/completions`` accepts. `parse_completion` reads a body strictly and
refuses anything else with an `ApiError` that names the field (``param``), which the server
sends as HTTP 400 with OpenAI's error object::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_value"}}

Accepted fields (OpenAI's, with its defaults): ``model`` (the served model's name), ``prompt``
(text when the model has a codec, token ids, or a one-element list of either), ``max_tokens``
(16), ``temperature`` (1.0), ``top_p`` (1.0), ``seed``, ``stop`` (strings when the model has a
codec; lists of token ids), ``stream``, ``stream_options.include_usage``, ``logprobs`` (0: the
chosen token's log-probability; ``k`` up to `MAX_TOP_LOGPROBS` (20): also the ``k`` most likely
tokens of each position, as ``top_logprobs`` dicts), ``frequency_penalty``,
``presence_penalty``, ``response_format`` (``{"type": "text"}``, ``{"type": "json_object"}``, or
``{"type": "json_schema", "json_schema": {"schema": {...}}}``: the output is constrained to
JSON, or to that schema), and ``n``, ``best_of``, ``echo``, ``suffix``, ``logit_bias``, ``user``
at their defaults only. Extensions: ``speculative`` (false: this request does not speculate;
its tokens are the same), ``top_k``, ``min_tokens``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``grammar`` (the ``specstate generate`` request field:
``{"json_schema": ...}``, ``{"regex": ...}``, ``{"ebnf": ...}`` or ``{"lark": ...}``; not
together with a constraining ``response_format``). Anything else is refused, and so is text
that is not Unicode (a lone surrogate such as ``"\\ud800"``, legal JSON) in ``prompt``, ``stop``,
``grammar`` or ``response_format``.

A request the engine itself refuses at submit (`InvalidRequest`: a temperature too small for
float32, ``max_tokens`` past the KV pool, a grammar that does not compile) is answered by
`refusal`, which maps the engine fields the refusal names (`InvalidRequest.fields`) to the
request fields that set them, so ``param`` names the field the client sent.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, Final

import attrs

from specstate.core.errors import InvalidRequest
from specstate.core.params import MAX_TOP_LOGPROBS, RequestLimits, SamplingParams
from specstate.grammar.spec import Grammar
from specstate.serving.text import TextCodec

__all__ = ["ApiError", "CompletionRequest", "parse_completion", "refusal"]

MAX_SEED: Final = 2**63
MAX_STOPS: Final = 16
DEFAULT_MAX_TOKENS: Final = 16
AT_DEFAULT: Final[Mapping[str, tuple[object, ...]]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None,),
    "logit_bias": (None, {}),
}
COMPLETION_FIELDS: Final = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "logprobs",
        "frequency_penalty",
        "presence_penalty",
        "response_format",
        "user",
        *AT_DEFAULT,
        # extensions
        "speculative",
        "top_k",
        "min_tokens",
        "repetition_penalty",
        "stop_token_ids",
        "ignore_eos",
        "grammar",
    }
)


TEXT_FIELDS: Final = ("prompt", "stop", "grammar", "response_format")
"""The fields whose strings reach a tokenizer or a grammar compiler."""
_PARAMS: Final[Mapping[str, str]] = {
    "prompt_ids": "prompt",
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "stop_sequences": "stop",
    "top_logprobs": "logprobs",  # logprobs: k asks for k alternatives
    **{
        name: name
        for name in (
            "stop_token_ids",
            "temperature",
            "top_p",
            "top_k",
            "seed",
            "logprobs",
            "speculative",
            "ignore_eos",
            "repetition_penalty",
            "frequency_penalty",
            "presence_penalty",
        )
    },
}
"""The request field that sets each engine field (for ``grammar``, the request's
`CompletionRequest.grammar_field`)."""


class ApiError(Exception):
    """A request the server refuses: the HTTP status and OpenAI's error object."""

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = "invalid_value",
        status: int = 400,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.status = status
        self.kind = kind

    def body(self) -> dict[str, object]:
        """``{"error": {"message", "type", "param", "code"}}``."""
        return {
            "error": {
                "message": self.message,
                "type": self.kind,
                "param": self.param,
                "code": self.code,
            }
        }


@attrs.frozen(kw_only=True)
class CompletionRequest:
    """A checked completion request, in engine terms.

    Attributes:
        prompt_ids: the prompt's token ids (text already encoded).
        sampling: the engine's sampling parameters.
        stream: answer with server-sent events.
        include_usage: (streaming) end with a chunk that carries the usage.
        logprobs: return the chosen tokens' log-probabilities.
        stop_sequences: the stops to cut from the returned output (OpenAI leaves them out).
        grammar_field: the field that gave the grammar (``grammar`` or ``response_format``),
            or None without one.
    """

    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    stream: bool
    include_usage: bool
    logprobs: bool
    stop_sequences: tuple[tuple[int, ...], ...]
    grammar_field: str | None = None


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _loads(body: bytes) -> dict[str, Any]:
    try:
        obj = json.loads(body, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise ApiError(f"the body is not valid JSON ({exc})", code="invalid_json") from None
    if not isinstance(obj, dict):
        raise ApiError("the body must be a JSON object", code="invalid_json")
    return obj


def check_text(obj: Mapping[str, Any], names: tuple[str, ...] = TEXT_FIELDS) -> None:
    """Refuse a string that is not Unicode text (a lone surrogate) in the text fields.

    JSON may escape half a surrogate pair (``"\\ud800"``); such a string has no UTF-8 form, so
    no tokenizer or grammar compiler can take it. Walked without recursion: the body's depth
    is bounded only by the JSON parser.
    """
    for name in names:
        todo = [obj.get(name)]
        while todo:
            value = todo.pop()
            if isinstance(value, dict):
                todo += [*value, *value.values()]
            elif isinstance(value, list):  # a prompt may be millions of ids: skip them fast
                todo += [item for item in value if type(item) is not int]
            elif isinstance(value, str):
                _encodable(value, name)


def _encodable(text: str, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ApiError(
            f"{name}: character {exc.start} of a string is a lone surrogate "
            f"({text[exc.start]!r}), not Unicode text; it has no UTF-8 form",
            param=name,
        ) from None


def _number(obj: Mapping[str, Any], name: str, default: float, low: float, high: float) -> float:
    value = obj.get(name)
    if value is None:
        return default
    if not _is_number(value) or not low <= value <= high:
        raise ApiError(f"{name} must be a number in [{low}, {high}], got {value!r:.40}", param=name)
    return float(value)


def count(obj: Mapping[str, Any], name: str, default: int | None, low: int) -> int | None:
    value = obj.get(name)
    if value is None:
        return default
    if not _is_int(value) or value < low:
        raise ApiError(f"{name} must be an integer >= {low}, got {value!r:.40}", param=name)
    return int(value)


def flag(obj: Mapping[str, Any], name: str, default: bool) -> bool:
    value = obj.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ApiError(f"{name} must be true or false, got {value!r:.40}", param=name)
    return value


def token_ids(value: object, name: str, limits: RequestLimits) -> tuple[int, ...]:
    """A non-empty list of token ids inside the vocabulary."""
    if not isinstance(value, list) or not value or not all(_is_int(t) for t in value):
        raise ApiError(f"{name} must be a non-empty list of token ids", param=name)
    bad = [t for t in value if not 0 <= t < limits.vocab_size]
    if bad:
        raise ApiError(
            f"{name}: token id {bad[0]} is outside the vocabulary [0, {limits.vocab_size})",
            param=name,
        )
    return tuple(value)


def _prompt(value: object, limits: RequestLimits, codec: TextCodec | None) -> tuple[int, ...]:
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str | list):
        value = value[0]  # a batch of one prompt
    if isinstance(value, str):
        if codec is None:
            raise ApiError(
                "this model has no tokenizer: send the prompt as a list of token ids",
                param="prompt",
            )
        if not value:
            raise ApiError("prompt must not be empty", param="prompt")
        ids = token_ids(codec.encode(value), "prompt", limits)
    elif isinstance(value, list) and value and all(isinstance(p, str | list) for p in value):
        raise ApiError("one prompt per request (a batch of prompts is not served)", param="prompt")
    else:
        ids = token_ids(value, "prompt", limits)
    if len(ids) >= limits.max_context_len:
        raise ApiError(
            f"prompt has {len(ids)} tokens; the context holds {limits.max_context_len} "
            "(prompt and at least one new token)",
            param="prompt",
            code="context_length_exceeded",
        )
    return ids


def _stops(
    value: object, limits: RequestLimits, codec: TextCodec | None
) -> tuple[tuple[int, ...], ...]:
    if value is None:
        return ()
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or len(items) > MAX_STOPS:
        raise ApiError(
            f"stop must be a string or a list of at most {MAX_STOPS} strings or token-id lists",
            param="stop",
        )
    sequences = []
    for item in items:
        if isinstance(item, str):
            if codec is None:
                raise ApiError(
                    "this model has no tokenizer: give stop as lists of token ids", param="stop"
                )
            if not item:
                raise ApiError("a stop string must not be empty", param="stop")
            sequences.append(token_ids(codec.encode_plain(item), "stop", limits))
        else:
            sequences.append(token_ids(item, "stop", limits))
    return tuple(sequences)


def request_grammar(
    obj: Mapping[str, Any], limits: RequestLimits
) -> tuple[Grammar | None, str | None]:
    """The request's grammar: ``grammar`` (the extension) or a constraining ``response_format``;
    and the field that gave it."""
    raw, fmt = obj.get("grammar"), obj.get("response_format")
    grammar = None if fmt is None else _response_format(fmt)
    if raw is not None:
        if grammar is not None:
            raise ApiError(
                "grammar and a constraining response_format were both given; give one",
                param="grammar",
            )
        try:
            grammar = Grammar.from_json(raw)
        except ValueError as exc:
            raise ApiError(f"grammar: {exc}", param="grammar") from None
    field = None if grammar is None else "grammar" if raw is not None else "response_format"
    if field is not None and limits.grammar_vocabulary is None:
        raise ApiError(
            "this model's vocabulary is not known as bytes, so it serves no grammar",
            param=field,
            code="unsupported_value",
        )
    return grammar, field


def _response_format(fmt: object) -> Grammar | None:
    """OpenAI's ``response_format``: None for text, else the grammar it asks for."""
    kind = fmt.get("type") if isinstance(fmt, Mapping) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return Grammar.json_schema({"type": "object"})
    spec = fmt.get("json_schema") if isinstance(fmt, Mapping) else None
    schema = spec.get("schema") if isinstance(spec, Mapping) else None
    if kind == "json_schema" and isinstance(schema, Mapping):
        return Grammar.json_schema(schema)
    raise ApiError(
        'response_format must be {"type": "text"}, {"type": "json_object"} or {"type": '
        f'"json_schema", "json_schema": {{"schema": {{...}}}}}}, got {fmt!r:.80}',
        param="response_format",
    )


def check_known(
    obj: Mapping[str, Any],
    model: str,
    *,
    fields: frozenset[str] = COMPLETION_FIELDS,
    at_default: Mapping[str, tuple[object, ...]] = AT_DEFAULT,
    required: str = "prompt",
) -> None:
    """Refuse unknown fields, fields not at their only value, a missing ``model`` or
    ``required`` field, another model's name."""
    unknown = sorted(set(obj) - fields)
    if unknown:
        raise ApiError(
            f"unrecognized request argument: {unknown[0]}",
            param=unknown[0],
            code="unknown_parameter",
        )
    for name, allowed in at_default.items():
        if name in obj and not any(obj[name] == a and type(obj[name]) is type(a) for a in allowed):
            raise ApiError(f"{name}={obj[name]!r:.40} is not supported", param=name)
    if "model" not in obj:
        raise ApiError("model is required", param="model", code="missing_required_parameter")
    if obj["model"] != model:
        raise ApiError(
            f"the model {obj['model']!r:.60} does not exist; this server serves {model!r}",
            param="model",
            code="model_not_found",
        )
    if required not in obj:
        raise ApiError(f"{required} is required", param=required, code="missing_required_parameter")
    if "user" in obj and not isinstance(obj["user"], str):
        raise ApiError("user must be a string", param="user")


def stream_options(obj: Mapping[str, Any], stream: bool) -> bool:
    """``stream_options.include_usage`` (only with ``stream``)."""
    options = obj.get("stream_options")
    if options is None:
        return False
    if not stream:
        raise ApiError("stream_options is only allowed with stream: true", param="stream_options")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise ApiError("stream_options takes include_usage only", param="stream_options")
    return flag(options, "include_usage", False)


def parse_completion(
    body: bytes, *, model: str, limits: RequestLimits, codec: TextCodec | None
) -> CompletionRequest:
    """The checked request of ``body`` (module docstring).

    Raises:
        ApiError: the body is not a completion request this server serves; ``param`` names
            the field.
    """
    obj = _loads(body)
    check_known(obj, model)
    check_text(obj)
    prompt = _prompt(obj["prompt"], limits, codec)
    logprobs = obj.get("logprobs")
    if logprobs is not None and (not _is_int(logprobs) or not 0 <= logprobs <= MAX_TOP_LOGPROBS):
        raise ApiError(
            f"logprobs must be null or an integer in [0, {MAX_TOP_LOGPROBS}]: the chosen "
            "token's log-probability and that many most likely alternatives per token "
            f"(got {logprobs!r:.40})",
            param="logprobs",
        )
    grammar, grammar_field = request_grammar(obj, limits)
    sampling = sampling_params(
        obj,
        prompt,
        limits,
        codec,
        max_tokens_field="max_tokens",
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
    )
    stream = flag(obj, "stream", False)
    return CompletionRequest(
        prompt_ids=prompt,
        sampling=attrs.evolve(sampling, grammar=grammar),
        stream=stream,
        include_usage=stream_options(obj, stream),
        logprobs=logprobs is not None,
        stop_sequences=sampling.stop_sequences,
        grammar_field=grammar_field,
    )


def load_object(body: bytes) -> dict[str, Any]:
    """``body`` as a JSON object (``ApiError`` when it is not one)."""
    return _loads(body)


def sampling_params(
    obj: Mapping[str, Any],
    prompt: tuple[int, ...],
    limits: RequestLimits,
    codec: TextCodec | None,
    *,
    max_tokens_field: str,
    logprobs: bool,
    max_tokens: int | None = None,
    top_logprobs: int = 0,
) -> SamplingParams:
    """The sampling fields both endpoints share, checked (no grammar): ``max_tokens_field``
    gives the length cap unless ``max_tokens`` is given; ``speculative`` defaults to true;
    ``top_logprobs``: the alternatives per token (already checked by the endpoint)."""
    if max_tokens is None:
        max_tokens = count(obj, max_tokens_field, DEFAULT_MAX_TOKENS, 1)
    assert max_tokens is not None
    if len(prompt) + max_tokens > limits.max_context_len:
        raise ApiError(
            f"prompt ({len(prompt)} tokens) plus {max_tokens_field} ({max_tokens}) exceeds the "
            f"context of {limits.max_context_len}",
            param=max_tokens_field,
            code="context_length_exceeded",
        )
    seed = obj.get("seed")
    if seed is not None and (not _is_int(seed) or not 0 <= seed < MAX_SEED):
        raise ApiError(f"seed must be an integer in [0, 2^63), got {seed!r:.40}", param="seed")
    stop_ids = obj.get("stop_token_ids")
    stop_tokens = () if stop_ids is None else token_ids(stop_ids, "stop_token_ids", limits)
    stops = _stops(obj.get("stop"), limits, codec)
    min_tokens = count(obj, "min_tokens", 0, 0)
    assert min_tokens is not None
    if min_tokens > max_tokens:
        raise ApiError(
            f"min_tokens ({min_tokens}) exceeds {max_tokens_field} ({max_tokens})",
            param="min_tokens",
        )
    return SamplingParams(
        max_new_tokens=max_tokens,
        temperature=_number(obj, "temperature", 1.0, 0.0, 100.0),
        top_p=_number(obj, "top_p", 1.0, 1e-9, 1.0),
        top_k=count(obj, "top_k", None, 1),
        seed=seed,
        stop_sequences=stops,
        stop_token_ids=stop_tokens,
        ignore_eos=flag(obj, "ignore_eos", False),
        frequency_penalty=_number(obj, "frequency_penalty", 0.0, -2.0, 2.0),
        presence_penalty=_number(obj, "presence_penalty", 0.0, -2.0, 2.0),
        repetition_penalty=_number(obj, "repetition_penalty", 1.0, 1e-6, 100.0),
        min_new_tokens=min_tokens,
        speculative=flag(obj, "speculative", True),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
    )


def refusal(
    error: InvalidRequest,
    request: CompletionRequest | None = None,
    *,
    grammar_field: str | None = None,
    renamed: Mapping[str, str] | None = None,
) -> ApiError:
    """The 400 of a request the engine refused with ``error``: ``param`` is the request field
    that set the first engine field ``error`` names (`InvalidRequest.fields`), or None when it
    names none. The grammar's field is ``request``'s (or ``grammar_field``); ``renamed`` maps
    engine fields to another endpoint's request fields."""
    if request is not None:
        grammar_field = request.grammar_field
    names = {**_PARAMS, **(renamed or {})}
    for field in error.fields:
        param = grammar_field if field == "grammar" else names.get(field)
        if param is not None:
            return ApiError(str(error), param=param)
    return ApiError(str(error))
