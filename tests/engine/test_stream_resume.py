"""Streams resume and survive manual steps, one at a time; `Engine.close` ends live requests.

The engine records what its streams delivered (`Deliveries`), so however the engine is driven —
a stream left and re-entered, ``engine.step()`` calls between streams, a consumer that raised, a
second stream refused while one is live — every request's events, concatenated, are exactly its
``emitted_ids`` once, in order, with its finish on its last event and nothing after it. The
workload retracts (a small pool) and accepts multi-token runs; the invariant checker runs after
every step. `Engine.close` with live requests ends each with ABORT and a reason, and a stream
still delivers those finishes; a stream on a closed engine with nothing left to deliver is
refused.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator

import pytest
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import FinishReason, Req, RequestLimits, SamplingParams, UsageError
from specstate.engine.config import EngineConfig, StepReport
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.stream import StreamCursor, TokenEvent, stream
from specstate.engine.trace import TraceRecorder

NEW_TOKENS = 16


def _engine(ckpt: SpecCheckpoints, *, overlap: bool, **config: object) -> Engine:
    engine = Engine(
        ckpt.worker("eagle", agreeing=False),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(
            overlap=overlap,
            page_size=4,
            kv_tokens=56,
            chunked_prefill=4,
            mixed_chunk=True,
            check_invariants=True,
            check_ownership=True,
            **config,  # type: ignore[arg-type]
        ),
    )
    original = engine.step
    engine.retracted = 0  # type: ignore[attr-defined]

    def step() -> StepReport:
        report = original()
        engine.retracted += len(report.retracted)  # type: ignore[attr-defined]
        check_engine(engine)
        return report

    engine.step = step  # type: ignore[method-assign]
    return engine


def _submit(engine: Engine) -> list[Req]:
    return [
        engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        for i, p in enumerate(MIXED_PROMPTS)
    ]


def _check_events(
    ckpt: SpecCheckpoints, reqs: list[Req], events: dict[str, list[TokenEvent]]
) -> None:
    """Each request: its tokens once, in order, exactly HF's; its finish last and once."""
    for prompt, req in zip(MIXED_PROMPTS, reqs, strict=True):
        got = events[req.request_id]
        assert got and got[-1].finish is not None and got[-1].finish == req.finish
        assert all(e.finish is None and e.tokens for e in got[:-1]), got
        tokens = [t for e in got for t in e.tokens]
        assert tokens == list(req.emitted_ids) == greedy(ckpt.hf, list(prompt), NEW_TOKENS)


