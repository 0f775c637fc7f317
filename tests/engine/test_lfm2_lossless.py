"""LFM2 (short convolution + attention) targets under speculation are lossless (HF generate).

The algorithms that serve a hybrid target (``none``, ``ngram``, chain ``draft_model`` with a
partly agreeing LFM2 drafter), both loops, page sizes 1 and 16, whole and chunked prefill with
mixed chunks, and stops inside accepted runs (retraction: test_hybrid_retraction.py). Every
step runs the invariant checker (the recurrent-state invariants included) and the ownership
checks. The convolutions steer the output, so a conv state selected for the wrong accept length
or not carried over a round shows up as a wrong token.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import pytest
from engine_driver import checked_config, serve_to_completion, with_stops
from hf_oracle import greedy
from hybrid_oracle import HYBRID_PROMPTS
from lfm2_oracle import Lfm2Checkpoints, make_lfm2_checkpoints
from spy_worker import SpyWorker

from specstate import RequestLimits
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish, WorkerProtocol

PROMPTS = HYBRID_PROMPTS
NEW_TOKENS = 14
LOOPS = [  # (overlap, page_size, chunked_prefill, mixed_chunk)
    (overlap, page_size, *chunking)
    for overlap, page_size, chunking in itertools.product(
        [False, True], [1, 16], [(None, False), (4, True)]
    )
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Lfm2Checkpoints:
    """The LFM2 target and its drafters, shared by the module."""
    return make_lfm2_checkpoints(tmp_path_factory.mktemp("lfm2"))


@pytest.fixture(scope="module")
def expected(ckpt: Lfm2Checkpoints) -> list[list[int]]:
    """transformers' greedy continuations."""
    return [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]


class RoundSpy(SpyWorker):
    """Delegates to a worker; records the accept lengths of every decode round."""

    def __init__(self, inner: WorkerProtocol) -> None:
        super().__init__(inner)
        self.accepts: list[int] = []

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Delegate; remember the accept lengths of a decode round."""
        result = super().forward_batch_generation(batch, on_publish=on_publish)
        if batch.forward_mode is ForwardMode.DECODE:
            self.accepts.extend(result.accept_lens.tolist())
        return result


def _serve(
    ckpt: Lfm2Checkpoints,
    worker: WorkerProtocol,
    stops: Sequence[int | None],
    config: EngineConfig,
) -> list[list[int]]:
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = serve_to_completion(engine, PROMPTS, max_new_tokens=NEW_TOKENS, stops=stops)
    return [list(r.emitted_ids) for r in reqs]


@pytest.mark.parametrize(("overlap", "page_size", "chunk", "mixed"), LOOPS)
@pytest.mark.parametrize("algorithm", ["none", "ngram", "draft_model"])
def test_lfm2_lossless_matrix(
    ckpt: Lfm2Checkpoints,
    expected: list[list[int]],
    algorithm: str,
    overlap: bool,
    page_size: int,
    chunk: int | None,
    mixed: bool,
) -> None:
    """Greedy outputs equal HF generate token for token, stops inside accepted runs included."""
    stops, wants = with_stops(expected)
    spy = RoundSpy(ckpt.worker(algorithm))
    config = checked_config(
        overlap=overlap, page_size=page_size, chunked_prefill=chunk, mixed_chunk=mixed
    )
    assert isinstance(config, EngineConfig) and config.check_invariants and config.check_ownership
    assert _serve(ckpt, spy, stops, config) == wants
    recurrent = spy.capabilities.recurrent
    assert recurrent is not None
    groups = [g.name for g in recurrent.groups]  # the drafter's state rows are counted too
    assert groups == ["target.short_conv"] + (["draft.short_conv"] * (algorithm == "draft_model"))
    if algorithm == "draft_model":  # an LFM2 drafter that agrees for a while
        max_accept = spy.capabilities.max_accept
        assert any(1 < a < max_accept for a in spy.accepts), spy.accepts
        assert max_accept in spy.accepts, spy.accepts
