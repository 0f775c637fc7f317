"""The OpenAI chat completions protocol: a request body checked into a prompt and engine terms.

Owner of what ``POST /v1/chat/completions`` accepts. `parse_chat` reads a body strictly, renders
its ``messages`` with the model's `ChatTemplate`, and refuses anything else with an `ApiError`
naming the field (``messages[1].content[0].type``, ``tools[0].function.parameters``, ...).

Accepted fields: ``model``, ``messages`` (roles ``system``, ``user``, ``assistant``, ``tool``;
``content`` a string or a list of ``{"type": "text", "text": ...}`` parts, joined; an assistant
message may carry ``tool_calls`` and no content; a tool message its ``tool_call_id``),
``max_completion_tokens`` (or the older ``max_tokens``; default: the rest of the context),
``temperature``, ``top_p``, ``seed``, ``stop``, ``stream``, ``stream_options.include_usage``,
``logprobs`` (true: the chosen tokens' log-probabilities), ``top_logprobs`` (with
``logprobs``: that many most likely alternatives per token, at most `MAX_TOP_LOGPROBS`, 20),
``n`` (at most the server's ``max_n``),
``frequency_penalty``, ``presence_penalty``, ``response_format``, ``tools``, ``tool_choice``,
``parallel_tool_calls``, ``user``, ``logit_bias`` (empty only), and the completions endpoint's
extensions (``speculative``, ``top_k``, ``min_tokens``, ``repetition_penalty``,
``stop_token_ids``, ``ignore_eos``, ``grammar``) plus ``speculative_stats`` (true: each choice
carries its speculation statistics).

The prompt is the rendered text's tokens: for a tokenizer without special tokens added (the
template writes them, as ``transformers``' ``apply_chat_template`` does); for a byte-level model
after its BOS id (bytes have no text for it).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from typing import Any, Final

import attrs

from specstate.core.params import MAX_TOP_LOGPROBS, RequestLimits, SamplingParams
from specstate.grammar.spec import Grammar
from specstate.serving.chat_template import ChatTemplate, TemplateRenderError
from specstate.serving.openai_protocol import (
    MAX_SEED,
    ApiError,
    check_known,
    check_text,
    count,
    flag,
    load_object,
    request_grammar,
    sampling_params,
    stream_options,
    token_ids,
)
from specstate.serving.text import TextCodec

__all__ = ["ChatRequest", "ToolSpec", "choice_seed", "parse_chat"]

"""The engine records the chosen token's log-probability only: no alternatives."""
ROLES: Final = ("system", "user", "assistant", "tool")
TOOL_CHOICES: Final = ("none", "auto", "required")
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JSON_TYPES: Final = frozenset(
    {"object", "array", "string", "number", "integer", "boolean", "null"}
)
_FIELDS: Final = frozenset(
    {
        "model",
        "messages",
        "max_tokens",
        "max_completion_tokens",
        "temperature",
        "top_p",
        "seed",
        "stop",
        "stream",
        "stream_options",
        "logprobs",
        "top_logprobs",
        "n",
        "frequency_penalty",
        "presence_penalty",
        "response_format",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "user",
        "logit_bias",
        # extensions
        "speculative",
        "speculative_stats",
        "top_k",
        "min_tokens",
        "repetition_penalty",
        "stop_token_ids",
        "ignore_eos",
        "grammar",
    }
)
_MESSAGE_FIELDS: Final = frozenset({"role", "content", "name", "tool_calls", "tool_call_id"})


@attrs.frozen(kw_only=True)
class ToolSpec:
    """The request's tools and how it may call them.

    Attributes:
        tools: the ``tools`` as sent (checked).
        choice: ``none``, ``auto``, ``required`` or ``named``.
        name: the function ``tool_choice`` names (``named`` only).
    """

    tools: tuple[Mapping[str, Any], ...]
    choice: str
    name: str | None = None

    @property
    def is_forced(self) -> bool:
        """The output must be a call (``required`` or a named function): a grammar says so."""
        return self.choice in ("required", "named")

    def names(self) -> tuple[str, ...]:
        """The functions' names, in order."""
        return tuple(str(t["function"]["name"]) for t in self.tools)

    def grammar(self) -> Grammar:
        """The JSON schema of one call ``{"name": ..., "arguments": {...}}`` of a tool the
        choice allows, as a grammar."""
        calls = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t["function"]["name"]},
                    "arguments": t["function"].get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
            if self.choice != "named" or t["function"]["name"] == self.name
        ]
        return Grammar.json_schema(calls[0] if len(calls) == 1 else {"anyOf": calls})


