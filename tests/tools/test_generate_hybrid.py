"""`specstate generate --model DIR` on a hybrid checkpoint: NemotronH (Mamba2 + attention) or
LFM2 (short convolutions + attention).

The reference workers serve hybrid targets; the command loads one as it loads a Llama. With a
partly agreeing hybrid drafter (accept lengths strictly between 1 and the maximum) its outputs
equal transformers' greedy `generate()`, and `KvLayout.from_config` counts only the attention
layers' KV (the recurrent layers hold state rows, not KV).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hf_oracle import greedy
from hybrid_oracle import make_hybrid_checkpoints
from lfm2_oracle import make_lfm2_checkpoint, make_lfm2_checkpoints

from specstate.memory.planning import KvLayout
from specstate.tools.cli import main

PROMPTS = [[3, 14, 15, 92, 65, 35, 89], [79, 32], [5, 5, 5, 5, 5, 5]]
NEW_TOKENS = 14


@pytest.mark.parametrize("kind", ["nemotron_h", "lfm2"])
def test_generate_serves_a_hybrid_checkpoint_losslessly(
    kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A hybrid target and drafter through `specstate generate` emit transformers' greedy tokens."""
    ckpt = (make_hybrid_checkpoints if kind == "nemotron_h" else make_lfm2_checkpoints)(tmp_path)
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
    """NemotronH: the ``full_attention`` entries of ``layers_block_type`` only."""
    ckpt = make_hybrid_checkpoints(tmp_path)
    layout = KvLayout.from_config(ckpt.target)
    config = json.loads((ckpt.target / "config.json").read_text())
    kinds = config["layers_block_type"]
    assert len(kinds) == 4 and layout.num_layers == kinds.count("full_attention") == 1


def test_an_lfm2_checkpoint_counts_only_its_attention_layers_as_kv(tmp_path: Path) -> None:
    """`KvLayout.from_config` counts the ``full_attention`` entries of ``layer_types`` only."""
    kinds = ("conv", "full_attention", "conv", "full_attention", "conv")
    make_lfm2_checkpoint(tmp_path, layer_types=kinds)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["num_hidden_layers"] == 5 and config["layer_types"] == list(kinds)
    layout = KvLayout.from_config(tmp_path)
    assert layout.num_layers == 2
    assert layout.num_kv_heads == 2 and layout.head_dim == 8


def test_an_lfm2_config_with_attention_indices_counts_those(tmp_path: Path) -> None:
    """A config that lists ``full_attn_idxs`` instead of ``layer_types`` counts those layers."""
    raw = {"model_type": "lfm2", "num_hidden_layers": 6, "full_attn_idxs": [2, 5],
           "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 32}  # fmt: skip
    assert KvLayout.from_config(raw).num_layers == 2
