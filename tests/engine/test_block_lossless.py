"""Lossless: the block drafters (dflash, uno) under every loop, page size, chunking and pressure.

Each case serves the mixed-length prompts concurrently with every check on (invariants after
every step, ownership, the consume-once relay; dflash also checks its materializations'
order) and compares the greedy tokens with transformers' ``generate()``; every other request
stops at a token from the middle of its output, so stops fall inside accepted runs. The
drafters are distilled from the target (`block_checkpoints`): drafts are accepted, partly.
"""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from block_checkpoints import BLOCK_FAMILIES, BLOCK_SIZE, UNO_STEPS, BlockCheckpoints
from engine_driver import (
    checked_config,
    run_checked,
    serve_to_completion,
    serve_under_pressure,
    with_stops,
)
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS

from specstate import Req, RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol

PROMPTS = [list(p) for p in MIXED_PROMPTS]
NEW_TOKENS = 16
LIMITS = RequestLimits(vocab_size=97, max_context_len=96)
MIN_ACCEPT = {"dflash": 1.0, "uno": 2.0}  # uno's root is always accepted


@pytest.fixture(scope="module")
def expected(block_ckpt: BlockCheckpoints) -> list[list[int]]:
    """The oracle's greedy continuations."""
    return [greedy(block_ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


def _worker(ckpt: BlockCheckpoints, family: str, **options: Any) -> WorkerProtocol:
    if family == "dflash":
        options.setdefault("check_commit_order", True)
    return ckpt.worker(family, **options)


def _run(
    ckpt: BlockCheckpoints,
    family: str,
    stops: list[int | None],
    *,
    checks: bool = True,
    **config: Any,
) -> tuple[list[list[int]], float]:
    with Engine(
        _worker(ckpt, family), limits=LIMITS, config=checked_config(checks=checks, **config)
    ) as engine:
        reqs = serve_to_completion(engine, PROMPTS, max_new_tokens=NEW_TOKENS, stops=stops)
        mean = engine.snapshot().metrics.mean_accept_length
    return [list(r.emitted_ids) for r in reqs], mean


MATRIX = list(itertools.product(BLOCK_FAMILIES, [False, True], [1, 16], [(None, False), (4, True)]))


@pytest.mark.slow
@pytest.mark.parametrize(("family", "overlap", "page_size", "chunking"), MATRIX)
def test_block_drafters_are_lossless(
    block_ckpt: BlockCheckpoints,
    expected: list[list[int]],
    family: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Greedy outputs equal HF generate token for token, stops inside runs included."""
    stops, wants = with_stops(expected)
    outs, mean = _run(
        block_ckpt,
        family,
        stops,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    assert outs == wants
    assert MIN_ACCEPT[family] < mean < (BLOCK_SIZE if family == "dflash" else UNO_STEPS + 1)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "overlap"), list(itertools.product(BLOCK_FAMILIES, [False, True]))
)
def test_production_mode_is_lossless(
    block_ckpt: BlockCheckpoints, expected: list[list[int]], family: str, overlap: bool
) -> None:
    """Every check off (the hot path's fast branches), chunked with mixed chunks: same tokens."""
    stops, wants = with_stops(expected)
    outs, _ = _run(
        block_ckpt,
        family,
        stops,
        checks=False,
        overlap=overlap,
        chunked_prefill=4,
        mixed_chunk=True,
    )
    assert outs == wants


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "overlap", "page_size"),
    [("dflash", False, 1), ("dflash", True, 16), ("uno", True, 1), ("uno", False, 16)],
)
def test_retraction_under_kv_pressure_stays_lossless(
    block_ckpt: BlockCheckpoints,
    expected: list[list[int]],
    family: str,
    overlap: bool,
    page_size: int,
) -> None:
    """A pool too small for every request at once: some are retracted, and re-prefill."""
    outs, log, _ = serve_under_pressure(
        _worker(block_ckpt, family),
        PROMPTS,
        vocab_size=97,
        max_new_tokens=NEW_TOKENS,
        overlap=overlap,
        page_size=page_size,
        kv_tokens=96 if page_size == 1 else 128,
    )
    assert log.retracted, "nobody was retracted"
    assert outs == expected


def _served(
    ckpt: BlockCheckpoints, family: str, waves: list[list[list[int]]], **config: Any
) -> tuple[list[Req], int]:
    """Serve ``waves`` one after the other (each to idle); the requests and the cache hits."""
    reqs: list[Req] = []
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(_worker(ckpt, family), limits=LIMITS, config=checked_config(**config)) as engine:
        for w, wave in enumerate(waves):
            reqs += [engine.submit(f"w{w}r{i}", p, params) for i, p in enumerate(wave)]
            run_checked(engine)
        cache = engine.snapshot().prefix_cache
    return reqs, 0 if cache is None else cache.num_hit_tokens


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "overlap", "page_size"),
    [("dflash", False, 1), ("dflash", True, 16), ("uno", True, 1)],
)
def test_the_prefix_cache_shares_the_drafters_state(
    block_ckpt: BlockCheckpoints, family: str, overlap: bool, page_size: int
) -> None:
    """A second wave extending the first's prompts and outputs hits the cache, stays exact, and
    every round accepts what the same requests accept with the cache off (a wrong materialized
    context on a cached prefix would change the drafts, which the tokens cannot show)."""
    base = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]
    first = greedy(block_ckpt.hf, base, NEW_TOKENS)
    waves = [[base], [[*base, *first, 7, 8], [*base, *first[:5]], base]]
    want = [greedy(block_ckpt.hf, p, NEW_TOKENS) for wave in waves for p in wave]
    config = {"overlap": overlap, "page_size": page_size}
    on, hits = _served(block_ckpt, family, waves, **config)
    off, none = _served(block_ckpt, family, waves, prefix_cache=False, **config)
    assert [list(r.emitted_ids) for r in on] == want == [list(r.emitted_ids) for r in off]
    assert hits >= 16 and none == 0
    assert [r.accept_lengths for r in on] == [r.accept_lengths for r in off]
    assert max(a for r in on for a in r.accept_lengths) > MIN_ACCEPT[family]


@pytest.mark.slow
def test_dflash_verifying_part_of_the_block_is_lossless(
    block_ckpt: BlockCheckpoints, expected: list[list[int]]
) -> None:
    """num_steps 2 of a block of 4: the assistant denoises the whole block, two are verified."""
    with Engine(
        _worker(block_ckpt, "dflash", num_steps=2),
        limits=LIMITS,
        config=checked_config(overlap=True),
    ) as engine:
        reqs = serve_to_completion(engine, PROMPTS, max_new_tokens=NEW_TOKENS, stops=[None] * 5)
        histogram = engine.snapshot().metrics.histogram
    assert [list(r.emitted_ids) for r in reqs] == expected
    assert max(length for length, _ in histogram) == 3  # a run never passes num_steps + 1
