"""`specstate generate --algorithm mtp|eagle3|frozen_kv_mtp` reproduces HF's greedy tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_oracle import greedy
from spec_checkpoints import FAMILIES, SpecCheckpoints, family_options

from specstate.tools.cli import main

PROMPTS = {"a": [3, 14, 15, 92, 65, 35, 89], "b": [79, 32], "c": [5, 5, 5, 5, 5, 5]}


def drafter_args(ckpt: SpecCheckpoints, algorithm: str) -> list[str]:
    """``--model`` and ``--draft`` of ``algorithm`` on the shared target."""
    options = family_options(ckpt.target, algorithm)
    if algorithm == "mtp":
        return ["--model", str(options["target"])]
    return ["--model", str(ckpt.target), "--draft", str(next(iter(options.values())))]


@pytest.mark.parametrize("algorithm", FAMILIES)
def test_generate_serves_every_hidden_state_family(
    partial_ckpt: SpecCheckpoints, tmp_path: Path, algorithm: str
) -> None:
    """JSONL in, JSONL out, equal to HF generate; speculation accepted runs of several."""
    lines = [
        json.dumps({"id": k, "input_ids": v, "max_new_tokens": 10}) for k, v in PROMPTS.items()
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = [
        "generate",
        *drafter_args(partial_ckpt, algorithm),
        "--algorithm", algorithm,
        "--num-steps", "3",
        "--page-size", "4",
        "--overlap",
        "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"),
        "--check-invariants",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    for row in rows:
        assert row["output_ids"] == greedy(partial_ckpt.hf, PROMPTS[row["id"]], 10)
    assert any(a > 1 for row in rows for a in row["accept_lengths"])


def test_mtp_takes_no_draft_and_eagle3_needs_one(
    partial_ckpt: SpecCheckpoints, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """mtp drafts with the layers inside --model; eagle3 without --draft is refused."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "input_ids": [3, 4]}) + "\n")
    common = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    mtp = family_options(partial_ckpt.target, "mtp")["target"]
    argv = ["generate", "--model", str(mtp), "--draft", str(mtp), "--algorithm", "mtp", *common]
    assert main(argv) == 2
    assert (
        "--draft is used by draft_model, eagle, eagle3, frozen_kv_mtp, dflash, dspark, uno, not mtp"
        in (capsys.readouterr().err)
    )
    argv = ["generate", "--model", str(partial_ckpt.target), "--algorithm", "eagle3", *common]
    assert main(argv) == 2
    assert "--algorithm eagle3 needs --draft DIR" in capsys.readouterr().err
