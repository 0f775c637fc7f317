"""`AsyncEngine` over a decode engine fed by a prefill loop (``serve_prefill(remote=True)``), in
one process over the in-memory transport: the front door of ``specstate serve --prefill``
without the processes (tests/tools/test_serve_pd.py runs the command itself).

Each request is prefilled by the prefill engine (its own thread, as the spawned process runs
it), crosses as a record, and streams from the decode engine: the tokens are HF's greedy ones,
each delivered once (the first, sampled on the prefill side, included); a request that ends at
its first token ends on the prefill side and its stream still gets it. A client abort while its
record is on the way frees both sides; a prefill side that dies or falls silent ends the waiting
requests with an error and refuses new ones, within a bound. Every test ends with both engines'
pools back to their start.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import attrs
import pytest
from engine_driver import checked_config, run_checked
from handoff_harness import PrefillCounter, QueueTransport, pools_full
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import FinishReason, RequestLimits, SamplingParams
from specstate.core.errors import EngineUnavailable, HandoffFailed, InvalidRequest
from specstate.core.request import TopLogprobs
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.stream import TokenEvent
from specstate.handoff.transport import Arrival, FrontDoorTransport, Message, serve_prefill
from specstate.serving.async_engine import AsyncEngine
from specstate.serving.driver import RemotePrefill

BOUND_S = 60.0
NEW = 8


class FrontEnd(QueueTransport):
    """The front door's end: records can be held back (still in flight), and the prefill side
    can die (every call then fails as a closed connection does)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.hold = False
        self.held: list[Message] = []
        self.dead = threading.Event()

    def poll(self, timeout_s: float) -> Message | None:
        if self.dead.is_set():
            raise HandoffFailed("rank 0: connection closed by peer")
        if not self.hold and self.held:
            return self.held.pop(0)
        message = super().poll(timeout_s)
        if self.hold and isinstance(message, Arrival):
            self.held.append(message)
            return None
        return message


