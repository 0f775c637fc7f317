"""A draft policy is user code inside the round: the engine contains it (`DraftGuard`).

Through the real engine, both loops, the invariant checker after every step: a policy whose
``choose`` answers something that is not a width (-1, past ``max_steps``, 2.5, "2", True, None)
or raises, or whose ``observe`` raises, is disabled at its first failure (logged once, named in
`Engine.snapshot`); that round and every later one draft the worker's full width; no request
ends with an error and every token is exactly Hugging Face ``generate()``'s, as without a policy.
"""

from __future__ import annotations

import logging

import numpy as np
import numpy.typing as npt
import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints
from spy_worker import SpyWorker

from specstate import (
    Engine,
    EngineConfig,
    FinishReason,
    ForwardBatch,
    GenerationBatchResult,
    InvalidConfig,
    OnPublish,
    RequestLimits,
    SamplingParams,
)
from specstate.engine.draft_policy import AcceptanceEma

NEW_TOKENS = 16
FAIL_AT = 3  # the policy's third call fails


class _Faulty:
    """Widths 1, 2, 1, 2, ...; its ``FAIL_AT``-th ``choose`` (or ``observe``) goes wrong."""

    def __init__(self, *, bad_choice: object = None, choose_raises: BaseException | None = None,
                 observe_raises: BaseException | None = None) -> None:  # fmt: skip
        self._bad = bad_choice
        self._choose_raises = choose_raises
        self._observe_raises = observe_raises
        self.chose = 0
        self.observed = 0

    @property
    def max_steps(self) -> int:
        """The widest round it chooses."""
        return 3

    def choose(self, batch_size: int) -> int:
        """1 or 2, or the bad answer on the ``FAIL_AT``-th call."""
        self.chose += 1
        if self.chose == FAIL_AT:
            if self._choose_raises is not None:
                raise self._choose_raises
            if self._bad is not None:
                return self._bad  # type: ignore[return-value]
        return 1 + self.chose % 2

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Count; raise on the ``FAIL_AT``-th call if told to."""
        self.observed += 1
        if self.observed == FAIL_AT and self._observe_raises is not None:
            raise self._observe_raises


class _Widths(SpyWorker):
    """Records the draft width of every decode forward."""

    def __init__(self, inner: object) -> None:
        super().__init__(inner)  # type: ignore[arg-type]
        self.widths: list[int | None] = []

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Record decode widths, then run the real forward."""
        if batch.forward_mode.is_decode():
            self.widths.append(batch.num_draft_steps)
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


def _engine(ckpt: SpecCheckpoints, policy: object, *, overlap: bool) -> tuple[Engine, _Widths]:
    worker = _Widths(ckpt.worker("draft_model", agreeing=True))
    engine = Engine(
        worker,
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=128),
        config=EngineConfig(
            overlap=overlap, kv_tokens=2048, check_invariants=True, check_ownership=True
        ),
        draft_policy=policy,  # type: ignore[arg-type]
    )
    return engine, worker


def _submit(engine: Engine) -> list[object]:
    return [
        engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True))
        for i, p in enumerate(MIXED_PROMPTS)
    ]


def _assert_exact(ckpt: SpecCheckpoints, reqs: list[object]) -> None:
    for prompt, req in zip(MIXED_PROMPTS, reqs, strict=True):
        finish = req.finish  # type: ignore[attr-defined]
        assert finish is not None and finish.reason is FinishReason.LENGTH, finish
        assert list(req.emitted_ids) == greedy(ckpt.hf, list(prompt), NEW_TOKENS)  # type: ignore[attr-defined]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize(
    ("fault", "named"),
    [
        ({"bad_choice": -1}, "returned -1; it must return an integer in [0, 3]"),
        ({"bad_choice": 4}, "returned 4"),
        ({"bad_choice": 2.5}, "returned 2.5"),
        ({"bad_choice": "2"}, "returned '2'"),
        ({"bad_choice": True}, "returned True"),
        ({"choose_raises": ValueError("no width")}, "choose(5) raised: ValueError: no width"),
        ({"observe_raises": RuntimeError("stats")}, "observe(2, ...) raised: RuntimeError: stats"),
    ],
    ids=["negative", "too-wide", "float", "str", "bool", "choose-raises", "observe-raises"],
)
def test_a_failing_policy_is_disabled_and_the_rounds_stay_exact(
    partial_ckpt: SpecCheckpoints,
    caplog: pytest.LogCaptureFixture,
    fault: dict[str, object],
    named: str,
    overlap: bool,
) -> None:
    """No request fails, tokens are exact, the failure is logged once and named; from the
    failure on, every decode round drafts the worker's full width and the policy is not called."""
    policy = _Faulty(**fault)  # type: ignore[arg-type]
    engine, worker = _engine(partial_ckpt, policy, overlap=overlap)
    with caplog.at_level(logging.ERROR, logger="specstate"), engine:
        reqs = _submit(engine)
        run_checked(engine)
        failure = engine.snapshot().draft_policy_failure
    _assert_exact(partial_ckpt, reqs)
    assert failure is not None and named in failure, failure
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1 and "disabled" in errors[0].getMessage(), errors
    if "observe_raises" in fault:
        assert policy.observed == FAIL_AT  # never called again
        failed_round = FAIL_AT + (1 if overlap else 0)  # one more round was already scheduled
        assert all(w == 3 for w in worker.widths[failed_round + 1 :])
    else:
        assert policy.chose == FAIL_AT  # never called again
        assert worker.widths[: FAIL_AT - 1] == [2, 1]
        assert all(w == 3 for w in worker.widths[FAIL_AT - 1 :]), worker.widths
    assert any(a > 2 for r in reqs for a in r.accept_lengths)  # type: ignore[attr-defined]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("where", ["choose_raises", "observe_raises"])
def test_an_interrupt_inside_the_policy_reaches_the_caller_and_loses_nothing(
    partial_ckpt: SpecCheckpoints, where: str, overlap: bool
) -> None:
    """KeyboardInterrupt from the policy propagates from ``step()`` once; the engine then serves
    every request to its cap, exactly, at the full width."""
    policy = _Faulty(**{where: KeyboardInterrupt()})
    engine, _ = _engine(partial_ckpt, policy, overlap=overlap)
    interrupts = 0
    with engine:
        reqs = _submit(engine)
        for _ in range(500):
            if engine.is_idle:
                break
            try:
                engine.step()
            except KeyboardInterrupt:
                interrupts += 1
        failure = engine.snapshot().draft_policy_failure
    assert interrupts == 1
    assert failure is not None and "KeyboardInterrupt" in failure
    _assert_exact(partial_ckpt, reqs)


@pytest.mark.parametrize(
    ("max_steps", "message"),
    [
        (5, "may choose 5 steps; worker 'draft_model' drafts at most 3"),
        (-1, r"max_steps must be an integer in \[0, 3\]"),
        ("2", r"may choose '2' steps"),
        (True, r"may choose True steps"),
    ],
)
def test_a_policy_whose_max_steps_is_not_a_width_is_refused(
    partial_ckpt: SpecCheckpoints, max_steps: object, message: str
) -> None:
    """``max_steps`` outside ``[0, num_steps]`` or not an integer: InvalidConfig at construction."""

    class Wide(AcceptanceEma):
        @property
        def max_steps(self) -> int:
            return max_steps  # type: ignore[return-value]

    with pytest.raises(InvalidConfig, match=message):
        _engine(partial_ckpt, Wide(3), overlap=False)
