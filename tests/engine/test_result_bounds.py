"""The result check's bounds, pinned exactly, through the real engine.

* A published frontier **short of** ``seq_lens + accept_lens`` fails its batch with
  `WorkerResultError`, as one too far ahead does (both loops: ``on_publish`` and
  ``new_seq_lens``).
* The adaptive width bound is exact: a round launched with ``w`` draft steps may accept
  ``w + 1`` tokens (a drafter the target always agrees with, every round at its bound) and
  fails its batch at ``w + 2`` (a worker that drafts one step more than asked).
"""

from __future__ import annotations

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints
from spy_worker import SpyWorker

from specstate import FinishReason, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish

PROMPT = [3, 14, 15, 92]


class _ShortFrontier(SpyWorker):
    """Its second decode round publishes one token short of where the runs end."""

    decodes = 0

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The real round, with the frontier (published and returned) minus one."""
        if not batch.forward_mode.is_decode():
            return self._inner.forward_batch_generation(batch, on_publish=on_publish)
        self.decodes += 1
        result = self._inner.forward_batch_generation(batch, on_publish=None)
        if self.decodes != 2:
            if on_publish is not None and result.new_seq_lens is not None:
                on_publish(result.new_seq_lens)
            return result
        assert result.new_seq_lens is not None
        short = result.new_seq_lens - 1
        if on_publish is not None:
            on_publish(short)
        return attrs.evolve(result, new_seq_lens=short)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_frontier_short_of_the_runs_fails_its_batch(
    partial_ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """published = seq_lens + accept - 1: WorkerResultError naming both numbers."""
    worker = _ShortFrontier(partial_ckpt.worker("eagle"))
    config = EngineConfig(overlap=overlap, check_invariants=True, check_ownership=True)
    limits = RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=config) as engine:
        req = engine.submit("r", PROMPT, SamplingParams(max_new_tokens=20, ignore_eos=True))
        run_checked(engine)
    assert req.finish is not None and req.finish.reason is FinishReason.ERROR
    assert "WorkerResultError: request r: published frontier" in req.finish.detail
    assert "but seq_lens + accept_lens is" in req.finish.detail


class _Fixed:
    """Always the same width."""

    def __init__(self, width: int) -> None:
        self._width = width

    @property
    def max_steps(self) -> int:
        """The worker's width."""
        return 3

    def choose(self, batch_size: int) -> int:
        """The fixed width."""
        return self._width

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Nothing to learn."""


class _OneMoreStep(SpyWorker):
    """Drafts one step more than the round asks (so an agreeing drafter accepts w + 2)."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The round at width + 1."""
        if batch.num_draft_steps is not None:
            batch = attrs.evolve(batch, num_draft_steps=batch.num_draft_steps + 1)
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("width", [0, 1, 2])
def test_the_adaptive_bound_is_width_plus_one_exactly(
    partial_ckpt: SpecCheckpoints, width: int, overlap: bool
) -> None:
    """accept == w + 1 every round is fine and exact; the same drafter asked for w but
    drafting w + 1 accepts w + 2 and fails its batch naming the width."""
    config = EngineConfig(overlap=overlap, check_invariants=True, check_ownership=True)
    limits = RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=15, ignore_eos=True)
    worker = partial_ckpt.worker("draft_model", agreeing=True)
    with Engine(worker, limits=limits, config=config, draft_policy=_Fixed(width)) as engine:
        exact = engine.submit("exact", PROMPT, params)
        run_checked(engine)
    assert exact.finish is not None and exact.finish.reason is FinishReason.LENGTH
    assert list(exact.emitted_ids) == greedy(partial_ckpt.hf, PROMPT, 15)
    assert set(exact.accept_lengths[:-1]) == {width + 1}  # the last may be cut by the cap
    over = _OneMoreStep(partial_ckpt.worker("draft_model", agreeing=True))
    with Engine(over, limits=limits, config=config, draft_policy=_Fixed(width)) as engine:
        wide = engine.submit("wide", PROMPT, params)
        run_checked(engine)
    assert wide.finish is not None and wide.finish.reason is FinishReason.ERROR
    assert f"accept length {width + 2} in a round launched with {width} draft steps" in (
        wide.finish.detail
    )
