"""The conformance kit checks a tensor-parallel worker on two spawned gloo ranks."""

from __future__ import annotations

from functools import partial

import pytest
from margin_screen import screen
from spec_checkpoints import SpecCheckpoints
from tp_programs import reference_worker, skewed_worker

from specstate.testing.conformance import check_worker

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def paths(partial_ckpt: SpecCheckpoints) -> dict[str, str]:
    """The partly agreeing checkpoints, as paths (the ranks load them)."""
    return {k: str(getattr(partial_ckpt, k)) for k in ("target", "draft", "eagle")}


def test_a_sharded_eagle_tree_worker_conforms(
    paths: dict[str, str], partial_ckpt: SpecCheckpoints
) -> None:
    """Every configuration clean, ranks agreeing, tokens equal to HF on margin-screened prompts."""
    expected = screen(
        partial_ckpt.hf, (7, 2, 15, 4, 9, 3, 12), vocab_size=97, max_new_tokens=NEW_TOKENS, keep=4
    )
    report = check_worker(
        partial(reference_worker, paths, "eagle", topk=2, num_draft_tokens=6),
        vocab_size=97,
        world_size=2,
        prompts=list(expected),
        max_new_tokens=NEW_TOKENS,
        oracle=lambda prompt, n: expected[tuple(prompt)][:n],
    )
    assert report.ok, str(report)
    assert len(report.configs) == 3


def test_a_worker_that_differs_by_rank_is_named(paths: dict[str, str]) -> None:
    """A worker whose rank 1 accepts fewer tokens breaks the ``rank`` rule, naming divergence."""
    report = check_worker(partial(skewed_worker, paths), vocab_size=97, world_size=2)
    assert report.rules() == {"rank"}
    assert "RankDivergence" in str(report)
