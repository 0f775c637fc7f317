"""``mtp`` is lossless: greedy output equals the Ernie MoE target's HF ``generate()``.

One MTP layer and two, both loops, page sizes 1 and 16, whole and chunked prefill with mixed
chunks, the prefix cache on, and retraction forced by a small KV pool; every step runs the
invariant checker, ownership checks and the consume-once relay, stops fall inside accepted runs,
and acceptance is real (mean accept length strictly between 1 and the maximum).
"""

from __future__ import annotations

import itertools

import pytest
from engine_driver import (
    checked_config,
    run_checked,
    serve_to_completion,
    serve_under_pressure,
    with_stops,
)
from hf_oracle import greedy
from mtp_oracle import MtpCheckpoints, make_mtp_checkpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine

PROMPTS = [
    [3, 14, 15, 92, 65, 35, 89],
    [79, 32],
    [38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93],
    [7],
    [5, 5, 5, 5, 5, 5],
]
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> MtpCheckpoints:
    """Ernie MoE targets with one and with two MTP layers."""
    return make_mtp_checkpoints(tmp_path_factory.mktemp("mtp_lossless"))


@pytest.fixture(scope="module")
def expected(ckpt: MtpCheckpoints) -> dict[int, list[list[int]]]:
    """HF's greedy continuations of each target, by MTP layer count."""
    return {
        1: [greedy(ckpt.hf_single, p, NEW_TOKENS) for p in PROMPTS],
        2: [greedy(ckpt.hf_multi, p, NEW_TOKENS) for p in PROMPTS],
    }


MATRIX = list(itertools.product([1, 2], [False, True], [1, 16], [(None, False), (4, True)]))


@pytest.mark.slow
@pytest.mark.parametrize(("layers", "overlap", "page_size", "chunking"), MATRIX)
def test_mtp_lossless_matrix(
    ckpt: MtpCheckpoints,
    expected: dict[int, list[list[int]]],
    layers: int,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Greedy outputs equal HF generate token for token, stops inside runs included."""
    stops, wants = with_stops(expected[layers])
    config = checked_config(
        overlap=overlap, page_size=page_size, chunked_prefill=chunking[0], mixed_chunk=chunking[1]
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(ckpt.worker(layers=layers), limits=limits, config=config) as engine:
        reqs = serve_to_completion(engine, PROMPTS, max_new_tokens=NEW_TOKENS, stops=stops)
        accept = engine.snapshot().metrics.mean_accept_length
    assert [list(r.emitted_ids) for r in reqs] == wants
    assert 1.0 < accept < layers + 1


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_mtp_lossless_with_the_prefix_cache(
    ckpt: MtpCheckpoints, expected: dict[int, list[list[int]]], layers: int, overlap: bool
) -> None:
    """Requests that share prefixes hit the cache (drafter state included) and stay lossless."""
    hf = ckpt.hf_single if layers == 1 else ckpt.hf_multi
    prompts = [*PROMPTS, [*PROMPTS[2][:10], 4, 4], PROMPTS[0] + [9]]
    wants = [*expected[layers], *(greedy(hf, p, NEW_TOKENS) for p in prompts[len(PROMPTS) :])]
    config = checked_config(overlap=overlap, page_size=4, prefix_cache=True, max_running=2)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(ckpt.worker(layers=layers), limits=limits, config=config) as engine:
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        run_checked(engine)
        cache = engine.snapshot().prefix_cache
    assert [list(r.emitted_ids) for r in reqs] == wants
    assert cache is not None and cache.num_hit_tokens > 0


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("overlap", [False, True])
def test_mtp_lossless_under_retraction(
    ckpt: MtpCheckpoints, expected: dict[int, list[list[int]]], layers: int, overlap: bool
) -> None:
    """A KV pool too small for every request forces retractions; outputs stay HF's."""
    outs, log, _ = serve_under_pressure(
        ckpt.worker(layers=layers),
        PROMPTS,
        vocab_size=ckpt.vocab_size,
        max_new_tokens=NEW_TOKENS,
        overlap=overlap,
        page_size=4,
        kv_tokens=64,
    )
    assert outs == expected[layers]
    assert log.retracted
