"""Adaptive draft length through the real engine: the width changes while results are in flight.

A draft policy picks each decode round's draft steps at scheduling; under overlap the round
before it is still in flight, launched at its own width. Every settled round must use the
stride of the forward that produced it, must be observed by the policy exactly once at the
width it was launched with, and the tokens must stay exactly HF `generate()`'s, including
rounds with 0 drafts (speculation switched off) and rounds switching it back on. The invariant
checker runs after every step.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import numpy as np
import numpy.typing as npt
import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import (
    FAMILIES,
    MIXED_PROMPTS,
    SpecCheckpoints,
    make_partial_drafters,
    make_spec_checkpoints,
)
from spy_worker import SpyWorker

from specstate import (
    Engine,
    EngineConfig,
    FinishReason,
    ForwardBatch,
    GenerationBatchResult,
    InvalidConfig,
    InvariantViolation,
    OnPublish,
    RequestLimits,
    SamplingParams,
)
from specstate.engine.draft_policy import AcceptanceEma
from specstate.tools.timed_worker import TimedWaitWorker

NEW_TOKENS = 24
SPECULATIVE = ("draft_model", "eagle", "ngram", *FAMILIES)


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """A target and an unrelated random drafter (its drafts are almost never accepted)."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("adaptive_raw"))


