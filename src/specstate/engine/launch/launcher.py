"""The Launcher: runs one planned batch on the forward stream, inside forward isolation.

It owns the FutureMap, the forward isolator and the forward stream. `Launcher.launch` submits one
closure to the stream (overlap) or runs it at once (normal loop, or a worker that declares
`WorkerCapabilities.asynchronous` on a CPU: it only enqueues, so it is launched on the driving
thread as a `CudaStream` launches, with no stream thread). The closure, in stream order:

1. resolves the batch's `Unresolved` frontier and bonus tokens from the FutureMap (the publish
   fence: on a stream, everything launched before is already done when this runs), and binds
   the relayed rows and mixed tails from device tensors the scheduler built;
2. isolates the batch and calls the worker, acting as `Role.WORKER`, with ``on_publish``
   (overlap), which must fire at most once; without overlap, or when the worker did not call
   it, publishes after return;
3. checks the result's dtypes and shapes; on the host CPU also its values, before anything is
   relayed; on a device it starts the result's one packed copy to the host instead (its values
   are checked after the copy, at settlement) and relays the frontier clamped into the row's
   reservation meanwhile;
4. stashes the next round's inputs; the done event recorded after the closure tells the host
   the batch ran.

The closure only enqueues device work: it reads no device value and copies nothing from the
host (`specstate.testing.device_audit` checks this on a CPU).

With a forward timeout, the host may give up on a batch (`Launcher.abandon`): the batch and any
batch queued behind it on the same stream are marked abandoned under their lock, a fresh stream
takes the old one's place, and an abandoned closure that wakes up later touches nothing shared:
it does not publish, stash, check or hand back a result.

A worker exception is caught in the closure and handed to the host with the result, so the
stream keeps running later batches; the failed batch's rows get their inputs republished
unchanged, so a later batch that resolves them reads defined values (its rows for those
requests are skipped at settlement because the requests ended with an error).

The launcher owns its batches in flight (`_Flight`, written by the stream closure and by the
host under the flight's lock); the round sees them only as values: `Launcher.collect` waits for
the oldest one and returns a frozen `Collected` (its result copied and checked, or its error, or
a timeout with the abandoned stream's drain predicate), and `Launcher.in_flight` a frozen view.

Invariant: batches are collected in launch order, each exactly once; a collected batch's host
result passed every check of `specstate.engine.launch.result_check`.
"""

from __future__ import annotations

import logging
import threading
import time

import attrs
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.isolation import ForwardIsolator
from specstate.batch.plan import LaunchPlan, PrefillPart
from specstate.batch.relay_inputs import resolve_batch_forward_inputs, resolve_batch_seq_lens
from specstate.batch.result import GenerationBatchResult
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.core.errors import ForwardTimeout, RelayError, WorkerResultError
from specstate.core.ownership import OwnershipChecker, Role
from specstate.engine.launch.outcome import Collected, InFlightView
from specstate.engine.launch.result_check import (
    check_form,
    check_result_type,
    check_sampling_rows,
    check_values,
)
from specstate.engine.launch.result_copy import HostResult, ResultCopy
from specstate.engine.worker import WorkerProtocol, handoff_worker
from specstate.relay.future_map import FutureMap, RelayPayload, Unresolved
from specstate.relay.streams import Event, Stream, make_stream

__all__ = ["Launcher"]

_log = logging.getLogger("specstate")


