"""`bench host` / `bench engine --algorithm eagle|dflash|uno`: one width, each family's payload."""

from __future__ import annotations

import json

import pytest

from specstate.core.errors import InvalidConfig
from specstate.tools.bench_families import FAMILIES, family_capabilities, family_payload
from specstate.tools.bench_host import HostSettings, host_benchmark
from specstate.tools.cli import main


def test_the_families_share_one_window_and_differ_in_what_they_relay() -> None:
    """Same steps, verify width and reservation; only eagle relays a hidden state."""
    windows = {f: family_capabilities(f).spec_window(16) for f in FAMILIES}
    assert {(w.num_steps, w.num_draft_tokens, w.reserve) for w in windows.values()} == {(3, 4, 8)}
    import torch

    bonus = torch.zeros(5, dtype=torch.int64)
    assert family_payload("eagle", bonus).hidden_states is not None
    assert family_payload("dflash", bonus).hidden_states is None
    assert family_payload("uno", bonus).topk_p is None
    with pytest.raises(InvalidConfig, match="unknown drafter family 'medusa'"):
        family_capabilities("medusa")


@pytest.mark.parametrize("family", FAMILIES)
def test_engine_bench_runs_each_family(family: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`bench engine --algorithm F --json` names the family and times every size."""
    argv = ["bench", "engine", "--algorithm", family, "--batch-sizes", "1,4", "--rounds", "5"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["config"]["algorithm"] == family
    assert all(r["step_us"]["median"] > 0 for r in out["results"])


@pytest.mark.parametrize("family", ["dflash", "uno"])
def test_host_bench_replays_a_block_family(family: str) -> None:
    """`bench host --algorithm F`: the workload's checks pass and the report names it."""
    settings = HostSettings(
        page_sizes=(16,), batch_sizes=(4,), iters=20, warmup=2, repeats=1, launch_us=0.0,
        algorithm=family,
    )  # fmt: skip
    report = host_benchmark(settings)
    config = report["config"]
    assert isinstance(config, dict) and str(config["algorithm"]).startswith(f"{family}: ")
    results = report["results"]
    assert isinstance(results, list) and results[0]["samples"] == 20
