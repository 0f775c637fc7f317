"""Soak: random arrivals, aborts, retractions, stop tokens and mixed chunks, every algorithm.

A seeded stream of requests arrives over the steps of one engine whose pool is small enough to
force retraction while speculative rounds are in flight. Some requests stop at a token taken
from the middle of the oracle's output (so stops fall inside accepted runs), some are aborted
at a random step. The test asserts that each of those things actually happened, that every
request that was not aborted emitted exactly HF `generate()`'s tokens up to its stop or cap
(an aborted one, a prefix of them), and that the pool balances at the end. The invariant
checker runs after every step.
"""

from __future__ import annotations

import random
from functools import cache

import pytest
from hf_oracle import greedy
from spec_checkpoints import (
    ALGORITHMS,
    SpecCheckpoints,
    make_partial_drafters,
    make_spec_checkpoints,
)

from specstate import FinishReason, RequestLimits, SamplingParams
from specstate.core.request import Req
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine

PROMPTS = [
    [3, 14, 15],
    [92, 65, 35, 89, 79, 32, 38],
    [46],
    [26, 43, 38, 32, 79, 50, 28, 84, 19, 71],
    [5, 5, 5, 5],
    [61, 7, 7, 61, 7],
]
MAX_NEW = 24
NUM_REQUESTS = 40


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """A target with partially agreeing drafters (accept lengths vary)."""
    root = tmp_path_factory.mktemp("soak")
    return make_partial_drafters(make_spec_checkpoints(root, seed=9), root)


@cache
def _oracle(ckpt: SpecCheckpoints, prompt: tuple[int, ...]) -> list[int]:
    return greedy(ckpt.hf, list(prompt), MAX_NEW)


@pytest.mark.slow
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_soak_is_exact_and_balanced(ckpt: SpecCheckpoints, algorithm: str, overlap: bool) -> None:
    """0 wrong tokens; retractions, aborts and stops inside runs all happen; pools balance."""
    rng = random.Random(f"{algorithm}-{overlap}")
    config = EngineConfig(
        overlap=overlap,
        page_size=4,
        kv_tokens=96,
        max_running=8,
        chunked_prefill=4,
        mixed_chunk=True,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    engine = Engine(
        ckpt.worker(algorithm, agreeing=False),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=config,
    )
    arrivals = sorted(rng.randrange(30) for _ in range(NUM_REQUESTS))
    live: list[tuple[Req, list[int], int | None]] = []
    retractions = 0
    for step in range(3000):
        while arrivals and arrivals[0] <= step:
            arrivals.pop(0)
            prompt = rng.choice(PROMPTS)
            full = _oracle(ckpt, tuple(prompt))
            cap = rng.randint(MAX_NEW // 2, MAX_NEW)
            stop = full[rng.randrange(cap // 2, cap)] if rng.random() < 0.3 else None
            params = SamplingParams(
                max_new_tokens=cap, stop_token_ids=() if stop is None else (stop,)
            )
            want = full[:cap]
            if stop is not None:
                want = want[: want.index(stop) + 1]
            abort_at = step + rng.randrange(1, 12) if rng.random() < 0.2 else None
            live.append((engine.submit(f"q{len(live)}", prompt, params), want, abort_at))
        for req, _, abort_at in live:
            if abort_at == step:
                engine.abort(req.request_id)
        retractions += len(engine.step().retracted)
        check_engine(engine)
        if not arrivals and engine.is_idle:
            break
    else:
        raise AssertionError("the soak did not finish")
    snap = engine.snapshot()
    engine.close()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages

    aborted = stopped = 0
    for req, want, _ in live:
        got = list(req.emitted_ids)
        assert req.finish is not None, req.request_id
        if req.finish.reason is FinishReason.ABORT:
            aborted += 1
            assert got == want[: len(got)], req.request_id
        else:
            assert got == want, (req.request_id, req.finish)
            stopped += req.finish.reason is FinishReason.STOP
    assert retractions > 0, "the pool must force retraction"
    assert aborted > 0 and stopped > 0
    if algorithm != "none":
        lengths = [a for req, _, _ in live for a in req.accept_lengths]
        assert any(1 < a < engine.worker.capabilities.max_accept for a in lengths)
