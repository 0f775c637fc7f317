"""`specstate generate --algorithm dflash|dspark|uno`: the block drafters from the command line.

``--draft`` names the drafter: the DFlash assistant or the UNO LoRA adapter. The tokens equal
HF's greedy ``generate()``; ``--kv-memory`` counts the assistant's cache beside the target's.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from block_checkpoints import BlockCheckpoints
from hf_oracle import greedy

from specstate import kv_layouts, kv_tokens_for_budget
from specstate.engine.planning import KvLayout
from specstate.tools.cli import main

PROMPTS = {"a": [3, 4, 5], "b": [9], "c": [60, 61, 62, 63, 64, 65, 66]}


def _generate(tmp_path: Path, *flags: str) -> tuple[list[dict[str, object]], dict[str, object]]:
    lines = [
        json.dumps({"id": k, "input_ids": v, "max_new_tokens": 10}) for k, v in PROMPTS.items()
    ]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = [
        "generate", *flags,
        "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"),
        "--trace", str(tmp_path / "trace.jsonl"),
        "--check-invariants",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    header = json.loads((tmp_path / "trace.jsonl").read_text().splitlines()[0])
    return rows, header


@pytest.mark.parametrize(
    ("algorithm", "extra", "max_accept"),
    [
        ("dflash", [], 4),  # the default --num-steps 4 takes the whole block of 4
        ("dflash", ["--num-steps", "2", "--no-overlap"], 3),
        ("uno", ["--num-steps", "4"], 5),
        ("uno", ["--num-steps", "3", "--topk", "2", "--num-draft-tokens", "5"], 4),
    ],
)
def test_generate_with_a_block_drafter(
    tmp_path: Path, block_ckpt: BlockCheckpoints, algorithm: str, extra: list[str], max_accept: int
) -> None:
    """JSONL out equals HF generate; the trace names the algorithm and its widest run."""
    draft = block_ckpt.assistant if algorithm == "dflash" else block_ckpt.adapter
    rows, header = _generate(
        tmp_path,
        "--model", str(block_ckpt.target),
        "--draft", str(draft),
        "--algorithm", algorithm,
        "--page-size", "4",
        *extra,
    )  # fmt: skip
    for row in rows:
        prompt = PROMPTS[str(row["id"])]
        assert row["output_ids"] == greedy(block_ckpt.hf, prompt, 10)
    worker = header["worker"]
    assert isinstance(worker, dict)
    assert worker["algorithm"] == algorithm and worker["max_accept"] == max_accept


def test_kv_memory_counts_the_assistant_cache(
    tmp_path: Path, block_ckpt: BlockCheckpoints, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-memory buys the pool the target's and the assistant's caches fit in."""
    _, header = _generate(
        tmp_path,
        "--model", str(block_ckpt.target),
        "--draft", str(block_ckpt.assistant),
        "--algorithm", "dflash",
        "--kv-memory", "300KiB",
    )  # fmt: skip
    layouts = (
        *kv_layouts(block_ckpt.target),
        KvLayout.from_config(block_ckpt.assistant, name="assistant"),
    )
    config = header["config"]
    assert isinstance(config, dict)
    assert config["kv_tokens"] == kv_tokens_for_budget(300 * 1024, layouts)
    assert "+ assistant 2x1x2x8x4 B" in capsys.readouterr().err


def test_a_block_drafter_without_its_drafter_is_refused(
    tmp_path: Path, block_ckpt: BlockCheckpoints, capsys: pytest.CaptureFixture[str]
) -> None:
    """dflash needs --draft; --topk trees are draft_model, eagle and uno only."""
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    base = ["generate", "--model", str(block_ckpt.target), "--input", str(tmp_path / "in.jsonl")]
    out = ["--output", str(tmp_path / "o.jsonl")]
    assert main([*base, *out, "--algorithm", "dflash"]) == 2
    assert "--algorithm dflash needs --draft DIR" in capsys.readouterr().err
    flags = ["--algorithm", "dflash", "--draft", str(block_ckpt.assistant), "--topk", "2"]
    assert main([*base, *out, *flags]) == 2
    err = capsys.readouterr().err
    assert "grow a draft tree (draft_model, eagle, eagle3, uno), not dflash" in err


@pytest.mark.parametrize("loop", ["--overlap", "--no-overlap"])
def test_generate_with_dspark_and_confidence_budgets(
    tmp_path: Path, block_ckpt: BlockCheckpoints, dspark_assistant: Path, loop: str
) -> None:
    """`--algorithm dspark --verify-budget confidence`: HF's greedy tokens; the trace names
    the worker and the policy plans from the confidences it reports."""
    rows, header = _generate(
        tmp_path,
        "--model", str(block_ckpt.target),
        "--draft", str(dspark_assistant),
        "--algorithm", "dspark",
        "--verify-budget", "confidence",
        loop,
    )  # fmt: skip
    for row in rows:
        assert row["output_ids"] == greedy(block_ckpt.hf, PROMPTS[str(row["id"])], 10)
    worker = header["worker"]
    assert isinstance(worker, dict)
    assert worker["algorithm"] == "dspark" and worker["max_accept"] == 4
    config = header["config"]
    assert isinstance(config, dict) and config["verify_budget"] == "confidence"
