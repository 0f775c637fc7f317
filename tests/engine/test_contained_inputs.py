"""User code and numbers at the engine's edges, beyond the sampling parameters.

* A trace recorder is called inside the round: one that raises (a subclass writing somewhere)
  stops recording, logged once; the engine serves on, every request ends exactly, and a stream
  still sees every finish.
* Numbers a config or the limits turn into int64 sizes or thread timeouts are refused where
  they enter (`InvalidConfig` naming the field), never an OverflowError or a size error from
  deep inside: a timeout past what a thread can wait, an integer past the float range, a pool
  past 2**50 or a vocabulary past 2**40.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import pytest
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import FinishReason, InvalidConfig, RequestLimits, SamplingParams, stream
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.trace import TraceRecorder


class _Flaky(TraceRecorder):
    """Keeps records like the stock recorder; its third round raises."""

    def round(self, **fields: Any) -> None:
        """Record, or raise on the third round."""
        if len(self.rounds) == 2:
            raise OSError("disk full")
        super().round(**fields)


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
def test_a_recorder_that_raises_stops_recording_and_nothing_else(
    partial_ckpt: SpecCheckpoints, caplog: pytest.LogCaptureFixture, overlap: bool
) -> None:
    """The step goes on; tokens exact; every finish streamed; logged once."""
    recorder = _Flaky()
    engine = Engine(
        partial_ckpt.worker("eagle", agreeing=False),
        limits=RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(overlap=overlap, kv_tokens=1024, check_invariants=True),
        trace=recorder,
    )
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    with caplog.at_level(logging.ERROR, logger="specstate"), engine:
        reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
        finishes = {e.request_id for e in stream(engine) if e.finish is not None}
    assert finishes == {r.request_id for r in reqs}
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH
        assert list(req.emitted_ids) == greedy(partial_ckpt.hf, list(prompt), 10)
    assert len(recorder.rounds) == 2 and recorder.header["worker"]["algorithm"] == "eagle"
    stopped = [r for r in caplog.records if "trace recording stopped" in r.getMessage()]
    assert len(stopped) == 1 and "_Flaky.round raised OSError: disk full" in stopped[0].getMessage()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"forward_timeout_s": 10**400}, "forward_timeout_s must be None or a finite number"),
        ({"forward_timeout_s": 1e300}, r"at most 9.22e\+09 s"),
        (
            {"kv_tokens": 2**70},
            r"kv_tokens must be an integer >= 2 pages \(2\) and at most 2\*\*50",
        ),
        (
            {"max_running": 2**62},
            r"max_running must be an integer >= 1, got 4611686018427387904 \(at most 2\*\*50\)",
        ),
        (
            {"page_size": 2**51},
            r"page_size must be an integer >= 1, got 2251799813685248 \(at most 2\*\*50\)",
        ),
    ],
)
def test_a_config_number_past_what_it_becomes_is_refused(
    fields: Mapping[str, object], message: str
) -> None:
    """InvalidConfig naming the field, not OverflowError or a size error at construction."""
    with pytest.raises(InvalidConfig, match=message):
        EngineConfig(**fields)  # type: ignore[arg-type]


def test_a_vocabulary_past_2_40_is_refused() -> None:
    """A vocabulary that no int64 top-k or table could hold: InvalidConfig at the limits."""
    with pytest.raises(
        InvalidConfig, match=r"vocab_size must be an integer >= 1 and at most 2\*\*40"
    ):
        RequestLimits(vocab_size=2**70, max_context_len=64)
