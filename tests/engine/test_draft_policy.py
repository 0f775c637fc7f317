"""The adaptive draft-length policy on its own: widening, narrowing, the gate and its probe."""

from __future__ import annotations

import numpy as np
import pytest

from specstate import InvalidConfig
from specstate.engine.draft_policy import AcceptanceEma, DraftPolicy


def _round(policy: AcceptanceEma, accept: list[int], *, batch: int = 4) -> int:
    """Schedule one round, settle it at the width it was launched with; return that width."""
    steps = policy.choose(batch)
    policy.observe(steps, np.array(accept if steps else [1] * len(accept), dtype=np.int64))
    return steps


def test_it_is_a_draft_policy() -> None:
    """The shipped policy satisfies the protocol the engine takes."""
    assert isinstance(AcceptanceEma(4), DraftPolicy)


def test_full_acceptance_keeps_the_widest_round() -> None:
    """Every draft kept: the width stays at max_steps."""
    policy = AcceptanceEma(4)
    assert [_round(policy, [5, 5]) for _ in range(10)] == [4] * 10


def test_poor_acceptance_narrows_one_step_at_a_time_then_gates_off() -> None:
    """Nothing accepted: 4, 3, 2, 1, then off (0), never skipping a width."""
    policy = AcceptanceEma(4, smoothing=1.0, gate_below=0.1, probe_after=100)
    widths = [_round(policy, [1, 1]) for _ in range(8)]
    assert widths[:4] == [4, 3, 2, 1]
    assert widths[4:] == [0, 0, 0, 0]


def test_hysteresis_holds_the_width_between_the_thresholds() -> None:
    """An acceptance between lower_below and raise_above moves nothing."""
    policy = AcceptanceEma(4, smoothing=1.0, raise_above=0.6, lower_below=0.35)
    policy.observe(4, np.array([1, 1], dtype=np.int64))  # rate 0: down to 3
    assert policy.steps == 3
    for _ in range(5):
        policy.observe(3, np.array([2, 3], dtype=np.int64))  # rate 0.5: in the band
    assert policy.steps == 3
    policy.observe(3, np.array([4, 4], dtype=np.int64))  # rate 1.0: up
    assert policy.steps == 4


def test_the_gate_probes_and_switches_speculation_back_on() -> None:
    """Off for probe_after rounds, then one round at min_steps; a good probe widens again."""
    policy = AcceptanceEma(3, smoothing=1.0, gate_below=0.1, probe_after=3)
    widths = [_round(policy, [1, 1]) for _ in range(4)]  # 3, 2, 1, then off
    assert widths == [3, 2, 1, 0]
    widths = [_round(policy, [1, 1]) for _ in range(2)]  # two more plain rounds
    assert widths == [0, 0]
    assert _round(policy, [2, 2]) == 1  # the probe: all of its one draft accepted
    assert policy.steps == 2  # acceptance 1.0 widens
    assert _round(policy, [3, 3]) == 2
    assert policy.steps == 3


def test_a_bad_probe_switches_it_off_again() -> None:
    """A probe that accepts nothing closes the gate again."""
    policy = AcceptanceEma(2, smoothing=1.0, gate_below=0.1, probe_after=2)
    assert [_round(policy, [1]) for _ in range(3)] == [2, 1, 0]
    assert [_round(policy, [1]) for _ in range(2)] == [0, 1]  # off once more, then the probe
    assert policy.steps == 0


def test_a_result_settles_at_the_width_it_was_launched_with() -> None:
    """Acceptance is per draft of the round's own width, not the policy's current width."""
    policy = AcceptanceEma(4, smoothing=1.0)
    policy.observe(4, np.array([1, 1], dtype=np.int64))  # width now 3
    assert policy.steps == 3
    policy.observe(4, np.array([3, 3], dtype=np.int64))  # 2 of 4 drafts: 0.5, in the band
    assert policy.acceptance == pytest.approx(0.5)
    assert policy.steps == 3


def test_batch_caps_bound_the_width_by_batch_size() -> None:
    """Larger batches draft less; the policy's own width is untouched by the cap."""
    policy = AcceptanceEma(5, batch_caps=[(32, 2), (128, 0)])
    assert [policy.choose(b) for b in (1, 31, 32, 127, 128, 1024)] == [5, 5, 2, 2, 0, 0]
    assert policy.steps == 5


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_steps": 2, "min_steps": 3}, "min_steps <= max_steps"),
        ({"max_steps": 2, "smoothing": 0.0}, "smoothing"),
        ({"max_steps": 2, "raise_above": 0.2, "lower_below": 0.3}, "lower_below < raise_above"),
        ({"max_steps": 2, "gate_below": 0.5}, "gate_below <= lower_below"),
        ({"max_steps": 2, "probe_after": 0}, "probe_after"),
        ({"max_steps": 2, "batch_caps": [(0, 1)]}, "batch_caps"),
    ],
)
def test_inconsistent_settings_are_refused(kwargs: dict[str, object], message: str) -> None:
    """Each bad setting is named."""
    with pytest.raises(InvalidConfig, match=message):
        AcceptanceEma(**kwargs)  # type: ignore[arg-type]
