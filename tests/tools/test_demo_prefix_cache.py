"""`specstate demo` serves follow-ups that share their prompt and answer: it reports cache hits."""

from __future__ import annotations

import re

import pytest

from specstate.tools.cli import main


def test_demo_reports_the_prefix_cache_hit_rate(capsys: pytest.CaptureFixture[str]) -> None:
    """The second turn's prompts hit the cache, and the runs stay lossless."""
    argv = ["demo", "--algorithm", "ngram", "--requests", "2", "--max-new-tokens", "8"]
    assert main([*argv, "--quiet"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"prefix cache: hit rate (\d+\.\d)% \((\d+) of (\d+) prefill tokens", out)
    assert found is not None, out
    hits, queried = int(found.group(2)), int(found.group(3))
    assert 0 < hits < queried
    assert "lossless (all runs emit identical tokens): yes" in out
