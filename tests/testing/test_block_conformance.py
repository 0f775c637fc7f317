"""The conformance kit on the block drafters: both conform; a late post-publish commit is named.

dflash runs with its commit-order check on, so every configuration of the kit (both loops, page
sizes, chunking, pressure with an abort, adaptive widths, speculation off) also checks that each
block draft reads only materialized context; the kit reports a port whose materialization runs
after the next forward's read under its own rule, ``commit-order``.
"""

from __future__ import annotations

from functools import partial

import pytest
from block_checkpoints import BLOCK_FAMILIES, BlockCheckpoints
from hf_oracle import greedy
from late_commit import MaterializesLate

from specstate.engine.worker import WorkerProtocol
from specstate.testing.conformance import assert_worker_conforms, check_worker


@pytest.mark.slow
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_the_block_drafters_conform(block_ckpt: BlockCheckpoints, family: str) -> None:
    """Every configuration, every rule, tokens equal to HF generate."""
    options = {"check_commit_order": True} if family == "dflash" else {}
    assert_worker_conforms(
        partial(block_ckpt.worker, family, **options),
        vocab_size=97,
        oracle=lambda prompt, n: greedy(block_ckpt.hf, prompt, n),
    )


@pytest.mark.slow
def test_a_late_materialization_breaks_the_commit_order_rule(block_ckpt: BlockCheckpoints) -> None:
    """The kit names the rule, and nothing else breaks: the tokens are still exact."""

    def factory() -> WorkerProtocol:
        return MaterializesLate(
            target=block_ckpt.target, assistant=block_ckpt.assistant, check_commit_order=True
        )

    report = check_worker(factory, vocab_size=97)
    assert report.rules() == {"commit-order"}, str(report)
