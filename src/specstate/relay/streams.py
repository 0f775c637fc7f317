"""Streams own the ordering of device work; they guarantee in-order execution and event fences.

A `Stream` runs submitted work strictly in submission order; an `Event` marks a point in one
stream's order. The same contract holds on both backends:

* CUDA (`CudaStream`): wraps ``torch.cuda.Stream`` / ``Event``; ``submit`` makes the stream
  wait for the host's current stream (the input fence: inputs the host enqueued before are
  ready), then runs the host function at once inside ``torch.cuda.stream(s)``, since the
  kernels it launches are asynchronous.
* CPU (`CpuStream`): one daemon worker thread runs the work; torch releases the GIL inside its
  ops, so a CPU forward truly overlaps the host's Python work.

The three fences of one overlapped iteration, as the engine uses them::

    host          | schedule N+1 (H2D inputs) | launch N+1 (enqueue) | wait copy N | settle N |
                                               ^ (1)                   ^ (3)
    forward       ... forward N: verify, PUBLISH, draft-extend | resolve N+1 (2), forward N+1 ...
    copy                                   | D2H of result N, copy event |

    (1) input fence:   `CudaStream.submit` makes the forward stream wait for the host's current
                       stream, where the host enqueued batch N+1's inputs and ``req_to_token``
                       writes; on a CPU, submission order gives it.
    (2) publish fence: stream order. Forward N publishes its frontier on the forward stream and
                       forward N+1 resolves it on the same stream, after it; the host never
                       reads a relayed value (``tests/engine/test_stream_order.py`` checks it).
    (3) result copy:   after forward N, the launch packs the result and copies it to pinned
                       host memory on a copy stream that waits for the forward stream, then
                       records the copy event; the host waits for that event, and only then
                       reads result N (`specstate.engine.launch.result_copy`).

Errors: an exception of submitted work is captured and re-raised *as is* (the original object,
with a note naming the stream) at the next host sync point after it (``synchronize`` or
``wait_current`` of a later event, ``stream.synchronize``). Like a sticky CUDA error, the stream
then *refuses* later work: it is skipped, later events carry the error, and a stream that waits
for such an event takes it too. ``stream.synchronize()`` reports it once and resets the stream.

One host thread drives a stream. Work running *on* a stream that submits to, records on or waits
for that same stream does so inline, which is exactly its place in stream order.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from types import TracebackType
from typing import Final, ParamSpec, Protocol, Self

import torch

from specstate.core.errors import InvalidConfig, RelayError

__all__ = ["CpuEvent", "CpuStream", "CudaEvent", "CudaStream", "Event", "Stream", "make_stream"]

_P = ParamSpec("_P")
_STOP: Final = None  # queue sentinel: the worker exits after draining everything before it
_Item = tuple[bool, Callable[[], object]]  # (runs even when the stream is poisoned, work)


class Event(Protocol):
    """A point in one stream's order; complete once the stream has run everything before it."""

    def query(self) -> bool:
        """Return whether the event has completed; never blocks, never raises."""

    def synchronize(self) -> None:
        """Block the host until the event completes; re-raise an error of work before it."""

    def synchronize_within(self, seconds: float) -> bool:
        """Block the host up to ``seconds``; True if the event completed (else False).

        A completed event re-raises an error of work before it, as `synchronize` does.
        """

    def wait(self, stream: Stream) -> None:
        """Make later work on ``stream`` wait for this event (``stream.wait_event(self)``)."""

    def wait_current(self) -> None:
        """Order the caller after it: CUDA, the current stream waits; CPU, the thread blocks."""


