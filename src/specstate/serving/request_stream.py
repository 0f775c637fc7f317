"""`RequestStream`: one request's tokens on its caller's event loop, as the driver emits them.

Owner of what the consumer has seen of one request: its events (a queue the driver fills
once per step through ``loop.call_soon_threadsafe``), its log-probabilities so far, and how it
ended. The driver touches a stream only through `RequestStream.deliver`, which runs on the
stream's own event loop; everything else runs there too, so a stream needs no lock.

Invariant: a stream yields each token once, in order, then ends exactly once: after its final
event (the one with a ``finish``; any reason, `FinishReason.ERROR` included) or by raising the
`EngineUnavailable` the driver ended it with. Closing a stream before its end (``aclose``, an
``async with`` block left early, a cancelled consumer) asks the driver to abort the request.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from types import TracebackType

import attrs

from specstate.core.params import SamplingParams
from specstate.core.request import TopLogprobs
from specstate.core.status import FinishState
from specstate.engine.stream import TokenEvent

__all__ = ["Accepted", "Ended", "RequestStream", "Update"]


@attrs.frozen
class Accepted:
    """The driver's answer to a submission: None, or why the engine refused it."""

    error: BaseException | None


@attrs.frozen
class Update:
    """One step's event of a request, its log-probabilities and, at the end, its acceptance
    and how many of its tokens the prefix cache supplied."""

    event: TokenEvent
    logprobs: tuple[float, ...] | None
    top_logprobs: tuple[TopLogprobs, ...] | None = None
    accept_lengths: tuple[int, ...] = ()
    cached_tokens: int = 0
    draft_acceptance: tuple[tuple[int, int], ...] = ()


@attrs.frozen
class Ended:
    """The stream ends with ``error`` (the engine can no longer step)."""

    error: BaseException


class RequestStream:
    """An async iterator of one request's `TokenEvent` s; `AsyncEngine.submit` makes one.

    ``async for event in stream`` yields the tokens emitted in each step, the last event with
    the request's `FinishState`; ``async with stream`` aborts the request if the block is left
    before the end. Made on, and used from, one event loop.

    Attributes:
        request_id: the request's id.
        sampling: its sampling parameters.
        loop: the event loop the stream lives on.
        finish: how the request ended, once the final event was yielded; None before.
        logprobs: with ``sampling.logprobs``, the log-probability of every token yielded so
            far (aligned with them); else None.
        top_logprobs: with ``sampling.top_logprobs``, the top alternatives of every token
            yielded so far (aligned with them, `Req.top_logprobs`); else None.
        accept_lengths: once ended, the accept length of every verify of the request, the
            last cut where the request ended (`Req.emitted_accept_lengths`): their sum counts
            only tokens this stream delivered.
        cached_tokens: once ended, the tokens whose KV the prefix cache supplied
            (`Req.cached_tokens`).
        draft_acceptance: once ended, per draft position ``(accepted, verified)``: in how
            many of the delivered verifies the draft at that position was verified, and in
            how many accepted (`Req.draft_acceptance`).
        num_tokens: tokens yielded so far.
    """

    def __init__(
        self,
        request_id: str,
        sampling: SamplingParams,
        *,
        cancel: Callable[[RequestStream], None],
    ) -> None:
        self.request_id = request_id
        self.sampling = sampling
        self.loop = asyncio.get_running_loop()
        self.finish: FinishState | None = None
        self.logprobs: list[float] | None = [] if sampling.logprobs else None
        self.top_logprobs: list[TopLogprobs] | None = [] if sampling.top_logprobs else None
        self.accept_lengths: tuple[int, ...] = ()
        self.cached_tokens = 0
        self.draft_acceptance: tuple[tuple[int, int], ...] = ()
        self.num_tokens = 0
        self._cancel = cancel
        self._accepted: asyncio.Future[None] = self.loop.create_future()
        # Items the consumer has not taken; a consumer that finds none waits on `_wake`. (Lighter
        # than an asyncio.Queue: an item already there is taken without suspending.)
        self._items: deque[Update | Ended] = deque()
        self._wake: asyncio.Future[None] | None = None
        self._ended = False
        self._closed = False

    # ---------------------------------------------------------- driver side
    def deliver(self, item: object) -> None:
        """On the stream's loop: take one item the driver routed here."""
        if isinstance(item, Accepted):
            if not self._accepted.done():
                if item.error is not None:
                    self._accepted.set_exception(item.error)
                else:
                    self._accepted.set_result(None)
        elif isinstance(item, Update | Ended):
            self._items.append(item)
            if self._wake is not None and not self._wake.done():
                self._wake.set_result(None)
        else:
            raise TypeError(f"RequestStream: unknown delivery {item!r}")

    async def accepted(self) -> None:
        """Wait for the engine to accept the request; raise why it refused it.

        A caller cancelled while waiting has the request aborted (if it was accepted).
        """
        try:
            await self._accepted
        except asyncio.CancelledError:
            self._close_early()
            raise

    # -------------------------------------------------------- consumer side
    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> TokenEvent:
        """The next event; StopAsyncIteration after the final one.

        Raises:
            EngineUnavailable: the engine can no longer step; the stream is over.
        """
        if self._ended or self._closed:
            raise StopAsyncIteration
        while not self._items:
            self._wake = self.loop.create_future()
            try:
                await self._wake
            finally:
                self._wake = None
        item = self._items.popleft()
        if isinstance(item, Ended):
            self._ended = True
            raise item.error
        event = item.event
        self.num_tokens += len(event.tokens)
        if self.logprobs is not None and item.logprobs is not None:
            self.logprobs.extend(item.logprobs)
        if self.top_logprobs is not None and item.top_logprobs is not None:
            self.top_logprobs.extend(item.top_logprobs)
        if event.finish is not None:
            self._ended = True
            self.finish = event.finish
            self.accept_lengths = item.accept_lengths
            self.cached_tokens = item.cached_tokens
            self.draft_acceptance = item.draft_acceptance
        return event

    @property
    def is_over(self) -> bool:
        """Whether the stream ended (its last event was yielded) or was closed."""
        return self._ended or self._closed

    async def aclose(self) -> None:
        """Stop consuming; a request that has not ended is aborted at the driver's next turn."""
        self._close_early()

    def _close_early(self) -> None:
        if not self._ended and not self._closed:
            self._closed = True
            self._cancel(self)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._close_early()
