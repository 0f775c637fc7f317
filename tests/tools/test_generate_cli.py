"""`specstate generate` reproduces HF's greedy tokens from the command line."""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hf_oracle import greedy, make_checkpoint
from safetensors.torch import load_file, save_file

from specstate.tools.cli import main

PROMPTS = {"a": [3, 4, 5], "b": [9], "c": [60, 61, 62, 63, 64, 65, 66]}
ROOT = Path(__file__).resolve().parents[2]


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


def test_requests_from_stdin_and_results_to_stdout(tmp_path: Path) -> None:
    """``--input -`` reads a pipe, and the results go to stdout (``--output`` left out): the
    same rows as from and to files, stdout holding only the rows, the summary on stderr."""
    make_checkpoint(tmp_path / "ckpt")
    lines = [json.dumps({"id": k, "input_ids": v, "max_new_tokens": 7}) for k, v in PROMPTS.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--algorithm", "ngram"]
    to_file = [*argv, "--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "o.jsonl")]
    assert main(to_file) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), *sys.path])}
    piped = subprocess.run(
        [sys.executable, "-m", "specstate.tools.cli", *argv, "--input", "-"],
        input=(tmp_path / "in.jsonl").read_text(),
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
        check=False,
    )
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == (tmp_path / "o.jsonl").read_text()
    assert "specstate generate: 3 requests: 3 finished" in piped.stderr


def test_a_bad_stdin_line_is_named_and_two_stdout_outputs_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bad line read from stdin is named ``<stdin>:N``; ``-`` for both the results and the
    summary is refused (they would interleave); both exit 2 before any model loads."""
    argv = ["generate", "--model", str(tmp_path / "no-model"), "--input", "-"]
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": "a", "input_ids": [1]}\n{"id": 7}\n'))
    assert main(argv) == 2
    assert capsys.readouterr().err.startswith("specstate generate: <stdin>:2: ")
    monkeypatch.setattr(sys, "stdin", io.StringIO('{"id": "a", "input_ids": [1]}\n'))
    assert main([*argv, "--summary-json", "-"]) == 2
    assert "--output and --summary-json are both '-'" in capsys.readouterr().err


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
        ('{"id": "a", "input_ids": [1], "temperature": -1}', '"temperature" must be a number >= 0'),
        ('{"id": "a", "input_ids": [1], "temperature": "0.7"}', '"temperature" must be a number'),
        ('{"id": "a", "input_ids": [1], "temperature": true}', '"temperature" must be a number'),
        ('{"id": "a", "input_ids": [1], "temperature": NaN}', '"temperature" must be a number'),
        ('{"id": "a", "input_ids": [1], "top_p": 0}', '"top_p" must be a number in (0, 1]'),
        ('{"id": "a", "input_ids": [1], "top_p": 1.5}', '"top_p" must be a number in (0, 1]'),
        ('{"id": "a", "input_ids": [1], "top_k": 0}', '"top_k" must be an integer >= 1 or null'),
        ('{"id": "a", "input_ids": [1], "top_k": 2.5}', '"top_k" must be an integer >= 1'),
        ('{"id": "a", "input_ids": [1], "seed": -1}', '"seed" must be an integer in [0, 2^63)'),
        ('{"id": "a", "input_ids": [1], "logprobs": 1}', '"logprobs" must be true or false'),
        ('{"id": "a", "input_ids": [1], "top_logprobs": 1.5}', '"top_logprobs" must be an'),
        ('{"id": "a", "input_ids": [1], "speculative": "no"}', '"speculative" must be true or'),
        ('{"id": "a", "input_ids": [1], "repetition_penalty": "2"}', '"repetition_penalty" must'),
        ('{"id": "a", "input_ids": [1], "min_new_tokens": 1.5}', '"min_new_tokens" must be an'),
        ('{"id": "a", "input_ids": [1], "stop_sequences": [[]]}', '"stop_sequences" must be a'),
        ('{"id": "a", "input_ids": [1], "stop_sequences": [1, 2]}', '"stop_sequences" must be'),
        ('{"id": "a", "input_ids": [1], "seed": "7"}', '"seed" must be an integer'),
        ('{"id": "a", "text": 5}', '"text" must be a string'),
        ('{"id": "a", "text": "hi", "input_ids": [1]}', 'give "input_ids" or "text", not both'),
        ('{"id": "a", "text": "\\ud800"}', '"text" is not valid Unicode'),
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
    err = capsys.readouterr().err
    assert (
        "--draft is used by draft_model, eagle, eagle3, frozen_kv_mtp, dflash, dspark, uno, "
        "not none" in err
    )


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
    from specstate.tools.generate.options import add_arguments
    from specstate.tools.generate.workers import build_worker

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
    """--help of a command shows each option's default, and says what --check-invariants does."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "KV token slots (default: 16384)" in out and "(default: float32)" in out
    assert "--check-invariants check every engine invariant and counter owner after" in out


