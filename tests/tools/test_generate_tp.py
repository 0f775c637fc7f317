"""`specstate generate --tp 2`: spawned ranks, or torchrun's, write what one rank writes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from margin_screen import screen
from spec_checkpoints import SpecCheckpoints

from specstate.distributed import free_port
from specstate.tools.cli import main

NEW_TOKENS = 8


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def requests(tmp_path_factory: pytest.TempPathFactory, partial_ckpt: SpecCheckpoints) -> Path:
    """Greedy requests on margin-screened prompts, and one seeded sampled request."""
    prompts = screen(
        partial_ckpt.hf, (5, 9, 3, 12, 7), vocab_size=97, max_new_tokens=NEW_TOKENS, keep=3
    )
    lines = [
        {"id": f"g{i}", "input_ids": list(p), "max_new_tokens": NEW_TOKENS}
        for i, p in enumerate(prompts)
    ]
    lines.append(
        {"id": "s", "input_ids": [5, 6, 7], "max_new_tokens": NEW_TOKENS, "temperature": 0.7,
         "seed": 11}
    )  # fmt: skip
    path = tmp_path_factory.mktemp("tp_generate") / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def test_tp2_spawned_and_torchrun_write_what_tp1_writes(
    requests: Path, partial_ckpt: SpecCheckpoints, tmp_path: Path
) -> None:
    """The same JSONL from --tp 1, --tp 2 (spawned ranks; requests on stdin, results on
    stdout) and torchrun --nproc-per-node 2."""
    common = [
        "generate",
        "--model", str(partial_ckpt.target),
        "--algorithm", "eagle",
        "--draft", str(partial_ckpt.eagle),
        "--num-steps", "3",
        "--page-size", "4",
        "--input", str(requests),
        "--check-invariants",
        "--threads", "1",
        "--quiet",
    ]  # fmt: skip
    assert main([*common, "--output", str(tmp_path / "tp1.jsonl")]) == 0
    # The spawned ranks read the requests from a pipe and write the results to stdout.
    piped = [a if a != str(requests) else "-" for a in common]
    spawned = subprocess.run(
        [sys.executable, "-m", "specstate.tools.cli", *piped, "--tp", "2"],
        input=requests.read_text(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert spawned.returncode == 0, spawned.stderr[-2000:]
    (tmp_path / "tp2.jsonl").write_text(spawned.stdout)
    torchrun = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "-m", "specstate.tools.cli",
        *common, "--output", str(tmp_path / "torchrun.jsonl"), "--tp", "2",
    ]  # fmt: skip
    done = subprocess.run(torchrun, capture_output=True, text=True, timeout=180, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    single = _rows(tmp_path / "tp1.jsonl")
    assert [r["finish_reason"] for r in single] == ["length"] * 4
    for name in ("tp2.jsonl", "torchrun.jsonl"):
        rows = _rows(tmp_path / name)
        assert [r["output_ids"] for r in rows] == [r["output_ids"] for r in single], name


def test_a_bad_rank_count_is_refused(requests: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--tp 0 is a usage error (argparse, exit 2) before anything starts."""
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", "m", "--input", str(requests), "--output", "o", "--tp", "0"])
    assert exit_info.value.code == 2
    assert "--tp" in capsys.readouterr().err
