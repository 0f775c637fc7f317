"""Synthetic acceptance: the timed worker accepts draft k with the given conditional rate.

Measured from the engine's own metrics and from a recorded trace: the per-position acceptance
of many rows follows the given rates (seeded, so the run is reproducible), the extremes are
exact, and bad rates are refused.
"""

from __future__ import annotations

import pytest
from engine_driver import run_checked

from specstate import RequestLimits, SamplingParams
from specstate.core.errors import InvalidConfig
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.trace import TraceRecorder
from specstate.tools.cli import main
from specstate.tools.timed_worker import TimedWaitWorker
from specstate.tools.trace import summarize


def _run(rates: tuple[float, ...]) -> dict[str, object]:
    trace = TraceRecorder()
    engine = Engine(
        TimedWaitWorker(device_seconds=0.0, accept_rates=rates, seed=1),
        limits=RequestLimits(vocab_size=32, max_context_len=512),
        config=EngineConfig(overlap=True, kv_tokens=16384, max_running=32, check_invariants=True),
        trace=trace,
    )
    for i in range(32):
        engine.submit(f"r{i}", [1, 2, 3], SamplingParams(max_new_tokens=120, ignore_eos=True))
    run_checked(engine, max_steps=400)
    engine.close()
    return summarize(list(trace.records()))


def test_per_position_acceptance_follows_the_rates() -> None:
    """Conditional rates 0.9, 0.5, 0.2: unconditional position rates 0.9, 0.45, 0.09."""
    summary = _run((0.9, 0.5, 0.2))
    rates = summary["accept_rate_by_position"]
    assert isinstance(rates, list) and summary["num_verifies"] > 1000  # type: ignore[operator]
    for got, want in zip(rates, (0.9, 0.45, 0.09), strict=True):
        assert abs(got - want) < 0.04, (rates, want)


@pytest.mark.parametrize(("rates", "length"), [((1.0, 1.0, 1.0), "4"), ((0.0, 1.0, 1.0), "1")])
def test_extreme_rates_are_exact(rates: tuple[float, ...], length: str) -> None:
    """Always or never: every verify accepts exactly that run."""
    summary = _run(rates)
    assert list(summary["histogram"]) == [length]  # type: ignore[call-overload]


def test_bad_rates_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    """Wrong count or a probability outside [0, 1]: InvalidConfig, or a usage error."""
    with pytest.raises(InvalidConfig, match="3 probabilities"):
        TimedWaitWorker(device_seconds=0.0, accept_rates=(0.5, 0.5))
    with pytest.raises(InvalidConfig, match="3 probabilities"):
        TimedWaitWorker(device_seconds=0.0, accept_rates=(0.5, 1.5, 0.1))
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "engine", "--accept-rates", "0.5,2,0"])
    assert exit_info.value.code == 2
    assert "give 3 probabilities" in capsys.readouterr().err
