"""The recorder guard: a trace recorder handed to the engine is called inside the round, contained.

`Engine(trace=recorder)` records spans, rounds and events from inside `Engine.submit` and
`Engine.step`, after the round's state has changed. A recorder is user code when it is a
subclass of `TraceRecorder` (writing somewhere, aggregating, filtering); if one raised there,
the step would stop half way, after the round settled but before its ended requests were
reported. `ContainedRecorder` is what the engine calls instead: it hands every record to the
user's recorder and, at its first exception, stops recording (logged once, with the traceback,
on the ``specstate`` logger) — the trace then ends there, and the engine runs on unchanged.

Invariant: no call into the user's recorder raises out of the engine; after its first failure
the user's recorder is not called again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import Any

from specstate.engine.trace import TraceRecorder

__all__ = ["ContainedRecorder"]

_log = logging.getLogger("specstate")


class ContainedRecorder(TraceRecorder):
    """Forwards every record to ``inner``; its first exception stops the recording.

    Args:
        inner: the recorder the user gave the engine (it keeps everything recorded).
    """

    def __init__(self, inner: TraceRecorder) -> None:
        super().__init__()
        self._inner = inner
        self.failure: str | None = None  # what stopped the recording, if anything

    def span(self, track: str, name: str, batch: int, start_ns: int, end_ns: int) -> None:
        """`TraceRecorder.span` of the user's recorder, contained."""
        self._call("span", self._inner.span, track, name, batch, start_ns, end_ns)

    def publish(self, batch: int, at_ns: int) -> None:
        """`TraceRecorder.publish` of the user's recorder, contained."""
        self._call("publish", self._inner.publish, batch, at_ns)

    def round(
        self,
        *,
        batch: int,
        mode: str,
        verify: bool,
        at_ns: int,
        running: int,
        free_pages: int,
        rows: Mapping[str, Any],
    ) -> None:
        """`TraceRecorder.round` of the user's recorder, contained."""
        self._call(
            "round",
            self._inner.round,
            batch=batch,
            mode=mode,
            verify=verify,
            at_ns=at_ns,
            running=running,
            free_pages=free_pages,
            rows=rows,
        )

    def event(
        self, event: str, request_id: str, batch: int, reason: str = "", **fields: int
    ) -> None:
        """`TraceRecorder.event` of the user's recorder, contained."""
        self._call("event", self._inner.event, event, request_id, batch, reason, **fields)

    def _call(self, what: str, record: Callable[..., None], *args: Any, **kwargs: Any) -> None:
        if self.failure is not None:
            return
        try:
            record(*args, **kwargs)
        except Exception as exc:
            self.failure = f"{type(self._inner).__name__}.{what} raised {type(exc).__name__}: {exc}"
            _log.error("trace recording stopped: %s", self.failure, exc_info=exc)
