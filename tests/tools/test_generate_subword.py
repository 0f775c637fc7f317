"""`specstate generate` takes ``text`` lines on a checkpoint with a subword ``tokenizer.json``:
the prompt is the tokenizer's encoding and the output's ``text`` its decoding of the ids."""

from __future__ import annotations

import json
import re
from pathlib import Path

from subword_tokenizers import subword_checkpoint

from specstate import Engine, EngineConfig, SamplingParams
from specstate.reference.workers import default_registry
from specstate.tools.cli import main
from specstate.tools.generate.workers import checkpoint_limits

TEXTS = ("def add(a, b):\n", "The quick brown fox")


def test_text_lines_go_through_the_checkpoint_tokenizer(tmp_path: Path) -> None:
    tok, _, draft = subword_checkpoint(tmp_path)
    lines = [{"id": f"t{i}", "text": t, "max_new_tokens": 12} for i, t in enumerate(TEXTS)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    argv = ["generate", "--model", str(tmp_path), "--draft", str(draft), "--algorithm",
            "draft_model", "--num-steps", "3", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"), "--check-invariants"]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    worker = default_registry().create(
        "draft_model", target=str(tmp_path), draft=str(draft), num_steps=3
    )
    config = EngineConfig(kv_tokens=2048, check_invariants=True)
    with Engine(worker, limits=checkpoint_limits(tmp_path), config=config) as engine:
        reqs = [
            engine.submit(f"e{i}", tok.encode(t).ids, SamplingParams(max_new_tokens=12))
            for i, t in enumerate(TEXTS)
        ]
        engine.run_until_idle()
    for row, req in zip(rows, reqs, strict=True):
        assert row["output_ids"] == list(req.emitted_ids)
        assert row["text"] == tok.decode(row["output_ids"])
        assert row["text"]  # the tiny model says something


def test_grammar_lines_run_on_a_subword_checkpoint(tmp_path: Path) -> None:
    """A ``grammar`` line on the byte-level BPE checkpoint: its vocabulary is read from
    ``tokenizer.json``, and the output matches the regex and the same request on `Engine`."""
    from specstate import Grammar

    tok, _, draft = subword_checkpoint(tmp_path)
    line = {"id": "g", "text": TEXTS[0], "max_new_tokens": 16, "grammar": {"regex": "[0-9]{3}"}}
    (tmp_path / "in.jsonl").write_text(json.dumps(line) + "\n")
    argv = ["generate", "--model", str(tmp_path), "--draft", str(draft), "--algorithm",
            "draft_model", "--num-steps", "3", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl"), "--check-invariants"]  # fmt: skip
    assert main(argv) == 0
    (row,) = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    worker = default_registry().create(
        "draft_model", target=str(tmp_path), draft=str(draft), num_steps=3
    )
    limits = checkpoint_limits(tmp_path)
    assert limits.grammar_vocabulary is not None  # read from tokenizer.json
    sampling = SamplingParams(max_new_tokens=16, grammar=Grammar.regex("[0-9]{3}"))
    with Engine(worker, limits=limits, config=EngineConfig(kv_tokens=2048)) as engine:
        req = engine.submit("e", tok.encode(TEXTS[0]).ids, sampling)
        engine.run_until_idle()
    assert row["output_ids"] == list(req.emitted_ids)
    assert row["finish_reason"] == "stop"
    assert re.fullmatch("[0-9]{3}", row["text"]), row["text"]
