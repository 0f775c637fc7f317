"""Lossless: every algorithm × loop × page size × chunked prefill × mixed chunk equals HF generate.

Each case runs concurrent requests of mixed lengths through the engine with the invariant checker
after every step, ownership checks on every counter write and the FutureMap's consume-once
checks, and compares the greedy output with transformers' ``generate()`` token for token. The
drafters agree with the target, so runs of several tokens happen; in the matrix every other
request has a stop token taken from the middle of its output, so stops fall inside runs. The
same cases also run in production mode (every check off, so the hot path takes its fast
branches), with the invariant checker still called after every step.
"""

from __future__ import annotations

import itertools

import pytest
from engine_driver import checked_config, serve_to_completion, with_stops
from hf_oracle import greedy
from spec_checkpoints import ALGORITHMS, MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import RequestLimits
from specstate.engine.engine import Engine

PROMPTS = [list(p) for p in MIXED_PROMPTS]
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("lossless"))


@pytest.fixture(scope="module")
def expected(ckpt: SpecCheckpoints) -> list[list[int]]:
    """The oracle's greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def other(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """A second seed and shape: vocabulary 131, hidden 48 (head_dim 12)."""
    return make_spec_checkpoints(
        tmp_path_factory.mktemp("lossless2"), seed=5, vocab_size=131, hidden=48
    )


def _run(
    ckpt: SpecCheckpoints,
    algorithm: str,
    stops: list[int | None] | None = None,
    *,
    checks: bool = True,
    **options: object,
) -> tuple[list[list[int]], float]:
    """Run PROMPTS to completion; checks off is production mode (the checker still runs)."""
    config = checked_config(checks=checks, **options)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    stops = stops or [None] * len(PROMPTS)
    with Engine(ckpt.worker(algorithm), limits=limits, config=config) as engine:
        reqs = serve_to_completion(engine, PROMPTS, max_new_tokens=NEW_TOKENS, stops=stops)
        mean_accept = engine.snapshot().metrics.mean_accept_length
    return [list(r.emitted_ids) for r in reqs], mean_accept


MATRIX = list(
    itertools.product(ALGORITHMS, [False, True], [1, 4, 16], [(None, False), (4, False), (4, True)])
)


@pytest.mark.slow
@pytest.mark.parametrize(("algorithm", "overlap", "page_size", "chunking"), MATRIX)
def test_lossless_matrix(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Greedy outputs equal HF generate token for token, stops inside runs included."""
    chunked, mixed = chunking
    stops, wants = with_stops(expected)
    outs, accept = _run(
        ckpt,
        algorithm,
        stops,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunked,
        mixed_chunk=mixed,
    )
    assert outs == wants
    if algorithm in ("draft_model", "eagle"):
        assert accept > 2.0  # runs of several tokens really happened


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "chunking"),
    list(itertools.product(ALGORITHMS, [False, True], [(None, False), (3, True)])),
)
def test_lossless_on_a_second_seed_and_shape(
    other: SpecCheckpoints, algorithm: str, overlap: bool, chunking: tuple[int | None, bool]
) -> None:
    """Another checkpoint (seed, vocabulary, width) is lossless too."""
    want = [greedy(other.hf, p, NEW_TOKENS) for p in PROMPTS]
    outs, _ = _run(
        other,
        algorithm,
        overlap=overlap,
        page_size=4,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    assert outs == want


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size", "chunking"),
    list(itertools.product(ALGORITHMS, [False, True], [1, 16], [(None, False), (4, True)])),
)
def test_production_mode_is_lossless(
    ckpt: SpecCheckpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunking: tuple[int | None, bool],
) -> None:
    """Checks off (the hot path's fast branches): the same tokens, stops inside runs included."""
    stops, wants = with_stops(expected)
    outs, accept = _run(
        ckpt,
        algorithm,
        stops,
        checks=False,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    assert outs == wants
    if algorithm in ("draft_model", "eagle"):
        assert accept > 2.0  # stops fell inside multi-token runs