@attrs.define
class _Flight:
    """A launched batch: its plan, and the result (or error) once the stream has run it."""

    plan: LaunchPlan
    batch_id: int
    result: GenerationBatchResult | None = None
    error: BaseException | None = None
    done: Event | None = None
    # On a stream only (None when launched inline): set once the forward's host-side
    # preparation (resolve, isolation, the ForwardBatch) is done and the worker is called,
    # or the closure ended early.
    started: threading.Event | None = None
    # Set by the host (under ``lock``) when it gives up on the batch; the closure checks it
    # (under ``lock``) before it touches anything shared.
    abandoned: bool = False
    timed_out: bool = False
    # The result as host arrays (host CPU), or its copy in flight (a device).
    host: HostResult | None = None
    copy: ResultCopy | None = None
    # Tracing only: clock marks of the closure (start, worker called, worker returned, end)
    # and of the publish; written on the stream thread, read by the host after the batch ran.
    marks: list[int] | None = None
    publish_ns: int = 0
    lock: threading.RLock = attrs.field(factory=threading.RLock)

    def wait_started(self) -> None:
        """Block until the worker of this batch was called (or the launch ended early).

        Under overlap on a CPU stream the launch's preparation is Python on the stream thread:
        letting it run before the host settles the previous batch keeps the two from
        contending for the interpreter lock while the forward has not started yet.
        """
        if self.started is None:
            return  # launched inline: the launch is over
        while not self.started.wait(0.01):
            if self.done is None or self.done.query():
                return  # the closure ended without calling the worker

    def wait(
        self, timeout: float | None = None
    ) -> tuple[GenerationBatchResult | None, BaseException | None]:
        """Block until the batch ran; its result or its error.

        With ``timeout`` (seconds), a batch not done by then sets `timed_out` and returns a
        `ForwardTimeout` error (the batch may still be running: see `Launcher.abandon`).
        """
        if self.done is not None:
            if timeout is None:
                self.done.synchronize()
            elif not self.done.synchronize_within(timeout):
                self.timed_out = True
                return None, self.timeout_error(timeout)
        if self.result is None and self.error is None:
            self.error = RelayError(f"batch {self.batch_id} never ran")
        return self.result, self.error

    def timeout_error(self, timeout: float, what: str = "forward") -> ForwardTimeout:
        """The error a timed-out batch's requests end with."""
        batch = self.plan.batch
        return ForwardTimeout(
            f"batch {self.batch_id} ({batch.forward_mode.value}, {batch.batch_size} requests): "
            f"{what} not done after {timeout:g} s; the forward stream was abandoned"
        )


