"""Failure behaviour of two gloo ranks: divergence is named, failures end every rank in bounds."""

from __future__ import annotations

from typing import Any

import pytest
from tp_programs import fatal_fault

from specstate.distributed import spawn_ranks

GROUP_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def faults(tp_healthy: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Both ranks' faults (from the healthy spawn): a perturbed accept length, other
    log-probabilities, diverged plans, a fault on every rank, then a workload."""
    return [rank["faults"] for rank in tp_healthy]


def test_a_perturbed_accept_length_is_named_at_its_round(faults: list[dict[str, Any]]) -> None:
    """Rank 1 accepts one token fewer at the first decode: RankDivergence there, everywhere."""
    for rank in faults:
        run = rank["result"]
        assert run["error"][0] == "RankDivergence"
        assert (
            "batch 2 (decode, 3 requests): rank(s) [1] settled a different result"
            in run["error"][1]
        )
        assert all(accepts == () for _, _, _, accepts in run["outputs"].values())  # nothing settled


def test_a_logprob_disagreement_is_named_at_its_round(faults: list[dict[str, Any]]) -> None:
    """Rank 1 reports other log-probabilities at the first decode (tokens, accept lengths and
    frontier equal): the result digest of checking mode names it there, on every rank."""
    for rank in faults:
        run = rank["logprobs"]
        assert run["error"] is not None and run["error"][0] == "RankDivergence"
        assert "(decode, 3 requests): rank(s) [1] settled a different result" in run["error"][1]
        assert all(accepts == () for _, _, _, accepts in run["outputs"].values())  # nothing settled


def test_diverged_plans_never_launch(faults: list[dict[str, Any]]) -> None:
    """Rank 1 admits fewer requests: RankDivergence names the first batch before it launches."""
    for rank in faults:
        run = rank["plan"]
        assert run["error"][0] == "RankDivergence"
        assert run["error"][1].startswith("batch 1 (extend, ")
        assert "planned it differently" in run["error"][1]


def test_a_fault_on_every_rank_fails_its_batch_alike(faults: list[dict[str, Any]]) -> None:
    """Every worker raises at the same round: its requests end with one error, serving goes on."""
    details = []
    for rank in faults:
        run = rank["both_raise"]
        assert run["error"] is None
        reasons = {reason for _, reason, _, _ in run["outputs"].values()}
        assert reasons == {"error"}
        details.append([detail for _, _, detail, _ in run["outputs"].values()])
        assert "injected worker fault" in details[-1][0]
        after = rank["after"]
        assert after["error"] is None
        assert {reason for _, reason, _, _ in after["outputs"].values()} == {"length"}
    assert details[0] == details[1]
    assert faults[0]["after"]["outputs"] == faults[1]["after"]["outputs"]


@pytest.mark.parametrize(
    ("fault", "overlap"),
    [
        ("raise", False),
        ("raise_after", False),
        ("raise_after", True),
        ("sleep", True),
        ("die", True),
    ],
)
def test_a_failing_rank_stops_every_rank_in_bounded_time(
    tp_paths: dict[str, str], fault: str, overlap: bool
) -> None:
    """Rank 1 raises (before or after the forward's collectives), wedges or dies at the first
    decode round: the others stop with RankFailure. A failure of rank 1 alone after the
    collectives leaves rank 0's forward whole, so only the agreement can tell that the ranks
    are out of step: it is fatal all the same."""
    outcomes = spawn_ranks(
        fatal_fault,
        (tp_paths, fault, overlap),
        world_size=2,
        timeout_s=90,
        group_timeout_s=GROUP_TIMEOUT_S,
    )
    leader = outcomes[0]
    assert leader.ok, leader.traceback
    run = leader.result
    assert run["error"][0] == "RankFailure"
    if fault == "die":
        assert outcomes[1].error_type == "Exited"
        return
    follower = outcomes[1]
    assert follower.ok, follower.traceback
    assert follower.result["error"][0] == "RankFailure"
    if fault == "raise_after":
        assert "not on every rank" in run["error"][1]
    if fault in ("raise", "raise_after"):  # the batch failed alike on both ranks, with its cause
        assert run["error"][1] == follower.result["error"][1]
        assert "injected worker fault" in run["error"][1]
        failed = [d for _, reason, d, _ in run["outputs"].values() if reason == "error"]
        assert failed == [
            d for _, reason, d, _ in follower.result["outputs"].values() if reason == "error"
        ]
        assert failed
