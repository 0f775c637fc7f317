"""Stream order for the block drafters: post-publish commits are ordered, never waited for.

DFLASH publishes after accept and materializes the accepted context into its assistant's KV
after the publish, on the forward stream; under overlap the host plans round N+1 meanwhile, and
round N+1's block draft reads that KV. The checker: a jittery forward stream (a random delay
before every item), the consume-once relay, and the worker's `CommitOrderLedger` (every block
draft checks that each position it reads was materialized from the latest forward that wrote
it).

* dflash and uno, chunked prefill with mixed chunks, on that stream: exact tokens, no relay
  error, no commit-order error.
* The checker can fail: a dflash worker that publishes and lets the next forward read before
  its materialization (here: deferred until after the next block draft, as a port that moved
  the commit off the stream might) fails its batch with the commit-order `RelayError`.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from block_checkpoints import BLOCK_FAMILIES, BlockCheckpoints
from engine_driver import run_checked
from hf_oracle import greedy
from late_commit import MaterializesLate
from spec_checkpoints import MIXED_PROMPTS

from specstate import RequestLimits, SamplingParams
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.launch import launcher as launch
from specstate.engine.worker import WorkerProtocol
from specstate.relay.streams import CpuStream, Stream

NEW_TOKENS = 12


@pytest.fixture
def jittery_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward stream the engine makes sleeps 0-3 ms before each item."""
    rng = random.Random(0)

    def make(device: object, *, name: str = "forward") -> Stream:
        return CpuStream(name, delay=lambda: rng.uniform(0.0, 0.003))

    monkeypatch.setattr(launch, "make_stream", make)


def _serve(worker: WorkerProtocol) -> list[Any]:
    config = EngineConfig(
        overlap=True,
        kv_tokens=1024,
        chunked_prefill=4,
        mixed_chunk=True,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=97, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
        run_checked(engine, max_steps=300)
    return reqs


@pytest.mark.usefixtures("jittery_stream")
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_block_drafters_follow_stream_order_on_a_jittery_stream(
    block_ckpt: BlockCheckpoints, family: str
) -> None:
    """Stream order alone orders publish -> commit -> next read: exact tokens, no error."""
    options: dict[str, object] = {"check_commit_order": True} if family == "dflash" else {}
    reqs = _serve(block_ckpt.worker(family, **options))
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH, req.finish
        assert list(req.emitted_ids) == greedy(block_ckpt.hf, prompt, NEW_TOKENS)


@pytest.mark.usefixtures("jittery_stream")
def test_the_checker_catches_a_materialization_after_the_next_read(
    block_ckpt: BlockCheckpoints,
) -> None:
    """The late commit leaves the next draft reading stale KV: its batch fails, naming it."""
    worker = MaterializesLate(
        target=block_ckpt.target, assistant=block_ckpt.assistant, check_commit_order=True
    )
    reqs = _serve(worker)
    details = [r.finish.detail for r in reqs if r.finish and r.finish.reason is FinishReason.ERROR]
    assert details, [r.finish for r in reqs]
    assert all("RelayError" in d and "before the post-publish commit" in d for d in details)