class _PublishOnce:
    """The ``on_publish`` handed to a worker: one publish per forward, recorded.

    Made on the thread that calls the worker. The worker may call it only from that thread
    and before its forward returns (`returned`): a call from another thread would enqueue the
    frontier on that thread's stream (a device hazard), and a late one could overwrite a
    frontier the next forward already read. Such a call is refused (`RelayError` in the caller)
    and logged; the engine then publishes ``new_seq_lens`` itself when the forward returns.
    """

    def __init__(
        self,
        future_map: FutureMap,
        indices: torch.Tensor,
        flight: _Flight,
        bounds: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        self._future_map = future_map
        self._indices = indices
        self._flight = flight
        self._bounds = bounds  # relay the frontier clamped into [lo, hi] (device path)
        self._thread = threading.get_ident()
        self.returned = False  # set once the worker's forward returned
        self.calls = 0
        self.published: torch.Tensor | None = None  # what the worker published, for the check

    def __call__(self, new_seq_lens: torch.Tensor) -> None:
        """The worker's publish: refused from another thread or after the forward returned."""
        late = self.returned
        if late or threading.get_ident() != self._thread:
            where = (
                "after its forward returned"
                if late
                else f"from thread {threading.current_thread().name!r}"
            )
            error = RelayError(
                f"[relay] batch {self._flight.batch_id}: on_publish called {where}; call it "
                "from the thread running forward_batch_generation, before it returns (refused)"
            )
            _log.error("%s", error)
            raise error
        self.publish(new_seq_lens)

    def publish(self, new_seq_lens: torch.Tensor) -> None:
        """Relay ``new_seq_lens`` (at most once per forward)."""
        with self._flight.lock:
            if self._flight.abandoned:
                return  # the host gave up on this forward: its frontier is not relayed
            self.calls += 1
            if self.calls > 1:
                raise RelayError(
                    f"[relay] on_publish called {self.calls} times in one forward (at most 1)"
                )
            self.published = new_seq_lens
            if self._flight.marks is not None:
                self._flight.publish_ns = time.perf_counter_ns()
            relayed = new_seq_lens
            if self._bounds is not None:  # unchecked yet: keep it inside the reservation
                relayed = torch.clamp(new_seq_lens, *self._bounds)
            host = self._flight.plan.slots_host  # the same slots, for the relay's row stamps
            self._future_map.publish(self._indices, relayed, host=host)


class Launcher:
    """Owner of the FutureMap, the isolator, the forward stream and the batches in flight.

    See the module docstring. ``traced`` records each forward's clock marks and each collect's
    wait for the trace (`Collected.marks`, `Collected.wait_ns`).
    """

    def __init__(
        self,
        *,
        worker: WorkerProtocol,
        overlap: bool,
        speculative: bool,
        max_accept: int,
        vocab_size: int,
        max_slots: int,
        device: torch.device,
        debug_relay: bool,
        req_to_token: torch.Tensor,
        checker: OwnershipChecker,
        forward_timeout: float | None = None,
        check: bool = False,
        asynchronous: bool = False,
        traced: bool = False,
    ) -> None:
        self._worker = worker
        self._checker = checker
        self._req_to_token = req_to_token
        self._overlap = overlap
        self._speculative = speculative
        self._max_accept = max_accept
        self._vocab_size = vocab_size
        self._timeout = forward_timeout
        self._traced = traced
        self.future_map = FutureMap(max_slots, device=device, debug=debug_relay)
        self.isolator = ForwardIsolator(overlap=overlap, check=check)
        self._device = device
        # On the host CPU a result is checked before anything is relayed; on a device, after
        # its copy, with the relayed frontier clamped meanwhile (`result_check`).
        self._on_host = device == torch.device("cpu")
        # A decode round's positions and frontier bounds, as rows of one add (`_decode_frame`).
        self._frame_offsets = torch.tensor(
            [[0], [1], [max_accept]], dtype=torch.int64, device=device
        )
        # The normal loop runs the forward inline, unless a timeout needs it on a stream. A
        # worker that only enqueues (``asynchronous``) is launched inline on the CPU too, as a
        # `CudaStream` launches on a GPU: its device time runs behind the result's copy event,
        # so a stream thread would only add hand-offs.
        on_stream = overlap or forward_timeout is not None
        self._inline = asynchronous and device.type == "cpu"
        self._stream: Stream | None = (
            make_stream(device) if on_stream and not self._inline else None
        )
        self._flights: tuple[_Flight, ...] = ()  # launched, not collected, oldest first
        self.num_in_flight = 0
        """Batches launched and not collected (read only)."""

    # ----------------------------------------------------------------- launch
    def launch(self, plan: LaunchPlan, *, batch_id: int) -> None:
        """Run ``plan`` on the stream (overlap, or with a forward timeout) or now."""
        flight = _Flight(plan=plan, batch_id=batch_id, marks=[] if self._traced else None)
        self._flights += (flight,)
        self.num_in_flight += 1
        if self._stream is None:
            self._run(flight)
        else:
            flight.started = threading.Event()
            self._stream.submit(self._run, flight)
            flight.done = self._stream.record_event()

    @property
    def in_flight(self) -> InFlightView | None:
        """The newest batch launched and not collected, or None."""
        if not self._flights:
            return None
        flight = self._flights[-1]
        return InFlightView(plan=flight.plan, batch_id=flight.batch_id, done=flight.done)

    def close(self) -> None:
        """Stop the forward stream (runs what was submitted first)."""
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    # ---------------------------------------------------------------- collect
    def collect(self) -> Collected:
        """Wait for the oldest batch in flight; its checked result, its error, or a timeout.

        The batch's result is copied to the host (one copy on a device) and every value is
        checked against the batch (`check_values`, `check_sampling_rows`): a result that
        breaks the contract comes back as an error. With a forward timeout, a batch whose
        forward or result copy is not done in time abandons the forward stream (`_abandon`).
        """
        flight = self._flights[0]
        waited = time.perf_counter_ns() if self._traced else 0
        timeout = self._timeout
        result, error = flight.wait(timeout)
        if flight.timed_out and timeout is not None:
            return self._abandon(timeout, "forward")
        if self.num_in_flight > 1:
            # Overlap: the next forward's launch runs on the stream now; let it reach the
            # worker before this thread's settlement competes with it for the interpreter.
            self._flights[1].wait_started()
        # The worker's own copy event, if it keeps one (a no-op when synchronous).
        if result is not None and not result.wait_copied(timeout):
            return self._abandon(timeout or 0.0, "result copy")
        host = None
        if error is None and result is not None:
            try:
                host = self._host_result(flight, timeout)
            except WorkerResultError as exc:
                error = exc
            else:
                if host is None:
                    return self._abandon(timeout or 0.0, "result copy")
        self._flights = self._flights[1:]
        self.num_in_flight -= 1
        if host is None and error is None:
            error = RelayError(f"batch {flight.batch_id} has neither a result nor an error")
        return Collected(
            plan=flight.plan,
            batch_id=flight.batch_id,
            host=host,
            error=error,
            marks=() if flight.marks is None else tuple(flight.marks),
            publish_ns=flight.publish_ns,
            wait_ns=(waited, time.perf_counter_ns()) if waited else (0, 0),
        )

    def _abandon(self, timeout: float, what: str) -> Collected:
        """Give up on the forward stream: every batch on it is abandoned, a fresh one takes over.

        The oldest batch fails with a `ForwardTimeout`; the batches queued behind it never run
        (their own `ForwardTimeout`). The returned predicate turns true once the old stream has
        got past everything submitted to it, i.e. once the abandoned forwards can no longer
        write the KV of their requests (it may never turn true).
        """
        flights = self._flights
        self._flights, self.num_in_flight = (), 0
        for flight in flights:
            with flight.lock:
                flight.abandoned = True
        old = self._stream
        if old is None and self._inline:
            # Launched inline: each forward's device work ends with its result's copy event.
            events = [f.result.copy_done for f in flights if f.result is not None]

            def drained() -> bool:
                return all(e is None or e.query() for e in events)

        elif old is None:
            raise RelayError("no forward stream to abandon (the forward ran inline)")
        else:
            drained = old.record_event().query
            old.abandon()
            self._stream = make_stream(self._device)
        first, *behind = flights
        queued = tuple(
            Collected(
                plan=f.plan,
                batch_id=f.batch_id,
                error=ForwardTimeout(
                    f"batch {f.batch_id} was queued behind batch {first.batch_id}, whose "
                    f"{what} timed out; it never ran"
                ),
            )
            for f in behind
        )
        return Collected(
            plan=first.plan,
            batch_id=first.batch_id,
            error=first.timeout_error(timeout, what),
            queued=queued,
            quarantine=drained,
        )

    def _run(self, flight: _Flight) -> None:
        marks = flight.marks
        if marks is not None:
            marks.append(time.perf_counter_ns())
        try:
            if not flight.abandoned:
                self._launch_on_stream(flight)
        finally:
            if flight.started is not None:
                flight.started.set()
            if marks is not None:
                marks.append(time.perf_counter_ns())

    def _launch_on_stream(self, flight: _Flight) -> None:
        batch = flight.plan.batch
        indices = batch.future_indices
        if indices is None:
            raise RelayError(f"batch {flight.batch_id} has no future indices")
        try:
            if flight.plan.prefill is not None:
                self._bind_mixed(batch, flight.plan.prefill, flight.plan.relay_rows)
            elif batch.forward_mode is ForwardMode.EXTEND:
                self._bind_extend_relay(batch, flight.plan.relay_rows)
            else:
                resolve_batch_seq_lens(self.future_map, batch)
                resolve_batch_forward_inputs(self.future_map, batch)
            positions, bounds = self._decode_frame(batch, flight.plan)
            publish = _PublishOnce(self.future_map, indices, flight, bounds)
            with self.isolator.forward_isolation(batch, speculative=self._speculative) as scope:
                forward = ForwardBatch.from_schedule(batch, positions=positions)
                on_publish = publish if self._overlap else None
                if flight.started is not None:
                    flight.started.set()
                if flight.marks is not None:
                    flight.marks.append(time.perf_counter_ns())
                with self._checker.acting(Role.WORKER):
                    try:
                        records = flight.plan.handoff
                        if records is None:
                            result = self._worker.forward_batch_generation(
                                forward, on_publish=on_publish
                            )
                        else:  # handed-off requests: their state is written, not computed
                            result = handoff_worker(self._worker).import_handoff(
                                forward, records, on_publish=on_publish
                            )
                    finally:
                        publish.returned = True  # a later call is refused
                check_result_type(result)
                if flight.marks is not None:
                    flight.marks.append(time.perf_counter_ns())
                scope.keep_alive(result.keep_alive_refs)
            with flight.lock:
                if flight.abandoned:
                    return  # the host gave up on this batch: touch nothing shared
                self._accept_result(flight, result, publish, indices)
        except BaseException as exc:  # handed to the host; the stream goes on
            # NOTE: BaseException too: a KeyboardInterrupt or a custom BaseException raised by
            # the worker must not poison the stream; the host re-raises the interrupting ones.
            with flight.lock:
                if flight.abandoned:
                    return
                flight.error = exc
                # Isolation restored the bindings: these are the inputs as resolved (if so).
                lens, ids = self._fallback(batch.seq_lens, indices, batch.input_ids)
                host = flight.plan.slots_host
                self.future_map.publish(indices, lens, host=host)
                self.future_map.stash(indices, RelayPayload(bonus_tokens=ids), host=host)

    def _accept_result(
        self,
        flight: _Flight,
        result: GenerationBatchResult,
        publish: _PublishOnce,
        indices: torch.Tensor,
    ) -> None:
        """Check the worker's result, relay its frontier and draft state, hand it to the host."""
        batch = flight.plan.batch
        seq_lens = batch.seq_lens
        if isinstance(seq_lens, Unresolved):  # isolation restored a resolved batch
            raise RelayError(f"batch {flight.batch_id}: frontier still unresolved")
        check_form(result, batch.batch_size, publish.published)
        if self._on_host:
            flight.host = HostResult.view(result, seq_lens, publish.published)
            self._check_values(flight.host, flight.plan)
        else:
            flight.copy = ResultCopy.start(result, seq_lens, publish.published)
        if publish.calls == 0 and result.new_seq_lens is not None:
            publish.publish(result.new_seq_lens)
        if result.next_draft_input is not None:
            self.future_map.stash(indices, result.next_draft_input, host=flight.plan.slots_host)
        flight.result = result

    def _host_result(self, flight: _Flight, timeout: float | None) -> HostResult | None:
        """The batch's result as host arrays, every value checked; None if the copy timed out.

        Raises:
            WorkerResultError: the values break the forward contract (on a device they are
                checked here, after the copy; on the host CPU the launch checked them before
                relaying), or a row's sampling flags disagree with the batch.
        """
        host = flight.host
        if host is None:
            if flight.copy is None:
                raise RelayError(f"batch {flight.batch_id} has a result but no copy of it")
            host = flight.copy.wait(timeout)
            if host is None:
                return None
            self._check_values(host, flight.plan)
            flight.host = host
        batch = flight.plan.batch
        check_sampling_rows(
            host,
            batch.sampling_info,
            request_ids=batch.request_ids,
            decode=flight.plan.is_decode,
            num_draft_steps=batch.num_draft_steps,
            budgets=None if batch.verify_budgets is None else batch.verify_budgets.host,
        )
        return host

    def _check_values(self, host: HostResult, plan: LaunchPlan) -> None:
        check_values(
            host,
            request_ids=plan.batch.request_ids,
            decode=plan.is_decode,
            max_accept=self._max_accept,
            vocab_size=self._vocab_size,
        )

    def _decode_frame(
        self, batch: ScheduleBatch, plan: LaunchPlan
    ) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor] | None]:
        """The forward's positions when the launch computes them (else None: the batch's
        own), and where a frontier may be relayed before it is checked (None on the host).

        Device path, decode: one operation, ``[3, b] = [0, 1, max_accept]^T + seq_lens``, whose
        rows are the round's positions (a fresh copy of ``seq_lens``) and the bounds
        ``[seq_lens + 1, seq_lens + max_accept]``.
        """
        seq_lens = batch.seq_lens
        if self._on_host or isinstance(seq_lens, Unresolved):
            return None, None
        if plan.is_decode:
            positions, lo, hi = (self._frame_offsets + seq_lens).unbind()
            return positions, (lo, hi)
        return None, (seq_lens, seq_lens)

    def _bind_extend_relay(self, batch: ScheduleBatch, rows: torch.Tensor | None) -> None:
        """Give rows that continue after a KV prefix the relay of their previous forward."""
        if rows is not None:
            batch.spec_info = self._relay_rows(batch, rows)

    def _bind_mixed(
        self, batch: ScheduleBatch, part: PrefillPart, rows: torch.Tensor | None
    ) -> None:
        """Late-bind the running tails of a MIXED batch: each extends its bonus at ``fresh``.

        Device work only: a tail's prefix and position is its device frontier, which the
        host does not know under overlap, so ``prefix_lens`` is a device tensor here.
        """
        if rows is None:
            raise RelayError("a mixed batch has running tails, so relayed rows")
        tails = self.future_map.resolve_mixed_tails(part.tail_slots, self._req_to_token)
        n = len(part.prefix_lens)
        batch.spec_info = self._relay_rows(batch, rows)
        bonus = batch.spec_info.bonus_tokens[n:]
        batch.input_ids = torch.cat([part.input_ids, bonus])
        batch.out_cache_loc = torch.cat([part.out_cache_loc, tails.out_cache_loc])
        batch.seq_lens = torch.cat([part.seq_lens, tails.seq_lens])
        batch.prefix_lens = torch.cat([part.prefix_lens_device, tails.prefix_lens])
        batch.positions = torch.cat([part.positions, tails.prefix_lens])
        batch.extend_lens = part.extend_lens + (1,) * part.tail_slots.numel()

    def _relay_rows(self, batch: ScheduleBatch, index: torch.Tensor) -> RelayPayload:
        """A batch-wide payload: the relayed inputs at rows ``index``, zeros elsewhere."""
        got = self.future_map.resolve_forward_inputs(batch.req_pool_indices[index])
        b = batch.batch_size

        def spread(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            full = t.new_zeros((b, *t.shape[1:]))
            return full.index_copy(0, index, t)

        bonus = got.bonus_tokens.new_zeros(b).index_copy(0, index, got.bonus_tokens)
        return RelayPayload(
            bonus_tokens=bonus,
            topk_p=spread(got.topk_p),
            topk_index=spread(got.topk_index),
            hidden_states=spread(got.hidden_states),
        )

    @staticmethod
    def _fallback(
        seq_lens: torch.Tensor | Unresolved,
        indices: torch.Tensor,
        input_ids: torch.Tensor | Unresolved | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Values to republish for a failed batch: its own inputs where known, else zeros."""
        zeros = torch.zeros_like(indices)
        lens = seq_lens if isinstance(seq_lens, torch.Tensor) else zeros
        ids = (
            input_ids
            if isinstance(input_ids, torch.Tensor) and input_ids.shape == indices.shape
            else zeros
        )
        return lens.clone(), ids.clone()
