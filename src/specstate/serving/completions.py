"""One completion: a request's stream of engine events turned into OpenAI response objects.

Owner of a completion's output as the client sees it. The engine includes a matched stop
sequence in a request's output (like a stop token); OpenAI's clients expect it left out. So
while streaming, `ChoiceOutput` holds back the last ``longest stop - 1`` tokens (they might be
the start of a stop) and, when the request ends on a stop, cuts the matched sequence::

    engine output:   t1 t2 t3 s1 s2        (stop sequence s1 s2)
    streamed:        t1 | t2 | t3          (s1 held back until the end shows it is a stop)
    returned:        t1 t2 t3              finish_reason "stop"

Usage carries the speculative statistics of the request (``accepted_tokens``: delivered tokens
its verifies accepted, bonus included, so a verify that accepted past a stop or the length cap
counts only up to it; ``verifies``; ``mean_accept_length``; ``verified_drafts`` and
``accepted_drafts``; ``by_position``: per draft position, ``accepted`` of ``verified``).
"""

from __future__ import annotations

import time
from collections.abc import AsyncGenerator, Sequence
from typing import Any

import attrs

from specstate.core.request import TopLogprobs
from specstate.core.status import FinishReason, FinishState
from specstate.engine.stream import TokenEvent
from specstate.serving.openai_protocol import ApiError, CompletionRequest
from specstate.serving.request_stream import RequestStream
from specstate.serving.text import TextCodec, TextStream

__all__ = [
    "FILTERED_LOGPROB",
    "ChoiceOutput",
    "CompletionIds",
    "Piece",
    "collect_completion",
    "joined",
    "reported",
    "stream_completion",
    "token_text",
]

FILTERED_LOGPROB = -9999.0
"""The log-probability reported for an alternative the sampling filters removed (top-k /
top-p: ``-inf``, which JSON cannot carry)."""

FINISH_REASONS = {
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
}


@attrs.frozen
class Piece:
    """Output released to the client: token ids, their text, their log-probabilities."""

    token_ids: tuple[int, ...]
    text: str
    logprobs: tuple[float, ...] | None
    top_logprobs: tuple[TopLogprobs, ...] | None = None


def joined(pieces: Sequence[Piece], *, logprobs: bool, top_logprobs: bool) -> Piece:
    """``pieces`` as one piece (the whole output of a choice)."""
    lps = tops = None
    if logprobs:
        lps = tuple(lp for p in pieces for lp in (p.logprobs or ()))
    if top_logprobs:
        tops = tuple(top for p in pieces for top in (p.top_logprobs or ()))
    ids = tuple(t for p in pieces for t in p.token_ids)
    return Piece(ids, "".join(p.text for p in pieces), lps, tops)


def token_text(codec: TextCodec | None, token: int) -> str:
    """The text of one token (``token_id:N`` without a codec)."""
    return codec.decode([token]) if codec is not None else f"token_id:{token}"


def reported(logprob: float) -> float:
    """A log-probability as JSON carries it (`FILTERED_LOGPROB` for ``-inf``)."""
    return max(logprob, FILTERED_LOGPROB)


class ChoiceOutput:
    """What the client has been handed of one request's output (module docstring)."""

    def __init__(
        self,
        *,
        codec: TextCodec | None,
        stops: Sequence[Sequence[int]],
        logprobs: bool,
        top_logprobs: bool = False,
    ) -> None:
        self._stops = sorted((tuple(s) for s in stops), key=len, reverse=True)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._codec = codec
        self._text = None if codec is None else TextStream(codec)
        self._pending: list[int] = []
        self._pending_lp: list[float] | None = [] if logprobs else None
        self._pending_top: list[TopLogprobs] | None = [] if top_logprobs else None
        self.num_generated = 0  # tokens the engine emitted, a cut stop included

    def take(self, stream: RequestStream, event: TokenEvent) -> Piece:
        """`push` the event ``stream`` just yielded, with its log-probabilities."""
        tokens = event.tokens
        top = None
        if stream.top_logprobs is not None:
            top = stream.top_logprobs[len(stream.top_logprobs) - len(tokens) :]
        return self.push(tokens, new_logprobs(stream, tokens), event.finish, top)

    def push(
        self,
        tokens: Sequence[int],
        logprobs: Sequence[float] | None,
        finish: FinishState | None = None,
        top_logprobs: Sequence[TopLogprobs] | None = None,
    ) -> Piece:
        """Take one event's tokens and release what may be shown (module docstring).

        Before the end, all but the last ``longest stop - 1`` pending tokens; at the end
        (``finish``), all of them, less the matched stop sequence if the request ended on one.
        """
        self.num_generated += len(tokens)
        self._pending.extend(tokens)
        if self._pending_lp is not None:
            self._pending_lp.extend(logprobs or ())
        if self._pending_top is not None:
            self._pending_top.extend(top_logprobs or ())
        if finish is None:
            return self._release(max(len(self._pending) - self._hold, 0), final=False)
        keep = len(self._pending)
        if finish.reason is FinishReason.STOP:
            # The last event carries the stop's last token and ``hold`` tokens stay pending
            # before it, so a matched sequence lies whole inside the pending tokens.
            for stop in self._stops:  # longest first
                if tuple(self._pending[-len(stop) :]) == stop:
                    keep -= len(stop)
                    break
        return self._release(keep, final=True)

    def _release(self, count: int, *, final: bool) -> Piece:
        ids, self._pending = self._pending[:count], self._pending[count:]
        lps = None
        if self._pending_lp is not None:
            lps, self._pending_lp = tuple(self._pending_lp[:count]), self._pending_lp[count:]
        tops = None
        if self._pending_top is not None:
            tops = tuple(self._pending_top[:count])
            self._pending_top = self._pending_top[count:]
        text = ""
        if self._text is not None:
            text = self._text.push(ids) + (self._text.flush() if final else "")
        return Piece(tuple(ids), text, lps, tops)

    def logprobs_body(self, piece: Piece) -> dict[str, object] | None:
        """OpenAI's ``logprobs`` object for ``piece`` (None when not asked for): with top
        logprobs, per token a dict of the alternatives' texts to their log-probabilities (two
        alternatives with the same text keep the likelier, as a dict must)."""
        if piece.logprobs is None:
            return None
        codec = self._codec
        tokens = [token_text(codec, t) for t in piece.token_ids]
        offsets, at = [], 0
        for token in tokens:
            offsets.append(at)
            at += len(token)
        top: list[dict[str, float]] | None = None
        if piece.top_logprobs is not None:
            top = []
            for pairs in piece.top_logprobs:
                alternatives: dict[str, float] = {}
                for t, value in pairs:  # most likely first: setdefault keeps the likelier
                    alternatives.setdefault(token_text(codec, t), reported(value))
                top.append(alternatives)
        return {
            "tokens": tokens,
            "token_logprobs": list(piece.logprobs),
            "top_logprobs": top,
            "text_offset": offsets,
        }


