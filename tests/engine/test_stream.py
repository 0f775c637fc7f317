"""Streaming yields every emitted token once, in order, and each request's finish last.

Partially agreeing drafters (multi-token runs), the overlap loop with chunked prefill and mixed
chunks, a pool small enough to retract, stop tokens inside runs and an abort: the tokens a
request's events carry, concatenated, are exactly its ``emitted_ids`` (and HF ``generate()``'s
tokens for the requests that were not aborted); its finish comes on its last event and nothing
follows it. The invariant checker runs after every step. A token is delivered on the step it
is emitted, also by a request in a slot whose previous holder ended with as many outputs.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from hf_oracle import greedy
from spec_checkpoints import (
    FAMILIES,
    MIXED_PROMPTS,
    SpecCheckpoints,
)
from spy_worker import SpyWorker

from specstate import FinishReason, Req, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.config import EngineConfig, StepReport
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.stream import StreamCursor, TokenEvent, stream
from specstate.engine.worker import OnPublish, WorkerProtocol
from specstate.tools.timed_worker import TimedWaitWorker

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", ["eagle", *FAMILIES])
def test_streamed_tokens_are_the_emitted_tokens(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Each token once, in order; the finish on the last event; retractions and an abort."""
    engine = Engine(
        ckpt.worker(algorithm, agreeing=False),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(
            overlap=overlap,
            page_size=4,
            kv_tokens=56,
            chunked_prefill=4,
            mixed_chunk=True,
            check_invariants=True,
            check_ownership=True,
        ),
    )
    wants = [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]
    reqs = []
    for i, (prompt, want) in enumerate(zip(MIXED_PROMPTS, wants, strict=True)):
        stop = {want[NEW_TOKENS // 2]} if i % 2 else set()  # a stop inside the output
        params = SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=stop)
        reqs.append(engine.submit(f"r{i}", prompt, params))
    events: dict[str, list[TokenEvent]] = defaultdict(list)
    retracted = 0
    original_step = engine.step

    def step() -> StepReport:
        nonlocal retracted
        report = original_step()
        retracted += len(report.retracted)
        check_engine(engine)
        return report

    engine.step = step  # type: ignore[method-assign]
    for n, event in enumerate(stream(engine, max_steps=500)):
        events[event.request_id].append(event)
        if n == 5:
            engine.abort("r0")
    engine.close()
    assert retracted > 0
    for req, want in zip(reqs, wants, strict=True):
        got = events[req.request_id]
        assert got and got[-1].finish == req.finish is not None
        assert all(e.finish is None for e in got[:-1]) and all(e.tokens for e in got[:-1])
        tokens = [t for e in got for t in e.tokens]
        assert tokens == list(req.emitted_ids)
        if req.finish.reason is FinishReason.ABORT:
            assert tokens == want[: len(tokens)]
        else:
            expected = (
                want[: want.index(next(iter(req.sampling.stop_token_ids))) + 1]
                if (req.sampling.stop_token_ids)
                else want
            )
            assert tokens == expected, req.request_id
    assert reqs[0].finish is not None and reqs[0].finish.reason is FinishReason.ABORT


class SlotSpy(SpyWorker):
    """Delegates to a worker; records the slot each request id was first launched in."""

    def __init__(self, inner: WorkerProtocol) -> None:
        super().__init__(inner)
        self.slots: dict[str, int] = {}

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Record the rows' slots, then delegate."""
        for rid, slot in zip(batch.request_ids, batch.req_pool_indices.tolist(), strict=True):
            self.slots.setdefault(rid, slot)
        return super().forward_batch_generation(batch, on_publish=on_publish)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_token_is_delivered_on_the_step_it_is_emitted_whatever_the_slot_held(
    overlap: bool,
) -> None:
    """Requests run one at a time and reuse the slots their predecessors left; some follow a
    holder that ended with one token and emit one token in their first step (the same output
    count in the same slot). After every step, each request's events carry all it emitted."""
    spy = SlotSpy(TimedWaitWorker(device_seconds=0.0, num_steps=2, accept=2))
    engine = Engine(
        spy,
        limits=RequestLimits(vocab_size=32, max_context_len=64),
        config=EngineConfig(overlap=overlap, max_running=1, kv_tokens=256, check_invariants=True),
    )
    caps = [1, 1, 5, 5] * 2
    reqs = [
        engine.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=cap))
        for i, cap in enumerate(caps)
    ]
    cursor = StreamCursor(engine)
    delivered: dict[str, int] = defaultdict(int)
    steps = 0
    with engine:
        while not engine.is_idle:
            for event in cursor.step():
                delivered[event.request_id] += len(event.tokens)
            steps += 1
            late = {
                r.request_id: (delivered[r.request_id], len(r.emitted_ids))
                for r in reqs
                if delivered[r.request_id] != len(r.emitted_ids)
            }
            assert not late, f"step {steps}: (delivered, emitted) {late}"
    assert [len(r.emitted_ids) for r in reqs] == caps
    previous: dict[int, Req] = {}  # slot -> its last holder (the requests ran in order)
    after_a_one_token_holder = []
    for req in reqs:
        slot = spy.slots[req.request_id]
        earlier = previous.get(slot)
        if earlier is not None and len(earlier.emitted_ids) == 1 < len(req.emitted_ids):
            after_a_one_token_holder.append(req.request_id)
        previous[slot] = req
    assert after_a_one_token_holder  # the case this test is about did happen


def test_a_live_delivery_reads_only_the_new_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step's event of a live request reads its new tokens from its row, not its whole
    output: what the deliveries read over a stream is what was emitted (plus one whole read of
    each request, at its end), however long the requests run. (The invariant checker's own
    reads, after every step, are not counted.)"""
    from specstate.engine.capabilities.delivery import Deliveries
    from specstate.engine.settle.outputs import OutputTable

    read = {"since": 0, "whole": 0}
    inside = [False]
    since, whole, pop = OutputTable.read_outputs_since, OutputTable.read_outputs, Deliveries.pop

    def counted_since(self: OutputTable, slot: int, start: int) -> list[int]:
        out = since(self, slot, start)
        read["since"] += len(out) if inside[0] else 0
        return out

    def counted_whole(self: OutputTable, slot: int) -> list[int]:
        out = whole(self, slot)
        read["whole"] += len(out) if inside[0] else 0
        return out

    def counted_pop(self: Deliveries) -> object:
        inside[0] = True
        try:
            return pop(self)
        finally:
            inside[0] = False

    monkeypatch.setattr(OutputTable, "read_outputs_since", counted_since)
    monkeypatch.setattr(OutputTable, "read_outputs", counted_whole)
    monkeypatch.setattr(Deliveries, "pop", counted_pop)
    worker = TimedWaitWorker(device_seconds=0.0, num_steps=3, accept=3)
    config = EngineConfig(overlap=True, kv_tokens=4096, check_invariants=True)
    limits = RequestLimits(vocab_size=64, max_context_len=1024)
    engine = Engine(worker, limits=limits, config=config)
    params = SamplingParams(max_new_tokens=300, ignore_eos=True)
    reqs = [engine.submit(f"r{i}", [1, 2, 3], params) for i in range(4)]
    events = 0
    with engine:
        for _ in stream(engine):
            events += 1
            check_engine(engine)
    emitted = sum(len(r.emitted_ids) for r in reqs)
    assert emitted == 4 * 300 and events > 4 * 50  # many deliveries per request
    assert 0 < read["since"] <= emitted
    assert read["whole"] <= emitted  # each request's last event (it left its row)
