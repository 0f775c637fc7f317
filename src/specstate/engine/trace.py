"""Traces: what the scheduler did, per round and per request, and when each stream was busy.

Hand a `TraceRecorder` to the engine (``Engine(..., trace=TraceRecorder())``) and it records

* **spans** on two tracks: the host (``schedule``, ``wait`` for a batch's result, ``settle``)
  and the forward stream (``resolve`` the relayed inputs, the worker's ``forward``, ``post``:
  check, copy, publish and stash), plus a ``publish`` instant when the worker hands over the
  next frontier; with grammar requests also ``grammar-mask``, ``grammar-advance`` and
  ``grammar-next-mask`` inside a forward and ``grammar-settle`` on the host
  (`specstate.grammar`);
* one **round** per settled batch: its mode, and per row (as columns) the request id, its
  incarnation, whether the row settled (a row of a request that ended meanwhile does not), the
  frontier the forward ran from and the one it published, the accept length and the bonus token
  (the last accepted), and after settlement ``kv_committed_len``, ``kv_allocated_len``,
  ``cache_protected_len`` and the number of outputs; the running batch size and free pages;
* **events**: submission (with the prompt length and ``max_new_tokens``), admission (with the
  tokens to prefill, prompt plus earlier outputs, and how many of them the prefix cache
  supplied), finish (with its reason), retraction and abort.

Recording adds no per-request Python to a round: a round is a handful of array copies. The
recorder keeps everything in memory; `TraceRecorder.write_jsonl` writes the documented JSONL
(schema ``specstate-trace``, version 1, below) and `chrome_trace` the Chrome / Perfetto
trace-event JSON (`specstate.tools.trace` reads the JSONL back). Timestamps are microseconds
since the recorder was made, on one clock (``time.perf_counter_ns``) for both tracks. On a CPU
the forward track is the stream thread's wall time; on CUDA it is the host's enqueue time of
the launch (device time is not read back).

JSONL, one object per line, in order::

    {"type": "header", "schema": "specstate-trace", "version": 1, "config": {...},
     "worker": {"algorithm", "num_draft_tokens", "max_accept"}}
    {"type": "span", "track": "host" | "forward", "name", "batch", "ts_us", "dur_us"}
    {"type": "publish", "batch", "ts_us"}
    {"type": "round", "batch", "mode", "verify", "ts_us", "running", "free_pages",
     "rows": {"id", "incarnation", "settled", "frontier_in", "frontier_out", "accept", "bonus",
              "committed", "allocated", "protected", "outputs"}}
    {"type": "event", "event": "submit" | "admit" | "finish" | "retract" | "abort", "id",
     "batch", "reason", "prompt_len"?, "max_new_tokens"?, "fill_tokens"?, "cached_tokens"?}
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import attrs
import numpy as np

__all__ = ["SCHEMA", "VERSION", "RoundRecord", "SpanRecord", "TraceRecorder"]

SCHEMA = "specstate-trace"
VERSION = 1
HOST, FORWARD = "host", "forward"


@attrs.frozen
class SpanRecord:
    """One span of one track, in microseconds since the recorder started."""

    track: str
    name: str
    batch: int
    ts_us: float
    dur_us: float


@attrs.frozen
class RoundRecord:
    """One settled batch: its mode and per-row columns (see the module docstring)."""

    batch: int
    mode: str
    verify: bool
    ts_us: float
    running: int
    free_pages: int
    rows: Mapping[str, Any]  # column name -> tuple or NumPy array, one entry per row


class TraceRecorder:
    """In-memory recorder of spans, rounds and events (see the module docstring)."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter_ns()
        self.header: dict[str, Any] = {}
        self.spans: list[SpanRecord] = []
        self.publishes: list[tuple[int, float]] = []  # (batch, ts_us)
        self.rounds: list[RoundRecord] = []
        self.events: list[dict[str, Any]] = []

    # ---------------------------------------------------------------- recording
    @staticmethod
    def now() -> int:
        """The recorder's clock (nanoseconds; one clock for every thread)."""
        return time.perf_counter_ns()

    def _us(self, ns: int) -> float:
        return (ns - self._t0) / 1e3

    def span(self, track: str, name: str, batch: int, start_ns: int, end_ns: int) -> None:
        """Record a span of ``track``."""
        self.spans.append(
            SpanRecord(track, name, batch, self._us(start_ns), (end_ns - start_ns) / 1e3)
        )

    def publish(self, batch: int, at_ns: int) -> None:
        """Record the instant a forward published its frontier."""
        self.publishes.append((batch, self._us(at_ns)))

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
        """Record one settled batch (columns are kept as given: copy arrays that change)."""
        self.rounds.append(
            RoundRecord(batch, mode, verify, self._us(at_ns), running, free_pages, rows)
        )

    def event(
        self, event: str, request_id: str, batch: int, reason: str = "", **fields: int
    ) -> None:
        """Record a request event: ``submit`` (with ``prompt_len`` and ``max_new_tokens``),
        ``admit`` (with ``fill_tokens`` and ``cached_tokens``), ``finish`` (with its reason),
        ``retract`` or ``abort``."""
        self.events.append(
            {
                "type": "event",
                "event": event,
                "id": request_id,
                "batch": batch,
                "reason": reason,
                **fields,
            }
        )

    # ------------------------------------------------------------------ writing
    def records(self) -> Iterator[dict[str, Any]]:
        """Every record as a JSON-ready dict, in the JSONL order of the module docstring."""
        yield {"type": "header", "schema": SCHEMA, "version": VERSION, **self.header}
        for s in self.spans:
            yield {"type": "span", **attrs.asdict(s)}
        for batch, ts in self.publishes:
            yield {"type": "publish", "batch": batch, "ts_us": ts}
        for r in self.rounds:
            yield {
                "type": "round",
                "batch": r.batch,
                "mode": r.mode,
                "verify": r.verify,
                "ts_us": r.ts_us,
                "running": r.running,
                "free_pages": r.free_pages,
                "rows": {k: _jsonable(v) for k, v in r.rows.items()},
            }
        yield from self.events

    def write_jsonl(self, path: str | Path) -> None:
        """Write the trace as JSONL (schema ``specstate-trace`` version 1)."""
        with Path(path).open("w", encoding="utf-8") as f:
            for record in self.records():
                f.write(json.dumps(record) + "\n")

    def chrome_trace(self, *, pid: int = 1, name: str = "specstate") -> list[dict[str, Any]]:
        """This trace as Chrome / Perfetto trace events (see `chrome_events`)."""
        return chrome_events(list(self.records()), pid=pid, name=name)