def speculation_body(stream: RequestStream) -> dict[str, Any]:
    """The speculative statistics of an ended request (module docstring)."""
    accept_lengths = stream.accept_lengths
    verifies = len(accept_lengths)
    accepted = sum(accept_lengths)
    return {
        "accepted_tokens": accepted,
        "verifies": verifies,
        "mean_accept_length": round(accepted / verifies, 4) if verifies else 0.0,
        "verified_drafts": sum(v for _, v in stream.draft_acceptance),
        "accepted_drafts": sum(a for a, _ in stream.draft_acceptance),
        "by_position": [{"accepted": a, "verified": v} for a, v in stream.draft_acceptance],
    }


def usage_body(prompt_tokens: int, generated: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's usage counts, with the prefix cache's share of the prompt."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": generated,
        "total_tokens": prompt_tokens + generated,
        # The prefix cache's share of the prompt (a re-admitted request's count may include
        # its earlier outputs, which OpenAI does not count as prompt).
        "prompt_tokens_details": {"cached_tokens": min(cached_tokens, prompt_tokens)},
    }


def _usage(prompt_tokens: int, generated: int, stream: RequestStream) -> dict[str, Any]:
    usage = usage_body(prompt_tokens, generated, stream.cached_tokens)
    return {**usage, "speculative": speculation_body(stream)}


def finish_error(finish: FinishState) -> ApiError:
    """The 500 of a request that ended with an error."""
    return ApiError(
        f"the request failed: {finish.detail}", status=500, kind="server_error", code="engine_error"
    )


@attrs.frozen(kw_only=True)
class CompletionIds:
    """The response's identity: its id, creation time (Unix seconds) and model name."""

    id: str
    model: str
    created: int = attrs.field(factory=lambda: int(time.time()))

    def wrap(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """A ``text_completion`` object with ``choices``."""
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def _choice(output: ChoiceOutput, piece: Piece, finish_reason: str | None) -> dict[str, Any]:
    return {
        "index": 0,
        "text": piece.text,
        "logprobs": output.logprobs_body(piece),
        "finish_reason": finish_reason,
        "token_ids": list(piece.token_ids),  # extension: the output as token ids
    }


async def collect_completion(
    stream: RequestStream, request: CompletionRequest, ids: CompletionIds, codec: TextCodec | None
) -> dict[str, Any]:
    """Consume ``stream`` to its end; the whole ``text_completion`` object.

    Raises:
        ApiError: the request ended with an error (HTTP 500).
    """
    output = _output(request, codec)
    parts: list[Piece] = []
    async with stream:
        async for event in stream:
            if event.finish is not None and event.finish.reason is FinishReason.ERROR:
                raise finish_error(event.finish)
            parts.append(output.take(stream, event))
    finish = stream.finish
    assert finish is not None
    whole = joined(parts, logprobs=request.logprobs, top_logprobs=request.sampling.top_logprobs > 0)
    usage = _usage(len(request.prompt_ids), output.num_generated, stream)
    return ids.wrap([_choice(output, whole, FINISH_REASONS[finish.reason])], usage=usage)


def _output(request: CompletionRequest, codec: TextCodec | None) -> ChoiceOutput:
    return ChoiceOutput(
        codec=codec,
        stops=request.stop_sequences,
        logprobs=request.logprobs,
        top_logprobs=request.sampling.top_logprobs > 0,
    )


def new_logprobs(stream: RequestStream, tokens: Sequence[int]) -> tuple[float, ...] | None:
    """The log-probabilities of the event just yielded (the last ``len(tokens)``)."""
    if stream.logprobs is None:
        return None
    return tuple(stream.logprobs[len(stream.logprobs) - len(tokens) :])


async def stream_completion(
    stream: RequestStream, request: CompletionRequest, ids: CompletionIds, codec: TextCodec | None
) -> AsyncGenerator[dict[str, Any], None]:
    """The chunks of a streamed completion: one per engine event with output, then the end.

    A request that ends with an error ends the stream with an error object instead.
    """
    output = _output(request, codec)
    async with stream:
        async for event in stream:
            finish = event.finish
            if finish is not None and finish.reason is FinishReason.ERROR:
                yield finish_error(finish).body()
                return
            piece = output.take(stream, event)
            if finish is not None:
                yield ids.wrap([_choice(output, piece, FINISH_REASONS[finish.reason])])
            elif piece.token_ids:
                yield ids.wrap([_choice(output, piece, None)])
    if request.include_usage:
        usage = _usage(len(request.prompt_ids), output.num_generated, stream)
        yield ids.wrap([], usage=usage)
