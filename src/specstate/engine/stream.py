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
Two streams advanced in turn share that record (each event goes to one of them), and
``engine.step()`` calls made outside any stream lose nothing: their events wait for the next
stream. Serving requests that arrive over time is a loop around it::

    while serving:
        for request in newly_arrived():
            engine.submit(...)
        for event in stream(engine):   # returns once the engine is idle
            deliver(event)
        wait_for_requests()

After `Engine.close`, a stream yields what is still undelivered (the requests that close ended,
with `FinishReason.ABORT`) and stops.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

from specstate.core.errors import InvalidConfig
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
    engine-side record `stream` reads (`Deliveries`), so a cursor and streams never hand out a
    token twice. Only the engine's driving thread may call it.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        engine.deliveries.start()

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


def stream(engine: Engine, *, max_steps: int = 100_000) -> Iterator[TokenEvent]:
    """Step ``engine`` until idle, yielding every request's new tokens (module docstring).

    Raises:
        InvalidConfig: the engine is not idle after ``max_steps`` steps of this stream.
    """
    engine.deliveries.start()
    steps = 0
    while True:
        yield from _due(engine)
        if engine.is_closed or engine.is_idle:
            return
        if steps == max_steps:
            raise InvalidConfig(f"engine not idle after {max_steps} steps")
        engine.step()
        steps += 1
