"""Test-only: a prefill engine and a decode engine linked in one process, every check on, and the
reference run of the same requests on one engine."""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import attrs
from engine_driver import checked_config, run_checked

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerProtocol
from specstate.handoff.codec import decode, encode
from specstate.handoff.link import HandoffLink, serve_disaggregated
from specstate.handoff.record import HandoffRecord
from specstate.handoff.transport import (
    Ack,
    Arrival,
    Closed,
    Message,
    RemoteAbort,
    RemoteEnd,
    RemoteSubmit,
)


@attrs.frozen(kw_only=True)
class PdRun:
    """What a prefill → decode run emitted, and what each engine did."""

    outputs: dict[str, list[int]]
    accepts: dict[str, tuple[int, ...]]  # accept length of every verify (the drafter's state)
    finish: dict[str, str]
    prefill_tokens_on_decode: int  # tokens the decode worker's target prefilled
    drafter_prefill_tokens_on_decode: int  # tokens the decode worker's drafter prefilled
    mean_accept: float
    handoffs: int
    decode_cached_tokens: int  # prompt tokens the decode engine's prefix cache supplied


class PrefillCounter:
    """Counts the tokens a reference worker's target and drafter prefill (its real methods run)."""

    def __init__(self, worker: Any) -> None:
        self.target_tokens = 0
        self.drafter_tokens = 0
        extend, draft_prefill = worker._target.extend, worker._draft_prefill

        def counted_extend(batch: Any, sampler: Any) -> Any:
            self.target_tokens += sum(batch.extend_lens)
            return extend(batch, sampler)

        def counted_draft_prefill(batch: Any, out: Any) -> Any:
            self.drafter_tokens += sum(batch.extend_lens)
            return draft_prefill(batch, out)

        worker._target.extend = counted_extend
        worker._draft_prefill = counted_draft_prefill


def pools_full(engine: Engine) -> bool:
    """Every page free (or cached and unreferenced) and no slot open."""
    snap = engine.snapshot()
    return snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages


@contextmanager
def linked(
    prefill_worker: WorkerProtocol,
    decode_worker: WorkerProtocol,
    *,
    vocab_size: int,
    prefill_options: dict[str, Any] | None = None,
    limits: RequestLimits | None = None,
    **options: Any,
) -> Iterator[HandoffLink]:
    """Two checked engines (``options`` for both; ``prefill_options`` override the prefill's);
    ``limits`` default to the vocabulary and a 64-token context."""
    limits = limits or RequestLimits(vocab_size=vocab_size, max_context_len=64)
    prefill = Engine(
        prefill_worker,
        limits=limits,
        config=checked_config(**{**options, **(prefill_options or {})}),
    )
    decode = Engine(decode_worker, limits=limits, config=checked_config(**options))
    try:
        yield HandoffLink(prefill, decode)
    finally:
        prefill.close()
        decode.close()


def run_pd(
    prefill_worker: WorkerProtocol,
    decode_worker: WorkerProtocol,
    waves: Sequence[Sequence[tuple[str, Sequence[int], SamplingParams]]],
    *,
    vocab_size: int,
    limits: RequestLimits | None = None,
    **options: Any,
) -> PdRun:
    """Serve each wave of requests prefill → decode to idle in turn (a later wave can hit the
    prefix caches an earlier one filled), with the invariant checker after every step of both
    engines; both pools must be back to full after each wave."""
    counter = PrefillCounter(decode_worker)
    with linked(
        prefill_worker, decode_worker, vocab_size=vocab_size, limits=limits, **options
    ) as link:
        reqs = {}
        for wave in waves:
            reqs.update(serve_disaggregated(link, wave, after_step=check_engine))
            assert pools_full(link.prefill) and pools_full(link.decode)
        decoded = [r for r in reqs.values() if r.finish and r.finish.reason.value != "handed_off"]
        return PdRun(
            outputs={rid: list(r.emitted_ids) for rid, r in reqs.items()},
            accepts={rid: r.accept_lengths for rid, r in reqs.items()},
            finish={rid: r.finish.reason.value for rid, r in reqs.items() if r.finish},
            prefill_tokens_on_decode=counter.target_tokens,
            drafter_prefill_tokens_on_decode=counter.drafter_tokens,
            mean_accept=link.decode.snapshot().metrics.mean_accept_length,
            handoffs=link.stats.handoffs,
            decode_cached_tokens=sum(r.cached_tokens for r in decoded),
        )


def run_one(
    worker: WorkerProtocol,
    waves: Sequence[Sequence[tuple[str, Sequence[int], SamplingParams]]],
    *,
    vocab_size: int,
    limits: RequestLimits | None = None,
    **options: Any,
) -> tuple[dict[str, list[int]], dict[str, tuple[int, ...]]]:
    """The same waves on one checked engine: outputs and accept lengths by id."""
    limits = limits or RequestLimits(vocab_size=vocab_size, max_context_len=64)
    out: dict[str, list[int]] = {}
    accepts: dict[str, tuple[int, ...]] = {}
    with Engine(worker, limits=limits, config=checked_config(**options)) as engine:
        for wave in waves:
            reqs = [engine.submit(rid, p, s) for rid, p, s in wave]
            run_checked(engine)
            assert pools_full(engine)
            out.update({r.request_id: list(r.emitted_ids) for r in reqs})
            accepts.update({r.request_id: r.accept_lengths for r in reqs})
    return out, accepts


class QueueTransport:
    """One end of an in-memory pair: what it sends, the other end polls (a `HandoffTransport`,
    and a `FrontDoorTransport`: the front door's messages too)."""

    def __init__(self, outbox: queue.Queue[Message], inbox: queue.Queue[Message]) -> None:
        self._outbox, self._inbox = outbox, inbox

    @classmethod
    def pair(cls) -> tuple[QueueTransport, QueueTransport]:
        a: queue.Queue[Message] = queue.Queue()
        b: queue.Queue[Message] = queue.Queue()
        return cls(a, b), cls(b, a)

    def send_record(self, record: HandoffRecord) -> int:
        wire = encode(record)
        num_bytes = sum(t.numel() * t.element_size() for t in wire)
        arrival = Arrival(record=decode(wire), request_id=record.request_id, num_bytes=num_bytes)
        self._outbox.put(arrival)
        return num_bytes

    def send_ack(self, ack: Ack) -> None:
        self._outbox.put(ack)

    def send_close(self) -> None:
        self._outbox.put(Closed())

    def send_submit(self, message: RemoteSubmit) -> None:
        self._outbox.put(message)

    def send_abort(self, message: RemoteAbort) -> None:
        self._outbox.put(message)

    def send_end(self, message: RemoteEnd) -> None:
        self._outbox.put(message)

    def poll(self, timeout_s: float) -> Message | None:
        try:
            return self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None
