"""Streaming yields every emitted token once, in order, and each request's finish last.

Partially agreeing drafters (multi-token runs), the overlap loop with chunked prefill and mixed
chunks, a pool small enough to retract, stop tokens inside runs and an abort: the tokens a
request's events carry, concatenated, are exactly its ``emitted_ids`` (and HF ``generate()``'s
tokens for the requests that were not aborted); its finish comes on its last event and nothing
follows it. The invariant checker runs after every step.
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

from specstate import FinishReason, RequestLimits, SamplingParams
from specstate.engine.engine import Engine, EngineConfig, StepReport
from specstate.engine.invariants import check_engine
from specstate.engine.stream import TokenEvent, stream

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
