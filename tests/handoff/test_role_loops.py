"""The role loops over an in-memory `HandoffTransport` (one process, no spawn): the interface is
all they need, and a decode side that never answers fails the prefill side's requests within the
acknowledgement timeout, every page freed."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable

import pytest
from engine_driver import checked_config
from handoff_harness import QueueTransport, pools_full
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.handoff.record import HandoffRecord
from specstate.handoff.transport import (
    Ack,
    Arrival,
    HandoffTransport,
    Message,
    serve_decode,
    serve_prefill,
)


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


class LateTransport(QueueTransport):
    """Each record lands ``delay`` polls after it was sent (its KV still in flight until then);
    ``on_land`` runs just before a record is handed over."""

    def __init__(
        self,
        outbox: queue.Queue[Message],
        inbox: queue.Queue[Message],
        *,
        delay: int,
        on_land: Callable[[str], None],
    ) -> None:
        super().__init__(outbox, inbox)
        self._delay, self._on_land = delay, on_land
        self._held: Message | None = None
        self._left = 0

    def poll(self, timeout_s: float) -> Message | None:
        if self._held is None:
            message = super().poll(timeout_s)
            if not isinstance(message, Arrival):
                return message
            self._held, self._left = message, self._delay
        if self._left > 0:
            self._left -= 1
            return None
        message, self._held = self._held, None
        assert isinstance(message, Arrival)
        self._on_land(message.request_id)
        return message


def test_a_record_joins_only_once_landed_while_the_decode_engine_keeps_decoding(
    ckpt: SpecCheckpoints,
) -> None:
    """While a record is in flight the decode engine keeps stepping its running requests; the
    request is unknown to it until every tensor has landed."""
    prefill_end, decode_end = QueueTransport.pair()
    seen: dict[str, tuple[bool, int]] = {}
    with _engine(ckpt) as prefill, _engine(ckpt) as decoder:

        def on_land(request_id: str) -> None:
            known = decoder.lifecycle.find(request_id) is not None
            first = decoder.lifecycle.find("r0")
            seen[request_id] = (known, 0 if first is None else first.num_outputs)

        late = LateTransport(decode_end._outbox, decode_end._inbox, delay=4, on_land=on_land)

        def answer(record: HandoffRecord) -> HandoffRecord:
            prefill_end._inbox.put(Ack(request_id=record.request_id, ok=True))
            return record

        serve_prefill(prefill, prefill_end, REQUESTS[:2], ack_timeout_s=5.0, on_export=answer)
        outcome = serve_decode(decoder, late, idle_timeout_s=5.0, after_step=check_engine)
        assert seen["r0"][0] is False and seen["r1"][0] is False  # unknown until landed
        assert seen["r1"][1] > 1  # r0 decoded on while r1's record was in flight
        want = {rid: greedy(ckpt.hf, p, 8) for rid, p, _ in REQUESTS[:2]}
        assert {rid: list(r.emitted_ids) for rid, r in outcome.requests.items()} == want
        assert pools_full(decoder)
