"""Non-finite logits end their request with ERROR; the rest of the batch stays exact.

The target's embedding of one token is set to NaN after the engine is built, so exactly the
rows whose context holds that token get NaN logits. The reference worker reports them in
``invalid_rows`` (zeroing their logits, so no sampling call raises for the whole batch); the
engine ends those requests with `FinishReason.ERROR` instead of emitting made-up tokens.

* a request whose prompt holds the token ends at its prefill, having emitted nothing;
* a request that *generates* the token emits a prefix of HF's tokens, then ends with ERROR at
  the forward that reads it: without speculation exactly the tokens up to and including it;
  with speculation the verify window that reads it is dropped whole, so the prefix may stop
  up to ``max_accept`` tokens earlier — but never holds a made-up token;
* a clean request in the same batches emits exactly HF `generate()`'s tokens.

Both loops, speculative and not, with the invariant checker after every step.
"""

from __future__ import annotations

import pytest
import torch
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints, make_spec_checkpoints

from specstate import FinishReason, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.reference.workers.round import ChainRoundWorker

CLEAN = [3, 14, 15, 92]
GENERATES = [65, 35, 89]
NEW_TOKENS = 12
CUT = 5  # the poisoned token is GENERATES' oracle token at this index


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("nan"), seed=3)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["none", "eagle"])
def test_non_finite_logits_end_only_their_request(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Poisoned rows end with ERROR after an exact prefix; the clean request is exact."""
    clean_want = greedy(ckpt.hf, CLEAN, NEW_TOKENS)
    gen_want = greedy(ckpt.hf, GENERATES, NEW_TOKENS)
    poison = gen_want[CUT]
    assert poison not in CLEAN + clean_want and poison not in GENERATES + gen_want[:CUT]
    worker = ckpt.worker(algorithm)
    config = EngineConfig(
        overlap=overlap, kv_tokens=512, check_invariants=True, check_ownership=True
    )
    engine = Engine(
        worker,
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=config,
    )
    assert isinstance(worker, ChainRoundWorker)
    with torch.no_grad():
        worker.target_model.embed_tokens.weight[poison] = float("nan")
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    holds = engine.submit("holds", [7, poison, 9], params)
    generates = engine.submit("generates", GENERATES, params)
    clean = engine.submit("clean", CLEAN, params)
    run_checked(engine)

    assert list(clean.emitted_ids) == clean_want
    assert clean.finish is not None and clean.finish.reason is FinishReason.LENGTH
    for req in (holds, generates):
        assert req.finish is not None and req.finish.reason is FinishReason.ERROR, req
        assert "invalid" in req.finish.detail and "non-finite" in req.finish.detail
    assert list(holds.emitted_ids) == []
    got = list(generates.emitted_ids)
    window = worker.capabilities.max_accept
    assert got == gen_want[: len(got)] and CUT + 1 - window <= len(got) <= CUT + 1, got
    if window == 1:
        assert len(got) == CUT + 1
    snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    engine.close()
