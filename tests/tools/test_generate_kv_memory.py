"""`specstate generate --kv-memory` / `--kv-fraction` size the KV pool from a byte budget.

The engine's configuration is read back from the run's own trace header; the bytes the budget
buys are checked against the planning functions (themselves checked against the allocated
caches in tests/memory/test_planning.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hf_oracle import greedy, make_checkpoint
from spec_checkpoints import make_spec_checkpoints

from specstate import kv_bytes_for_tokens, kv_layouts, kv_tokens_for_budget
from specstate.engine.planning import parse_bytes
from specstate.tools.cli import main

PROMPT = [3, 4, 5]


def _run(tmp_path: Path, *flags: str) -> tuple[int, dict[str, object]]:
    (tmp_path / "in.jsonl").write_text(
        json.dumps({"id": "a", "input_ids": PROMPT, "max_new_tokens": 6}) + "\n"
    )
    trace = tmp_path / "trace.jsonl"
    argv = ["generate", "--input", str(tmp_path / "in.jsonl"), "--trace", str(trace)]
    code = main([*argv, "--output", str(tmp_path / "out.jsonl"), *flags])
    header = json.loads(trace.read_text().splitlines()[0]) if code == 0 else {}
    config: dict[str, object] = header.get("config", {})
    return code, config


@pytest.mark.parametrize("algorithm", ["none", "draft_model", "eagle"])
def test_kv_memory_buys_the_pool_the_plan_says(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], algorithm: str
) -> None:
    """--kv-memory 200KiB: the engine runs with kv_tokens_for_budget's pool (target and the
    drafter's cache counted, in --dtype), the line on stderr says so, the tokens are HF's."""
    ckpt = make_spec_checkpoints(tmp_path / "ckpt")
    flags = ["--model", str(ckpt.target), "--algorithm", algorithm, "--page-size", "4"]
    draft = {"draft_model": ckpt.draft, "eagle": ckpt.eagle}.get(algorithm)
    if draft is not None:
        flags += ["--draft", str(draft)]
    code, config = _run(tmp_path, *flags, "--kv-memory", "200KiB")
    assert code == 0
    layouts = kv_layouts(
        ckpt.target,
        draft=ckpt.draft if algorithm == "draft_model" else None,
        eagle=ckpt.eagle if algorithm == "eagle" else None,
    )
    expected = kv_tokens_for_budget(200 * 1024, layouts, page_size=4)
    assert config["kv_tokens"] == expected
    err = capsys.readouterr().err
    per_token = sum(layout.bytes_per_token for layout in layouts)
    assert f"--kv-memory 200 KiB: --kv-tokens {expected}," in err
    assert f"{per_token} bytes a token (target 2x1x2x8x4 B" in err
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert rows[0]["output_ids"] == greedy(ckpt.hf, PROMPT, 6)


def test_kv_fraction_takes_a_share_of_the_free_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-fraction on the CPU: a share of MemAvailable; the pool's caches fit in it."""
    make_checkpoint(tmp_path / "ckpt")
    code, config = _run(tmp_path, "--model", str(tmp_path / "ckpt"), "--kv-fraction", "0.0001")
    assert code == 0
    line = next(x for x in capsys.readouterr().err.splitlines() if "--kv-fraction" in x)
    shown = re.search(r"of ([\d.]+ \w+) free on cpu: --kv-tokens (\d+),", line)
    assert shown is not None, line
    free = parse_bytes(shown.group(1).replace(" ", ""))
    assert config["kv_tokens"] == int(shown.group(2))
    layouts = kv_layouts(tmp_path / "ckpt", dtype=None)
    spent = kv_bytes_for_tokens(int(shown.group(2)), layouts)
    assert 0 < spent <= 0.0001 * free * 1.01  # the free memory is shown rounded


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-memory", "100B"], "--kv-memory 100 B: a KV budget of 100 B holds 0 token slots"),
        (["--kv-memory", "2 gigs"], "argument --kv-memory: invalid parse_bytes value"),
        (["--kv-fraction", "1.5"], "argument --kv-fraction: invalid fraction value"),
        (["--kv-memory", "1GiB", "--kv-tokens", "64"], "not allowed with argument"),
    ],
)
def test_a_bad_budget_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], flags: list[str], message: str
) -> None:
    """A budget under two pages, a size without a unit we know, a fraction outside (0, 1],
    or two ways to size the pool at once: exit 2, one line, nothing loaded."""
    make_checkpoint(tmp_path / "ckpt")
    try:
        code, _ = _run(tmp_path, "--model", str(tmp_path / "ckpt"), *flags)
    except SystemExit as exc:  # argparse's usage errors
        code = int(str(exc.code))
    assert code == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_a_budget_needs_a_model_to_size_a_token(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--worker without --model: nothing says what a token costs, so --kv-memory is refused."""
    worker = "specstate.tools.generate:build_worker"
    code, _ = _run(tmp_path, "--worker", worker, "--kv-memory", "1GiB")
    assert code == 2
    assert "--kv-memory needs --model DIR: its config.json sizes a KV token" in (
        capsys.readouterr().err
    )
