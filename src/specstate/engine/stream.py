"""Streaming: each request's newly emitted tokens after every step, without polling requests.

``for event in stream(engine): ...`` steps the engine until it is idle and, after each step,
yields one `TokenEvent` per request that emitted tokens or ended in that step: the tokens it
emitted since its previous event, and, on its last event, its `FinishState`. Which requests
changed is found with one array comparison over the output table's lengths; only those are
touched. Tokens are yielded once each and exactly as ``Req.emitted_ids`` ends up (a request
that is retracted and re-admitted continues where it stopped; tokens past a stop or the cap
are never yielded). Requests can be submitted between events; the loop ends when the engine is
idle (or closed).

What has been yielded is recorded by the engine (`Deliveries`, a capability of its round), not
by the iterator, so a stream can be left and resumed: calling ``stream(engine)`` again first
yields what the previous stream had not handed out yet, then steps on, and yields nothing twice.
``engine.step()`` calls made outside any stream lose nothing: their events wait for the next
stream. One stream reads an engine at a time: from its first step until it ends or is closed
(``it.close()``, or leaving a ``for`` loop over it with no other reference kept), a second
stream or a `StreamCursor` is refused with `UsageError`, since each event would reach only one
of them. Serving requests that arrive over time is a loop around it::

    while serving:
        for request in newly_arrived():
            engine.submit(...)
        for event in stream(engine):   # returns once the engine is idle
            deliver(event)
        wait_for_requests()

After `Engine.close`, a stream yields what is still undelivered (the requests that close ended,
with `FinishReason.ABORT`) and stops; once nothing is left, ``stream(engine)`` raises
`UsageError` (a serving loop around it stops instead of spinning on empty streams).
"""

from __future__ import annotations

from collections.abc import Generator, Iterator

import attrs

from specstate.core.errors import InvalidConfig, UsageError
from specstate.core.status import FinishState
from specstate.engine.engine import Engine

__all__ = ["StreamCursor", "TokenEvent", "stream"]


@attrs.frozen
class TokenEvent:
    """New tokens of one request after one step, and its finish on its last event.

    Attributes:
        request_id: the request.
        tokens: output tokens it emitted since its previous event (may be empty on the last).
        finish: how it ended, on its last event; None before.
    """

    request_id: str
    tokens: tuple[int, ...]
    finish: FinishState | None = None


class StreamCursor:
    """One step at a time of what `stream` yields, for a driver that works between steps.

    A driver that must do other work between steps (`specstate.serving.AsyncEngine`) holds a
    cursor: `step` steps the engine once and returns the events that are due, from the same
    engine-side record `stream` reads (`Deliveries`). The cursor is the engine's one reader
    until `close`: a stream meanwhile is refused. Only the engine's driving thread may call it.

    Raises:
        UsageError: a stream (or another cursor) reads the engine.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        engine.deliveries.start()
        self._claim = engine.deliveries.claim("a StreamCursor")

    def close(self) -> None:
        """Stop reading: a stream or another cursor may read the engine now. Idempotent."""
        self._engine.deliveries.release(self._claim)

    def step(self) -> list[TokenEvent]:
        """One `Engine.step`, then every event due (tokens emitted, requests ended)."""
        self._engine.step()
        return self.due()

    def due(self) -> list[TokenEvent]:
        """The events not handed out yet (after `Engine.close`: the requests it ended)."""
        return list(_due(self._engine))


def _due(engine: Engine) -> Iterator[TokenEvent]:
    deliveries = engine.deliveries
    while (delivery := deliveries.pop()) is not None:  # marked delivered as it is yielded
        req, tokens, finish = delivery
        yield TokenEvent(req.request_id, tokens, finish)


def stream(engine: Engine, *, max_steps: int = 100_000) -> Generator[TokenEvent, None, None]:
    """Step ``engine`` until idle, yielding every request's new tokens (module docstring).

    Raises:
        UsageError: at once, when the engine is closed and nothing is left to deliver; at the
            first step, when another stream or a `StreamCursor` is live.
        InvalidConfig: the engine is not idle after ``max_steps`` steps of this stream.
    """
    if engine.is_closed and not engine.deliveries.has_due():
        raise UsageError(
            "stream(engine) on a closed engine: every event was delivered (nothing can follow)"
        )
    return _stream(engine, max_steps)


def _stream(engine: Engine, max_steps: int) -> Generator[TokenEvent, None, None]:
    deliveries = engine.deliveries
    deliveries.start()
    claim = deliveries.claim("a stream(engine) iterator")
    try:
        steps = 0
        while True:
            yield from _due(engine)
            if engine.is_closed or engine.is_idle:
                return
            if steps == max_steps:
                raise InvalidConfig(f"engine not idle after {max_steps} steps")
            engine.step()
            steps += 1
    finally:  # ended, closed, or collected: the next stream may read
        deliveries.release(claim)
