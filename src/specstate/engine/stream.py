"""Streaming: each request's newly emitted tokens after every step, without polling requests.

``for event in stream(engine): ...`` steps the engine until it is idle and, after each step,
yields one `TokenEvent` per request that emitted tokens or ended in that step: the tokens it
emitted since its previous event, and, on its last event, its `FinishState`. Which requests
changed is found with one array comparison over the output table's lengths; only those are
touched. Tokens are yielded once each and exactly as ``Req.emitted_ids`` ends up (a request
that is retracted and re-admitted continues where it stopped; tokens past a stop or the cap
are never yielded). Requests can be submitted between events; the loop ends when the engine is
idle.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import numpy as np

from specstate.core.errors import InvalidConfig
from specstate.core.request import FinishState, Req
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
    """The streaming state of one engine: which tokens of which live request were handed out.

    `step` steps the engine once and returns that step's events (see the module docstring);
    across calls each token is handed out once. `stream` is a loop over one cursor; a driver
    that must do other work between steps (`specstate.serving.AsyncEngine`) holds a cursor
    itself. Only the engine's driving thread may call `step`.
    """

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._sent: dict[Req, int] = {}  # tokens handed out, by request (hashes by identity)
        self._seen = engine.outputs.all_lengths()

    def step(self) -> list[TokenEvent]:
        """One `Engine.step`, then one event per request that emitted tokens or ended in it."""
        engine = self._engine
        report = engine.step()
        now = engine.outputs.all_lengths()
        changed = [engine.outputs.holder(int(s)) for s in np.flatnonzero(now != self._seen)]
        self._seen = now
        events = []
        for req in dict.fromkeys([*(r for r in changed if r is not None), *report.ended]):
            emitted = req.emitted_ids
            start = self._sent.get(req, 0)
            if len(emitted) > start or req.is_finished:
                self._sent[req] = len(emitted)
                events.append(TokenEvent(req.request_id, tuple(emitted[start:]), req.finish))
            if req.is_finished:
                self._sent.pop(req, None)
        return events


def stream(engine: Engine, *, max_steps: int = 100_000) -> Iterator[TokenEvent]:
    """Step ``engine`` until idle, yielding every request's new tokens (module docstring).

    Raises:
        InvalidConfig: the engine is not idle after ``max_steps`` steps.
    """
    cursor = StreamCursor(engine)
    for _ in range(max_steps):
        if engine.is_idle:
            return
        yield from cursor.step()
    raise InvalidConfig(f"engine not idle after {max_steps} steps")
