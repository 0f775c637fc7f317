"""`BackgroundServer`: an ASGI app served by uvicorn on a thread of its own, on a free port.

For tests, benchmarks and notebooks: the server runs beside the caller's code, on
``127.0.0.1`` and a port the OS picks (or the one given), and stops on `close` (or at the end
of a ``with`` block), running the app's shutdown (its lifespan) first. Given the `AsyncEngine`
the app serves (``front=``), `close` shuts down as ``specstate serve`` does on Ctrl-C
(`specstate.serving.uvicorn_server`): the live requests end first (``finish_reason``
``"abort"``), so it returns within `SHUTDOWN_BOUND_S` even with streams open; without it, the
open responses get `RESPONSE_GRACE_S` to finish and are then cancelled. Needs the ``serve``
extra (uvicorn).
"""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import TYPE_CHECKING, Any

from specstate.core.errors import UsageError

if TYPE_CHECKING:
    from specstate.serving.async_engine import AsyncEngine

__all__ = ["BackgroundServer"]


class BackgroundServer:
    """Serve ``app`` with uvicorn on a daemon thread (module docstring).

    Args:
        app: an ASGI application.
        front: the front door ``app`` serves, if any: `close` ends its live requests first.
        host: the address to bind.
        port: the port; 0 lets the OS pick a free one (`url` says which).
        startup_timeout_s: how long `start` waits for the server to accept connections.
    """

    def __init__(
        self,
        app: Any,
        *,
        front: AsyncEngine | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        startup_timeout_s: float = 60.0,
    ) -> None:
        import uvicorn

        from specstate.serving.uvicorn_server import (
            RESPONSE_GRACE_S,
            SHUTDOWN_BOUND_S,
            FrontDoorServer,
        )

        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self._host, self._port = self._socket.getsockname()[:2]
        config = uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            lifespan="on",
            timeout_graceful_shutdown=RESPONSE_GRACE_S,
        )
        self._server = uvicorn.Server(config) if front is None else FrontDoorServer(config, front)
        self._stop_timeout = max(startup_timeout_s, float(SHUTDOWN_BOUND_S))
        self._thread = threading.Thread(
            target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True
        )
        self._timeout = startup_timeout_s
        self._started = False

    @property
    def url(self) -> str:
        """``http://HOST:PORT`` of the server."""
        return f"http://{self._host}:{self._port}"

    def start(self) -> BackgroundServer:
        """Start serving; return once the server accepts connections.

        Raises:
            UsageError: started twice, or the server did not come up in time.
        """
        if self._started:
            raise UsageError("BackgroundServer.start() twice")
        self._started = True
        self._thread.start()
        deadline = time.monotonic() + self._timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.close()
                raise UsageError(f"the server at {self.url} did not start")
            time.sleep(0.01)
        return self

    def close(self) -> None:
        """Stop serving (the app's shutdown runs first) and wait for the thread (module
        docstring: with ``front``, within `SHUTDOWN_BOUND_S`)."""
        self._server.should_exit = True
        if self._thread.is_alive():
            self._thread.join(self._stop_timeout)
        self._socket.close()

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()
