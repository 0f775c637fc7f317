"""`specstate generate --model DIR` on a NemotronH (Mamba2 + attention) checkpoint.

The reference workers serve hybrid targets; the command loads one as it loads a Llama. With a
partly agreeing hybrid drafter (accept lengths strictly between 1 and the maximum) its outputs
equal transformers' greedy `generate()`, and `--kv-memory` counts only the attention layers'
KV (the recurrent layers hold state rows, not KV).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_oracle import greedy
from hybrid_oracle import make_hybrid_checkpoints

from specstate.memory.planning import KvLayout
from specstate.tools.cli import main

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [79, 32], [5, 5, 5, 5, 5, 5]]
NEW_TOKENS = 14


def test_generate_serves_a_hybrid_checkpoint_losslessly(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ckpt = make_hybrid_checkpoints(tmp_path)
    lines = [
        {"id": f"p{i}", "input_ids": p, "max_new_tokens": NEW_TOKENS} for i, p in enumerate(PROMPTS)
    ]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["generate", "--model", str(ckpt.target), "--draft", str(ckpt.partial),
            "--algorithm", "draft_model", "--num-steps", "3", "--check-invariants",
            "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl")]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["output_ids"] for r in rows] == [greedy(ckpt.hf, p, NEW_TOKENS) for p in PROMPTS]
    accepts = {a for r in rows for a in r["accept_lengths"]}
    assert accepts & {2, 3}, accepts  # drafts accepted, some runs cut short
    capsys.readouterr()


def test_a_hybrid_checkpoint_counts_only_its_attention_layers_as_kv(tmp_path: Path) -> None:
    ckpt = make_hybrid_checkpoints(tmp_path)
    layout = KvLayout.from_config(ckpt.target)
    config = json.loads((ckpt.target / "config.json").read_text())
    kinds = config["layers_block_type"]
    assert len(kinds) == 4 and layout.num_layers == kinds.count("full_attention") == 1
