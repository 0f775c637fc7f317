"""The output hand-off that ``specstate bench host --handoff`` times: an `AsyncEngine`'s own.

`StreamHandOff` owns what an `AsyncEngine` adds around `Engine.step` to hand a round's tokens to
its callers: a `Driver` (the driver thread's body) with one `RequestStream` per request, on an
asyncio event loop. `hand_off` is what the driver thread does after a step: the step's events
(`StreamCursor.due`), routed to each request's stream (``Driver._publish``), then one
``call_soon_threadsafe`` per event loop (``Driver._flush``). `consume` is the callers' side,
which in a server runs on the event loop's own thread: it delivers the items and lets each
stream's consumer take them; the bench runs it between rounds, untimed, as a peer's harness
leaves its detokenizer's side out.

NOTE: the bench steps the engine itself, so it calls the driver's per-step methods without the
driver thread's loop (``Driver.run``): the same code a served step runs, minus the inbox.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from specstate.core.params import SamplingParams
from specstate.core.request import Req
from specstate.engine.engine import Engine
from specstate.engine.stream import StreamCursor
from specstate.serving.driver import Driver
from specstate.serving.inbox import Inbox, Submit
from specstate.serving.request_stream import RequestStream

__all__ = ["StreamHandOff"]


class StreamHandOff:
    """An `AsyncEngine`'s hand-off of ``engine``'s events to request streams (module docstring).

    Owns an event loop until `close`; single-threaded: the bench calls everything.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._loop = asyncio.new_event_loop()
        self._driver = Driver(engine, Inbox(max_waiting=1 << 20))
        self._cursor = StreamCursor(engine)
        self._tasks: list[asyncio.Task[int]] = []

    def submit(self, request_id: str, prompt: Sequence[int], params: SamplingParams) -> Req:
        """Submit a request through the driver, with a stream and a consumer for it."""

        async def open_stream() -> RequestStream:
            return RequestStream(request_id, params, cancel=lambda stream: None)

        stream = self._loop.run_until_complete(open_stream())
        self._driver._apply(Submit(stream=stream, prompt_ids=prompt))
        self._tasks.append(self._loop.create_task(_consume(stream)))
        return self._engine.request(request_id)

    def hand_off(self) -> None:
        """After a step: its events routed to their streams, one hand-off per event loop."""
        fatal = self._driver._publish(self._cursor.due())
        self._driver._flush()
        if fatal is not None:
            raise fatal

    def consume(self) -> None:
        """The callers' side (untimed): deliver what was handed off; consumers take it."""
        for _ in range(2):  # the deliveries, then the consumers they woke
            self._loop.run_until_complete(asyncio.sleep(0))
        self._tasks = [t for t in self._tasks if not t.done()]

    def close(self) -> None:
        """Stop reading the engine; cancel the consumers and close the loop."""
        self._cursor.close()
        for task in self._tasks:
            task.cancel()
        if self._tasks:
            self._loop.run_until_complete(asyncio.gather(*self._tasks, return_exceptions=True))
        self._loop.close()


async def _consume(stream: RequestStream) -> int:
    """A caller reading its stream to the end; the tokens it read."""
    await stream.accepted()
    count = 0
    async for event in stream:
        count += len(event.tokens)
    return count
