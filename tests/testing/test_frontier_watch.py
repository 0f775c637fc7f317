"""`FrontierWatch`: every reference worker reads KV only below its frontier (or what it just
wrote) and writes only inside the window its capabilities reserve; a planted read one position
past the frontier (a Frozen-KV drafter's) and a planted undeclared write are each caught."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from engine_driver import checked_config, run_checked
from hf_oracle import greedy
from planted_workers import ReadsOnePastTheFrontier, WritesUndeclaredKv, planted
from spec_checkpoints import ALGORITHMS, FAMILIES, MIXED_PROMPTS, SpecCheckpoints

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.testing.frontier_watch import FrontierWatch, WatchableWorker

NEW_TOKENS = 10


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """The shared target with partly agreeing drafters."""
    return partial_ckpt


def serve(
    ckpt: SpecCheckpoints,
    worker: WatchableWorker,
    *,
    overlap: bool,
    page_size: int,
    **options: Any,
) -> tuple[list[list[int]], list[tuple[str, str]]]:
    """Serve the mixed prompts through a watched worker; outputs and findings."""
    watch = FrontierWatch(worker, page_size=page_size)
    config = checked_config(overlap=overlap, page_size=page_size, **options)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(watch, limits=limits, config=config) as engine:
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
        run_checked(engine)
    return [list(r.emitted_ids) for r in reqs], watch.take()


CASES = list(itertools.product([*ALGORITHMS, *FAMILIES], [False, True], [1, 16]))


@pytest.mark.parametrize(("algorithm", "overlap", "page_size"), CASES)
def test_every_reference_worker_keeps_to_its_frontier_and_window(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool, page_size: int
) -> None:
    """No finding for any reference chain worker, chunked and mixed prefill included."""
    worker = ckpt.worker(algorithm, agreeing=False)
    assert isinstance(worker, WatchableWorker)
    outs, found = serve(
        ckpt, worker, overlap=overlap, page_size=page_size, chunked_prefill=4, mixed_chunk=True
    )
    assert found == []
    assert outs == [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]


def test_a_frozen_kv_read_past_the_frontier_is_caught(ckpt: SpecCheckpoints) -> None:
    """The planted read is found (outputs stay lossless: only the watch can see it)."""
    outs, found = serve(ckpt, planted(ckpt, ReadsOnePastTheFrontier), overlap=True, page_size=1)
    assert outs == [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]
    assert [rule for rule, _ in found] == ["frontier"]
    assert "the target KV cache was read at position" in found[0][1]


def test_kv_writes_the_capabilities_do_not_declare_are_caught(ckpt: SpecCheckpoints) -> None:
    """A drafter declaring no KV that writes past the target's window: a window finding."""
    _, found = serve(ckpt, planted(ckpt, WritesUndeclaredKv), overlap=False, page_size=1)
    assert [rule for rule, _ in found] == ["window"]
    assert "the target KV cache was written at slot" in found[0][1]
