"""Tracing as a capability of the round, and the guard that contains a user's recorder.

`Engine(trace=recorder)` adds a `TraceHook` to the round: at its hook points
(`specstate.engine.hooks`) it records the host's spans (schedule, wait, settle), the forward's
spans from the launcher's clock marks, one round record per settled batch (a handful of array
copies, no per-request Python) and the submit, admit, retract, finish and abort events.
An engine with no recorder has no hook: tracing then costs nothing.

The recorder is called from inside `Engine.submit` and `Engine.step`, after the round's state has
changed. A recorder is user code when it is a
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
from typing import TYPE_CHECKING, Any

import numpy as np

from specstate.core.ledger import LedgerReader
from specstate.core.request import Req
from specstate.engine.hooks import RoundHook
from specstate.engine.trace import FORWARD, HOST, TraceRecorder

if TYPE_CHECKING:
    from specstate.batch.plan import LaunchPlan
    from specstate.engine.config import StepReport
    from specstate.engine.launch.outcome import Collected
    from specstate.engine.schedule.scheduler import Scheduler
    from specstate.engine.settle.outputs import OutputTable
    from specstate.engine.settle.results import Settlement
    from specstate.memory.allocation import KvAllocator

__all__ = ["ContainedRecorder", "TraceHook"]

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


class TraceHook(RoundHook):
    """Records the round into a (contained) recorder at the round's hook points.

    The owners it is given are read, never written: the ledger, the output table, the
    scheduler (admitted requests, running count) and the allocator (free pages).

    Args:
        recorder: where the records go (the engine wraps the user's in `ContainedRecorder`).
    """

    def __init__(
        self,
        recorder: TraceRecorder,
        *,
        ledger: LedgerReader,
        outputs: OutputTable,
        scheduler: Scheduler,
        allocator: KvAllocator,
    ) -> None:
        self.recorder = recorder
        self._ledger = ledger
        self._outputs = outputs
        self._scheduler = scheduler
        self._allocator = allocator
        self._step_ns = 0
        self._launched = 0  # the last batch launched (events name the batch they happened at)

    def on_submit(self, req: Req) -> None:
        """A ``submit`` event."""
        self.recorder.event(
            "submit",
            req.request_id,
            self._launched,
            prompt_len=len(req.prompt_ids),
            max_new_tokens=req.sampling.max_new_tokens,
        )

    def on_step(self) -> None:
        """The step's start: the schedule span begins."""
        self._step_ns = self.recorder.now()

    def on_launch(self, plan: LaunchPlan | None, batch_id: int) -> None:
        """The ``schedule`` span of a step that launches."""
        if plan is not None:
            self._launched = batch_id
            rec = self.recorder
            rec.span(HOST, "schedule", batch_id, self._step_ns, rec.now())

    def on_settled(self, flight: Collected, settlement: Settlement | None) -> None:
        """The ``wait`` and ``settle`` spans, the round record and the forward's spans."""
        rec = self.recorder
        waited, settling = flight.wait_ns
        if waited:
            rec.span(HOST, "wait", flight.batch_id, waited, settling)
        if flight.host is not None and settlement is not None:
            self._record_round(flight, settlement)
        if waited:
            rec.span(HOST, "settle", flight.batch_id, settling, rec.now())
        _record_forward(rec, flight)

    def on_end(self, report: StepReport) -> None:
        """The step's ``admit``, ``retract``, ``finish`` and ``abort`` events."""
        rec, batch = self.recorder, self._launched
        for req in self._scheduler.admitted:
            rec.event(
                "admit",
                req.request_id,
                batch,
                fill_tokens=req.seqlen,
                cached_tokens=req.cached_tokens,
            )
        for rid in report.retracted:
            rec.event("retract", rid, batch)
        for req in report.ended:
            finish = req.finish
            reason = "" if finish is None else finish.reason.value
            rec.event("abort" if reason == "abort" else "finish", req.request_id, batch, reason)

    def _record_round(self, flight: Collected, settlement: Settlement) -> None:
        """One round of the trace: a handful of array copies, no per-request Python."""
        plan, host = flight.plan, flight.host
        assert host is not None  # on_settled records only a settled result
        slots = plan.slots_host
        committed, allocated = self._ledger.host_lengths(slots)
        accept = np.array(host.accept, dtype=np.int64)
        last = np.maximum(accept, 1) - 1
        rows = {
            "id": plan.batch.request_ids,
            "incarnation": plan.batch.incarnations,
            "settled": settlement.live.copy(),
            "frontier_in": np.array(host.seq_lens, dtype=np.int64),
            "frontier_out": None if host.frontier is None else np.array(host.frontier),
            "accept": accept,
            "bonus": host.tokens[np.arange(accept.size), last].astype(np.int64),
            "committed": committed,
            "allocated": allocated,
            "protected": self._ledger.host_protected(slots),
            "outputs": self._outputs.lengths(slots),
        }
        self.recorder.round(
            batch=flight.batch_id,
            mode=plan.batch.forward_mode.value,
            verify=plan.is_decode,
            at_ns=self.recorder.now(),
            running=self._scheduler.num_running,
            free_pages=self._allocator.token_pool.available_pages(),
            rows=rows,
        )


def _record_forward(rec: TraceRecorder, flight: Collected) -> None:
    """The forward track of a batch from its closure's clock marks (read after it ran)."""
    marks = flight.marks
    if not marks:
        return
    if len(marks) == 4:  # start, worker called, worker returned, end
        start, called, returned, end = marks
        rec.span(FORWARD, "resolve", flight.batch_id, start, called)
        rec.span(FORWARD, "forward", flight.batch_id, called, returned)
        rec.span(FORWARD, "post", flight.batch_id, returned, end)
    else:  # the closure failed before or inside the worker
        rec.span(FORWARD, "failed", flight.batch_id, marks[0], marks[-1])
    if flight.publish_ns:
        rec.publish(flight.batch_id, flight.publish_ns)
