"""`specstate generate` takes a ``grammar`` field: outputs parse; bad grammars name their line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hf_oracle import make_checkpoint

from specstate.reference import embedded
from specstate.tools.cli import main

SCHEMA = {
    "type": "object",
    "properties": {"debug": {"type": "boolean"}, "level": {"enum": [1, 2, 3]}},
    "required": ["debug", "level"],
    "additionalProperties": False,
}


def _argv(tmp_path: Path, model: Path, lines: list[dict[str, object]]) -> list[str]:
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return [
        "generate",
        "--model", str(model),
        "--algorithm", "ngram",
        "--num-steps", "3",
        "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"),
        "--check-invariants",
    ]  # fmt: skip


def test_generate_serves_grammar_requests_on_a_byte_level_model(tmp_path: Path) -> None:
    """The embedded byte-level model's limits carry its vocabulary: a regex, a JSON schema and
    an EBNF request end at their grammar's end, and their text parses."""
    lines: list[dict[str, object]] = [
        {"id": "r", "text": "def f(x):\n    return ", "max_new_tokens": 40,
         "grammar": {"regex": r"[a-z_]+\(x\)"}},
        {"id": "j", "text": "config = ", "max_new_tokens": 60, "grammar": {"json_schema": SCHEMA}},
        {"id": "e", "text": "x = ", "max_new_tokens": 30,
         "grammar": {"ebnf": 'root ::= [0-9]{1,3} " + " [0-9]{1,3}'}},
    ]  # fmt: skip
    assert main(_argv(tmp_path, embedded.target_dir(), lines)) == 0
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out.jsonl").read_text().splitlines())}
    assert all(r["finish_reason"] == "stop" for r in rows.values())
    assert all(r["output_ids"][-1] == embedded.EOS_ID for r in rows.values())
    assert re.fullmatch(r"[a-z_]+\(x\)", rows["r"]["text"])
    parsed = json.loads(rows["j"]["text"])
    assert isinstance(parsed["debug"], bool) and parsed["level"] in (1, 2, 3)
    assert re.fullmatch(r"[0-9]{1,3} \+ [0-9]{1,3}", rows["e"]["text"])


@pytest.mark.parametrize(
    ("grammar", "message"),
    [
        ({"yaml": "x"}, "unknown grammar kind 'yaml'"),
        ({"regex": "a", "ebnf": "b"}, "exactly one key"),
        ("[0-9]+", "exactly one key"),
        ({"regex": "[a-"}, "does not compile"),
    ],
)
def test_a_bad_grammar_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], grammar: object, message: str
) -> None:
    """A malformed or uncompilable grammar fails the run before any work (exit 2), naming it."""
    lines: list[dict[str, object]] = [
        {"id": "ok", "text": "x", "max_new_tokens": 4},
        {"id": "bad", "text": "x", "max_new_tokens": 4, "grammar": grammar},
    ]
    assert main(_argv(tmp_path, embedded.target_dir(), lines)) == 2
    err = capsys.readouterr().err
    assert message in err and ("in.jsonl:2" in err or "'bad'" in err), err


def test_a_model_without_a_byte_vocabulary_refuses_grammars(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint whose ids are not bytes has no grammar vocabulary: refused, by name."""
    make_checkpoint(tmp_path / "ckpt")
    lines: list[dict[str, object]] = [
        {"id": "g", "input_ids": [3, 4], "max_new_tokens": 4, "grammar": {"regex": "a"}}
    ]
    assert main(_argv(tmp_path, tmp_path / "ckpt", lines)) == 2
    assert "a grammar needs the tokenizer's vocabulary" in capsys.readouterr().err
