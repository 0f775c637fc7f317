"""``eagle3`` is lossless: greedy output equals the target's HF ``generate()``.

Chains under both loops, page sizes 1 and 16, whole and chunked prefill with mixed chunks;
trees (topk 2) through the same tree path EAGLE uses; the prefix cache; retraction forced by a
small KV pool. Every step runs the invariant checker, ownership checks and the consume-once
relay, stops fall inside accepted runs, and acceptance is real.
"""

from __future__ import annotations

import itertools

import pytest
from eagle3_oracle import TRAINING_PROMPTS, Eagle3Checkpoints, make_eagle3_checkpoints
from engine_driver import (
    checked_config,
    run_checked,
    serve_to_completion,
    serve_under_pressure,
    with_stops,
)
from hf_oracle import greedy

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine

PROMPTS = [list(p) for p in TRAINING_PROMPTS[:5]]
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Eagle3Checkpoints:
    """A three-layer target and its EAGLE-3 head."""
    return make_eagle3_checkpoints(tmp_path_factory.mktemp("eagle3_lossless"))


@pytest.fixture(scope="module")
def expected(ckpt: Eagle3Checkpoints) -> list[list[int]]:
    """HF's greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


Chunking = tuple[int | None, bool]
CHAINS: list[tuple[int, bool, int, Chunking]] = list(
    itertools.product([1], [False, True], [1, 16], [(None, False), (4, True)])
)
TREES: list[tuple[int, bool, int, Chunking]] = list(
    itertools.product([2], [False, True], [1, 16], [(None, False)])
)


@pytest.mark.slow
@pytest.mark.parametrize(("topk", "overlap", "page_size", "chunking"), CHAINS + TREES)
def test_eagle3_lossless_matrix(
    ckpt: Eagle3Checkpoints,
    expected: list[list[int]],
    topk: int,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Greedy outputs equal HF generate token for token, stops inside runs included."""
    stops, wants = with_stops(expected)
    config = checked_config(
        overlap=overlap, page_size=page_size, chunked_prefill=chunking[0], mixed_chunk=chunking[1]
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    worker = ckpt.worker(num_steps=3, topk=topk)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = serve_to_completion(engine, PROMPTS, max_new_tokens=NEW_TOKENS, stops=stops)
        accept = engine.snapshot().metrics.mean_accept_length
    assert [list(r.emitted_ids) for r in reqs] == wants
    assert 1.0 < accept < 4.0


@pytest.mark.parametrize("overlap", [False, True])
def test_eagle3_lossless_with_the_prefix_cache(
    ckpt: Eagle3Checkpoints, expected: list[list[int]], overlap: bool
) -> None:
    """Requests that share prefixes hit the cache (their features included) and stay HF's."""
    prompts = [*PROMPTS, [*PROMPTS[2][:10], 4, 4], [*PROMPTS[0], 9]]
    wants = [*expected, *(greedy(ckpt.hf, p, NEW_TOKENS) for p in prompts[len(PROMPTS) :])]
    config = checked_config(overlap=overlap, page_size=4, prefix_cache=True, max_running=2)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(ckpt.worker(), limits=limits, config=config) as engine:
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        run_checked(engine)
        cache = engine.snapshot().prefix_cache
    assert [list(r.emitted_ids) for r in reqs] == wants
    assert cache is not None and cache.num_hit_tokens > 0


@pytest.mark.parametrize("topk", [1, 2])
def test_eagle3_lossless_under_retraction(
    ckpt: Eagle3Checkpoints, expected: list[list[int]], topk: int
) -> None:
    """A KV pool too small for every request forces retractions; outputs stay HF's."""
    outs, log, _ = serve_under_pressure(
        ckpt.worker(topk=topk),
        PROMPTS,
        vocab_size=ckpt.vocab_size,
        max_new_tokens=NEW_TOKENS,
        overlap=True,
        page_size=4,
        kv_tokens=96,
    )
    assert outs == expected
    assert log.retracted
