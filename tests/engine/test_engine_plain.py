"""The engine with a plain worker: normal and overlap loops are lossless against HF generate."""

from __future__ import annotations

from pathlib import Path

import pytest
from hf_oracle import greedy, make_checkpoint
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine

PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32, 79, 50, 28], [7]]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize(("chunked", "mixed"), [(None, False), (4, False), (4, True)])
def test_plain_engine_matches_hf(
    tmp_path: Path, overlap: bool, page_size: int, chunked: int | None, mixed: bool
) -> None:
    """Concurrent requests of mixed lengths produce exactly HF's greedy tokens."""
    hf = make_checkpoint(tmp_path)
    config = EngineConfig(
        overlap=overlap,
        page_size=page_size,
        kv_tokens=1024,
        chunked_prefill=chunked,
        mixed_chunk=mixed,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=97, max_context_len=64)
    worker = SpyWorker.plain(tmp_path)
    with Engine(worker, limits=limits, config=config) as engine:
        outs = engine.generate(PROMPTS, SamplingParams(max_new_tokens=12))
        snap = engine.snapshot()
    assert ("mixed" in worker.calls) == mixed
    assert outs == [tuple(greedy(hf, p, 12)) for p in PROMPTS]
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
