"""Both reference hybrids (NemotronH: Mamba2; LFM2: short convolutions) under KV pressure.

A pool too small for every request retracts some: their recurrent states are discarded with
their KV and rebuilt by the re-prefill, which starts from the zero state whatever the reused
rows hold. Every request still emits transformers' greedy tokens, every step runs the invariant
checker, and every state record closes with its slot.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

import pytest
from engine_driver import serve_under_pressure
from hf_oracle import greedy
from hybrid_oracle import HYBRID_PROMPTS, make_hybrid_checkpoints
from lfm2_oracle import make_lfm2_checkpoints

from specstate.engine.worker import WorkerProtocol

PROMPTS = HYBRID_PROMPTS
NEW_TOKENS = 14


class Checkpoints(Protocol):
    """A hybrid target, its transformers twin and its drafters (either oracle's)."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def hf(self) -> object: ...

    def worker(self, algorithm: str, *, num_steps: int = 3) -> WorkerProtocol: ...


@pytest.fixture(scope="module", params=["nemotron_h", "lfm2"])
def hybrid(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Checkpoints, list[list[int]]]:
    """A hybrid target of each kind and transformers' greedy continuations."""
    root: Path = tmp_path_factory.mktemp(request.param)
    ckpt = (
        make_hybrid_checkpoints(root)
        if request.param == "nemotron_h"
        else make_lfm2_checkpoints(root)
    )
    return ckpt, [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize(("overlap", "page_size"), [(False, 1), (True, 16)])
@pytest.mark.parametrize("algorithm", ["ngram", "draft_model"])
def test_retraction_under_pressure_is_lossless(
    hybrid: tuple[Checkpoints, list[list[int]]], algorithm: str, overlap: bool, page_size: int
) -> None:
    """Retractions happen, every request emits HF's tokens, and every state record closes."""
    ckpt, expected = hybrid
    outputs, log, engine = serve_under_pressure(
        ckpt.worker(algorithm),
        PROMPTS,
        vocab_size=ckpt.vocab_size,
        max_new_tokens=NEW_TOKENS,
        overlap=overlap,
        page_size=page_size,
    )
    assert log.retracted, "the pool was meant to force retractions"
    assert outputs == expected
    pool = engine.allocator.recurrent
    assert pool is not None and pool.snapshot().num_open == 0
