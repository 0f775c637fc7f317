"""`specstate generate` reproduces HF's greedy tokens from the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_oracle import greedy, make_checkpoint
from safetensors.torch import load_file, save_file

from specstate.tools.cli import main

PROMPTS = {"a": [3, 4, 5], "b": [9], "c": [60, 61, 62, 63, 64, 65, 66]}


@pytest.mark.parametrize("algorithm", ["none", "ngram"])
@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_generate_jsonl_round_trip(tmp_path: Path, algorithm: str, overlap: str) -> None:
    """JSONL in, JSONL out, in input order, equal to HF generate; the trace has one row a step."""
    hf = make_checkpoint(tmp_path / "ckpt")
    lines = [json.dumps({"id": k, "input_ids": v, "max_new_tokens": 7}) for k, v in PROMPTS.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = [
        "generate",
        "--model", str(tmp_path / "ckpt"),
        "--algorithm", algorithm,
        "--num-steps", "3",
        "--page-size", "4",
        overlap,
        "--input", str(tmp_path / "in.jsonl"),
        "--output", str(tmp_path / "out.jsonl"),
        "--trace", str(tmp_path / "trace.jsonl"),
        "--perfetto", str(tmp_path / "timeline.json"),
        "--check-invariants",
    ]  # fmt: skip
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == list(PROMPTS)
    for row in rows:
        assert row["output_ids"] == greedy(hf, PROMPTS[row["id"]], 7)
        assert row["finish_reason"] == "length"
        assert all(1 <= a <= 4 for a in row["accept_lengths"])
    trace = [json.loads(x) for x in (tmp_path / "trace.jsonl").read_text().splitlines()]
    assert trace[0]["schema"] == "specstate-trace" and trace[0]["worker"]["algorithm"] == algorithm
    rounds = [r for r in trace if r["type"] == "round"]
    assert rounds[0]["mode"] == "extend" and rounds[-1]["running"] == 0
    finished = {r["id"] for r in trace if r["type"] == "event" and r["reason"] == "length"}
    assert finished == set(PROMPTS)
    timeline = json.loads((tmp_path / "timeline.json").read_text())["traceEvents"]
    assert {e["ph"] for e in timeline} >= {"M", "X", "C"}


def test_bad_input_line_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A malformed request line fails with exit code 2 and names the file and line."""
    make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [1]}\n{"id": "b"}\n')
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl")]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 2
    assert 'in.jsonl:2: "input_ids" must be a list of integers' in capsys.readouterr().err


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "a", "input_ids": "104105"}', '"input_ids" must be a list of integers'),
        ('{"id": "a", "input_ids": [1.5, 2]}', '"input_ids" must be a list of integers'),
        ('{"id": "a", "input_ids": [true, 2]}', '"input_ids" must be a list of integers'),
        ('{"id": "a", "input_ids": [1e400]}', '"input_ids" must be a list of integers'),
        ('{"id": null, "input_ids": [1]}', '"id" must be a non-empty string, got None'),
        ('{"id": "a", "input_ids": [1], "stop_token_ids": "32"}', '"stop_token_ids" must be'),
        ('{"id": "a", "input_ids": [1], "max_new_tokens": 2.5}', '"max_new_tokens" must be'),
        ('{"id": "a", "input_ids": [1], "max_tokens": 5}', "unknown fields ['max_tokens']"),
        ('["a", [1]]', "a request line must be a JSON object"),
    ],
)
def test_wrong_json_types_are_refused_not_misread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], line: str, message: str
) -> None:
    """Wrong types and unknown fields exit 2 naming the line, before any model loads."""
    (tmp_path / "in.jsonl").write_text(line + "\n")
    argv = [
        "generate",
        "--model",
        str(tmp_path / "no-model"),
        "--input",
        str(tmp_path / "in.jsonl"),
    ]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "in.jsonl:1: " in err and message in err and "Traceback" not in err


@pytest.mark.parametrize("where", ["missing/dir/out.jsonl", "."])
def test_an_unwritable_output_fails_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], where: str
) -> None:
    """An output in a missing directory, or a directory, exits 2 before the model loads."""
    (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [1]}\n')
    argv = [
        "generate",
        "--model",
        str(tmp_path / "no-model"),
        "--input",
        str(tmp_path / "in.jsonl"),
    ]
    assert main([*argv, "--output", str(tmp_path / where)]) == 2
    assert "--output" in capsys.readouterr().err


@pytest.mark.parametrize("content", [b"\xff\xfe{\x00", None], ids=["binary", "missing"])
def test_an_unreadable_input_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes | None
) -> None:
    """A missing or undecodable input file exits 2 with one line naming it."""
    if content is not None:
        (tmp_path / "in.jsonl").write_bytes(content)
    argv = ["generate", "--model", str(tmp_path), "--input", str(tmp_path / "in.jsonl")]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 2
    assert "in.jsonl: cannot read the requests" in capsys.readouterr().err