class Stream(AbstractContextManager["Stream", None], Protocol):
    """An in-order work queue for one device; see the module docstring for the contract."""

    @property
    def device(self) -> torch.device:
        """The device whose work this stream orders."""

    def submit(self, fn: Callable[_P, object], /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Run ``fn(*args, **kwargs)`` after all previously submitted work; its value is dropped.

        Raises:
            RelayError: the stream is closed.
        """

    def record_event(self) -> Event:
        """Return an event that completes when the stream reaches this point."""

    def wait_event(self, event: Event) -> None:
        """Make later work on this stream wait for ``event``; never blocks the host."""

    def wait_stream(self, other: Stream) -> None:
        """Make later work on this stream wait for all work submitted to ``other`` so far."""

    def synchronize(self) -> None:
        """Block the host until all submitted work ran; report (and clear) a captured error."""

    def close(self) -> None:
        """Finish submitted work and release the stream; idempotent (also on context exit)."""

    def abandon(self) -> None:
        """Refuse new work and release the stream *without* waiting for submitted work.

        For a stream whose work is wedged (a forward that never returns): the host stops
        waiting; queued work still runs in order whenever the wedged item returns (CPU), or
        stays enqueued on the device (CUDA). Events recorded before keep their meaning.
        """


class CpuEvent:
    """An event of a `CpuStream`; completes when the worker thread reaches it."""

    def __init__(self, stream: CpuStream) -> None:
        self._stream = stream
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _complete(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()  # publishes _error to waiters (happens-before)

    def query(self) -> bool:
        """Return whether the stream has reached this event."""
        return self._done.is_set()

    def synchronize(self) -> None:
        """Block until the stream reaches this event; re-raise an error of earlier work.

        Raises:
            RelayError: called from the event's own stream before it completed (deadlock).
        """
        if not self._done.is_set() and self._stream.is_current():
            raise RelayError(f"stream {self._stream._name!r}: own later event (deadlock)")
        self._done.wait()
        if self._error is not None:
            raise self._error

    def synchronize_within(self, seconds: float) -> bool:
        """Block up to ``seconds`` for the stream to reach this event; re-raise its error.

        Raises:
            RelayError: called from the event's own stream before it completed (deadlock).
        """
        if not self._done.is_set() and self._stream.is_current():
            raise RelayError(f"stream {self._stream._name!r}: own later event (deadlock)")
        if not self._done.wait(seconds):
            return False
        if self._error is not None:
            raise self._error
        return True

    def wait(self, stream: Stream) -> None:
        """Make later work on ``stream`` wait for this event."""
        stream.wait_event(self)

    def wait_current(self) -> None:
        """Block the calling thread (host or another stream) until the event completes."""
        if self._stream.is_current():
            return  # NOTE: in-order: earlier events are done, a later one is not ours to wait
        self.synchronize()


class _Lifecycle:
    """The single-use lifecycle and the sticky error shared by both stream kinds."""

    def __init__(self, name: str, device: torch.device) -> None:
        self._name = name
        self._device = device
        self._lock = threading.Lock()  # guards _closed, _entered and _error
        self._closed = self._entered = False
        self._error: BaseException | None = None

    @property
    def device(self) -> torch.device:
        """The device whose work this stream orders."""
        return self._device

    def close(self) -> None:
        """Finish all submitted work, refuse new work, then report a captured error; idempotent.

        Raises:
            RelayError: called from the stream's own work (it would wait for itself).
        """
        self._shutdown()
        self._report()

    def __enter__(self) -> Self:
        with self._lock:
            if self._closed or self._entered:
                raise RelayError(f"stream {self._name!r}: context is single-use and not reentrant")
            self._entered = True
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._shutdown()
        if ev is None:  # NOTE: never mask the exception already in flight
            self._report()

    def _shutdown(self) -> None:
        raise NotImplementedError

    def _report(self) -> None:
        with self._lock:
            error, self._error = self._error, None
        if error is not None:
            raise error

    def _poison(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None:
                self._error = error


class CpuStream(_Lifecycle):
    """An in-order stream executed by one dedicated daemon worker thread.

    Invariant: work runs in submission order, one item at a time; an item after an event runs
    only once the event has completed.

    Args:
        name: names the worker thread and errors.
        delay: a stream-order checker's hook: seconds to sleep before each item (a slow,
            jittery device). Work that is correctly ordered by the stream is unaffected; a read
            on the host that is not ordered after the stream's write then sees the old value.
    """

    def __init__(
        self, name: str = "cpu-stream", *, delay: Callable[[], float] | None = None
    ) -> None:
        super().__init__(name, torch.device("cpu"))
        self._delay = delay
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=f"specstate-{name}", daemon=True)
        self._thread.start()

    def is_current(self) -> bool:
        """Return whether the caller is running on this stream's worker thread."""
        return threading.get_ident() == self._thread.ident

    def submit(self, fn: Callable[_P, object], /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Enqueue ``fn``; from the stream's own work it runs inline (its place in order).

        Raises:
            RelayError: the stream is closed.
        """
        if self.is_current():
            fn(*args, **kwargs)  # an error propagates into the enclosing item, which captures it
            return
        self._put((False, functools.partial(fn, *args, **kwargs)))

    def record_event(self) -> CpuEvent:
        """Return an event that completes when the worker reaches this point."""
        event = CpuEvent(self)
        if self.is_current():
            event._complete(self._error)  # everything before this point already ran
        else:
            self._put((True, lambda: event._complete(self._error)))
        return event

    def wait_event(self, event: Event) -> None:
        """Make later work wait for ``event`` (of any `CpuStream`); the host does not block.

        Raises:
            RelayError: ``event`` is not a `CpuEvent`, or the stream is closed.
        """
        if not isinstance(event, CpuEvent):
            raise RelayError(f"stream {self._name!r}: cannot wait for {type(event).__name__}")
        if event._stream is self or (event.query() and event._error is None):
            return  # in-order already, or nothing left to wait for
        if self.is_current():
            event.synchronize()  # blocks this stream right here; an error poisons the item
            return
        self._put((True, functools.partial(self._wait_marker, event)))

    def wait_stream(self, other: Stream) -> None:
        """Make later work wait for everything submitted to ``other`` so far."""
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        """Block until all submitted work ran; re-raise and clear a captured error.

        Raises:
            RelayError: the stream is closed, or this is its own work (it would wait for itself).
        """
        if self.is_current():
            raise RelayError(f"stream {self._name!r}: synchronize from its own work (deadlock)")
        self.record_event()._done.wait()
        self._report()

    def _put(self, item: _Item) -> None:
        with self._lock:
            if self._closed:
                raise RelayError(f"stream {self._name!r} is closed: no new work is accepted")
            self._queue.put(item)

    def _shutdown(self) -> None:
        if self.is_current():
            raise RelayError(f"stream {self._name!r}: close from its own work (deadlock)")
        self._stop()
        self._thread.join()

    def abandon(self) -> None:
        """Refuse new work; the daemon thread drains the queue on its own time, never joined."""
        self._stop()

    def _stop(self) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                self._queue.put(_STOP)

    def _wait_marker(self, event: CpuEvent) -> None:
        event._done.wait()
        if event._error is not None:
            self._poison(event._error)

    def _run(self) -> None:
        while (item := self._queue.get()) is not _STOP:
            always, work = item
            if not always and self._error is not None:
                continue  # refused: an unreported error precedes it
            if self._delay is not None:
                time.sleep(self._delay())
            try:
                work()
            except BaseException as exc:  # reported at the next host sync point
                exc.add_note(f"raised by work on stream {self._name!r}; reported asynchronously")
                self._poison(exc)


class CudaEvent:
    """A ``torch.cuda.Event`` recorded on a `CudaStream`, plus that stream's captured error."""

    def __init__(
        self, event: torch.cuda.Event, error: BaseException | None, device: torch.device
    ) -> None:
        self._event = event
        self._error = error
        self._device = device

    def query(self) -> bool:
        """Return whether the device has passed this event."""
        return bool(self._event.query())  # type: ignore[no-untyped-call]  # torch lacks hints

    def synchronize(self) -> None:
        """Block the host until the device passes this event; re-raise a captured error."""
        self._event.synchronize()
        if self._error is not None:
            raise self._error

    def synchronize_within(self, seconds: float) -> bool:
        """Poll the device up to ``seconds`` for this event; re-raise a captured error.

        The poll sleeps between queries (at most 1 ms), so a host waiting here leaves the CPU
        to other threads, as a blocking-sync event would.
        """
        deadline = time.monotonic() + seconds
        pause = 1e-5
        while not self.query():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(pause, left))
            pause = min(pause * 2, 1e-3)
        if self._error is not None:
            raise self._error
        return True

    def wait(self, stream: Stream) -> None:
        """Make later work on ``stream`` wait for this event."""
        stream.wait_event(self)

    def wait_current(self) -> None:
        """Make the current stream of the event's device wait for it; the host does not block."""
        if self._error is not None:
            raise self._error
        self._event.wait(torch.cuda.current_stream(self._device))


