"""Drafters that agree for a few tokens and then diverge: accept lengths strictly inside (1, D).

Agreeing drafters accept everything and random ones almost nothing, so neither exercises runs
cut in the middle. Here the draft model is the target with perturbed weights and the EAGLE head
a perturbed identity head: every accept length from 1 to D occurs, stop tokens fall inside
runs, and the output must still equal HF generate token for token, in both loops, at page 1
and 16, with chunked prefill and mixed chunks, with the invariant checker after every step.
"""

from __future__ import annotations

import itertools

import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import (
    MIXED_PROMPTS,
    SpecCheckpoints,
)

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine

NEW_TOKENS = 20
STEPS = 3  # D = 4


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


@pytest.fixture(scope="module")
def expected(ckpt: SpecCheckpoints) -> list[list[int]]:
    """The oracle's greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size", "chunking"),
    list(
        itertools.product(
            ["draft_model", "eagle"], [False, True], [1, 16], [(None, False), (4, True)]
        )
    ),
)
def test_partial_acceptance_is_lossless(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Runs cut mid-way, with stops inside them, equal HF generate; every length 1..D occurs."""
    config = EngineConfig(
        kv_tokens=2048,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    stops = [out[12] for out in expected]  # a token well inside each continuation
    worker = ckpt.worker(algorithm, num_steps=STEPS, agreeing=False)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(
                f"p{i}",
                prompt,
                SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=(stops[i],)),
            )
            for i, prompt in enumerate(MIXED_PROMPTS)
        ]
        run_checked(engine)
        metrics = engine.snapshot().metrics
    for req, out, stop in zip(reqs, expected, stops, strict=True):
        assert list(req.emitted_ids) == out[: out.index(stop) + 1]
    lengths = dict(metrics.histogram)
    assert all(lengths.get(a, 0) > 0 for a in range(1, STEPS + 2)), lengths
    assert 1.2 < metrics.mean_accept_length < STEPS + 0.8


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["draft_model", "eagle"])
@pytest.mark.parametrize("page_size", [1, 4])
def test_speculative_retraction_and_deferred_release(
    ckpt: SpecCheckpoints, expected: list[list[int]], algorithm: str, page_size: int
) -> None:
    """A pool too small for every speculating request retracts some (asserted), defers the
    release of requests that finish under a launched batch (asserted), and stays lossless."""
    config = EngineConfig(
        kv_tokens=120,
        overlap=True,
        page_size=page_size,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    worker = ckpt.worker(algorithm, num_steps=STEPS, agreeing=False)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(f"p{i}", prompt, SamplingParams(max_new_tokens=NEW_TOKENS))
            for i, prompt in enumerate(MIXED_PROMPTS)
        ]
        log = run_checked(engine)
        snap = engine.snapshot()
    assert log.retracted, "the pool was meant to force retractions of speculating requests"
    assert log.deferred, "a request finishing under a launched batch keeps its KV until it retires"
    assert max(r.incarnation for r in reqs) >= 1
    assert [list(r.emitted_ids) for r in reqs] == expected
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
