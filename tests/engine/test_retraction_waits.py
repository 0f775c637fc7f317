"""Under overlap, KV pressure waits for deferred releases instead of aborting the last request.

A request that ends while the next batch is in flight keeps its pages until that batch retires
(`DeferredReleases`). If the pool is short only because of those pages, the scheduler must not
retract or abort anyone: it skips one decode round, the in-flight batch retires, the pages come
back, and every request finishes exactly. Found by the example adapter's test: the last running
request was aborted ("KV pool cannot hold its next decode") with 15 pages about to be freed.
"""

from __future__ import annotations

import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints, make_spec_checkpoints

from specstate import Engine, EngineConfig, FinishReason, RequestLimits, SamplingParams

NEW_TOKENS = 20
PROMPTS = [
    [62, 93, 3, 60, 5, 62, 93, 3, 60, 5],
    [70, 32, 4, 70, 32, 4],
    [75, 48, 75],
    [11, 12, 13, 14, 15, 16, 17, 18],
    [42],
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("retraction_waits"))


def test_pages_held_for_the_batch_in_flight_are_waited_for(ckpt: SpecCheckpoints) -> None:
    """Overlap, page 4, a 56-token pool, one user abort: nobody else is aborted, all exact."""
    config = EngineConfig(
        overlap=True, page_size=4, kv_tokens=56, check_invariants=True, check_ownership=True
    )
    limits = RequestLimits(vocab_size=97, max_context_len=256)
    with Engine(ckpt.worker("none"), limits=limits, config=config) as engine:
        reqs = [
            engine.submit(f"p{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            for i, p in enumerate(PROMPTS)
        ]
        for _ in range(3):
            engine.step()
        engine.abort("p1")
        log = run_checked(engine)
    assert log.deferred, "no release was deferred: the case under test did not happen"
    reasons = {r.request_id: r.finish.reason for r in reqs if r.finish is not None}
    assert reasons.pop("p1") is FinishReason.ABORT
    assert all(reason is FinishReason.LENGTH for reason in reasons.values()), reasons
    for req, prompt in zip(reqs, PROMPTS, strict=True):
        if req.request_id != "p1":
            assert list(req.emitted_ids) == greedy(ckpt.hf, prompt, NEW_TOKENS)
