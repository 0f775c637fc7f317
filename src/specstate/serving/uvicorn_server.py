"""`FrontDoorServer`: uvicorn serving an app over an `AsyncEngine`, whose shutdown ends the live
requests first, so that an interrupt stops the server within a bound.

uvicorn's own shutdown stops accepting connections and then waits for every open connection to
finish its response; only after that does the app's shutdown run. A stream with thousands of
tokens to go would hold the server up until it ended. This server begins its shutdown by
closing the front door without draining::

    Ctrl-C / SIGTERM   uvicorn sets should_exit; its main loop notices within 0.1 s
    shutdown           AsyncEngine.close(drain=False): every live request is aborted at the
                       driver's next turn (the end of the current step); its stream gets its
                       final event (FinishReason.ABORT): a streamed response sends its last
                       chunk (finish_reason "abort") and [DONE], a whole one returns what it had
                       ... at most ABORT_WAIT_S (a step that does not end is left behind)
                       uvicorn's shutdown: no new connections, open ones finish their response
                       ... at most RESPONSE_GRACE_S, then the rest are cancelled
    exit               SHUTDOWN_BOUND_S after the interrupt at the latest (interpreter exit aside)

A second Ctrl-C makes uvicorn skip the wait for the responses. Needs the ``serve`` extra.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from typing import Any, Final

import uvicorn

from specstate.core.errors import EngineUnavailable
from specstate.serving.async_engine import AsyncEngine

__all__ = [
    "ABORT_WAIT_S",
    "RESPONSE_GRACE_S",
    "SHUTDOWN_BOUND_S",
    "FrontDoorServer",
    "serve_front_door",
]

_log = logging.getLogger("specstate")

ABORT_WAIT_S: Final = 4.0
"""How long a shutdown waits for the front door to end its requests and stop (one step)."""
RESPONSE_GRACE_S: Final = 4
"""How long uvicorn then lets the open connections finish their responses (whole seconds)."""
SHUTDOWN_BOUND_S: Final = 10
"""docs/serving.md's bound from an interrupt to the exit: the two waits and a margin."""


class FrontDoorServer(uvicorn.Server):
    """A uvicorn server whose shutdown first closes ``front`` without draining (module
    docstring), so the live requests end before uvicorn waits for their responses.

    Args:
        config: uvicorn's configuration (`serve_front_door` sets its grace period).
        front: the front door the app serves.
    """

    def __init__(self, config: uvicorn.Config, front: AsyncEngine) -> None:
        super().__init__(config)
        self._front = front

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """End every live request (bounded by `ABORT_WAIT_S`), then uvicorn's shutdown."""
        try:
            await self._front.close(drain=False, timeout_s=ABORT_WAIT_S)
        except EngineUnavailable as exc:  # a step that does not end: go on without it
            _log.warning("specstate serve: %s", exc)
        await super().shutdown(sockets)


def serve_front_door(app: Any, front: AsyncEngine, *, host: str, port: int, log_level: str) -> None:
    """Serve ``app`` (an ASGI app over ``front``) on ``host:port`` until interrupted; on the
    interrupt, end the live requests and return within `SHUTDOWN_BOUND_S` (module docstring).
    The front door is closed on return (or left to a step that never ends)."""
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        timeout_graceful_shutdown=RESPONSE_GRACE_S,
    )
    # uvicorn raises the interrupt it held back once it has shut down: that is the end here.
    with contextlib.suppress(KeyboardInterrupt):
        FrontDoorServer(config, front).run()
