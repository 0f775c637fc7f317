"""``specstate bench budget``: the policies on the varying workload, counted in modelled time.

The device time is modelled (no sleep, no wall clock), so the comparison is deterministic for a
seed: the confidence and goodput policies verify less work that buys nothing than the fixed
width, at equal or better goodput.
"""

from __future__ import annotations

import json
import subprocess
import sys

from specstate.tools.bench_budget import (
    DEFAULT_PROFILE,
    VaryingAcceptanceWorker,
    policies,
    run_policy,
)


def test_adaptive_policies_reject_fewer_drafts_at_no_loss_of_goodput() -> None:
    """Confidence and goodput scheduling: fewer rejected drafts and goodput >= the fixed width's."""
    runs = {
        name: run_policy(name, make(), DEFAULT_PROFILE, requests=32, seed=1)
        for name, make in policies(DEFAULT_PROFILE).items()
    }
    fixed = runs["fixed"]
    assert fixed.rejected_drafts > 0 and fixed.accepted_tokens > 0
    for name in ("confidence", "goodput"):
        run = runs[name]
        assert run.rejected_drafts < fixed.rejected_drafts, (name, run, fixed)
        assert run.goodput_tokens_per_s >= fixed.goodput_tokens_per_s, (name, run, fixed)
        assert run.reserved_unused_tokens < fixed.reserved_unused_tokens, (name, run, fixed)


def test_the_workload_mixes_predictable_and_unpredictable_requests() -> None:
    """Some requests draw the predictable rates, some the unpredictable ones."""
    kinds = {VaryingAcceptanceWorker.rates(f"req-{i}") for i in range(12)}
    assert len(kinds) == 2


def test_the_command_prints_every_policy() -> None:
    """The bench runs from the command line and reports each policy, as JSON."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "specstate.tools.cli",
            "bench",
            "budget",
            "--requests",
            "16",
            "--rounds",
            "1",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    report = json.loads(out.stdout)
    names = [p["policy"] for p in report["policies"]]
    assert names == ["fixed", "batch-size schedule", "goodput", "confidence"]
    assert report["profile"] == DEFAULT_PROFILE.to_json()