class CudaStream(_Lifecycle):
    """A thin wrapper over ``torch.cuda.Stream`` with the `CpuStream` error contract."""

    def __init__(self, device: torch.device, name: str = "cuda-stream") -> None:
        super().__init__(name, device)
        self._stream = torch.cuda.Stream(device=device)  # type: ignore[no-untyped-call]
        self._depth = 0  # nesting of submit: only the outermost captures an error

    @property
    def torch_stream(self) -> torch.cuda.Stream:
        """The wrapped torch stream."""
        return self._stream

    def submit(self, fn: Callable[_P, object], /, *args: _P.args, **kwargs: _P.kwargs) -> None:
        """Run ``fn`` now on the host inside ``torch.cuda.stream``; its kernels run async.

        Raises:
            RelayError: the stream is closed.
        """
        if self._closed:
            raise RelayError(f"stream {self._name!r} is closed: no new work is accepted")
        if self._depth > 0:  # own work: inline, an error propagates to the enclosing item
            fn(*args, **kwargs)
            return
        if self._error is not None:
            return  # refused: an unreported error precedes it
        self._depth += 1
        try:
            # The input fence: whatever the host enqueued on its current stream before this
            # (batch inputs, req_to_token writes) is ordered before this work.
            self._stream.wait_stream(torch.cuda.current_stream(self._device))
            with torch.cuda.stream(self._stream):
                fn(*args, **kwargs)
        except BaseException as exc:
            exc.add_note(f"raised by work on stream {self._name!r}; reported asynchronously")
            self._poison(exc)
        finally:
            self._depth -= 1

    def record_event(self) -> CudaEvent:
        """Record an event at the current end of this stream."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch lacks hints
        event.record(self._stream)
        return CudaEvent(event, self._error, self._device)

    def wait_event(self, event: Event) -> None:
        """Make later work wait for ``event`` on the device; the host does not block.

        Raises:
            RelayError: ``event`` is not a `CudaEvent`.
        """
        if not isinstance(event, CudaEvent):
            raise RelayError(f"stream {self._name!r}: cannot wait for {type(event).__name__}")
        self._stream.wait_event(event._event)
        if event._error is not None:
            self._poison(event._error)

    def wait_stream(self, other: Stream) -> None:
        """Make later work wait for everything submitted to ``other`` so far."""
        self.wait_event(other.record_event())

    def synchronize(self) -> None:
        """Block until the device ran all work; re-raise and clear a captured error."""
        self._stream.synchronize()
        self._report()

    def _shutdown(self) -> None:
        with self._lock:
            self._closed = True
        self._stream.synchronize()

    def abandon(self) -> None:
        """Refuse new work; work already enqueued stays on the device (nothing waits for it)."""
        with self._lock:
            self._closed = True


def make_stream(device: torch.device, *, name: str = "forward") -> Stream:
    """Return a new stream for ``device``: a `CudaStream` or a `CpuStream`.

    Raises:
        InvalidConfig: the device type is neither ``cuda`` nor ``cpu``.
    """
    if device.type == "cuda":
        return CudaStream(device, name)
    if device.type == "cpu":
        return CpuStream(name)
    raise InvalidConfig(f"no stream for device type {device.type!r} (expected 'cuda' or 'cpu')")
