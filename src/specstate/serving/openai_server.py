"""The OpenAI-compatible HTTP server of ``specstate serve``: Starlette routes over an `AsyncEngine`.

Needs the ``serve`` extra (``pip install 'specstate[serve]'``: Starlette, uvicorn,
prometheus_client); nothing else in specstate imports this module.

Routes:

* ``POST /v1/completions`` (`specstate.serving.openai_protocol` says what it accepts): the
  whole completion, or server-sent events (``data: {chunk}`` ... ``data: [DONE]``) with
  ``stream: true``. A client that disconnects has its request aborted (its KV released).
* ``POST /v1/chat/completions`` (`specstate.serving.chat_protocol` says what it accepts): the
  conversation rendered with the model's chat template, answered as a ``chat.completion`` or
  as ``chat.completion.chunk`` events; ``n`` choices are ``n`` engine requests
  (`specstate.serving.chat`).
* ``GET /v1/models``: the one model served.
* ``GET /health``: 200 ``{"status": "ok"}``, or 503 with the failure once the engine (or, with
  ``--prefill``, the prefill process) can no
  longer step.
* ``GET /metrics``: the engine's Prometheus metrics (`specstate.engine.metrics`) and the front
  door's request latencies and token counts (`specstate.serving.request_metrics`), scraped on
  the driver thread between two steps, from a registry of this app's own.

Errors are OpenAI's error object: 400 for a bad request (``param`` names the field), 404 (405
for a method a route does not take) for a route the server does not have, with the routes it
serves in the message and in a ``routes`` list beside the error, 429 when the waiting queue is
full, 503 when the engine is unavailable or closed, 500 when the request itself failed in the
worker. No input crashes the server: anything unexpected is a 500.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from specstate.core.errors import EngineUnavailable, InvalidRequest, QueueFull, UsageError
from specstate.core.params import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.serving.async_engine import AsyncEngine
from specstate.serving.chat import ChatIds, collect_chat, stream_chat
from specstate.serving.chat_protocol import ChatRequest, parse_chat
from specstate.serving.chat_template import ChatTemplate, load_chat_template
from specstate.serving.completions import CompletionIds, collect_completion, stream_completion
from specstate.serving.openai_protocol import ApiError, parse_completion, refusal
from specstate.serving.request_stream import RequestStream
from specstate.serving.text import TextCodec, load_codec

__all__ = ["DEFAULT_MAX_N", "ServedModel", "create_app"]

DEFAULT_MAX_N = 8
"""The most choices (``n``) a chat request may ask for, unless the app is told otherwise."""

_log = logging.getLogger("specstate")
_Handler = Callable[[Request], Awaitable[Response]]


@attrs.frozen(kw_only=True)
class ServedModel:
    """The model a server answers for.

    Attributes:
        name: its name in ``/v1/models`` and the ``model`` field requests must give.
        limits: its vocabulary, context and EOS ids (request checks).
        codec: text <-> ids, or None (prompts and stops as token ids only).
        chat_template: renders chat messages, or None (``/v1/chat/completions`` answers 400).
        created: Unix seconds, shown in ``/v1/models``.
    """

    name: str
    limits: RequestLimits
    codec: TextCodec | None = None
    chat_template: ChatTemplate | None = None
    created: int = attrs.field(factory=lambda: int(time.time()))

    @classmethod
    def from_checkpoint(
        cls, path: Path, limits: RequestLimits, *, name: str, chat_template: Path | None = None
    ) -> ServedModel:
        """The model of the checkpoint at ``path``: its codec found by `load_codec`, its chat
        template by `load_chat_template` (``chat_template``, a file, overrides it).

        Raises:
            InvalidConfig: a tokenizer or a chat template that cannot be loaded.
        """
        return cls(
            name=name,
            limits=limits,
            codec=load_codec(path),
            chat_template=load_chat_template(path, chat_template),
        )


def _unavailable(exc: Exception) -> ApiError:
    return ApiError(str(exc), status=503, kind="server_error", code="engine_unavailable")


def _json(body: dict[str, Any], status: int = 200) -> Response:
    # NOTE: ASCII JSON (``\u`` escapes), unlike JSONResponse: an error may quote what the
    # client sent, a lone surrogate included, which has no UTF-8 form.
    text = json.dumps(body, allow_nan=False)
    return Response(text, status_code=status, media_type="application/json")


def _sse(chunk: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


class _EventStream(StreamingResponse):
    """Server-sent events whose source is closed whatever ends the response.

    A disconnect cancels the response (ASGI < 2.4) or makes ``send`` raise (2.4): either way
    the events' generator is closed here, which aborts the request behind it.
    """

    def __init__(self, events: AsyncGenerator[bytes, None]) -> None:
        super().__init__(events, media_type="text/event-stream")
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()


async def _disconnected(request: Request) -> None:
    """Return when the client goes away (the body was read: only a disconnect comes next)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _Routes:
    """The route handlers of one app over one front door."""

    def __init__(self, front: AsyncEngine, model: ServedModel, max_n: int) -> None:
        self._front = front
        self._model = model
        self._max_n = max_n
        self._registry: Any = None
        self._prefix_cache: bool | None = None

    async def completions(self, request: Request) -> Response:
        model = self._model
        try:
            parsed = parse_completion(
                await request.body(), model=model.name, limits=model.limits, codec=model.codec
            )
            ids = CompletionIds(id=f"cmpl-{uuid.uuid4().hex}", model=model.name)
            stream = await self._submit(
                ids.id, parsed.prompt_ids, parsed.sampling, grammar_field=parsed.grammar_field
            )
        except ApiError as exc:
            return _json(exc.body(), exc.status)
        if parsed.stream:
            chunks = stream_completion(stream, parsed, ids, model.codec)
            return _EventStream(self._sse_events(chunks))
        work = collect_completion(stream, parsed, ids, model.codec)
        return await self._answer(request, work, [stream])

    async def chat(self, request: Request) -> Response:
        model = self._model
        try:
            parsed = parse_chat(
                await request.body(),
                model=model.name,
                limits=model.limits,
                codec=model.codec,
                template=model.chat_template,
                max_n=self._max_n,
            )
            ids = ChatIds(id=f"chatcmpl-{uuid.uuid4().hex}", model=model.name)
            streams = await self._submit_choices(ids.id, parsed)
        except ApiError as exc:
            return _json(exc.body(), exc.status)
        if parsed.stream:
            chunks = stream_chat(streams, parsed, ids, model.codec)
            return _EventStream(self._sse_events(chunks))
        work = collect_chat(streams, parsed, ids, model.codec)
        return await self._answer(request, work, streams)

    async def _submit_choices(self, rid: str, parsed: ChatRequest) -> list[RequestStream]:
        """Submit the request's choices; with ``n > 1`` and the prefix cache on, the prompt
        is prefilled first (a one-token request of its own), so every choice reads it from the
        cache instead of computing it again."""
        if parsed.n > 1 and await self._has_prefix_cache():
            warm = attrs.evolve(
                parsed.sampling,
                max_new_tokens=1,
                min_new_tokens=0,
                grammar=None,
                logprobs=False,
                top_logprobs=0,
            )
            stream = await self._submit(f"{rid}-prompt", parsed.prompt_ids, warm)
            async with stream:
                async for _ in stream:
                    pass
            await self._released(self._front)
        streams: list[RequestStream] = []
        renamed = {"max_new_tokens": parsed.max_tokens_field, "top_logprobs": "top_logprobs"}
        try:
            for i in range(parsed.n):
                sampling = parsed.choice_sampling(i)
                streams.append(
                    await self._submit(
                        f"{rid}-{i}",
                        parsed.prompt_ids,
                        sampling,
                        grammar_field=parsed.grammar_field,
                        renamed=renamed,
                    )
                )
        except BaseException:
            for stream in streams:  # the choices already running are aborted
                await stream.aclose()
            raise
        return streams

    @staticmethod
    async def _released(front: AsyncEngine) -> None:
        """Return once a request that just ended is released (its KV in the prefix cache):
        under overlap that is when the last batch launched before it ended has retired."""
        try:
            launched = await front.read(lambda e: e.num_launched)
            while not await front.read(lambda e: e.is_idle or e.num_retired >= launched):
                pass  # each read waits for the driver's next turn: one step
        except (EngineUnavailable, UsageError) as exc:
            raise _unavailable(exc) from None

    async def _has_prefix_cache(self) -> bool:
        if self._prefix_cache is None:
            try:
                self._prefix_cache = await self._front.read(lambda e: e.config.prefix_cache)
            except (EngineUnavailable, UsageError) as exc:
                raise _unavailable(exc) from None
        return self._prefix_cache

    async def _submit(
        self,
        rid: str,
        prompt_ids: tuple[int, ...],
        sampling: SamplingParams,
        *,
        grammar_field: str | None = None,
        renamed: dict[str, str] | None = None,
    ) -> RequestStream:
        try:
            return await self._front.submit(rid, prompt_ids, sampling)
        except InvalidRequest as exc:  # the engine's own checks (a grammar that does not compile)
            raise refusal(exc, grammar_field=grammar_field, renamed=renamed) from None
        except QueueFull as exc:
            raise ApiError(
                str(exc), status=429, kind="rate_limit_error", code="queue_full"
            ) from None
        except (EngineUnavailable, UsageError) as exc:
            raise _unavailable(exc) from None

    async def _answer(
        self,
        request: Request,
        body: Awaitable[dict[str, Any]],
        streams: list[RequestStream],
    ) -> Response:
        """``body``'s object, or nothing if the client leaves first (``streams`` aborted)."""
        work = asyncio.ensure_future(body)
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            done, _ = await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():  # the client left (or the server stops): abort the request
                work.cancel()
                for stream in streams:
                    await stream.aclose()
        if work not in done:
            return Response(status_code=499)  # nobody reads it
        try:
            return _json(work.result())
        except ApiError as exc:
            return _json(exc.body(), exc.status)
        except EngineUnavailable as exc:
            error = _unavailable(exc)
            return _json(error.body(), error.status)

    async def _sse_events(
        self, chunks: AsyncGenerator[dict[str, Any], None]
    ) -> AsyncGenerator[bytes, None]:
        async with contextlib.aclosing(chunks):
            try:
                async for chunk in chunks:
                    yield _sse(chunk)
            except EngineUnavailable as exc:
                yield _sse(_unavailable(exc).body())
        yield b"data: [DONE]\n\n"

    async def models(self, request: Request) -> Response:
        model = self._model
        card = {"id": model.name, "object": "model", "created": model.created}
        return _json({"object": "list", "data": [{**card, "owned_by": "specstate"}]})

    async def health(self, request: Request) -> Response:
        failure = self._front.failure or self._front.prefill_failure
        if failure is None:
            return _json({"status": "ok"})
        return _json({"status": "unhealthy", "error": str(failure)}, 503)

    async def metrics(self, request: Request) -> Response:
        try:
            text = await self._front.read(self._scrape)
        except (EngineUnavailable, UsageError) as exc:
            error = _unavailable(exc)
            return _json(error.body(), error.status)
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    def _scrape(self, engine: Engine) -> bytes:
        """On the driver thread: the exposition of this app's registry (made on first use)."""
        from prometheus_client import CollectorRegistry, generate_latest

        from specstate.engine.metrics import register_metrics
        from specstate.serving.request_metrics import register_request_metrics

        if self._registry is None:
            self._registry = CollectorRegistry()
            register_metrics(engine, self._registry)
            register_request_metrics(self._front, self._registry)
            handoffs = self._front.handoff_metrics
            if handoffs is not None:  # a decode engine served by a prefill process
                from specstate.serving.handoff_metrics import register_handoff_metrics

                register_handoff_metrics(handoffs, self._registry)
        exposition: bytes = generate_latest(self._registry)
        return exposition