@attrs.frozen(kw_only=True)
class ChatRequest:
    """A checked chat completion request, in engine terms.

    Attributes:
        prompt_text: the rendered conversation.
        prompt_ids: its token ids.
        sampling: choice 0's sampling parameters (`choice_seed` gives the others' seeds).
        n: the number of choices.
        stream: answer with server-sent events.
        include_usage: (streaming) end with a chunk that carries the usage.
        logprobs: return the chosen tokens' log-probabilities.
        stop_sequences: the stops to cut from the returned output.
        grammar_field: the field that gave the grammar, or None.
        tools: the tools, or None without any.
        speculative_stats: each choice carries its speculation statistics.
        max_tokens_field: the field that gave the length cap (``max_completion_tokens`` or
            ``max_tokens``), for the engine's refusals.
    """

    prompt_text: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    n: int
    stream: bool
    include_usage: bool
    logprobs: bool
    stop_sequences: tuple[tuple[int, ...], ...]
    grammar_field: str | None
    tools: ToolSpec | None
    speculative_stats: bool
    max_tokens_field: str = "max_completion_tokens"

    def choice_sampling(self, index: int) -> SamplingParams:
        """The sampling parameters of choice ``index``: its own seed, derived from the
        request's (choice 0 keeps it)."""
        seed = self.sampling.seed
        if index == 0 or seed is None:
            return self.sampling
        return attrs.evolve(self.sampling, seed=choice_seed(seed, index))


