"""A chat completion: the streams of its ``n`` choices turned into OpenAI chat objects.

Owner of a chat completion's output as the client sees it: the assistant message of each choice
(its text cut at a matched stop as `ChoiceOutput` cuts it, its tool calls), the
``chat.completion`` object, or the ``chat.completion.chunk`` events of a stream (the choices'
chunks interleaved as their tokens arrive, each with its ``index``).

Tool calls. With ``tool_choice`` ``required`` or a named function the output is constrained to
one call, the JSON object ``{"name": ..., "arguments": {...}}`` (`ToolSpec.grammar`), so it is
a call by construction. With ``auto`` the model may call tools by writing, anywhere in its
text, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (`TOOL_CALL_OPEN`); the text
around the calls, as it is, is the content (none when it is only whitespace). A choice with
calls has ``finish_reason: "tool_calls"``, each call an id ``call_...``; a stream sends each
call whole, in one delta, once its choice ended (with ``auto`` the content streams up to the
first ``<tool_call>``). An output that is not a
call after all (a forced call cut by the length cap, tags around text that is not a call)
comes back as content.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import attrs

from specstate.core.status import FinishReason, FinishState
from specstate.serving.chat_protocol import ChatRequest, ToolSpec
from specstate.serving.completions import (
    FINISH_REASONS,
    ChoiceOutput,
    Piece,
    finish_error,
    joined,
    reported,
    speculation_body,
    token_text,
    usage_body,
)
from specstate.serving.openai_protocol import ApiError
from specstate.serving.request_stream import RequestStream
from specstate.serving.text import TextCodec

__all__ = ["TOOL_CALL_CLOSE", "TOOL_CALL_OPEN", "ChatIds", "collect_chat", "stream_chat"]

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_CALL = re.compile(re.escape(TOOL_CALL_OPEN) + r"(.*?)" + re.escape(TOOL_CALL_CLOSE), re.S)


@attrs.frozen(kw_only=True)
class ChatIds:
    """The response's identity: its id, creation time (Unix seconds) and model name."""

    id: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))

    def wrap(self, kind: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A ``chat.completion`` (or ``.chunk``) object with ``choices``."""
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def _call(obj: object, names: Sequence[str]) -> dict[str, Any] | None:
    """``{"name", "arguments"}`` of a tool in ``names`` as an OpenAI tool call, or None."""
    if not isinstance(obj, dict) or set(obj) != {"name", "arguments"}:
        return None
    if obj["name"] not in names or not isinstance(obj["arguments"], dict):
        return None
    arguments = json.dumps(obj["arguments"], ensure_ascii=False)
    function = {"name": obj["name"], "arguments": arguments}
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": function}


def parse_tool_calls(text: str, tools: ToolSpec) -> tuple[str | None, list[dict[str, Any]]]:
    """The content and the tool calls of an output (module docstring); no calls when the output
    is not one (forced) or any tagged call does not parse (auto)."""
    names = tools.names()
    if tools.is_forced:
        try:
            call = _call(json.loads(text), names)
        except ValueError:
            call = None
        return (text, []) if call is None else (None, [call])
    if tools.choice == "none" or TOOL_CALL_OPEN not in text:
        return text, []
    calls = []
    for match in _CALL.finditer(text):
        try:
            call = _call(json.loads(match.group(1)), names)
        except ValueError:
            call = None
        if call is None:
            return text, []
        calls.append(call)
    if not calls:
        return text, []
    content = _CALL.sub("", text)
    return (content if content.strip() else None), calls


def _token_logprob(codec: TextCodec | None, token: int, logprob: float) -> dict[str, Any]:
    """One token's entry: its text, log-probability and UTF-8 bytes."""
    text = token_text(codec, token)
    return {
        "token": text,
        "logprob": reported(logprob),
        "bytes": list(text.encode("utf-8", errors="replace")),
    }


def _logprobs(piece: Piece, codec: TextCodec | None) -> dict[str, Any] | None:
    """The chat ``logprobs`` object of ``piece`` (None when not asked for): per token its
    entry and its ``top_logprobs`` alternatives (most likely first; empty when none were
    asked for)."""
    if piece.logprobs is None:
        return None
    tops = piece.top_logprobs or ((),) * len(piece.token_ids)
    content = [
        {
            **_token_logprob(codec, token, logprob),
            "top_logprobs": [_token_logprob(codec, t, value) for t, value in top],
        }
        for token, logprob, top in zip(piece.token_ids, piece.logprobs, tops, strict=True)
    ]
    return {"content": content}


class _Choice:
    """One choice's stream and what of it the client has been handed."""

    def __init__(
        self, index: int, stream: RequestStream, request: ChatRequest, codec: TextCodec | None
    ) -> None:
        self.index = index
        self.stream = stream
        self.request = request
        self.codec = codec
        self.output = ChoiceOutput(
            codec=codec,
            stops=request.stop_sequences,
            logprobs=request.logprobs,
            top_logprobs=request.sampling.top_logprobs > 0,
        )
        self.pieces: list[Piece] = []

    def whole(self) -> Piece:
        return joined(
            self.pieces,
            logprobs=self.request.logprobs,
            top_logprobs=self.request.sampling.top_logprobs > 0,
        )

    def finish_reason(self, calls: list[dict[str, Any]]) -> str:
        finish = self.stream.finish
        assert finish is not None
        return "tool_calls" if calls else FINISH_REASONS[finish.reason]

    def extras(self) -> dict[str, Any]:
        """The extensions of an ended choice: its token ids, its speculation if asked."""
        extra: dict[str, Any] = {"token_ids": [t for p in self.pieces for t in p.token_ids]}
        if self.request.speculative_stats:
            extra["speculative"] = speculation_body(self.stream)
        return extra

    async def collect(self) -> dict[str, Any]:
        async with self.stream:
            async for event in self.stream:
                _check(event.finish)
                self.pieces.append(self.output.take(self.stream, event))
        whole = self.whole()
        content: str | None = whole.text
        calls: list[dict[str, Any]] = []
        if self.request.tools is not None:
            content, calls = parse_tool_calls(whole.text, self.request.tools)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        return {
            "index": self.index,
            "message": message,
            "logprobs": _logprobs(whole, self.codec),
            "finish_reason": self.finish_reason(calls),
            **self.extras(),
        }


def _check(finish: FinishState | None) -> None:
    if finish is not None and finish.reason is FinishReason.ERROR:
        raise finish_error(finish)


def _usage(request: ChatRequest, choices: Sequence[_Choice]) -> dict[str, Any]:
    """Usage of the request: the prompt once, the choices' tokens summed; the cached share of
    choice 0's prompt."""
    generated = sum(c.output.num_generated for c in choices)
    return usage_body(len(request.prompt_ids), generated, choices[0].stream.cached_tokens)


async def collect_chat(
    streams: Sequence[RequestStream], request: ChatRequest, ids: ChatIds, codec: TextCodec | None
) -> dict[str, Any]:
    """Consume the choices' streams to their end; the whole ``chat.completion`` object.

    Raises:
        ApiError: a choice ended with an error (HTTP 500).
    """
    choices = [_Choice(i, s, request, codec) for i, s in enumerate(streams)]
    tasks = [asyncio.ensure_future(c.collect()) for c in choices]
    try:
        bodies = await asyncio.gather(*tasks)
    finally:  # one choice failed (or the caller gave up): the others are aborted
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return ids.wrap("chat.completion", list(bodies), usage=_usage(request, choices))


def _held_back(text: str) -> int:
    """How many characters at the end of ``text`` may start a ``<tool_call>`` tag."""
    for size in range(min(len(TOOL_CALL_OPEN) - 1, len(text)), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0


class _ChoiceStream(_Choice):
    """A choice streamed: content deltas as its text arrives, tool calls at its end."""

    def __init__(
        self, index: int, stream: RequestStream, request: ChatRequest, codec: TextCodec | None
    ) -> None:
        super().__init__(index, stream, request, codec)
        tools = request.tools
        self._forced = tools is not None and tools.is_forced
        self._auto = tools is not None and tools.choice == "auto"
        self._text = ""  # all text released by the output
        self._sent = 0  # characters of it sent as content
        self._open = True  # no <tool_call> seen yet (auto)

    def _chunk(
        self, delta: dict[str, Any], finish: str | None, piece: Piece | None
    ) -> dict[str, Any]:
        logprobs = None if piece is None else _logprobs(piece, self.codec)
        return {"index": self.index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def _content_delta(self, final: bool) -> str:
        """The content that may be sent now (module docstring)."""
        if self._forced:
            return ""
        upto = len(self._text)
        if self._auto and self._open:
            at = self._text.find(TOOL_CALL_OPEN, self._sent)
            if at >= 0:
                self._open = False
                upto = at
            elif not final:
                upto -= _held_back(self._text)
        elif self._auto:
            upto = self._sent
        delta = self._text[self._sent : upto]
        self._sent = max(self._sent, upto)
        return delta

    async def chunks(self) -> AsyncGenerator[dict[str, Any], None]:
        yield self._chunk({"role": "assistant", "content": ""}, None, None)
        async with self.stream:
            async for event in self.stream:
                _check(event.finish)
                piece = self.output.take(self.stream, event)
                self.pieces.append(piece)
                self._text += piece.text
                delta = self._content_delta(final=event.finish is not None)
                if delta or (piece.logprobs and not self._forced):
                    yield self._chunk({"content": delta}, None, piece)
        async for chunk in self._end():
            yield chunk

    async def _end(self) -> AsyncGenerator[dict[str, Any], None]:
        calls: list[dict[str, Any]] = []
        content: str | None = self._text
        if self.request.tools is not None:
            content, calls = parse_tool_calls(self._text, self.request.tools)
        sent = self._text[: self._sent]
        rest = ""
        if not calls:
            rest = self._text[self._sent :]
        elif content is not None and content.startswith(sent):
            rest = content[len(sent) :]
        if rest:
            yield self._chunk({"content": rest}, None, None)
        if calls:
            deltas = [{"index": i, **call} for i, call in enumerate(calls)]
            yield self._chunk({"tool_calls": deltas}, None, None)
        yield {**self._chunk({}, self.finish_reason(calls), None), **self.extras()}


async def _merged(
    sources: Sequence[AsyncGenerator[dict[str, Any], None]],
) -> AsyncGenerator[dict[str, Any], None]:
    """The items of ``sources`` as each produces them; an exception of one ends them all."""
    if len(sources) == 1:
        async with contextlib.aclosing(sources[0]) as only:
            async for item in only:
                yield item
        return
    queue: asyncio.Queue[tuple[dict[str, Any] | None, BaseException | None]] = asyncio.Queue()

    async def pump(source: AsyncGenerator[dict[str, Any], None]) -> None:
        try:
            async with contextlib.aclosing(source):
                async for item in source:
                    queue.put_nowait((item, None))
        except Exception as exc:
            queue.put_nowait((None, exc))
        finally:
            queue.put_nowait((None, None))

    tasks = [asyncio.ensure_future(pump(s)) for s in sources]
    try:
        remaining = len(tasks)
        while remaining:
            got, error = await queue.get()
            if error is not None:
                raise error
            if got is None:
                remaining -= 1
            else:
                yield got
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_chat(
    streams: Sequence[RequestStream], request: ChatRequest, ids: ChatIds, codec: TextCodec | None
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunks of a streamed chat completion (module docstring); a choice that ends with an
    error ends the stream with an error object instead."""
    choices = [_ChoiceStream(i, s, request, codec) for i, s in enumerate(streams)]
    merged = _merged([c.chunks() for c in choices])
    async with contextlib.aclosing(merged):
        try:
            async for chunk in merged:
                yield ids.wrap("chat.completion.chunk", [chunk])
        except ApiError as exc:  # a choice failed in the worker
            yield exc.body()
            return
    if request.include_usage:
        yield ids.wrap("chat.completion.chunk", [], usage=_usage(request, choices))
