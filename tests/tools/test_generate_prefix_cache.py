"""`specstate generate` shares prefixes by default, reports it, and `--no-prefix-cache` stops it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_oracle import greedy, make_checkpoint

from specstate.tools.cli import main

PROMPT = [3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]


@pytest.mark.parametrize("cache", [True, False])
def test_generate_reports_cached_tokens_and_the_hit_rate(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], cache: bool
) -> None:
    """One request at a time (normal loop: a finish is released at once): the second, same
    prompt, comes from the cache unless it is off."""
    hf = make_checkpoint(tmp_path / "ckpt")
    rows = [{"id": k, "input_ids": PROMPT, "max_new_tokens": 6} for k in ("a", "b")]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl")]
    argv += ["--output", str(tmp_path / "out.jsonl"), "--max-running", "1", "--no-overlap"]
    argv += ["--check-invariants"]
    assert main([*argv] if cache else [*argv, "--no-prefix-cache"]) == 0
    err = capsys.readouterr().err
    out = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in out] == [greedy(hf, PROMPT, 6)] * 2
    assert [r["cached_tokens"] for r in out] == [0, len(PROMPT) - 1 if cache else 0]
    assert ("prefix cache: hit rate" in err) is cache
