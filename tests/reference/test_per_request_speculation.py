"""``SamplingParams(speculative=False)``: such rows ride the verify batch and accept exactly 1.

A batch mixes speculative and non-speculative requests of the same prompts: every output
equals HF's greedy continuation, the non-speculative rows accept exactly one token in every
round while the speculative ones accept runs strictly between 1 and D. A seeded sampled request
emits the same tokens either way (its tokens do not depend on the drafts). A worker that
ignores the switch fails its batch with `WorkerResultError` (the engine's check).
"""

from __future__ import annotations

import attrs
import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import (
    ALGORITHMS,
    FAMILIES,
    MIXED_PROMPTS,
    SpecCheckpoints,
)
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.request import Req
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish, WorkerProtocol

NEW_TOKENS = 16
STEPS = 3


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


@pytest.fixture(scope="module")
def expected(ckpt: SpecCheckpoints) -> list[list[int]]:
    """HF's greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]


def serve(
    worker: WorkerProtocol,
    vocab_size: int,
    requests: list[tuple[list[int], SamplingParams]],
    **config: object,
) -> list[Req]:
    """Serve ``requests`` in one checked engine."""
    engine_config = EngineConfig(
        kv_tokens=2048,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **config,  # type: ignore[arg-type]
    )
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=engine_config) as engine:
        reqs = [engine.submit(f"q{i}", p, params) for i, (p, params) in enumerate(requests)]
        run_checked(engine)
    return reqs


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", [*ALGORITHMS, *FAMILIES])
def test_mixed_batch_is_lossless_and_non_speculative_rows_accept_one(
    ckpt: SpecCheckpoints, expected: list[list[int]], algorithm: str, overlap: bool
) -> None:
    """Each prompt twice in one batch, with and without speculation: both equal HF."""
    requests = [
        (list(prompt), SamplingParams(max_new_tokens=NEW_TOKENS, speculative=spec))
        for prompt in MIXED_PROMPTS
        for spec in (True, False)
    ]
    worker = ckpt.worker(algorithm, num_steps=STEPS, agreeing=False)
    reqs = serve(worker, ckpt.vocab_size, requests, overlap=overlap)
    assert [list(r.emitted_ids) for r in reqs] == [e for e in expected for _ in range(2)]
    plain, speculating = reqs[1::2], reqs[0::2]
    for req in plain:  # one verify per output after the prefill's token, each accepting 1
        assert req.accept_lengths == (1,) * (NEW_TOKENS - 1)
    if algorithm != "none":
        assert any(1 < a < STEPS + 1 for r in speculating for a in r.accept_lengths)


@pytest.mark.parametrize("algorithm", ["draft_model", "eagle", "ngram", *FAMILIES])
def test_a_seeded_sampled_request_emits_the_same_tokens_with_or_without_speculation(
    ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """Seeded tokens are a function of the seed and the target: the switch changes speed only."""
    requests = [
        (
            list(prompt),
            SamplingParams(
                max_new_tokens=NEW_TOKENS, temperature=0.8, seed=100 + i, speculative=spec
            ),
        )
        for i, prompt in enumerate(MIXED_PROMPTS)
        for spec in (True, False)
    ]
    worker = ckpt.worker(algorithm, num_steps=STEPS, agreeing=False)
    reqs = serve(worker, ckpt.vocab_size, requests, overlap=True)
    for spec, plain in zip(reqs[0::2], reqs[1::2], strict=True):
        assert spec.emitted_ids == plain.emitted_ids
        assert set(plain.accept_lengths) == {1}
    if algorithm != "ngram":  # coupled drafts of a model drafter are accepted too
        assert any(a > 1 for r in reqs[0::2] for a in r.accept_lengths)


class IgnoresTheSwitch(SpyWorker):
    """Delegates to a reference worker but hides ``speculative`` from it: every row drafts
    (it still claims the switch: the inner worker's capabilities)."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Forward with every row speculating."""
        sampling = attrs.evolve(batch.sampling_info, speculative=None, speculative_host=None)
        hidden = attrs.evolve(batch, sampling_info=sampling)
        return super().forward_batch_generation(hidden, on_publish=on_publish)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_worker_that_ignores_the_switch_fails_its_batch(
    ckpt: SpecCheckpoints, expected: list[list[int]], overlap: bool
) -> None:
    """An agreeing drafter accepts D tokens for a non-speculative row: WorkerResultError."""
    worker = IgnoresTheSwitch(ckpt.worker("draft_model", num_steps=STEPS, agreeing=True))
    params = SamplingParams(max_new_tokens=NEW_TOKENS, speculative=False)
    reqs = serve(worker, ckpt.vocab_size, [(list(MIXED_PROMPTS[0]), params)], overlap=overlap)
    finish = reqs[0].finish
    assert finish is not None and finish.reason is FinishReason.ERROR
    assert "WorkerResultError" in finish.detail and "does not speculate" in finish.detail
    assert list(reqs[0].emitted_ids) == expected[0][: len(reqs[0].emitted_ids)]
