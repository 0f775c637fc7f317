"""Lossless: the ``dspark`` worker under every verify-budget policy, both loops, page sizes,
the prefix cache on and off, and retraction.

The DSpark assistant is `block_ckpt`'s distilled DFlash assistant with heads fitted to the
target (`dspark_checkpoints`): its drafts are accepted partly and its confidences are
calibrated, low on some rounds' first position, so `ConfidenceBudget` (the stand-in cost
profile: a draft costs 15% of a step, minimum gain 0.04) cuts some rows to 0 and verifies
others in full. Every case checks the invariants after every step and compares the greedy
tokens with transformers' ``generate()`` of the target.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from block_checkpoints import BLOCK_SIZE, BlockCheckpoints
from engine_driver import checked_config, run_checked
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS

from specstate import Engine, Req, RequestLimits, SamplingParams
from specstate.engine.budgets import budget_policy
from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

PROMPTS = [list(p) for p in MIXED_PROMPTS]
NEW_TOKENS = 16
LIMITS = RequestLimits(vocab_size=97, max_context_len=96)
POLICIES = ("fixed", "schedule:2=3,4=2,beyond=1", "goodput", "confidence")


@pytest.fixture(scope="module")
def expected(block_ckpt: BlockCheckpoints) -> list[list[int]]:
    """The oracle's greedy continuations."""
    return [greedy(block_ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


def _worker(ckpt: BlockCheckpoints, assistant: Path) -> WorkerProtocol:
    return default_registry().create(
        "dspark", target=ckpt.target, assistant=assistant, check_commit_order=True
    )


def _serve(
    ckpt: BlockCheckpoints, assistant: Path, policy: str, **config: Any
) -> tuple[list[Req], float, tuple[str, ...]]:
    """Serve `PROMPTS` to completion; the requests, the mean accept length, the retracted."""
    engine = Engine(
        _worker(ckpt, assistant),
        limits=LIMITS,
        config=checked_config(**config),
        verify_budget=budget_policy(policy),
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with engine:
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(PROMPTS)]
        log = run_checked(engine, max_steps=600)
        mean = engine.snapshot().metrics.mean_accept_length
    return reqs, mean, log.retracted


def _check_exact(reqs: list[Req], expected: list[list[int]], mean: float) -> None:
    assert [list(r.emitted_ids) for r in reqs] == expected
    for req in reqs:
        pairs = zip(req.accept_lengths, req.verified_lengths, strict=True)
        assert all(a <= v + 1 for a, v in pairs)
    assert 1.0 < mean < BLOCK_SIZE


# Every policy under both loops, both page sizes, the prefix cache on and off (each case is a
# fraction of a second: the models are tiny).
MATRIX = list(itertools.product(POLICIES, [False, True], [1, 16], [True, False]))


@pytest.mark.parametrize(("policy", "overlap", "page_size", "prefix_cache"), MATRIX)
def test_dspark_is_lossless_under_every_policy(
    block_ckpt: BlockCheckpoints,
    dspark_assistant: Path,
    expected: list[list[int]],
    policy: str,
    overlap: bool,
    page_size: int,
    prefix_cache: bool,
) -> None:
    """HF's greedy tokens; every run at most its verified length + 1; 1 < mean accept < W."""
    reqs, mean, _ = _serve(
        block_ckpt,
        dspark_assistant,
        policy,
        overlap=overlap,
        page_size=page_size,
        prefix_cache=prefix_cache,
    )
    _check_exact(reqs, expected, mean)


@pytest.mark.parametrize(("overlap", "page_size"), [(False, 1), (True, 16)])
def test_confidence_budgets_vary_with_the_reported_confidences(
    block_ckpt: BlockCheckpoints,
    dspark_assistant: Path,
    expected: list[list[int]],
    overlap: bool,
    page_size: int,
) -> None:
    """With ``confidence`` the verified lengths differ between requests and between one
    request's rounds, some rows verify nothing (a plain decode step) and some the whole block,
    and the tokens stay exact."""
    reqs, mean, _ = _serve(
        block_ckpt, dspark_assistant, "confidence", overlap=overlap, page_size=page_size
    )
    _check_exact(reqs, expected, mean)
    width = BLOCK_SIZE - 1
    seen = {v for r in reqs for v in r.verified_lengths}
    assert {0, width} <= seen, seen
    varying = [r for r in reqs if len(set(r.verified_lengths)) > 1]
    assert len(varying) >= 2, [r.verified_lengths for r in reqs]
    # a row at 0 still decodes exactly one token
    assert all(
        a == 1
        for r in reqs
        for a, v in zip(r.accept_lengths, r.verified_lengths, strict=True)
        if v == 0
    )


@pytest.mark.parametrize(
    ("policy", "overlap", "page_size"),
    [(p, overlap, page) for p in POLICIES for overlap, page in [(False, 1), (True, 16)]],
)
def test_retraction_under_kv_pressure_stays_lossless(
    block_ckpt: BlockCheckpoints,
    dspark_assistant: Path,
    expected: list[list[int]],
    policy: str,
    overlap: bool,
    page_size: int,
) -> None:
    """A pool too small for every request at once: some are retracted and re-prefill (their
    policy history forgotten); still HF's tokens."""
    reqs, mean, retracted = _serve(
        block_ckpt,
        dspark_assistant,
        policy,
        overlap=overlap,
        page_size=page_size,
        kv_tokens=64 if page_size == 1 else 128,
        prefix_cache=False,
    )
    assert retracted, "nobody was retracted"
    _check_exact(reqs, expected, mean)


def _waves(
    ckpt: BlockCheckpoints, assistant: Path, waves: list[list[list[int]]], **config: Any
) -> tuple[list[Req], int]:
    """Serve ``waves`` one after the other (each to idle) under ``confidence``; the requests
    and the prefix cache's hit tokens."""
    reqs: list[Req] = []
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(
        _worker(ckpt, assistant),
        limits=LIMITS,
        config=checked_config(**config),
        verify_budget=budget_policy("confidence"),
    ) as engine:
        for w, wave in enumerate(waves):
            reqs += [engine.submit(f"w{w}r{i}", p, params) for i, p in enumerate(wave)]
            run_checked(engine)
        cache = engine.snapshot().prefix_cache
    return reqs, 0 if cache is None else cache.num_hit_tokens


@pytest.mark.parametrize(("overlap", "page_size"), [(False, 1), (True, 16)])
def test_cached_prefixes_give_the_same_confidences_and_budgets(
    block_ckpt: BlockCheckpoints, dspark_assistant: Path, overlap: bool, page_size: int
) -> None:
    """A second wave extending the first's prompts and outputs hits the cache; every request
    verifies and accepts, round for round, what it does with the cache off (a wrong context on
    a cached prefix would change the drafts and the confidences, so the budgets)."""
    base = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28]
    first = greedy(block_ckpt.hf, base, NEW_TOKENS)
    waves = [[base], [[*base, *first, 7, 8], [*base, *first[:5]], base]]
    want = [greedy(block_ckpt.hf, p, NEW_TOKENS) for wave in waves for p in wave]
    config = {"overlap": overlap, "page_size": page_size}
    on, hits = _waves(block_ckpt, dspark_assistant, waves, **config)
    off, none = _waves(block_ckpt, dspark_assistant, waves, prefix_cache=False, **config)
    assert [list(r.emitted_ids) for r in on] == want == [list(r.emitted_ids) for r in off]
    assert hits >= 16 and none == 0
    assert [r.verified_lengths for r in on] == [r.verified_lengths for r in off]
    assert [r.accept_lengths for r in on] == [r.accept_lengths for r in off]
    assert len({v for r in on for v in r.verified_lengths}) > 1
