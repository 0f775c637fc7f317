"""`specstate demo` runs the main job on the embedded model and reports that every check held."""

from __future__ import annotations

import pytest

from specstate.tools.cli import main


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["eagle", "draft_model"])
def test_demo_runs_lossless_and_clean(algorithm: str, capsys: pytest.CaptureFixture[str]) -> None:
    """A short demo exits 0, says the runs agree and the KV was released."""
    argv = ["demo", "--algorithm", algorithm, "--requests", "3", "--max-new-tokens", "12"]
    assert main([*argv, "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "lossless (all runs emit identical tokens): yes" in out
    assert "KV fully released: yes" in out
    assert "mean accept" in out