def _gpt2_checkpoint(directory: Path) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=500, n_embd=16, n_layer=1, n_head=2, n_positions=96)
    config.bos_token_id = config.eos_token_id = 499
    GPT2LMHeadModel(config).save_pretrained(directory)


def test_a_non_llama_model_is_explained(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A GPT-2 --model: with --worker, checkpoint_limits reads it and a text line is refused
    for its vocabulary (not its model_type); without --worker, the reference worker says it
    runs Llama and points at --worker."""
    from specstate.tools.generate.workers import checkpoint_limits

    _gpt2_checkpoint(tmp_path / "gpt2")
    limits = checkpoint_limits(tmp_path / "gpt2")
    assert (limits.vocab_size, limits.max_context_len, limits.eos_token_ids) == (
        500,
        96,
        frozenset({499}),
    )
    capsys.readouterr()
    requests = _write_lines(tmp_path / "in.jsonl", {"id": "a", "text": "hello"})
    argv = ["generate", "--model", "gpt2", "--input", str(requests), "--output", "o.jsonl"]
    assert main([*argv, "--worker", f"{factories}:make"]) == 2
    err = capsys.readouterr().err
    assert 'in.jsonl:1: "text" needs a byte-level model' in err and "vocab_size 500" in err
    assert "model_type" not in err and len(err.strip().splitlines()) == 1
    _write_lines(requests, {"id": "a", "input_ids": [1, 2]})
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "'gpt2'" in err and "drive another architecture with --worker MODULE:FACTORY" in err


def _write_lines(path: Path, *rows: dict[str, object]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_sampling_fields_reach_the_sampler_and_a_seed_reproduces(tmp_path: Path) -> None:
    """temperature / top_k / top_p / seed map onto SamplingParams: greedy rows equal HF; top_k 1
    or a tiny top_p sample the argmax; a line's seed is the request's own (the same tokens
    whatever the worker's --seed), another seed changes them; unseeded sampled rows follow
    --seed."""
    hf = make_checkpoint(tmp_path / "ckpt")
    prompt = [3, 4, 5]
    lines: list[dict[str, object]] = [
        {"id": "greedy", "input_ids": prompt, "max_new_tokens": 12},
        {"id": "top_k_1", "input_ids": prompt, "max_new_tokens": 12, "temperature": 1.5,
         "top_k": 1},
        {"id": "tiny_top_p", "input_ids": prompt, "max_new_tokens": 12, "temperature": 1.5,
         "top_p": 1e-9},
        {"id": "hot", "input_ids": prompt, "max_new_tokens": 24, "temperature": 2.0},
        {"id": "hot2", "input_ids": [9], "max_new_tokens": 24, "temperature": 2.0},
    ]  # fmt: skip
    plain = _write_lines(tmp_path / "plain.jsonl", *lines)
    seeded = _write_lines(
        tmp_path / "seeded.jsonl", *lines[:3], *({**x, "seed": 5} for x in lines[3:])
    )
    reseeded = _write_lines(
        tmp_path / "reseeded.jsonl", *lines[:3], *({**x, "seed": 6} for x in lines[3:])
    )

    def outputs(requests: Path, *extra: str) -> dict[str, Any]:
        out = tmp_path / "out.jsonl"
        argv = ["generate", "--model", str(tmp_path / "ckpt"), "--algorithm", "ngram"]
        assert main([*argv, "--input", str(requests), "--output", str(out), *extra]) == 0
        return {r["id"]: r["output_ids"] for r in _rows(out)}

    first = outputs(seeded, "--seed", "1")
    expected = greedy(hf, prompt, 12)
    assert first["greedy"] == first["top_k_1"] == first["tiny_top_p"] == expected
    assert outputs(seeded, "--seed", "2") == first  # the requests' seeds decide
    assert outputs(reseeded, "--seed", "1")["hot"] != first["hot"]
    by_worker = outputs(plain, "--seed", "5")
    assert outputs(plain, "--seed", "5") == by_worker
    other = outputs(plain, "--seed", "6")
    assert other["greedy"] == expected
    assert (other["hot"], other["hot2"]) != (by_worker["hot"], by_worker["hot2"])


def test_each_line_has_its_own_seed(tmp_path: Path) -> None:
    """Lines may give different seeds; a seeded request emits the same tokens alone and among
    others."""
    make_checkpoint(tmp_path / "ckpt")
    a = {"id": "a", "input_ids": [3, 4, 5], "max_new_tokens": 16, "temperature": 1.0, "seed": 1}
    others = [
        {"id": "b", "input_ids": [7, 8], "max_new_tokens": 9, "temperature": 1.0},
        {"id": "c", "input_ids": [9], "max_new_tokens": 20, "temperature": 1.0, "seed": 2},
    ]

    def output_of_a(*rows: dict[str, object]) -> list[int]:
        requests = _write_lines(tmp_path / "in.jsonl", *rows)
        out = tmp_path / "out.jsonl"
        argv = ["generate", "--model", str(tmp_path / "ckpt"), "--algorithm", "ngram"]
        assert main([*argv, "--input", str(requests), "--output", str(out)]) == 0
        ids: list[int] = next(r["output_ids"] for r in _rows(out) if r["id"] == "a")
        return ids

    assert output_of_a(a) == output_of_a(*others, a) == output_of_a(others[0], a, others[1])


def test_sampling_controls_and_logprobs_reach_the_engine(tmp_path: Path) -> None:
    """speculative / penalties / min_new_tokens / stop_sequences / logprobs / top_logprobs map
    onto SamplingParams: a stop sequence cuts the output after its first occurrence, logprobs
    come back one per output token (top_logprobs: the token first among its alternatives), and
    a repetition penalty changes the greedy output."""
    hf = make_checkpoint(tmp_path / "ckpt")
    prompt = [3, 4, 5]
    expected = greedy(hf, prompt, 16)
    stop = expected[5:7]
    rows = [
        {"id": "plain", "input_ids": prompt, "max_new_tokens": 16, "logprobs": True,
         "top_logprobs": 3, "speculative": False},
        {"id": "stop", "input_ids": prompt, "max_new_tokens": 16, "stop_sequences": [stop]},
        {"id": "penalized", "input_ids": prompt, "max_new_tokens": 16,
         "repetition_penalty": 3.0, "frequency_penalty": 0.5, "presence_penalty": 0.5,
         "min_new_tokens": 4},
    ]  # fmt: skip
    requests = _write_lines(tmp_path / "in.jsonl", *rows)
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--algorithm", "ngram"]
    assert main([*argv, "--input", str(requests), "--output", str(out)]) == 0
    got = {r["id"]: r for r in _rows(out)}
    assert got["plain"]["output_ids"] == expected
    assert set(got["plain"]["accept_lengths"]) == {1}  # speculative: false
    logprobs = got["plain"]["logprobs"]
    assert len(logprobs) == 16 and all(lp <= 0.0 for lp in logprobs)
    tops = got["plain"]["top_logprobs"]  # greedy: the output token is the most likely
    assert len(tops) == 16
    for top, token, logprob in zip(tops, expected, logprobs, strict=True):
        assert len(top) == 3 and top[0][0] == token
        assert top[0][1] == pytest.approx(logprob, abs=1e-6)
        assert top[0][1] >= top[1][1] >= top[2][1]
    assert "top_logprobs" not in got["stop"]
    first = next(i for i in range(len(expected)) if expected[i : i + 2] == stop)
    assert got["stop"]["output_ids"] == expected[: first + 2]
    assert got["stop"]["finish_reason"] == "stop"
    assert "logprobs" not in got["stop"]
    assert got["penalized"]["output_ids"] != expected


def test_text_prompts_on_a_byte_level_model(tmp_path: Path) -> None:
    """On a byte-level checkpoint a "text" prompt is its UTF-8 bytes (after BOS when the
    config names one) and the row carries the output decoded; id rows carry no text."""
    from specstate.reference import embedded

    hf = make_checkpoint(tmp_path / "bytes", vocab_size=260)  # no BOS/EOS: bytes only
    text = "héllo, wörld"
    requests = _write_lines(
        tmp_path / "in.jsonl",
        {"id": "t", "text": text, "max_new_tokens": 8},
        {"id": "i", "input_ids": list(text.encode()), "max_new_tokens": 8},
    )
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--input", str(requests), "--output", str(out)]
    assert main([*argv, "--model", str(tmp_path / "bytes")]) == 0
    by_text, by_ids = _rows(out)
    assert by_text["output_ids"] == by_ids["output_ids"] == greedy(hf, list(text.encode()), 8)
    ids = by_text["output_ids"]
    assert isinstance(ids, list)
    assert by_text["text"] == bytes(i for i in ids if i < 256).decode(errors="replace")
    assert "text" not in by_ids
    # The embedded model names BOS 256: a text prompt starts with it, as in training.
    prompt = "def add(a, b):\n    "
    requests = _write_lines(
        tmp_path / "in.jsonl",
        {"id": "t", "text": prompt, "max_new_tokens": 16},
        {"id": "i", "input_ids": [embedded.BOS_ID, *prompt.encode()], "max_new_tokens": 16},
    )
    summary = tmp_path / "summary.json"
    assert main([*argv, "--model", str(embedded.target_dir()), "--summary-json", str(summary)]) == 0
    assert json.loads(summary.read_text())["prompt_tokens"] == 2 * (1 + len(prompt.encode()))
    by_text, by_ids = _rows(out)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert by_text["text"] == embedded.decode(by_ids["output_ids"])


def test_text_on_a_model_that_is_not_byte_level_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A text prompt on a 97-token vocabulary exits 2, one line naming the line and why."""
    make_checkpoint(tmp_path / "ckpt")
    capsys.readouterr()  # transformers' own progress bar
    requests = _write_lines(
        tmp_path / "in.jsonl",
        {"id": "a", "input_ids": [1]},
        {"id": "b", "text": "hello"},
    )
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(requests)]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert 'in.jsonl:2: "text" needs a byte-level model' in err and "vocab_size 97" in err
    assert len(err.strip().splitlines()) == 1


def test_a_request_the_engine_refuses_names_its_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A prompt id outside the vocabulary (checked at submit) names the line, exit 2."""
    make_checkpoint(tmp_path / "ckpt")
    requests = _write_lines(
        tmp_path / "in.jsonl", {"id": "a", "input_ids": [1]}, {"id": "b", "input_ids": [500]}
    )
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(requests)]
    assert main([*argv, "--output", str(tmp_path / "o.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "in.jsonl:2: " in err and "500" in err and "Traceback" not in err


def test_summary_progress_and_quiet(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The summary (stderr and --summary-json) agrees with the rows; the bar shows only when
    asked (stderr is not a terminal here); --quiet prints nothing; --threads reaches torch."""
    make_checkpoint(tmp_path / "ckpt")
    lines = [{"id": k, "input_ids": v, "max_new_tokens": 9} for k, v in PROMPTS.items()]
    requests = _write_lines(tmp_path / "in.jsonl", *lines)
    out, summary = tmp_path / "out.jsonl", tmp_path / "summary.json"
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--input", str(requests)]
    argv += ["--output", str(out), "--algorithm", "ngram", "--num-steps", "3"]
    before = torch.get_num_threads()
    try:
        assert main([*argv, "--summary-json", str(summary), "--threads", "2"]) == 0
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    err = capsys.readouterr().err
    assert "req/s" not in err and "3/3" not in err  # no bar when stderr is not a terminal
    got = json.loads(summary.read_text())
    rows = _rows(out)
    accepts = [a for r in rows for a in r["accept_lengths"]]
    generated = sum(len(r["output_ids"]) for r in rows)
    assert got["requests"] == got["finished"] == 3 and got["failed"] == 0
    assert got["finish_reasons"] == {"length": 3}
    assert got["generated_tokens"] == generated == 27
    assert got["prompt_tokens"] == sum(len(v) for v in PROMPTS.values())
    assert got["verifies"] == len(accepts)
    assert got["mean_accept_length"] == pytest.approx(sum(accepts) / len(accepts), abs=1e-4)
    assert got["algorithm"] == "ngram" and got["num_steps"] == 3 and got["threads"] == 2
    assert got["tokens_per_second"] == pytest.approx(generated / got["wall_s"], rel=1e-2)
    assert "3 requests: 3 finished, 0 failed" in err
    assert f"{generated} tokens in " in err and " tok/s " in err
    assert f"mean accept length {got['mean_accept_length']:.2f}" in err
    assert main([*argv, "--progress"]) == 0
    err = capsys.readouterr().err
    assert "3/3" in err and "req/s" in err and "3 requests: 3 finished" in err
    assert main([*argv, "--quiet"]) == 0
    assert capsys.readouterr().err == ""


FACTORIES = """\
import argparse

from specstate import RequestLimits
from specstate.tools.timed_worker import TimedWaitWorker

SEEN = []


def make(args: argparse.Namespace):
    SEEN.append(args)
    worker = TimedWaitWorker(device_seconds=0.0, num_steps=args.num_steps, accept=args.num_steps)
    return worker, RequestLimits(vocab_size=32, max_context_len=64)


def worker_only(args):
    return make(args)[0]


def no_worker(args):
    return None, make(args)[1]


def raises(args):
    raise ValueError("boom")


class Builders:
    make = staticmethod(make)


NOT_CALLABLE = 3
"""


@pytest.fixture
def factories(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, request: pytest.FixtureRequest
) -> Iterator[str]:
    """A module of worker factories in the working directory, under a name unique to the test."""
    name = f"factories_{request.node.name.split('[')[0]}_{abs(hash(request.node.name))}"
    (tmp_path / f"{name}.py").write_text(FACTORIES)
    (tmp_path / "broken_factories.py").write_text("import no_such_dependency_xyz\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # the cwd the CLI adds goes away after
    yield name
    sys.modules.pop(name, None)


def test_a_custom_worker_drives_generate(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--worker MODULE:FACTORY: the factory gets the parsed args (--seed included) and the
    engine drives the worker it returns; no --model is needed."""
    requests = _write_lines(
        tmp_path / "in.jsonl",
        {"id": "a", "input_ids": [1, 2, 3], "max_new_tokens": 10},
        {"id": "b", "input_ids": [4], "max_new_tokens": 5},
    )
    for spec in (f"{factories}:make", f"{factories}:Builders.make"):
        argv = ["generate", "--worker", spec, "--num-steps", "3", "--input", str(requests)]
        assert main([*argv, "--output", "out.jsonl", "--seed", "11"]) == 0
        rows = _rows(tmp_path / "out.jsonl")
        assert [r["output_ids"] for r in rows] == [[7] * 10, [7] * 5]  # the worker's token
        assert all(set(r["accept_lengths"]) <= {3} for r in rows)
    seen = sys.modules[factories].SEEN
    assert [a.seed for a in seen] == [11, 11] and seen[0].model is None
    assert "timed_wait K=3: mean accept length 3.00" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("attr", "message"),
    [
        ("no_such_module_xyz:make", "no module named 'no_such_module_xyz'"),
        ("broken_factories:make", "importing broken_factories failed: ModuleNotFoundError"),
        ("{m}", "expected MODULE:FACTORY"),
        ("{m}:missing", "has no attribute 'missing'"),
        ("{m}:NOT_CALLABLE", "NOT_CALLABLE is a int, not a callable factory"),
        ("{m}:worker_only", "must return (worker, limits)"),
        ("{m}:no_worker", "it returned (NoneType, RequestLimits)"),
        ("{m}:raises", "the factory raised ValueError: boom (at "),
    ],
)
def test_a_bad_worker_factory_is_one_line(
    factories: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], attr: str, message: str
) -> None:
    """A missing module or attribute, a failing import or factory, or a wrong return exit 2
    with one line naming --worker and what is wrong."""
    requests = _write_lines(tmp_path / "in.jsonl", {"id": "a", "input_ids": [1]})
    spec = attr.format(m=factories)
    argv = ["generate", "--worker", spec, "--input", str(requests), "--output", "o.jsonl"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"specstate generate: --worker {spec}" in err and message in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_neither_model_nor_worker_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --model and --worker there is nothing to run: exit 2, one line."""
    requests = _write_lines(tmp_path / "in.jsonl", {"id": "a", "input_ids": [1]})
    assert main(["generate", "--input", str(requests), "--output", str(tmp_path / "o")]) == 2
    assert "--model DIR is required (or --worker MODULE:FACTORY)" in capsys.readouterr().err


def test_help_tells_about_threads_with_no_overlap(capsys: pytest.CaptureFixture[str]) -> None:
    """--help says that with --no-overlap the forward runs on the main thread."""
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "--threads N torch intra-op threads" in out
    assert "With --no-overlap the forward runs on the main thread" in out


def test_the_documented_worker_factory_drives_generate(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The factory module of docs/cli.md, saved as a file, runs under --worker: its n-gram
    worker (K = --num-steps) emits what plain greedy decoding emits."""
    from specstate.reference import embedded

    page = Path(__file__).resolve().parents[2] / "docs" / "cli.md"
    blocks = re.findall(r"```python\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    (tmp_path / "my_workers_doc.py").write_text(next(b for b in blocks if "def make_worker" in b))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.delitem(sys.modules, "my_workers_doc", raising=False)
    requests = _write_lines(
        tmp_path / "in.jsonl", {"id": "a", "text": "def add(a, b):\n    ", "max_new_tokens": 24}
    )
    argv = ["generate", "--model", str(embedded.target_dir()), "--input", str(requests)]
    assert main([*argv, "--output", "plain.jsonl"]) == 0
    capsys.readouterr()
    custom = ["--worker", "my_workers_doc:make_worker", "--num-steps", "3"]
    assert main([*argv, *custom, "--output", "custom.jsonl"]) == 0
    assert "ngram K=3: mean accept length" in capsys.readouterr().err
    (plain,), (ours,) = _rows(tmp_path / "plain.jsonl"), _rows(tmp_path / "custom.jsonl")
    assert ours["output_ids"] == plain["output_ids"] and ours["text"] == plain["text"]
    assert max(ours["accept_lengths"]) <= 4
    sys.modules.pop("my_workers_doc", None)


@pytest.mark.parametrize(
    "flags",
    [
        ["--algorithm", "draft_model", "--topk", "2", "--num-draft-tokens", "5"],
        ["--algorithm", "ngram", "--adaptive"],
    ],
    ids=["tree", "adaptive"],
)
def test_tree_and_adaptive_flags_stay_exact(tmp_path: Path, flags: list[str]) -> None:
    """--topk / --num-draft-tokens grow a draft tree, --adaptive picks widths; greedy is exact."""
    hf = make_checkpoint(tmp_path / "ckpt")
    prompts = [[3, 4, 5, 3, 4, 5], [9, 9, 9]]
    requests = _write_lines(
        tmp_path / "in.jsonl",
        *({"id": f"r{i}", "input_ids": p, "max_new_tokens": 16} for i, p in enumerate(prompts)),
    )
    out = tmp_path / "out.jsonl"
    argv = ["generate", "--model", str(tmp_path / "ckpt"), *flags]
    if "draft_model" in flags:
        argv += ["--draft", str(tmp_path / "ckpt")]
    assert main([*argv, "--input", str(requests), "--output", str(out)]) == 0
    rows = _rows(out)
    assert [r["output_ids"] for r in rows] == [greedy(hf, p, 16) for p in prompts]
    if "draft_model" in flags:  # the drafter is the target: whole tree paths are accepted
        assert max(a for r in rows for a in r["accept_lengths"]) > 1


def test_tree_flags_need_a_tree_drafter(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--topk above 1 with an algorithm that cannot grow a tree exits 2 with one line."""
    make_checkpoint(tmp_path / "ckpt")
    requests = _write_lines(tmp_path / "in.jsonl", {"id": "a", "input_ids": [1]})
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--algorithm", "ngram", "--topk", "2"]
    assert main([*argv, "--input", str(requests), "--output", str(tmp_path / "o.jsonl")]) == 2
    assert (
        "grow a draft tree (draft_model, eagle, eagle3, uno), not ngram" in capsys.readouterr().err
    )


@pytest.mark.parametrize("overlap", ["--overlap", "--no-overlap"])
def test_a_verify_budget_from_the_command_line(tmp_path: Path, overlap: str) -> None:
    """``--verify-budget schedule:1=1,beyond=2``: a lone request verifies one draft a round,
    the batch of three two; the tokens stay HF's greedy ones."""
    hf = make_checkpoint(tmp_path / "ckpt")
    prompts = {"alone": [7, 8, 9, 7, 8, 9, 7, 8]}
    for group, batch in [("alone", prompts), ("three", PROMPTS)]:
        lines = [
            json.dumps({"id": k, "input_ids": v, "max_new_tokens": 9}) for k, v in batch.items()
        ]
        (tmp_path / f"{group}.jsonl").write_text("\n".join(lines) + "\n")
        argv = [
            "generate",
            "--model", str(tmp_path / "ckpt"),
            "--algorithm", "ngram",
            "--num-steps", "3",
            overlap,
            "--verify-budget", "schedule:1=1,beyond=2",
            "--check-invariants",
            "--input", str(tmp_path / f"{group}.jsonl"),
            "--output", str(tmp_path / f"{group}.out.jsonl"),
        ]  # fmt: skip
        assert main(argv) == 0
        rows = [json.loads(x) for x in (tmp_path / f"{group}.out.jsonl").read_text().splitlines()]
        for row in rows:
            assert row["output_ids"] == greedy(hf, batch[row["id"]], 9)
            decode = row["verified_lengths"][1:]  # the prefill round verifies nothing
            assert decode and max(decode) <= (1 if group == "alone" else 2)
            pairs = zip(row["accept_lengths"], row["verified_lengths"], strict=True)
            assert all(a <= v + 1 for a, v in pairs)
        if group == "alone":
            assert max(rows[0]["verified_lengths"]) == 1


def test_a_bad_verify_budget_is_refused_before_the_model_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An unknown policy name exits 2 naming it; no checkpoint is read."""
    argv = ["generate", "--model", str(tmp_path / "no-model"), "--verify-budget", "bestest"]
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "input_ids": [1]}) + "\n")
    assert main([*argv, "--input", str(tmp_path / "in.jsonl")]) == 2
    assert "verify_budget 'bestest'" in capsys.readouterr().err