@pytest.fixture(scope="module")
def ckpt(raw: SpecCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """The same target with drafters that agree only partly (accept lengths vary)."""
    root: Path = tmp_path_factory.mktemp("adaptive_partial")
    return make_partial_drafters(raw, root)


class ScriptedPolicy:
    """Cycles through fixed widths (0 included), recording every choice and observation."""

    def __init__(self, widths: tuple[int, ...], max_steps: int = 3, *, strict: bool = True) -> None:
        self._widths = widths
        self._strict = strict
        self._max = max_steps
        self.chosen: list[int] = []
        self.observed: list[tuple[int, int]] = []  # (width, rows)

    @property
    def max_steps(self) -> int:
        """The widest round it chooses."""
        return self._max

    def choose(self, batch_size: int) -> int:
        """The next width of the script."""
        width = self._widths[len(self.chosen) % len(self._widths)]
        self.chosen.append(width)
        return width

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Record the settled round's own width; accept lengths never exceed it."""
        assert not self._strict or int(accept_lens.max(initial=1)) <= num_steps + 1
        self.observed.append((num_steps, accept_lens.size))


class _Widths(SpyWorker):
    """Records each decode forward's drafting width and its result's stride."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.rounds: list[tuple[int | None, int, list[int]]] = []

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Pass through, recording decode rounds."""
        result = self._inner.forward_batch_generation(batch, on_publish=on_publish)
        if batch.forward_mode.is_decode():
            accepts = [int(a) for a in result.accept_lens.tolist()]
            self.rounds.append((batch.num_draft_steps, result.stride, accepts))
        return result


def _serve(
    worker: object,
    ckpt: SpecCheckpoints,
    *,
    overlap: bool,
    policy: object | None = None,
    adaptive: bool = False,
    page_size: int = 1,
) -> list[list[int]]:
    config = EngineConfig(
        overlap=overlap,
        page_size=page_size,
        kv_tokens=2048,
        check_invariants=True,
        check_ownership=True,
        adaptive_draft=adaptive,
    )
    limits = RequestLimits(vocab_size=97, max_context_len=256)
    with Engine(
        worker,  # type: ignore[arg-type]
        limits=limits,
        config=config,
        draft_policy=policy,  # type: ignore[arg-type]
    ) as engine:
        reqs = [
            engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
            for i, p in enumerate(MIXED_PROMPTS)
        ]
        run_checked(engine)
    assert all(r.finish is not None and r.finish.reason is FinishReason.LENGTH for r in reqs)
    return [list(r.emitted_ids) for r in reqs]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("algorithm", SPECULATIVE)
def test_width_changing_every_round_stays_exact(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Widths 3, 1, 0, 2, 0, 3, ...: exact tokens, each round at its own stride, observed once."""
    policy = ScriptedPolicy((3, 1, 0, 2, 0, 3, 2))
    worker = _Widths(ckpt.worker(algorithm, agreeing=False))
    outputs = _serve(worker, ckpt, overlap=overlap, policy=policy)
    for prompt, out in zip(MIXED_PROMPTS, outputs, strict=True):
        assert out == greedy(ckpt.hf, list(prompt), NEW_TOKENS)
    widths = [w for w, _, _ in worker.rounds]
    assert set(widths) == {0, 1, 2, 3}, "the script's widths did not all run"
    assert all(stride == w + 1 for w, stride, _ in worker.rounds if w is not None)
    assert all(max(a) <= w + 1 for w, _, a in worker.rounds if w is not None)
    # Exactly one observation per launched decode round, at the width it was launched with.
    assert [w for w, _ in policy.observed] == policy.chosen
    # Speculative rounds accept partly: a run strictly between 1 and the round's width + 1.
    assert any(1 < a < w + 1 for w, _, run in worker.rounds if w for a in run)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_the_shipped_policy_switches_off_and_back_on_exactly(
    raw: SpecCheckpoints, overlap: bool
) -> None:
    """A drafter that never agrees gates speculation off; probes turn it on; tokens are exact."""
    policy = AcceptanceEma(3, smoothing=1.0, gate_below=0.1, probe_after=2)
    chosen: list[int] = []
    choose = policy.choose

    def recording_choose(batch_size: int) -> int:
        chosen.append(choose(batch_size))
        return chosen[-1]

    policy.choose = recording_choose  # type: ignore[method-assign]
    worker = _Widths(raw.worker("draft_model", agreeing=False))
    outputs = _serve(worker, raw, overlap=overlap, policy=policy)
    for prompt, out in zip(MIXED_PROMPTS, outputs, strict=True):
        assert out == greedy(raw.hf, list(prompt), NEW_TOKENS)
    assert 0 in chosen, "speculation never switched off"
    off = chosen.index(0)
    assert any(w > 0 for w in chosen[off:]), "speculation never came back on"
    assert chosen.count(0) >= 2, chosen


def test_adaptive_draft_config_builds_the_shipped_policy(ckpt: SpecCheckpoints) -> None:
    """``EngineConfig(adaptive_draft=True)`` runs rounds below the full width, exactly."""
    worker = _Widths(ckpt.worker("ngram"))
    outputs = _serve(worker, ckpt, overlap=True, adaptive=True, page_size=16)
    for prompt, out in zip(MIXED_PROMPTS, outputs, strict=True):
        assert out == greedy(ckpt.hf, list(prompt), NEW_TOKENS)
    assert all(w is not None for w, _, _ in worker.rounds)


class _IgnoresWidth(SpyWorker):
    """A worker that drafts its full width whatever the round asks."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Drop the round's width before the real worker sees it."""
        batch = attrs.evolve(batch, num_draft_steps=None)
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_worker_accepting_past_the_round_width_fails_its_batch(
    ckpt: SpecCheckpoints, overlap: bool
) -> None:
    """Accepting more than ``num_draft_steps + 1`` fails the batch naming the width."""
    worker = _IgnoresWidth(ckpt.worker("draft_model", agreeing=True))
    config = EngineConfig(overlap=overlap, check_invariants=True, check_ownership=True)
    limits = RequestLimits(vocab_size=97, max_context_len=256)
    with Engine(worker, limits=limits, config=config, draft_policy=ScriptedPolicy((0,))) as engine:
        req = engine.submit("r", [3, 14, 15], SamplingParams(max_new_tokens=12, ignore_eos=True))
        run_checked(engine)
    assert req.finish is not None and req.finish.reason is FinishReason.ERROR
    assert "launched with 0 draft steps" in req.finish.detail


def test_a_policy_the_worker_cannot_follow_is_refused(ckpt: SpecCheckpoints) -> None:
    """No adaptive support, or a policy wider than the worker: InvalidConfig at construction."""
    limits = RequestLimits(vocab_size=32, max_context_len=64)
    with pytest.raises(InvalidConfig, match="does not support adaptive draft length"):
        Engine(
            TimedWaitWorker(device_seconds=0.0),
            limits=limits,
            config=EngineConfig(adaptive_draft=True),
        )
    with pytest.raises(InvalidConfig, match="drafts at most 3"):
        Engine(
            ckpt.worker("ngram"),
            limits=RequestLimits(vocab_size=97, max_context_len=64),
            config=EngineConfig(),
            draft_policy=AcceptanceEma(5),
        )


def test_the_invariant_checker_names_a_round_settled_past_its_width(
    ckpt: SpecCheckpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the always-on result check bypassed, ``draft-width`` still catches the round."""
    import specstate.engine.launch.launcher as launcher_module

    monkeypatch.setattr(launcher_module, "check_sampling_rows", lambda *a, **k: None)
    worker = _IgnoresWidth(ckpt.worker("draft_model", agreeing=True))
    config = EngineConfig(overlap=False, check_invariants=True, check_ownership=True)
    limits = RequestLimits(vocab_size=97, max_context_len=256)
    policy = ScriptedPolicy((0,), strict=False)
    with Engine(worker, limits=limits, config=config, draft_policy=policy) as engine:
        engine.submit("r", [3, 14, 15], SamplingParams(max_new_tokens=12, ignore_eos=True))
        with pytest.raises(InvariantViolation) as caught:
            run_checked(engine)
    assert caught.value.invariant == "draft-width", caught.value
    assert "launched with 0 draft steps" in str(caught.value)


def test_rows_that_do_not_speculate_are_not_observed(ckpt: SpecCheckpoints) -> None:
    """``speculative=False`` requests accept one token whatever the drafts: the policy's view of
    acceptance leaves them out, so they cannot switch speculation off for the others."""
    policy = ScriptedPolicy((2,))
    config = EngineConfig(overlap=True, kv_tokens=2048, check_invariants=True)
    limits = RequestLimits(vocab_size=97, max_context_len=256)
    speculates = [i % 2 == 0 for i in range(len(MIXED_PROMPTS))]
    with Engine(ckpt.worker("ngram"), limits=limits, config=config, draft_policy=policy) as engine:
        reqs = [
            engine.submit(
                f"r{i}",
                p,
                SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True, speculative=spec),
            )
            for i, (p, spec) in enumerate(zip(MIXED_PROMPTS, speculates, strict=True))
        ]
        run_checked(engine)
    for prompt, req in zip(MIXED_PROMPTS, reqs, strict=True):
        assert list(req.emitted_ids) == greedy(ckpt.hf, list(prompt), NEW_TOKENS)
    rows = [n for _, n in policy.observed]
    assert rows and max(rows) <= sum(speculates) < len(MIXED_PROMPTS)
