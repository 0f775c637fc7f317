"""Admission counts what a request will need, not only its prompt, through the real engine.

* A waiting request is admitted only if the free pool holds its prompt, its first speculative
  reservation and a page **after** what the running requests' next decode reservation takes:
  with a prompt sized to fit only when one of those is ignored, it waits until the running
  request ends, and no retraction or abort ever happens (an admission that did not count them
  would force one on the very next decode).
* ``max_running`` counts requests still in chunked prefill: running + prefilling never exceeds
  it, after any step.

The invariant checker runs after every step; tokens are exactly Hugging Face ``generate()``'s.
"""

from __future__ import annotations

import pytest
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints

from specstate import FinishReason, ReqStatus, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine

RESERVE = 8  # draft_model, 3 steps: L = 4, R = 2 * L
PAGE = 1


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_request_waits_until_prompt_reserve_and_page_fit_after_the_decodes(
    partial_ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """B's prompt + reserve + page fits the free pool only if A's next reservation is ignored
    (or the reserve is): B waits while A runs, nothing is retracted, both are exact."""
    worker = partial_ckpt.worker("draft_model", agreeing=True)  # A accepts 4 a round
    assert worker.capabilities.spec_window(PAGE).reserve == RESERVE
    config = EngineConfig(
        overlap=overlap, page_size=PAGE, kv_tokens=64, check_invariants=True, check_ownership=True
    )
    limits = RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64)
    a_prompt = [3, 14, 15, 92, 65, 35]
    with Engine(worker, limits=limits, config=config) as engine:
        a = engine.submit("a", a_prompt, SamplingParams(max_new_tokens=24, ignore_eos=True))
        while len(a.output_ids) < 5:  # A decodes: its rounds reserve 4 more tokens each
            engine.step()
        free = engine.snapshot().num_free_pages * PAGE
        b_prompt = [(7 * i) % 90 + 1 for i in range(free - RESERVE - PAGE)]
        b = engine.submit("b", b_prompt, SamplingParams(max_new_tokens=4, ignore_eos=True))
        retracted = aborted = 0
        waited = 0
        while not engine.is_idle:
            if not a.is_finished:
                waited += b.status is ReqStatus.WAITING
                assert b.status is ReqStatus.WAITING, "B was admitted while A still ran"
            report = engine.step()
            retracted += len(report.retracted)
            aborted += sum(r.finish is not None and r.finish.reason is FinishReason.ABORT
                           for r in report.ended)  # fmt: skip
            check_engine(engine)
    assert waited > 3 and retracted == 0 and aborted == 0
    assert list(a.emitted_ids) == greedy(partial_ckpt.hf, a_prompt, 24)
    assert list(b.emitted_ids) == greedy(partial_ckpt.hf, b_prompt, 4)
    assert max(a.accept_lengths) == 4


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_max_running_counts_requests_in_chunked_prefill(
    partial_ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """running + prefilling <= max_running after every step, while prompts are chunked."""
    config = EngineConfig(
        overlap=overlap,
        max_running=2,
        chunked_prefill=8,
        kv_tokens=1024,
        check_invariants=True,
        check_ownership=True,
    )
    limits = RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64)
    prompts = [[(5 * i + j) % 90 + 1 for j in range(10 + 3 * i)] for i in range(5)]
    chunked = 0
    with Engine(partial_ckpt.worker("eagle"), limits=limits, config=config) as engine:
        reqs = [
            engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=6, ignore_eos=True))
            for i, p in enumerate(prompts)
        ]
        while not engine.is_idle:
            engine.step()
            check_engine(engine)
            snap = engine.snapshot()
            assert snap.num_running + snap.num_prefilling <= 2, snap
            chunked += snap.num_prefilling > 0
    assert chunked > 2  # prompts of 10+ tokens in chunks of 8: some step left one prefilling
    for req, prompt in zip(reqs, prompts, strict=True):
        assert list(req.emitted_ids) == greedy(partial_ckpt.hf, prompt, 6)