def _jsonable(value: Any) -> Any:
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, tuple):
        return list(value)
    return value


_TIDS = {HOST: 1, FORWARD: 2}


def chrome_events(
    records: list[dict[str, Any]], *, pid: int = 1, name: str = "specstate"
) -> list[dict[str, Any]]:
    """Trace-event JSON of JSONL records: one process, a host and a forward-stream track.

    Spans are complete events (``ph`` X) on their track; a publish is an instant (``i``) on the
    forward track with a flow arrow (``s`` → ``f``) to the resolve of the next batch; counters
    (``C``) carry the running batch size, the free pages and each decode round's mean accept
    length.
    """
    events: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 1, "args": {"name": "host"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": 2, "args": {"name": "forward"}},
    ]
    resolve_at: dict[int, float] = {}
    for r in records:
        if r["type"] == "span":
            events.append(
                {
                    "ph": "X",
                    "name": r["name"],
                    "cat": r["track"],
                    "pid": pid,
                    "tid": _TIDS[r["track"]],
                    "ts": r["ts_us"],
                    "dur": r["dur_us"],
                    "args": {"batch": r["batch"]},
                }
            )
            if r["name"] == "resolve":
                resolve_at[r["batch"]] = r["ts_us"]
    for r in records:
        if r["type"] == "publish":
            batch, ts = r["batch"], r["ts_us"]
            events.append({"ph": "i", "s": "t", "name": "publish", "pid": pid, "tid": 2, "ts": ts})
            end = resolve_at.get(batch + 1)
            if end is not None and end >= ts:
                flow = {"name": "relay", "cat": "relay", "id": batch, "pid": pid, "tid": 2}
                events.append({"ph": "s", "ts": ts, **flow})
                events.append({"ph": "f", "bp": "e", "ts": end, **flow})
        elif r["type"] == "round":
            ts = r["ts_us"]
            args: dict[str, float] = {"running": r["running"], "free_pages": r["free_pages"]}
            events.append({"ph": "C", "name": "engine", "pid": pid, "ts": ts, "args": args})
            if r["verify"]:
                rows = r["rows"]
                accept = [a for a, s in zip(rows["accept"], rows["settled"], strict=True) if s]
                if accept:
                    mean = {"tokens": sum(accept) / len(accept)}
                    counter = {"ph": "C", "name": "mean accept", "pid": pid, "ts": ts}
                    events.append({**counter, "args": mean})
    return events