def test_draft_with_an_algorithm_that_has_none_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--draft with --algorithm none is an error, not silently ignored."""
    make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [1]}\n')
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--draft", str(tmp_path / "ckpt")]
    argv += ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    assert main(argv) == 2
    assert "--draft is used by draft_model and eagle, not none" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--requests", "--max-new-tokens", "--num-steps", "--page-size"])
def test_demo_refuses_non_positive_sizes(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    """`specstate demo --requests 0` is a usage error (it divided by zero)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", flag, "0"])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flags", "dtype"), [((), "float32"), (("--dtype", "checkpoint"), "float16")]
)
def test_generate_runs_in_float32_unless_asked(flags: tuple[str, ...], dtype: str) -> None:
    """The shipped fp16 weights run in float32 by default (lossless on a CPU)."""
    import argparse

    from specstate.reference.embedded import target_dir
    from specstate.tools.generate import add_arguments, build_worker

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(target_dir()), "--input", "-", "--output", "-", *flags]
    )
    worker, _ = build_worker(args)
    assert worker._target.config.dtype == getattr(torch, dtype)  # type: ignore[attr-defined]


def _break_checkpoint(ckpt: Path, how: str) -> None:
    config = json.loads((ckpt / "config.json").read_text())
    weights = ckpt / "model.safetensors"
    if how == "truncated weights":
        weights.write_bytes(weights.read_bytes()[:100])
    elif how == "garbage weights":
        weights.write_bytes(b"not a safetensors file at all")
    elif how == "NaN rms_norm_eps":
        (ckpt / "config.json").write_text(json.dumps(config).replace(
            f'"rms_norm_eps": {json.dumps(config["rms_norm_eps"])}', '"rms_norm_eps": NaN'
        ))  # fmt: skip
    elif how == "EOS outside the vocabulary":
        config["eos_token_id"] = config["vocab_size"] + 5
        (ckpt / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("truncated weights", "unreadable safetensors weights"),
        ("garbage weights", "unreadable safetensors weights"),
        ("NaN rms_norm_eps", "must be finite and > 0"),
        ("EOS outside the vocabulary", "are not ids in"),
    ],
)
def test_a_broken_checkpoint_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], how: str, message: str
) -> None:
    """Unloadable weights or impossible configs exit 2 with one line, no traceback."""
    make_checkpoint(tmp_path / "ckpt")
    _break_checkpoint(tmp_path / "ckpt", how)
    (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [1]}\n')
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl")]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_huge_context_costs_only_what_the_pool_holds(tmp_path: Path) -> None:
    """max_position_embeddings of 2^30 runs: rows are sized by the pool, not the context."""
    hf = make_checkpoint(tmp_path / "ckpt")
    config = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    config["max_position_embeddings"] = 1 << 30
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config))
    (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [3, 4], "max_new_tokens": 5}\n')
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl")]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl"), "--kv-tokens", "256"]) == 0
    row = json.loads((tmp_path / "o.jsonl").read_text())
    assert row["output_ids"] == greedy(hf, [3, 4], 5)


def test_nan_weights_end_every_request_with_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Weights full of NaN: each request ends with 'error' and no tokens; the exit code is 1."""
    make_checkpoint(tmp_path / "ckpt")
    weights = tmp_path / "ckpt" / "model.safetensors"
    tensors = load_file(weights)
    save_file({k: torch.full_like(v, float("nan")) for k, v in tensors.items()}, weights)
    lines = [json.dumps({"id": k, "input_ids": v, "max_new_tokens": 4}) for k, v in PROMPTS.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl")]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 1
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["id"] for r in rows] == list(PROMPTS)
    for row in rows:
        assert row["finish_reason"] == "error" and row["output_ids"] == []
        assert "non-finite logits" in row["error"]
    err = capsys.readouterr().err
    assert "3 of 3 requests ended with an error" in err and "Traceback" not in err


def test_a_kv_cache_larger_than_memory_is_refused_before_allocating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-tokens far past the machine's memory exits 2 naming the flag and the sizes."""
    make_checkpoint(tmp_path / "ckpt")
    (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [1]}\n')
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(tmp_path / "in.jsonl")]
    huge = str(10**13)  # 10^13 tokens of 512 bytes: petabytes
    assert main([*argv, "--output", str(tmp_path / "o.jsonl"), "--kv-tokens", huge]) == 2
    err = capsys.readouterr().err
    assert f"--kv-tokens {huge}: the KV cache needs" in err and "Traceback" not in err


def test_help_shows_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """--help of a command shows each option's default."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    assert "KV token slots (default: 16384)" in out and "(default: float32)" in out
