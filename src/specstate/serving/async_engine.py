"""`AsyncEngine`: the asyncio front door of one `Engine`, which a thread of its own drives.

An `Engine` is driven by one thread; a server is asynchronous. `AsyncEngine` owns the engine
and a driver thread (`specstate.serving.driver`), the only thread that calls it::

    any event loop, any thread                     the driver thread (owns the Engine)
    ---------------------------                    -----------------------------------
    generate() / submit()  -- Submit ------->      Inbox (one condition; sleeps when idle)
    stream closed / task cancelled -- Cancel ->      commands applied between two steps
    abort(), snapshot(), read(), close() ----->      Engine.step() -> this step's TokenEvents
    RequestStream queue  <--- call_soon_threadsafe  one hand-off per event loop per step

Requests are validated by `Engine.submit` on the driver: `submit` raises its `InvalidRequest`
in the caller. Backpressure: at most ``max_waiting`` requests wait for admission; one more is
refused with `QueueFull`. A worker failure ends only its batch's requests, whose final events
carry `FinishReason.ERROR`. An engine that can no longer step (an exception out of
`Engine.step`, a forward that timed out) ends every open stream with `EngineUnavailable` and
reports unhealthy (`is_healthy`, `failure`) instead of hanging.

Invariant: every request accepted by `submit` gets exactly one end (its final event or
`EngineUnavailable`); a stream closed before its end has its request aborted, and so its KV
released, by the driver at its next turn (the end of the current step at the latest).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from types import TracebackType
from typing import TypeVar

import attrs

from specstate.core.errors import EngineUnavailable, InvalidConfig, InvalidRequest, UsageError
from specstate.core.params import SamplingParams
from specstate.engine.config import EngineSnapshot
from specstate.engine.engine import Engine
from specstate.engine.stream import TokenEvent
from specstate.serving.driver import Driver, RemotePrefill
from specstate.serving.handoff_metrics import HandoffMetrics
from specstate.serving.inbox import (
    Abort,
    Cancel,
    Close,
    Inbox,
    InboxState,
    Read,
    Reply,
    Submit,
    WaitIdle,
)
from specstate.serving.request_metrics import RequestMetrics, RequestMetricsSnapshot
from specstate.serving.request_stream import RequestStream

__all__ = ["AsyncEngine", "AsyncEngineSnapshot"]

_T = TypeVar("_T")


@attrs.frozen(kw_only=True)
class AsyncEngineSnapshot:
    """The front door and its engine at one instant, between two steps (`AsyncEngine.snapshot`).

    Attributes:
        healthy: False once the engine can no longer step.
        failure: why, when not healthy; None otherwise.
        num_streams: accepted requests whose stream has not ended.
        num_waiting: requests waiting for admission (the bounded queue).
        num_submitted: requests the engine accepted so far.
        num_refused: requests it refused at submission (`InvalidRequest`).
        num_ended: accepted requests that ended (any finish reason).
        num_cancelled: requests aborted because their consumer left before the end.
        engine: the engine's own snapshot (`Engine.snapshot`); after a failure, the last one.
        requests: latencies and token counts of the requests served
            (`specstate.serving.request_metrics`).
    """

    healthy: bool
    failure: str | None
    num_streams: int
    num_waiting: int
    num_submitted: int
    num_refused: int
    num_ended: int
    num_cancelled: int
    engine: EngineSnapshot | None
    requests: RequestMetricsSnapshot


class AsyncEngine:
    """Serve one `Engine` to asyncio code from any thread or event loop (module docstring).

    ``async with AsyncEngine(engine) as front:`` closes it (aborting what still runs) on
    exit. The engine must not have been driven by any thread yet: from now on only the
    driver thread calls it.

    Args:
        engine: the engine to serve; the front door owns it and closes it.
        max_waiting: the most requests that may wait for admission at once; one more is
            refused with `QueueFull`.
        remote_prefill: a prefill process that prefills every request
            (`specstate.serving.driver.RemotePrefill`; ``specstate serve --prefill``): the
            engine is then its decode engine, and streams read tokens from it. Once the prefill
            side is gone, requests waiting on it end with `FinishReason.ERROR` and new ones
            are refused with `EngineUnavailable`.

    Raises:
        InvalidConfig: ``max_waiting`` is not an integer >= 1.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        max_waiting: int = 1024,
        remote_prefill: RemotePrefill | None = None,
    ) -> None:
        if isinstance(max_waiting, bool) or not isinstance(max_waiting, int) or max_waiting < 1:
            raise InvalidConfig(f"max_waiting must be an integer >= 1, got {max_waiting!r}")
        self._engine = engine
        self._inbox = Inbox(max_waiting)
        self._remote = remote_prefill
        self._driver = Driver(engine, self._inbox, remote_prefill)
        self._thread = threading.Thread(
            target=self._driver.run, name="specstate-driver", daemon=True
        )
        self._thread.start()

    # ------------------------------------------------------------ requests
    async def submit(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it; its stream of events.

        Use the stream in ``async with`` (or `RequestStream.aclose` it) so that a consumer
        that stops early aborts the request. Cancelling this call aborts the request too.

        Raises:
            InvalidRequest: the engine refused the request (nothing of it remains).
            QueueFull: ``max_waiting`` requests already wait; nothing was queued.
            UsageError: the front door is closing or closed.
            EngineUnavailable: the engine can no longer step.
        """
        if not isinstance(sampling, SamplingParams):  # refused here: the driver serves everyone
            raise InvalidRequest(
                f"request {request_id!r}: sampling must be a SamplingParams, got "
                f"{type(sampling).__name__}",
                fields=("sampling",),
            )
        try:
            prompt = tuple(prompt_ids)
        except TypeError:
            raise InvalidRequest(
                f"request {request_id!r}: prompt_ids must be a sequence of token ids, got "
                f"{type(prompt_ids).__name__}",
                fields=("prompt_ids",),
            ) from None
        stream = RequestStream(request_id, sampling, cancel=self._cancel)
        self._inbox.submit(Submit(stream, prompt))
        await stream.accepted()
        return stream

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling: SamplingParams
    ) -> AsyncIterator[TokenEvent]:
        """The request's events as they are emitted, the final one with its finish.

        Leaving the loop early, or cancelling the consuming task, aborts the request.

        Raises:
            InvalidRequest, QueueFull, UsageError, EngineUnavailable: as `submit`, on the
                first iteration; `EngineUnavailable` also later, if the engine fails.
        """
        stream = await self.submit(request_id, prompt_ids, sampling)
        async with stream:
            async for event in stream:
                yield event

    async def abort(self, request_id: str, reason: str = "aborted by user") -> bool:
        """Abort the live request ``request_id`` at the driver's next turn; whether it was live.

        Its stream still ends with a final event (`FinishReason.ABORT`).
        """
        reply = Reply.here()
        if not self._inbox.put(Abort(request_id, reason, reply)):
            return False
        result: bool = await reply.future
        return result

    def _cancel(self, stream: RequestStream) -> None:
        self._inbox.put(Cancel(stream))

    # -------------------------------------------------------------- state
    @property
    def is_healthy(self) -> bool:
        """False once the engine can no longer step (see `failure`)."""
        return self._driver.failure is None and (
            self._thread.is_alive() or self._inbox.state is InboxState.SHUT
        )

    @property
    def failure(self) -> EngineUnavailable | None:
        """Why the engine can no longer step (``__cause__`` is the failure); None if healthy."""
        gone = not self._thread.is_alive() and self._inbox.state is not InboxState.SHUT
        if self._driver.failure is None and gone:  # the thread vanished unannounced
            return EngineUnavailable("the driver thread is gone")
        return self._driver.failure

    @property
    def request_metrics(self) -> RequestMetrics:
        """The latencies and token counts of the requests served (written by the driver thread;
        `snapshot` reads them consistently, `register_request_metrics` exports them)."""
        return self._driver.request_metrics

    @property
    def prefill_failure(self) -> str | None:
        """Why the prefill process (``remote_prefill``) is unavailable, once it is; else None."""
        if self._remote is None or self._remote.failure is None:
            return None
        return f"the prefill side is unavailable: {self._remote.failure}"

    @property
    def handoff_metrics(self) -> HandoffMetrics | None:
        """The handoffs received from the prefill process (``remote_prefill``); None without."""
        return None if self._remote is None else self._remote.metrics

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, as of the driver's last turn (no driver round trip)."""
        return self._inbox.num_waiting

    async def read(self, fn: Callable[[Engine], _T]) -> _T:
        """``fn(engine)`` run on the driver thread between two steps; its value.

        For reads only (a snapshot, a metrics scrape): ``fn`` must not change the engine.

        Raises:
            UsageError: the front door is closed (`EngineUnavailable` if it failed); or ``fn``
                raised a `BaseException` that is no `Exception` (``__cause__``; handed over
                wrapped, so that a `KeyboardInterrupt` does not stop the caller's event loop).
                The driver goes on either way.
            Exception: whatever ``fn`` raised.
        """
        reply = Reply.here()
        if not self._inbox.put(Read(fn, reply)):
            raise self._driver.failure or UsageError("AsyncEngine.read() after close()")
        value: _T = await reply.future
        return value

    async def snapshot(self) -> AsyncEngineSnapshot:
        """The front door and its engine between two steps (after a stop: the last state)."""
        driver = self._driver

        def take(engine: Engine) -> AsyncEngineSnapshot:
            return self._snapshot(engine.snapshot())

        if self._inbox.state is not InboxState.SHUT:
            try:
                return await self.read(take)
            except (UsageError, EngineUnavailable):
                pass  # the driver stopped meanwhile
        return self._snapshot(driver.final_snapshot)

    def _snapshot(self, engine: EngineSnapshot | None) -> AsyncEngineSnapshot:
        counts = self._driver.counts()
        failure = self.failure
        return AsyncEngineSnapshot(
            healthy=failure is None,
            failure=None if failure is None else str(failure),
            num_streams=self._driver.num_streams,
            num_waiting=self._inbox.num_waiting,
            num_submitted=counts.num_submitted,
            num_refused=counts.num_refused,
            num_ended=counts.num_ended,
            num_cancelled=counts.num_cancelled,
            engine=engine,
            requests=self._driver.request_metrics.snapshot(),
        )

    async def wait_idle(self) -> None:
        """Return once the engine is idle and no command is queued (or the driver stopped)."""
        reply = Reply.here()
        if self._inbox.put(WaitIdle(reply)):
            await reply.future

    # ---------------------------------------------------------- lifecycle
    async def close(self, *, drain: bool = False, timeout_s: float | None = None) -> None:
        """Stop accepting requests, end the live ones, close the engine, stop the driver.

        ``drain=True`` lets every live request finish; ``drain=False`` aborts them (their
        streams end with `FinishReason.ABORT`). Either way the engine steps until idle, so
        every request's KV is released, before it closes. Idempotent; returns at once if
        the driver already stopped.

        Args:
            drain: finish the live requests instead of aborting them.
            timeout_s: wait at most this long for the driver to stop; None waits as long as
                it takes (a forward that never returns keeps the caller waiting).

        Raises:
            EngineUnavailable: the driver did not stop within ``timeout_s`` (a step still
                runs); the close stays asked for, and the driver, a daemon thread, carries it
                out when that step ends.
        """
        reply = Reply.here()
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            if self._inbox.put(Close(drain, reply)):
                await asyncio.wait_for(reply.future, timeout_s)
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            # NOTE: joined with the time left: a thread of the loop's executor that waits
            # forever would hold up the loop's own shutdown.
            await asyncio.to_thread(self._thread.join, left)
        except TimeoutError:
            pass  # reported below, as the join running out is
        if self._thread.is_alive():
            raise EngineUnavailable(
                f"AsyncEngine.close(): the driver did not stop within {timeout_s} s (a step "
                "still runs); it stops on its own when that step ends"
            )

    async def __aenter__(self) -> AsyncEngine:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close(drain=False)