class PrefillEnd(QueueTransport):
    """The prefill side's end: once the front end's ``dead`` is set it fails too."""

    def __init__(self, *args: object, dead: threading.Event, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._dead = dead

    def poll(self, timeout_s: float) -> Message | None:
        if self._dead.is_set():
            raise HandoffFailed("rank 1: connection closed by peer")
        return super().poll(timeout_s)


@attrs.define
class Pair:
    front: AsyncEngine
    transport: FrontEnd
    prefill_thread: threading.Thread
    prefill_pools_full: list[bool]  # set by the prefill thread when its loop returned
    prefill_finish: dict[str, tuple[str, str]]
    decode_prefills: PrefillCounter  # what the decode worker's target and drafter prefilled


def _engine(ckpt: SpecCheckpoints, counter: list[PrefillCounter] | None = None) -> Engine:
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    worker = ckpt.worker("eagle")
    if counter is not None:
        counter.append(PrefillCounter(worker))
    return Engine(worker, limits=limits, config=checked_config(page_size=4))


@contextmanager
def _pair(ckpt: SpecCheckpoints, *, handoff_timeout_s: float = BOUND_S) -> Iterator[Pair]:
    """A decode engine behind an `AsyncEngine` and a prefill loop on a thread of its own."""
    import queue

    a: queue.Queue[Message] = queue.Queue()
    b: queue.Queue[Message] = queue.Queue()
    front_end = FrontEnd(a, b)
    prefill_end = PrefillEnd(b, a, dead=front_end.dead)
    assert isinstance(front_end, FrontDoorTransport)
    prefill_engine = _engine(ckpt)
    pools: list[bool] = []
    finish: dict[str, tuple[str, str]] = {}

    def run_prefill() -> None:
        with prefill_engine:
            reqs = serve_prefill(
                prefill_engine, prefill_end, (), remote=True, after_step=check_engine
            )
            pools.append(pools_full(prefill_engine))
            finish.update(
                {
                    rid: (r.finish.reason.value, r.finish.detail)
                    for rid, r in reqs.items()
                    if r.finish
                }
            )

    thread = threading.Thread(target=run_prefill, daemon=True)
    thread.start()
    remote = RemotePrefill(transport=front_end, handoff_timeout_s=handoff_timeout_s)
    counter: list[PrefillCounter] = []
    front = AsyncEngine(_engine(ckpt, counter), remote_prefill=remote)
    try:
        yield Pair(front, front_end, thread, pools, finish, counter[0])
    finally:
        asyncio.run(asyncio.wait_for(front.close(), BOUND_S))
        thread.join(BOUND_S)
    assert not thread.is_alive(), "the prefill loop did not end once the front door closed"


async def _collect(
    front: AsyncEngine, rid: str, prompt: tuple[int, ...], n: int
) -> list[TokenEvent]:
    return [e async for e in front.generate(rid, prompt, SamplingParams(max_new_tokens=n))]


def _tokens(events: list[TokenEvent]) -> list[int]:
    return [t for e in events for t in e.tokens]


def test_streams_read_hf_tokens_from_the_decode_side_each_once(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """Concurrent requests through prefill → decode: every stream's tokens are HF's greedy
    ones, each delivered once; a one-token request ends on the prefill side with its token;
    the decode worker prefilled nothing (target nor drafter); the handoff metrics count each
    record; both pools end full."""
    ckpt = partial_ckpt
    prompts = [tuple(p) for p in MIXED_PROMPTS]
    with _pair(ckpt) as pair:

        async def scenario() -> tuple[list[list[TokenEvent]], list[TokenEvent], bool]:
            runs = [_collect(pair.front, f"r{i}", p, NEW) for i, p in enumerate(prompts)]
            streams = await asyncio.gather(*runs, _collect(pair.front, "one", prompts[0], 1))
            await pair.front.wait_idle()
            return list(streams[:-1]), streams[-1], await pair.front.read(pools_full)

        streams, one, decode_full = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
        metrics = pair.front.handoff_metrics
        assert metrics is not None
        snap = metrics.snapshot()
    want = [greedy(ckpt.hf, p, NEW) for p in prompts]
    assert [_tokens(events) for events in streams] == want
    for events in streams:
        assert events[-1].finish is not None and events[-1].finish.reason is FinishReason.LENGTH
    assert _tokens(one) == want[0][:1]
    assert one[-1].finish is not None and one[-1].finish.reason is FinishReason.LENGTH
    assert snap.num_handoffs == len(prompts) and snap.num_failures == 0
    assert snap.num_bytes > 0 and snap.transfer.count == len(prompts)
    assert decode_full and pair.prefill_pools_full == [True]
    assert pair.decode_prefills.target_tokens == 0 and pair.decode_prefills.drafter_tokens == 0
    assert pair.prefill_finish["one"][0] == "length"
    assert {pair.prefill_finish[f"r{i}"][0] for i in range(len(prompts))} == {"handed_off"}


def test_a_client_abort_while_the_record_is_in_flight_frees_both_sides(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """The record is exported but held on the way; the client aborts: its stream ends with
    ABORT at once, the record that lands later is refused (never admitted), the prefill side
    ends the request with ERROR naming the refusal; both pools end full."""
    with _pair(partial_ckpt) as pair:
        pair.transport.hold = True

        async def scenario() -> tuple[list[TokenEvent], tuple[int, int], bool]:
            stream = await pair.front.submit(
                "r", MIXED_PROMPTS[0], SamplingParams(max_new_tokens=NEW)
            )
            deadline = time.monotonic() + BOUND_S
            while not pair.transport.held and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # the record was sent: it is on the way
            assert pair.transport.held
            assert await pair.front.abort("r")
            async with stream:
                events = [e async for e in stream]
            pair.transport.hold = False  # it lands now
            deadline = time.monotonic() + BOUND_S
            while pair.transport.held and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await pair.front.wait_idle()
            counts = await pair.front.read(lambda e: e.handoff_counts)
            return events, counts, await pair.front.read(pools_full)

        events, counts, decode_full = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
        assert events[-1].finish is not None and events[-1].finish.reason is FinishReason.ABORT
        assert _tokens(events) == []
        assert counts == (0, 0) and decode_full  # never admitted on the decode side
        metrics = pair.front.handoff_metrics
        assert metrics is not None and metrics.snapshot().num_failures == 1
    assert pair.prefill_pools_full == [True]
    reason, detail = pair.prefill_finish["r"]
    assert reason == "error" and "no longer live on the decode side" in detail


def test_a_dead_prefill_side_fails_waiting_and_new_requests_within_a_bound(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """The prefill side dies while a request waits on it: that stream ends with ERROR naming
    it, a new request is refused with `EngineUnavailable`, /health's failure is set; within
    the bound; the decode pool stays full."""
    with _pair(partial_ckpt) as pair:
        pair.transport.hold = True

        async def scenario() -> tuple[list[TokenEvent], float, bool]:
            stream = await pair.front.submit(
                "r", MIXED_PROMPTS[0], SamplingParams(max_new_tokens=NEW)
            )
            deadline = time.monotonic() + BOUND_S
            while not pair.transport.held and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            pair.transport.dead.set()
            started = time.monotonic()
            async with stream:
                events = [e async for e in stream]
            elapsed = time.monotonic() - started
            with pytest.raises(EngineUnavailable, match="the prefill side is unavailable"):
                await pair.front.submit("new", (1, 2), SamplingParams(max_new_tokens=2))
            return events, elapsed, await pair.front.read(pools_full)

        events, elapsed, decode_full = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
        finish = events[-1].finish
        assert finish is not None and finish.reason is FinishReason.ERROR
        assert "the prefill side is unavailable" in finish.detail and elapsed < 5.0
        assert pair.front.prefill_failure is not None and decode_full
    assert pair.prefill_pools_full == [True]  # the prefill loop ended, its request freed


def test_a_silent_prefill_side_fails_the_request_at_the_handoff_timeout(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """No record (nor end) within ``handoff_timeout_s``: the stream ends with ERROR naming
    the timeout; the prefill side is told to abort it, and frees it."""
    with _pair(partial_ckpt, handoff_timeout_s=0.5) as pair:
        pair.transport.hold = True  # the record never lands

        async def scenario() -> list[TokenEvent]:
            return await _collect(pair.front, "r", MIXED_PROMPTS[0], NEW)

        started = time.monotonic()
        events = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
        finish = events[-1].finish
        assert finish is not None and finish.reason is FinishReason.ERROR
        assert "no record from the prefill side within 0.5 s" in finish.detail
        assert time.monotonic() - started < 10.0
    assert pair.prefill_pools_full == [True]


def test_a_request_the_prefill_side_refuses_is_refused_at_submit(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """Validation happens on the prefill engine: a bad request raises `InvalidRequest` from
    `submit`, as on one engine (here: a prompt token past the vocabulary)."""
    with _pair(partial_ckpt) as pair:

        async def scenario() -> None:
            sampling = SamplingParams(max_new_tokens=2)
            with pytest.raises(InvalidRequest, match="vocab"):
                await pair.front.submit("r", (1, partial_ckpt.vocab_size), sampling)

        asyncio.run(asyncio.wait_for(scenario(), BOUND_S))


def test_logprobs_and_alternatives_cross_to_the_decode_side(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """A request with ``logprobs`` and ``top_logprobs`` through prefill → decode: its stream's
    log-probabilities (the first token's from the prefill side) and alternatives equal one
    engine's for the same request, one per token."""
    prompt = tuple(MIXED_PROMPTS[0])
    sampling = SamplingParams(max_new_tokens=NEW, logprobs=True, top_logprobs=3)
    single = _engine(partial_ckpt)
    with single:
        want = single.submit("x", prompt, sampling)
        run_checked(single, max_steps=200)
    with _pair(partial_ckpt) as pair:

        async def scenario() -> tuple[list[int], list[float], list[TopLogprobs]]:
            stream = await pair.front.submit("x", prompt, sampling)
            tokens: list[int] = []
            async with stream:
                async for event in stream:
                    tokens += event.tokens
            assert stream.logprobs is not None and stream.top_logprobs is not None
            return tokens, list(stream.logprobs), list(stream.top_logprobs)

        tokens, logprobs, tops = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    assert tokens == list(want.emitted_ids)
    assert want.logprobs is not None and want.top_logprobs is not None
    assert len(logprobs) == len(tops) == len(tokens)
    assert logprobs == pytest.approx(list(want.logprobs), abs=1e-6)
    assert [[t for t, _ in top] for top in tops] == [
        [t for t, _ in top] for top in want.top_logprobs
    ]


def test_docs_observability_lists_the_handoff_series_as_exported() -> None:
    """docs/observability.md's handoff table names every series the collector exports, the
    transfer histogram with its exact buckets."""
    import re
    from pathlib import Path

    from prometheus_client import CollectorRegistry, generate_latest

    from specstate.serving.handoff_metrics import (
        TRANSFER_BUCKETS_S,
        HandoffMetrics,
        register_handoff_metrics,
    )

    registry = CollectorRegistry()
    metrics = HandoffMetrics()
    metrics.record_arrival(100, 0.003, admitted=True)
    register_handoff_metrics(metrics, registry)
    text = generate_latest(registry).decode()
    page = (Path(__file__).resolve().parents[2] / "docs" / "observability.md").read_text()
    section = page.split("## Serving metrics")[1].split("\n## ")[0]
    for name in ("handoffs", "handoff_bytes", "handoff_failures"):
        assert f"specstate_{name}_total " in text
        assert f"| `specstate_{name}_total` | counter |" in section, name
    row = re.search(
        r"^\| `specstate_handoff_transfer_seconds` \| histogram \| ([^|]*) \|", section, re.M
    )
    assert row is not None
    assert [float(b) for b in re.findall(r"[\d.]+", row.group(1))] == list(TRANSFER_BUCKETS_S)
    exported = [
        float(m)
        for m in re.findall(r'specstate_handoff_transfer_seconds_bucket\{le="([\d.e-]+)"\}', text)
    ]
    assert exported == list(TRANSFER_BUCKETS_S)
    assert 'specstate_handoff_transfer_seconds_bucket{le="0.005"} 1.0' in text
    assert "specstate_handoffs_total 1.0" in text and "specstate_handoff_bytes_total 100.0" in text


def test_a_request_sent_while_a_record_awaits_its_acknowledgement_is_served(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """The prefill loop waits for a record's acknowledgement (held on the way) when another
    request arrives: that request is kept, not lost, and both get HF's tokens."""
    prompts = [tuple(MIXED_PROMPTS[0]), tuple(MIXED_PROMPTS[2])]
    with _pair(partial_ckpt) as pair:
        pair.transport.hold = True

        async def scenario() -> list[list[TokenEvent]]:
            first = asyncio.create_task(_collect(pair.front, "a", prompts[0], NEW))
            deadline = time.monotonic() + BOUND_S
            while not pair.transport.held and time.monotonic() < deadline:
                await asyncio.sleep(0.01)  # a's record is on the way: the prefill loop waits
            assert pair.transport.held
            second = asyncio.create_task(_collect(pair.front, "b", prompts[1], NEW))
            await asyncio.sleep(0.3)  # b's request reaches the waiting prefill loop
            pair.transport.hold = False
            return [await first, await second]

        streams = asyncio.run(asyncio.wait_for(scenario(), BOUND_S))
    assert [_tokens(s) for s in streams] == [greedy(partial_ckpt.hf, p, NEW) for p in prompts]
    assert pair.prefill_pools_full == [True]