def _guarded(handler: _Handler) -> _Handler:
    """``handler`` with any unexpected exception answered as a 500 error object (logged)."""

    async def guarded(request: Request) -> Response:
        try:
            return await handler(request)
        except Exception:
            _log.exception("specstate serve: %s %s failed", request.method, request.url.path)
            error = ApiError("internal server error", status=500, kind="server_error", code=None)
            return _json(error.body(), 500)

    return guarded


def _http_errors(served: list[str]) -> Callable[[Request, Exception], Awaitable[Response]]:
    """Starlette's HTTP errors as OpenAI's error object; a route this app does not have (404,
    or 405 for a method it does not take there) names the ``served`` routes and lists them."""

    async def http_error(request: Request, exc: Exception) -> Response:
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        if status not in (404, 405):
            error = ApiError(str(getattr(exc, "detail", exc)), status=status, code=None)
            return _json(error.body(), status)
        asked = f"{request.method} {request.url.path}"
        error = ApiError(
            f"this server has no route {asked}; it serves {', '.join(served)}",
            status=status,
            code="unknown_route",
        )
        return _json({**error.body(), "routes": served}, status)

    return http_error


def create_app(
    front: AsyncEngine,
    model: ServedModel,
    *,
    close_on_shutdown: bool = False,
    max_n: int = DEFAULT_MAX_N,
) -> Starlette:
    """The server's ASGI app over ``front`` (module docstring).

    Args:
        front: the front door the routes submit to.
        model: the model served.
        close_on_shutdown: close ``front`` (aborting what still runs) when the app shuts down;
            leave False when the caller owns ``front``.
        max_n: the most choices a chat request may ask for (``n``; more is a 400).
    """
    routes = _Routes(front, model, max_n)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            if close_on_shutdown:
                await front.close(drain=False)

    table = [
        Route("/v1/completions", _guarded(routes.completions), methods=["POST"]),
        Route("/v1/chat/completions", _guarded(routes.chat), methods=["POST"]),
        Route("/v1/models", _guarded(routes.models), methods=["GET"]),
        Route("/health", _guarded(routes.health), methods=["GET"]),
        Route("/metrics", _guarded(routes.metrics), methods=["GET"]),
    ]
    served = [f"{m} {r.path}" for r in table for m in sorted(r.methods or ()) if m != "HEAD"]
    return Starlette(
        routes=table,
        exception_handlers={HTTPException: _http_errors(served)},
        lifespan=lifespan,
    )