def choice_seed(seed: int, index: int) -> int:
    """Choice ``index``'s seed of a request seeded ``seed`` (choice 0's is ``seed``)."""
    if index == 0:
        return seed
    digest = hashlib.blake2b(f"{seed}:{index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % MAX_SEED


def _text_content(value: object, where: str, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        raise ApiError(
            f"{where} must be a string or a list of text parts, got {value!r:.40}", param=where
        )
    texts = []
    for j, part in enumerate(value):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            raise ApiError(
                f"{where}[{j}].type must be 'text' (this model reads text only), got {kind!r:.40}",
                param=f"{where}[{j}].type",
            )
        if not isinstance(part.get("text"), str) or set(part) - {"type", "text"}:
            raise ApiError(
                f"{where}[{j}] must be {{'type': 'text', 'text': str}}", param=f"{where}[{j}]"
            )
        texts.append(part["text"])
    return "".join(texts)


def _tool_calls(value: object, where: str) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise ApiError(f"{where} must be a list of tool calls", param=where)
    calls = []
    for j, call in enumerate(value):
        fn = call.get("function") if isinstance(call, dict) else None
        ok = (
            isinstance(call, dict)
            and call.get("type", "function") == "function"
            and isinstance(call.get("id"), str)
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and isinstance(fn.get("arguments"), str)
        )
        if not ok:
            raise ApiError(
                f"{where}[{j}] must be {{'id': str, 'type': 'function', 'function': "
                "{'name': str, 'arguments': str}}",
                param=f"{where}[{j}]",
            )
        assert isinstance(call, dict) and isinstance(fn, dict)
        function = {"name": fn["name"], "arguments": fn["arguments"]}
        calls.append({"id": call["id"], "type": "function", "function": function})
    return calls


def _message(raw: object, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(raw, dict):
        raise ApiError(f"{where} must be an object", param=where)
    role = raw.get("role")
    if role not in ROLES:
        raise ApiError(
            f"{where}.role must be one of {list(ROLES)}, got {role!r:.40}", param=f"{where}.role"
        )
    unknown = sorted(set(raw) - _MESSAGE_FIELDS)
    if unknown:
        raise ApiError(
            f"{where}.{unknown[0]} is not a message field", param=f"{where}.{unknown[0]}"
        )
    has_calls = role == "assistant" and raw.get("tool_calls") is not None
    message: dict[str, Any] = {
        "role": role,
        "content": _text_content(raw.get("content"), f"{where}.content", optional=has_calls),
    }
    if raw.get("name") is not None:
        if not isinstance(raw["name"], str):
            raise ApiError(f"{where}.name must be a string", param=f"{where}.name")
        message["name"] = raw["name"]
    if "tool_calls" in raw and raw["tool_calls"] is not None:
        if role != "assistant":
            raise ApiError(
                f"{where}.tool_calls: only an assistant message has tool calls",
                param=f"{where}.tool_calls",
            )
        message["tool_calls"] = _tool_calls(raw["tool_calls"], f"{where}.tool_calls")
    if role == "tool":
        if not isinstance(raw.get("tool_call_id"), str):
            raise ApiError(
                f"{where}.tool_call_id: a tool message needs the id of the call it answers",
                param=f"{where}.tool_call_id",
            )
        message["tool_call_id"] = raw["tool_call_id"]
    elif "tool_call_id" in raw:
        raise ApiError(
            f"{where}.tool_call_id: only a tool message has one", param=f"{where}.tool_call_id"
        )
    return message


def _messages(value: object) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        raise ApiError("messages must be a non-empty list of messages", param="messages")
    return [_message(raw, i) for i, raw in enumerate(value)]


def _schema_problem(schema: object, depth: int = 0) -> str | None:
    """What makes ``schema`` no JSON schema a grammar can take, or None (a structural check:
    types, properties, required, items; the grammar compiler checks the rest)."""
    if isinstance(schema, bool):
        return None
    if not isinstance(schema, dict) or depth > 64:
        return "a schema must be a JSON object"
    kind = schema.get("type")
    kinds = kind if isinstance(kind, list) else [kind] if kind is not None else []
    bad = [k for k in kinds if k not in _JSON_TYPES]
    if bad:
        return f"type {bad[0]!r:.40} is not a JSON schema type"
    props = schema.get("properties", {})
    if not isinstance(props, dict):
        return "properties must be an object of schemas"
    required = schema.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        return "required must be a list of property names"
    subs = [*props.values()]
    if "items" in schema:
        subs.append(schema["items"])
    for key in ("anyOf", "oneOf", "allOf"):
        if key in schema:
            if not isinstance(schema[key], list):
                return f"{key} must be a list of schemas"
            subs += schema[key]
    for sub in subs:
        problem = _schema_problem(sub, depth + 1)
        if problem is not None:
            return problem
    return None


def _tools(obj: Mapping[str, Any]) -> ToolSpec | None:
    raw, choice = obj.get("tools"), obj.get("tool_choice")
    if raw is None:
        if choice is not None and choice != "none":
            raise ApiError("tool_choice needs tools", param="tool_choice")
        return None
    if not isinstance(raw, list) or not raw:
        raise ApiError("tools must be a non-empty list of functions", param="tools")
    tools = []
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(fn, dict):
            raise ApiError(
                f"{where} must be {{'type': 'function', 'function': {{...}}}}", param=where
            )
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise ApiError(
                f"{where}.function.name must be 1-64 of a-z, A-Z, 0-9, _ and -, got {name!r:.40}",
                param=f"{where}.function.name",
            )
        params = fn.get("parameters")
        problem = None if params is None else _schema_problem(params)
        if problem is None and params is not None and not isinstance(params, dict):
            problem = "parameters must be a JSON schema object"
        if problem is not None:
            raise ApiError(
                f"{where}.function.parameters is not a valid JSON schema: {problem}",
                param=f"{where}.function.parameters",
            )
        tools.append(tool)
    names = [t["function"]["name"] for t in tools]
    if len(set(names)) != len(names):
        raise ApiError("tools: two functions have the same name", param="tools")
    if choice is None:
        return ToolSpec(tools=tuple(tools), choice="auto")
    if choice in TOOL_CHOICES:
        return ToolSpec(tools=tuple(tools), choice=str(choice))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(choice, dict) or choice.get("type") != "function" or name not in names:
        raise ApiError(
            f"tool_choice must be one of {list(TOOL_CHOICES)} or {{'type': 'function', "
            f"'function': {{'name': ...}}}} naming one of {names}, got {choice!r:.80}",
            param="tool_choice",
        )
    return ToolSpec(tools=tuple(tools), choice="named", name=str(name))


def _prompt_ids(text: str, codec: TextCodec | None, limits: RequestLimits) -> tuple[int, ...]:
    if codec is None:
        raise ApiError(
            "this model has no tokenizer: chat needs text; use /v1/completions with token ids",
            param="messages",
        )
    ids = codec.encode(text) if codec.kind == "bytes" else codec.encode_plain(text)
    if not ids:
        raise ApiError("the chat template rendered an empty prompt", param="messages")
    prompt = token_ids(ids, "messages", limits)
    if len(prompt) >= limits.max_context_len:
        raise ApiError(
            f"the conversation renders to {len(prompt)} tokens; the context holds "
            f"{limits.max_context_len} (prompt and at least one new token)",
            param="messages",
            code="context_length_exceeded",
        )
    return prompt


def _render(
    template: ChatTemplate | None, messages: Sequence[Mapping[str, Any]], tools: ToolSpec | None
) -> str:
    if template is None:
        raise ApiError(
            "this model has no chat template (no chat_template.jinja, no chat_template in "
            "tokenizer_config.json): start the server with --chat-template FILE, or use "
            "/v1/completions",
            param="messages",
            code="no_chat_template",
        )
    shown = None if tools is None or tools.choice == "none" else tools.tools
    try:
        return template.render(messages, tools=shown, add_generation_prompt=True)
    except TemplateRenderError as exc:
        raise ApiError(
            f"the chat template failed on these messages: {exc}",
            param="messages",
            code="template_error",
        ) from None


def _counts(obj: Mapping[str, Any], max_n: int) -> tuple[int, bool, int]:
    """``n``, ``logprobs`` and ``top_logprobs``, checked."""
    n = count(obj, "n", 1, 1)
    assert n is not None
    if n > max_n:
        raise ApiError(f"n must be at most {max_n} (this server's --max-n), got {n}", param="n")
    logprobs = flag(obj, "logprobs", False)
    top = count(obj, "top_logprobs", 0, 0)
    assert top is not None
    if top > MAX_TOP_LOGPROBS:
        raise ApiError(
            f"top_logprobs must be at most {MAX_TOP_LOGPROBS} alternatives per token (got {top})",
            param="top_logprobs",
        )
    if "top_logprobs" in obj and obj["top_logprobs"] is not None and not logprobs:
        raise ApiError("top_logprobs needs logprobs: true", param="top_logprobs")
    return n, logprobs, top


def _grammar(
    obj: Mapping[str, Any], limits: RequestLimits, tools: ToolSpec | None
) -> tuple[Grammar | None, str | None]:
    grammar, field = request_grammar(obj, limits)
    if tools is None or not tools.is_forced:
        return grammar, field
    if grammar is not None:
        raise ApiError(
            f"tool_choice {tools.choice!r} constrains the output; {field} cannot too",
            param="tool_choice",
        )
    if limits.grammar_vocabulary is None:
        raise ApiError(
            "this model's vocabulary is not known as bytes, so it cannot force a tool call",
            param="tool_choice",
            code="unsupported_value",
        )
    return tools.grammar(), "tools"


def parse_chat(
    body: bytes,
    *,
    model: str,
    limits: RequestLimits,
    codec: TextCodec | None,
    template: ChatTemplate | None,
    max_n: int,
) -> ChatRequest:
    """The checked request of ``body`` (module docstring).

    Raises:
        ApiError: the body is not a chat request this server serves; ``param`` names the field.
    """
    obj = load_object(body)
    check_known(
        obj, model, fields=_FIELDS, at_default={"logit_bias": (None, {})}, required="messages"
    )
    check_text(obj, ("messages", "stop", "grammar", "response_format", "tools", "tool_choice"))
    messages = _messages(obj["messages"])
    tools = _tools(obj)
    flag(obj, "parallel_tool_calls", True)
    n, logprobs, top = _counts(obj, max_n)
    text = _render(template, messages, tools)
    prompt = _prompt_ids(text, codec, limits)
    field = "max_completion_tokens" if "max_completion_tokens" in obj else "max_tokens"
    cap = count(obj, field, limits.max_context_len - len(prompt), 1)
    grammar, grammar_field = _grammar(obj, limits, tools)
    sampling = sampling_params(
        obj,
        prompt,
        limits,
        codec,
        max_tokens_field=field,
        logprobs=logprobs,
        max_tokens=cap,
        top_logprobs=top,
    )
    stream = flag(obj, "stream", False)
    return ChatRequest(
        prompt_text=text,
        prompt_ids=prompt,
        sampling=attrs.evolve(sampling, grammar=grammar),
        n=n,
        stream=stream,
        include_usage=stream_options(obj, stream),
        logprobs=logprobs,
        stop_sequences=sampling.stop_sequences,
        grammar_field=grammar_field,
        tools=tools,
        speculative_stats=flag(obj, "speculative_stats", False),
        max_tokens_field=field,
    )
