"""The role loops over an in-memory `HandoffTransport` (one process, no spawn): the interface is
all they need, and a decode side that never answers fails the prefill side's requests within the
acknowledgement timeout, every page freed."""

from __future__ import annotations

import queue
import time

import pytest
from engine_driver import checked_config
from handoff_harness import pools_full
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.handoff.codec import decode, encode
from specstate.handoff.record import HandoffRecord
from specstate.handoff.transport import (
    Ack,
    Arrival,
    Closed,
    HandoffTransport,
    Message,
    serve_decode,
    serve_prefill,
)


class QueueTransport:
    """One end of an in-memory pair: what it sends, the other end polls."""

    def __init__(self, outbox: queue.Queue[Message], inbox: queue.Queue[Message]) -> None:
        self._outbox, self._inbox = outbox, inbox

    @classmethod
    def pair(cls) -> tuple[QueueTransport, QueueTransport]:
        a: queue.Queue[Message] = queue.Queue()
        b: queue.Queue[Message] = queue.Queue()
        return cls(a, b), cls(b, a)

    def send_record(self, record: HandoffRecord) -> int:
        wire = encode(record)
        self._outbox.put(Arrival(record=decode(wire), request_id=record.request_id))
        return sum(t.numel() * t.element_size() for t in wire)

    def send_ack(self, ack: Ack) -> None:
        self._outbox.put(ack)

    def send_close(self) -> None:
        self._outbox.put(Closed())

    def poll(self, timeout_s: float) -> Message | None:
        try:
            return self._inbox.get(timeout=timeout_s) if timeout_s > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return None


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("loops"))


def _engine(ckpt: SpecCheckpoints) -> Engine:
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    return Engine(ckpt.worker("eagle"), limits=limits, config=checked_config(page_size=4))


REQUESTS = [
    (f"r{i}", list(p), SamplingParams(max_new_tokens=8)) for i, p in enumerate(MIXED_PROMPTS)
]


def test_the_role_loops_over_any_transport(ckpt: SpecCheckpoints) -> None:
    """The prefill loop's sends are answered by the decode loop run after it on the other end
    (sends queue up): HF's greedy tokens, every request handed off."""
    ours, theirs = QueueTransport.pair()
    assert isinstance(ours, HandoffTransport)
    with _engine(ckpt) as prefill, _engine(ckpt) as decoder:
        # The prefill loop waits for each acknowledgement: answer it from a decode loop that
        # runs in between, as another process would (here: on the prefill loop's thread).
        def answer(record: HandoffRecord) -> HandoffRecord:
            theirs.send_ack(Ack(request_id=record.request_id, ok=True))
            return record

        reqs = serve_prefill(
            prefill, ours, REQUESTS, ack_timeout_s=5.0, after_step=check_engine, on_export=answer
        )
        outcome = serve_decode(decoder, theirs, idle_timeout_s=5.0, after_step=check_engine)
        assert {r.finish.reason.value for r in reqs.values() if r.finish} == {"handed_off"}
        assert outcome.failure is None
        want = {rid: greedy(ckpt.hf, p, 8) for rid, p, _ in REQUESTS}
        assert {rid: list(r.emitted_ids) for rid, r in outcome.requests.items()} == want
        assert pools_full(prefill) and pools_full(decoder)


def test_a_silent_decode_side_fails_requests_within_the_timeout(ckpt: SpecCheckpoints) -> None:
    """No acknowledgement within ``ack_timeout_s``: the first request fails naming it, the rest
    fail at once; every page is freed."""
    ours, _ = QueueTransport.pair()
    with _engine(ckpt) as prefill:
        started = time.monotonic()
        reqs = serve_prefill(prefill, ours, REQUESTS, ack_timeout_s=0.3, after_step=check_engine)
        elapsed = time.monotonic() - started
        details = [r.finish.detail for r in reqs.values() if r.finish]
        assert len(details) == len(REQUESTS)
        assert all("no acknowledgement" in d and "0.3 s" in d for d in details)
        assert sum(d.startswith("handoff failed: ") for d in details) == 1
        assert sum(d.startswith("decode side unavailable: ") for d in details) == len(REQUESTS) - 1
        assert pools_full(prefill) and elapsed < 5.0


def test_a_silent_prefill_side_ends_the_decode_loop(ckpt: SpecCheckpoints) -> None:
    """Nothing arrives within ``idle_timeout_s``: the decode loop returns the failure."""
    _, theirs = QueueTransport.pair()
    with _engine(ckpt) as decoder:
        started = time.monotonic()
        outcome = serve_decode(decoder, theirs, idle_timeout_s=0.3)
        assert outcome.failure is not None and "0.3 s" in outcome.failure
        assert time.monotonic() - started < 5.0 and pools_full(decoder)
