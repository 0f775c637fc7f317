"""The driver thread of an `AsyncEngine`: the one thread that calls its `Engine`.

The driver owns the engine's calls, the open routes (request id -> the stream that consumes
it) and the outbox of deliveries. Callers never touch the engine: they put commands in the
`Inbox`, which the driver takes between two steps::

    loop:  take commands (block while the engine is idle and nothing is queued)
           apply them in order: submit, cancel, abort, read, wait-idle, close
           one Engine.step through a StreamCursor -> that step's TokenEvents
           route each event to its stream's outbox, one list per event loop
           flush: one loop.call_soon_threadsafe per event loop (not per token)

A function that `AsyncEngine.read` runs is the caller's: whatever it raises, a `BaseException`
included, goes back to that caller and the driver goes on.

Failure: an exception out of `Engine.step` (or anything the driver does), or a batch that
ended with `ForwardTimeout`, means the engine can no longer be trusted to step (after a
timeout the worker may still be running the abandoned forward): the driver stops calling the
worker, every open stream ends with `EngineUnavailable` (its ``__cause__`` the failure),
queued commands are answered, and the gate refuses new requests.

Disaggregated (``remote``: ``specstate serve --prefill``): the engine is a decode engine and a
prefill process prefills every request (`RemotePrefill`); between two steps the driver also
applies what the prefill process sent (acknowledgements, records to admit, ends), and a
request is *pending* until its record arrives; `Driver` says how each one ends.

Invariant: every submitted request's stream gets exactly one end: its final event (any
finish reason) or `EngineUnavailable`; a stream whose consumer left is aborted in the engine
at the driver's next turn, so its KV is released like any aborted request's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs

from specstate.core.errors import (
    EngineUnavailable,
    ForwardTimeout,
    HandoffFailed,
    InvalidRequest,
    UsageError,
)
from specstate.core.request import Req
from specstate.core.status import FinishReason, FinishState
from specstate.engine.config import EngineSnapshot
from specstate.engine.engine import Engine
from specstate.engine.stream import StreamCursor, TokenEvent
from specstate.handoff.transport import (
    Ack,
    Arrival,
    Closed,
    FrontDoorTransport,
    RemoteAbort,
    RemoteEnd,
    RemoteSubmit,
    admit_arrival,
)
from specstate.serving.handoff_metrics import HandoffMetrics
from specstate.serving.inbox import Abort, Cancel, Close, Inbox, Read, Reply, Submit, WaitIdle
from specstate.serving.request_metrics import RequestMetrics
from specstate.serving.request_stream import Accepted, Ended, RequestStream, Update

__all__ = ["Driver", "DriverCounts"]

_log = logging.getLogger("specstate")

_Delivery = tuple[Callable[[Any], None], Any]
"""A callable to run on an event loop and its one argument."""


@attrs.frozen(kw_only=True)
class DriverCounts:
    """The driver's request counters (`AsyncEngineSnapshot` carries them).

    Attributes:
        num_submitted: requests the engine accepted.
        num_refused: requests the engine refused at submit (`InvalidRequest`).
        num_ended: accepted requests that ended (any reason).
        num_cancelled: requests aborted because their consumer left before the end.
    """

    num_submitted: int
    num_refused: int
    num_ended: int
    num_cancelled: int


@attrs.define
class _Route:
    """A live request and the stream that consumes it."""

    stream: RequestStream
    req: Req
    num_sent: int = 0  # tokens delivered so far (logprobs are sliced from here)


@attrs.define
class _Pending:
    """A request on the prefill process (``remote``): no record has arrived for it yet."""

    stream: RequestStream
    arrived_s: float
    deadline_s: float
    accepted: bool = False  # the prefill process acknowledged its submission
    ended: bool = False  # its stream ended here (aborted, failed): kept until the prefill
    # side's answer (its record, refused; its end) arrives, so that it is freed there too


@attrs.define
class RemotePrefill:
    """A prefill process the driver's engine decodes for (``specstate serve --prefill``).

    Attributes:
        transport: the connection to it (`FrontDoorTransport`).
        handoff_timeout_s: how long a request may stay on the prefill side with no record (or
            end) arriving before it fails.
        metrics: the handoffs received (`specstate.serving.handoff_metrics`).
        failure: why the prefill side is unavailable, once it is; None while it serves.
    """

    transport: FrontDoorTransport
    handoff_timeout_s: float = 600.0
    metrics: HandoffMetrics = attrs.field(factory=HandoffMetrics)
    failure: str | None = None


def _run_deliveries(items: list[_Delivery]) -> None:
    """On an event loop: hand each stream what the driver routed to it in one turn."""
    for deliver, item in items:
        deliver(item)


class Driver:
    """The body of the driver thread (module docstring); `run` is the thread's target.

    With ``remote``, the engine is a decode engine: a request is submitted to the prefill
    process, and joins the engine when its record arrives (`Engine.admit_handoff`); until then
    it is *pending* (accepted once the prefill process acknowledged it). Its stream reads every
    token from the engine (the first one, sampled on the prefill side, arrives in the record and
    is delivered once, by the engine), or the end the prefill side reports (`RemoteEnd`).

    Args:
        engine: the engine; no other thread may have called it.
        inbox: the gate the callers queue commands through.
        remote: the prefill process, for a disaggregated server; None for one engine.
    """

    def __init__(self, engine: Engine, inbox: Inbox, remote: RemotePrefill | None = None) -> None:
        self._engine = engine
        self._inbox = inbox
        self._remote = remote
        self._pending: dict[str, _Pending] = {}
        self._routes: dict[str, _Route] = {}
        self._outbox: dict[asyncio.AbstractEventLoop, list[_Delivery]] = {}
        self._closers: list[Reply] = []
        self._idle_waiters: list[Reply] = []
        self._aborted_all = False
        self._submitted = self._refused = self._ended = self._cancelled = 0
        self.failure: EngineUnavailable | None = None
        """Why the driver stopped stepping, once it did; None while healthy."""
        self.final_snapshot: EngineSnapshot | None = None
        """The engine's snapshot when the driver stopped (None while it runs)."""
        self.request_metrics = RequestMetrics()
        """Latencies and token counts of the requests it routes; only this thread writes them."""

    # ------------------------------------------------------------------ the loop
    def run(self) -> None:
        """Drive the engine until a close finishes or a failure stops it."""
        engine = self._engine
        try:
            cursor = StreamCursor(engine)
            while True:
                wait = engine.is_idle and not self._closers and not self._pending
                for command in self._inbox.take(wait=wait):
                    self._apply(command)
                if self._remote is not None and self._pending:
                    self._receive(self._remote)
                self._inbox.set_engine_waiting(len(engine.scheduler.waiting))
                if not engine.is_idle:
                    fatal = self._publish(cursor.step())
                    self._inbox.set_engine_waiting(len(engine.scheduler.waiting))
                    if fatal is not None:  # `_stop` records it, then hands out this step's ends
                        raise fatal
                if engine.is_idle:
                    quiet = not self._pending and not self._inbox.has_commands()
                    if self._idle_waiters and quiet:
                        self._answer(self._idle_waiters, None)
                    if self._closers and not self._pending:
                        break
                self._flush()
        except BaseException as exc:  # the thread's last word: fail every stream
            self._stop(exc)
        else:
            self._stop(None)

    def counts(self) -> DriverCounts:
        """The request counters so far."""
        return DriverCounts(
            num_submitted=self._submitted,
            num_refused=self._refused,
            num_ended=self._ended,
            num_cancelled=self._cancelled,
        )

    @property
    def num_streams(self) -> int:
        """Requests submitted whose stream has not been handed its end yet."""
        return len(self._routes)

    # -------------------------------------------------------------- commands
    def _apply(self, command: object) -> None:
        match command:
            case Submit(stream=stream, prompt_ids=prompt, arrived_s=arrived_s):
                self._submit(stream, prompt, arrived_s)
            case Cancel(stream=stream) if self._is_pending(stream.request_id, stream):
                self._end_pending(stream.request_id, "the stream's consumer left")
                self._cancelled += 1
            case Abort(request_id=rid, reason=reason, reply=reply) if self._is_pending(rid):
                self._end_pending(rid, reason)
                self._answer([reply], True)
            case Cancel(stream=stream):
                route = self._routes.get(stream.request_id)
                if route is not None and route.stream is stream and not route.req.is_finished:
                    self._engine.abort(stream.request_id, "the stream's consumer left")
                    self._cancelled += 1
            case Abort(request_id=rid, reason=reason, reply=reply):
                route = self._routes.get(rid)
                live = route is not None and not route.req.is_finished
                if live:
                    self._engine.abort(rid, reason)
                self._answer([reply], live)
            case Read(fn=fn, reply=reply):
                try:
                    value = fn(self._engine)
                except Exception as exc:  # the caller's function failed: the caller's error
                    self._answer([reply], None, exc)
                except BaseException as exc:  # still the caller's, not the driver's end
                    self._answer([reply], None, _read_failed(exc))
                else:
                    self._answer([reply], value)
            case WaitIdle(reply=reply):
                self._idle_waiters.append(reply)
            case Close(drain=drain, reply=reply):
                self._closers.append(reply)
                if not drain and not self._aborted_all:
                    self._aborted_all = True
                    for rid in [r for r in self._pending if self._is_pending(r)]:
                        self._end_pending(rid, "the AsyncEngine closed")
                    for rid, route in self._routes.items():
                        if not route.req.is_finished:
                            self._engine.abort(rid, "the AsyncEngine closed")
            case _:
                raise TypeError(f"unknown driver command {command!r}")

    def _submit(self, stream: RequestStream, prompt: Sequence[int], arrived_s: float) -> None:
        if self._remote is not None:
            self._submit_remote(self._remote, stream, prompt, arrived_s)
            return
        try:
            req = self._engine.submit(stream.request_id, prompt, stream.sampling)
        except (InvalidRequest, TypeError, ValueError) as exc:  # this request's fault alone
            self._refused += 1
            self._send(stream, Accepted(exc))
            return
        self._submitted += 1
        self.request_metrics.record_accepted(req, arrived_s=arrived_s)
        self._routes[stream.request_id] = _Route(stream=stream, req=req)
        self._send(stream, Accepted(None))

    # ------------------------------------------------------ remote prefill
    def _is_pending(self, request_id: str, stream: RequestStream | None = None) -> bool:
        pending = self._pending.get(request_id)
        if pending is None or pending.ended:
            return False
        return stream is None or pending.stream is stream

    def _submit_remote(
        self, remote: RemotePrefill, stream: RequestStream, prompt: Sequence[int], arrived_s: float
    ) -> None:
        rid = stream.request_id
        if remote.failure is not None:
            self._send(stream, Accepted(_prefill_unavailable(remote.failure)))
            return
        if rid in self._pending or rid in self._routes:
            self._refused += 1
            error = InvalidRequest(
                f"request {rid!r}: a live request already has this id", fields=("request_id",)
            )
            self._send(stream, Accepted(error))
            return
        message = RemoteSubmit(request_id=rid, prompt_ids=tuple(prompt), sampling=stream.sampling)
        deadline = time.monotonic() + remote.handoff_timeout_s
        self._pending[rid] = _Pending(stream=stream, arrived_s=arrived_s, deadline_s=deadline)
        try:
            remote.transport.send_submit(message)
        except HandoffFailed as exc:
            self._prefill_failed(remote, str(exc))

    def _receive(self, remote: RemotePrefill) -> None:
        """Apply what the prefill process sent; fail the requests past their deadline."""
        try:
            message = remote.transport.poll(0.02 if self._engine.is_idle else 0.0)
            while message is not None:
                self._on_message(remote, message)
                message = remote.transport.poll(0.0)
        except HandoffFailed as exc:
            self._prefill_failed(remote, str(exc))
            return
        now = time.monotonic()
        late = [rid for rid, p in self._pending.items() if p.deadline_s < now]
        for rid in late:
            if self._pending[rid].ended:  # no answer to its abort either: forget it
                del self._pending[rid]
                continue
            remote.metrics.record_failures(1)
            detail = f"no record from the prefill side within {remote.handoff_timeout_s:g} s"
            self._end_pending(rid, detail, reason=FinishReason.ERROR)

    def _on_message(self, remote: RemotePrefill, message: object) -> None:
        match message:
            case Ack(request_id=rid, ok=ok) if rid in self._pending and self._pending[rid].ended:
                if not ok:  # refused there: nothing of it remains on either side
                    del self._pending[rid]
            case Ack(request_id=rid, ok=ok, detail=detail) if rid in self._pending:
                pending = self._pending[rid]
                if ok:
                    pending.accepted = True
                    self._submitted += 1
                    self._send(pending.stream, Accepted(None))
                else:
                    del self._pending[rid]
                    self._refused += 1
                    self._send(pending.stream, Accepted(InvalidRequest(detail)))
            case Arrival():
                self._arrive(remote, message)
            case RemoteEnd(request_id=rid) if rid in self._pending:
                pending = self._pending.pop(rid)
                if pending.ended:  # its abort (or failure) was answered
                    return
                finish = FinishState(
                    reason=FinishReason(message.reason),
                    finished_len=len(message.output_ids),
                    detail=message.detail,
                )
                event = TokenEvent(rid, message.output_ids, finish)
                self._ended += 1
                self._send(pending.stream, Update(event, None))
            case Closed():
                raise HandoffFailed("the prefill side closed")
            case _:
                pass  # about a request no longer pending here (aborted): nothing to do

    def _arrive(self, remote: RemotePrefill, arrival: Arrival) -> None:
        """A record landed: admit it if its request is still pending here; acknowledge."""
        pending = self._pending.pop(arrival.request_id, None)
        if pending is None or pending.ended:
            ack = Ack(
                request_id=arrival.request_id,
                ok=False,
                detail="the request is no longer live on the decode side (aborted)",
            )
        else:
            ack, req = admit_arrival(self._engine, arrival)
            if req is not None:
                self.request_metrics.record_accepted(req, arrived_s=pending.arrived_s)
                self._routes[req.request_id] = _Route(stream=pending.stream, req=req)
            else:
                self._ended += 1
                self._end_stream(
                    pending.stream, FinishReason.ERROR, f"handoff refused: {ack.detail}"
                )
        remote.metrics.record_arrival(arrival.num_bytes, arrival.seconds, admitted=ack.ok)
        remote.transport.send_ack(ack)

    def _end_pending(
        self, rid: str, detail: str, *, reason: FinishReason = FinishReason.ABORT
    ) -> None:
        """End a pending request's stream here and tell the prefill side to abort it; it stays
        (ended) until the prefill side's answer arrives, within a fresh deadline."""
        pending = self._pending[rid]
        pending.ended = True
        if self._remote is not None:
            pending.deadline_s = time.monotonic() + self._remote.handoff_timeout_s
        if self._remote is not None and self._remote.failure is None:
            try:
                self._remote.transport.send_abort(RemoteAbort(request_id=rid, reason=detail))
            except HandoffFailed as exc:
                self._prefill_failed(self._remote, str(exc))
        if pending.accepted:
            self._ended += 1
            self._end_stream(pending.stream, reason, detail)
        else:  # its submit still waits: answered 503, as a closed front door's
            self._send(pending.stream, Accepted(EngineUnavailable(f"request {rid!r}: {detail}")))

    def _end_stream(self, stream: RequestStream, reason: FinishReason, detail: str) -> None:
        finish = FinishState(reason=reason, finished_len=0, detail=detail)
        self._send(stream, Update(TokenEvent(stream.request_id, (), finish), None))

    def _prefill_failed(self, remote: RemotePrefill, detail: str) -> None:
        """The prefill side is gone: its pending requests fail, later ones are refused."""
        if remote.failure is None:
            remote.failure = detail
            _log.error("the prefill side is unavailable: %s", detail)
        remote.metrics.record_failures(sum(not p.ended for p in self._pending.values()))
        for rid in list(self._pending):
            pending = self._pending.pop(rid)
            if pending.ended:
                continue
            if pending.accepted:
                self._ended += 1
                self._end_stream(
                    pending.stream, FinishReason.ERROR, f"the prefill side is unavailable: {detail}"
                )
            else:
                self._send(pending.stream, Accepted(_prefill_unavailable(detail)))

    # ----------------------------------------------------------- deliveries
    def _publish(self, events: list[TokenEvent]) -> ForwardTimeout | None:
        """Route one step's events; a `ForwardTimeout` among the ends is returned (fatal)."""
        fatal = None
        now = time.monotonic()
        for event in events:
            route = self._routes.get(event.request_id)
            if route is None:  # submitted to the engine by someone else: not ours to route
                continue
            self.request_metrics.record_delivery(route.req, len(event.tokens), at_s=now)
            start = route.num_sent
            route.num_sent += len(event.tokens)
            logprobs = top = None
            sampling = route.stream.sampling
            if sampling.logprobs:
                values = route.req.logprobs or ()
                logprobs = tuple(values[start : route.num_sent])
                if sampling.top_logprobs:  # only the new positions are read
                    top = tuple(route.req.stored_top_logprobs(start, route.num_sent))
            finish = event.finish
            if finish is None:
                self._send(route.stream, Update(event, logprobs, top_logprobs=top))
                continue
            del self._routes[event.request_id]
            self._ended += 1
            req = route.req
            accepts = req.emitted_accept_lengths  # the usage counts only delivered tokens
            self.request_metrics.record_end(req, finish, accepts, at_s=now)
            update = Update(
                event,
                logprobs,
                top_logprobs=top,
                accept_lengths=accepts,
                cached_tokens=req.cached_tokens,
                draft_acceptance=req.draft_acceptance(),
            )
            self._send(route.stream, update)
            # NOTE: the engine names the error type first in an ERROR finish's detail.
            prefix = f"{ForwardTimeout.__name__}: "
            if finish.reason is FinishReason.ERROR and finish.detail.startswith(prefix):
                fatal = ForwardTimeout(finish.detail.removeprefix(prefix))
        return fatal

    def _send(self, stream: RequestStream, item: object) -> None:
        self._outbox.setdefault(stream.loop, []).append((stream.deliver, item))

    def _answer(
        self, replies: list[Reply], value: object, error: BaseException | None = None
    ) -> None:
        for reply in replies:
            self._outbox.setdefault(reply.loop, []).append((reply.resolve, (value, error)))
        replies.clear()

    def _flush(self) -> None:
        """One hand-off per event loop; a loop that is gone has its streams cancelled."""
        outbox, self._outbox = self._outbox, {}
        for loop, items in outbox.items():
            try:
                loop.call_soon_threadsafe(_run_deliveries, items)
            except RuntimeError:  # the loop is closed: nobody will consume these streams
                for deliver, _ in items:
                    stream = getattr(deliver, "__self__", None)
                    if isinstance(stream, RequestStream):
                        self._apply(Cancel(stream))

    # ------------------------------------------------------------------ stop
    def _stop(self, error: BaseException | None) -> None:
        """Answer everything once the loop ends; on a failure, end every open stream."""
        remote = self._remote
        if remote is not None:
            if self._pending:
                self._prefill_failed(remote, "the front door stopped")
            if remote.failure is None:
                remote.failure = "the front door stopped"
                with contextlib.suppress(HandoffFailed):  # the prefill side is gone already
                    remote.transport.send_close()
        if error is not None:
            self.failure = _unavailable(error)
            _log.error("AsyncEngine driver stopped; every open stream ends", exc_info=error)
            for route in self._routes.values():
                self._send(route.stream, Ended(_unavailable(error)))
            self._routes.clear()
        leftover = self._inbox.shut(self.failure)
        closed: BaseException = self.failure or UsageError("AsyncEngine: used after close()")
        for command in leftover:
            match command:
                case Submit(stream=stream):
                    self._send(stream, Accepted(closed))
                case Abort(reply=reply):
                    self._answer([reply], False)
                case Read(reply=reply):
                    self._answer([reply], None, closed)
                case WaitIdle(reply=reply):
                    self._idle_waiters.append(reply)
                case Close(reply=reply):
                    self._closers.append(reply)
        if error is None or isinstance(error, ForwardTimeout):
            self._close_engine()  # after a timeout the fresh forward stream is idle
        try:
            self.final_snapshot = self._engine.snapshot()
        except Exception:  # a failed engine may not even summarize itself; keep the last
            _log.exception("AsyncEngine: the engine's final snapshot failed")
        self._answer(self._idle_waiters, None)
        self._answer(self._closers, None)
        self._flush()

    def _close_engine(self) -> None:
        try:
            self._engine.close()
        except Exception:  # closing is best effort once the driver is done
            _log.exception("AsyncEngine: closing the engine failed")


def _prefill_unavailable(detail: str) -> EngineUnavailable:
    return EngineUnavailable(f"the prefill side is unavailable: {detail}")


def _read_failed(error: BaseException) -> UsageError:
    """The caller's error for a read whose function raised a `BaseException` that is no
    `Exception`. NOTE: not handed over as is: a `KeyboardInterrupt` or `SystemExit` set on the
    caller's future would stop the caller's event loop, not just its await."""
    failure = UsageError(
        f"AsyncEngine.read(): fn raised {type(error).__name__}: {error} (a read must only read; "
        "the engine goes on)"
    )
    failure.__cause__ = error
    return failure


def _unavailable(error: BaseException) -> EngineUnavailable:
    """A fresh `EngineUnavailable` caused by ``error`` (one per stream: each raises its own)."""
    failure = EngineUnavailable(f"the engine can no longer step: {type(error).__name__}: {error}")
    failure.__cause__ = error
    return failure