def _collect(into: dict[str, list[TokenEvent]], it: Iterator[TokenEvent], n: int) -> int:
    """Take up to ``n`` events from ``it``; how many it gave."""
    taken = 0
    for event in it:
        into[event.request_id].append(event)
        taken += 1
        if taken == n:
            break
    return taken


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_stream_left_and_entered_again_resumes(
    partial_ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """Leave after every 3 events (mid-step), enter again: nothing twice, nothing lost."""
    engine = _engine(partial_ckpt, overlap=overlap)
    reqs = _submit(engine)
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    entries = 0
    while _collect(events, stream(engine), 3):
        entries += 1
    engine.close()
    assert entries > 5 and engine.retracted > 0  # type: ignore[attr-defined]
    _check_events(partial_ckpt, reqs, events)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_second_live_stream_is_refused(partial_ckpt: SpecCheckpoints, overlap: bool) -> None:
    """While a stream is live (started, not ended or closed), a second stream and a
    `StreamCursor` are refused with `UsageError` and take nothing; the first goes on, and once
    it is closed a new stream resumes after it: every event is delivered exactly once."""
    engine = _engine(partial_ckpt, overlap=overlap)
    reqs = _submit(engine)
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    first = stream(engine)
    assert _collect(events, first, 3) == 3  # left, but kept: still live
    for _ in range(2):
        with pytest.raises(UsageError, match="another reader is live: a stream"):
            _collect(events, stream(engine), 1)
        with pytest.raises(UsageError, match="another reader is live: a stream"):
            StreamCursor(engine)
        assert _collect(events, first, 2) == 2
    assert engine.deliveries.snapshot().reader == "a stream(engine) iterator"
    first.close()
    assert engine.deliveries.snapshot().reader is None
    assert _collect(events, stream(engine), 10_000) > 0
    engine.close()
    _check_events(partial_ckpt, reqs, events)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_manual_steps_between_streams_lose_nothing(
    partial_ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """Two events from a stream, then two ``engine.step()`` calls, again and again."""
    engine = _engine(partial_ckpt, overlap=overlap)
    reqs = _submit(engine)
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    it = stream(engine)
    while True:
        if not _collect(events, it, 2) and engine.is_idle:
            break  # the stream returned: the engine is idle, every event delivered
        for _ in range(2):
            if not engine.is_idle:
                engine.step()
    engine.close()
    _check_events(partial_ckpt, reqs, events)


def test_a_consumer_that_raises_loses_nothing(partial_ckpt: SpecCheckpoints) -> None:
    """The loop body raises after an event; the next stream goes on from the next one."""
    engine = _engine(partial_ckpt, overlap=True)
    reqs = _submit(engine)
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    raised = 0

    def consume(it: Iterator[TokenEvent], fail_after: int) -> None:
        for n, event in enumerate(it):
            events[event.request_id].append(event)
            if n == fail_after:
                raise RuntimeError("the client went away")

    for _ in range(100):
        try:
            consume(stream(engine), fail_after=4)
            break
        except RuntimeError:
            raised += 1
    engine.close()
    assert raised > 2
    _check_events(partial_ckpt, reqs, events)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_close_ends_live_requests_with_abort(partial_ckpt: SpecCheckpoints, overlap: bool) -> None:
    """Waiting, prefilling and running requests end with ABORT and the reason; their tokens
    so far are HF's; a stream after close delivers those finishes; the trace records them."""
    trace = TraceRecorder()
    engine = Engine(
        partial_ckpt.worker("eagle", agreeing=False),
        limits=RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(overlap=overlap, max_running=2, chunked_prefill=2, kv_tokens=512),
        trace=trace,
    )
    reqs = _submit(engine)
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    _collect(events, stream(engine), 6)
    states = {r.status.value for r in reqs if not r.is_finished}
    assert {"waiting", "running"} <= states or {"waiting", "prefill"} <= states, states
    engine.close("server shutting down")
    assert engine.is_closed and all(r.is_finished for r in reqs)
    for prompt, req in zip(MIXED_PROMPTS, reqs, strict=True):
        assert req.finish is not None and req.finish.reason is FinishReason.ABORT
        assert req.finish.detail == "server shutting down"
        assert (
            list(req.emitted_ids)
            == greedy(partial_ckpt.hf, list(prompt), NEW_TOKENS)[: len(req.emitted_ids)]
        )
    _collect(events, stream(engine), 10_000)  # after close: the undelivered, then it stops
    with pytest.raises(UsageError, match=r"stream\(engine\) on a closed engine"):
        stream(engine)  # nothing is left to deliver: refused, not an empty stream
    for req in reqs:
        got = events[req.request_id]
        assert got[-1].finish == req.finish
        assert [t for e in got for t in e.tokens] == list(req.emitted_ids)
    aborted = {e["id"] for e in trace.events if e["event"] == "abort"}
    assert aborted == {r.request_id for r in reqs}


def test_a_stream_on_a_closed_engine_with_nothing_to_deliver_is_refused(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """Closed after its requests were streamed, or never streamed: ``stream(engine)`` raises
    `UsageError` at once (a serving loop around it does not spin on empty streams)."""
    for streamed in (True, False):
        engine = Engine(
            partial_ckpt.worker("none"),
            limits=RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64),
            config=EngineConfig(kv_tokens=512),
        )
        engine.submit("a", [1, 2], SamplingParams(max_new_tokens=2))
        if streamed:
            assert [e.request_id for e in stream(engine)] == ["a", "a"]
        else:
            engine.run_until_idle()
        engine.close()
        with pytest.raises(UsageError, match=r"stream\(engine\) on a closed engine"):
            stream(engine)


def test_undelivered_ends_are_bounded_when_nobody_streams(partial_ckpt: SpecCheckpoints) -> None:
    """After a stream, ``run_until_idle`` only: at most ``finished_history`` ended requests wait."""
    engine = Engine(
        partial_ckpt.worker("none"),
        limits=RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(kv_tokens=512, finished_history=3),
    )
    with engine:
        first = engine.submit("first", [1, 2], SamplingParams(max_new_tokens=2))
        assert [e.request_id for e in stream(engine)] == ["first", "first"]
        assert first.is_finished
        for i in range(12):
            engine.submit(f"x{i}", [3, 4], SamplingParams(max_new_tokens=2))
            engine.run_until_idle()
        snap = engine.deliveries.snapshot()
        assert snap.active and snap.ended_waiting == 3
        assert snap.queued == ("x9", "x10", "x11")
        ids = [e.request_id for e in stream(engine) if e.finish is not None]
    assert ids == ["x9", "x10", "x11"]


def test_the_old_iterator_contract_still_holds(partial_ckpt: SpecCheckpoints) -> None:
    """A single stream to the end, requests submitted between events: each token once."""
    engine = _engine(partial_ckpt, overlap=True)
    reqs = _submit(engine)[:2]
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    late: Callable[[], None] = lambda: reqs.append(  # noqa: E731
        engine.submit("late", [7, 7], SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
    )
    for n, event in enumerate(stream(engine)):
        events[event.request_id].append(event)
        if n == 2:
            late()
    engine.close()
    for req in reqs:
        got = events[req.request_id]
        assert [t for e in got for t in e.tokens] == list(req.emitted_ids)
        assert got[-1].finish == req.finish and req.finish is not None
