"""The inbox of an `AsyncEngine`: the gate through which any thread reaches its driver thread.

Owner of the queued commands, the admission state and the bound on waiting requests. Callers
(any thread, any event loop) put commands; the driver takes them all at once between two
steps, and sleeps on the inbox's condition while the engine is idle and nothing is queued, so
an idle front door costs no CPU.

Admission: OPEN accepts requests; CLOSING (a close was asked) refuses new requests with
`UsageError` but still carries every other command; SHUT (the driver stopped) refuses all.
A request is refused with `QueueFull` when the requests that wait for admission (submitted to
the inbox but not yet taken, plus those in the engine's waiting queue after the driver's last
turn) already number ``max_waiting``: nothing is queued, the caller may retry later.

Invariant: a command put while the inbox is not SHUT is taken by the driver exactly once, or
handed back to it by `shut` (which answers it), so no caller waits forever.
"""

from __future__ import annotations

import asyncio
import enum
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import attrs

from specstate.core.errors import EngineUnavailable, QueueFull, UsageError

if TYPE_CHECKING:
    from specstate.engine.engine import Engine
    from specstate.serving.request_stream import RequestStream

__all__ = [
    "Abort",
    "Cancel",
    "Close",
    "Inbox",
    "InboxState",
    "Read",
    "Reply",
    "Submit",
    "WaitIdle",
]


@attrs.frozen(eq=False)
class Reply:
    """Where the driver's answer to one command goes: a future on the caller's event loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[Any]

    @classmethod
    def here(cls) -> Reply:
        """A reply to the running event loop."""
        loop = asyncio.get_running_loop()
        return cls(loop, loop.create_future())

    def resolve(self, outcome: tuple[object, BaseException | None]) -> None:
        """On the caller's loop: set the answer, unless the caller stopped waiting."""
        if self.future.done():
            return
        value, error = outcome
        if error is not None:
            self.future.set_exception(error)
        else:
            self.future.set_result(value)


@attrs.frozen(eq=False)
class Submit:
    """Submit ``stream``'s request with ``prompt_ids``; it arrived at ``arrived_s``
    (`time.monotonic`, when the command was made: its latencies count from there)."""

    stream: RequestStream
    prompt_ids: Sequence[int]
    arrived_s: float = attrs.field(factory=time.monotonic)


@attrs.frozen(eq=False)
class Cancel:
    """``stream``'s consumer left: abort its request if it is still live."""

    stream: RequestStream


@attrs.frozen(eq=False)
class Abort:
    """Abort the live request ``request_id``; the reply is whether it was live."""

    request_id: str
    reason: str
    reply: Reply


@attrs.frozen(eq=False)
class Read:
    """Run ``fn(engine)`` on the driver thread between two steps; the reply is its value."""

    fn: Callable[[Engine], object]
    reply: Reply


@attrs.frozen(eq=False)
class WaitIdle:
    """Reply once the engine is idle and nothing is queued."""

    reply: Reply


@attrs.frozen(eq=False)
class Close:
    """Stop: finish (``drain``) or abort every live request, then close the engine."""

    drain: bool
    reply: Reply


class InboxState(enum.Enum):
    """Admission state of the inbox (module docstring)."""

    OPEN = "open"
    CLOSING = "closing"
    SHUT = "shut"


class Inbox:
    """Commands for the driver thread, under one condition (module docstring).

    Args:
        max_waiting: the most requests that may wait for admission at once (>= 1).
    """

    def __init__(self, max_waiting: int) -> None:
        self._cond = threading.Condition()
        self._commands: list[object] = []
        self._state = InboxState.OPEN
        self._failure: EngineUnavailable | None = None
        self._max_waiting = max_waiting
        self._num_submits = 0  # Submit commands not taken yet
        self._engine_waiting = 0  # the engine's waiting queue after the driver's last turn

    def submit(self, command: Submit) -> None:
        """Queue a request.

        Raises:
            EngineUnavailable: the driver stopped on a failure.
            UsageError: the front door is closing or closed.
            QueueFull: ``max_waiting`` requests already wait for admission.
        """
        rid = command.stream.request_id
        with self._cond:
            if self._failure is not None:
                raise EngineUnavailable(f"request {rid!r} refused: {self._failure}")
            if self._state is not InboxState.OPEN:
                raise UsageError(f"request {rid!r}: AsyncEngine.generate() after close()")
            waiting = self._num_submits + self._engine_waiting
            if waiting >= self._max_waiting:
                raise QueueFull(
                    f"request {rid!r} refused: {waiting} requests wait for admission "
                    f"(max_waiting {self._max_waiting}); retry later"
                )
            self._commands.append(command)
            self._num_submits += 1
            self._cond.notify()

    def put(self, command: Abort | Cancel | Read | WaitIdle | Close) -> bool:
        """Queue a command other than a submission; False if the driver already stopped."""
        with self._cond:
            if self._state is InboxState.SHUT:
                return False
            if isinstance(command, Close):
                self._state = InboxState.CLOSING
            self._commands.append(command)
            self._cond.notify()
            return True

    def take(self, *, wait: bool) -> list[object]:
        """Every queued command, in order; with ``wait``, sleep until there is one."""
        with self._cond:
            while wait and not self._commands:
                self._cond.wait()
            taken, self._commands = self._commands, []
            self._num_submits = 0
            return taken

    def has_commands(self) -> bool:
        """Whether a command is queued (the driver's idle test)."""
        with self._cond:
            return bool(self._commands)

    def set_engine_waiting(self, count: int) -> None:
        """The driver's report of the engine's waiting queue, after each of its turns."""
        with self._cond:
            self._engine_waiting = count

    def shut(self, failure: EngineUnavailable | None) -> list[object]:
        """The driver stopped (on ``failure``, if given): refuse everything from now on, new
        requests with the failure; return what was still queued."""
        with self._cond:
            self._state = InboxState.SHUT
            self._failure = failure
            leftover, self._commands = self._commands, []
            self._num_submits = 0
            return leftover

    @property
    def state(self) -> InboxState:
        """The admission state."""
        return self._state

    @property
    def num_waiting(self) -> int:
        """Requests waiting for admission, as of the driver's last turn."""
        with self._cond:
            return self._num_submits + self._engine_waiting
