"""A device this machine lacks is an `InvalidConfig` naming it when the config is made.

What torch reports about its backends (``torch.cuda.is_available``, ``device_count``,
``torch.version.cuda``, ``torch.backends.mps.is_available``) is set per test with monkeypatch, so
every branch runs on a CPU-only machine and on a GPU machine alike; nothing of specstate is
replaced.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_oracle import greedy, make_checkpoint

from specstate import EngineConfig, InvalidConfig
from specstate.engine.device_check import device_problems
from specstate.tools.cli import main


def _no_cuda(monkeypatch: pytest.MonkeyPatch, *, built_with: str | None) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", built_with)


def _gpus(monkeypatch: pytest.MonkeyPatch, count: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:7"])
def test_cuda_on_a_torch_without_cuda_is_refused(
    monkeypatch: pytest.MonkeyPatch, device: str
) -> None:
    """A CPU build of torch: the config names the device and says the build has no CUDA."""
    _no_cuda(monkeypatch, built_with=None)
    with pytest.raises(InvalidConfig, match=rf"device '{device}' is not available: .*no CUDA"):
        EngineConfig(device=device)


def test_cuda_with_no_gpu_visible_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CUDA build that sees no GPU says so, with where to look."""
    _no_cuda(monkeypatch, built_with="12.4")
    with pytest.raises(InvalidConfig, match=r"'cuda' is not available: .*CUDA 12.4.*no CUDA dev"):
        EngineConfig(device="cuda")


def test_a_cuda_index_past_the_visible_devices_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    """cuda:7 and cuda:2 on a machine with two GPUs name the devices there are; cuda:1 and
    cuda pass."""
    _gpus(monkeypatch, 2)
    with pytest.raises(InvalidConfig, match=r"'cuda:7' does not exist: 2 CUDA device\(s\)"):
        EngineConfig(device="cuda:7")
    assert device_problems("cuda:2") == [
        "device 'cuda:2' does not exist: 2 CUDA device(s) are visible (cuda:0 to cuda:1)"
    ]
    assert device_problems("cuda:1") == device_problems("cuda") == []


def test_mps_and_other_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """mps unavailable: not available; available: still refused, the engine has no stream
    for it; meta: refused the same way; not a device at all: named."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(InvalidConfig, match=r"device 'mps' is not available: .* no mps backend"):
        EngineConfig(device="mps")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    assert device_problems("mps") == [
        "device 'mps': the engine runs on 'cpu' or 'cuda' devices (its forward stream exists "
        "for those)"
    ]
    assert "runs on 'cpu' or 'cuda'" in device_problems("meta")[0]
    with pytest.raises(InvalidConfig, match="device 'gpu0' is not a torch device"):
        EngineConfig(device="gpu0")


def test_cpu_devices_pass() -> None:
    """The host CPU and a tagged CPU device (the device audit's) are always there."""
    assert device_problems("cpu") == device_problems("cpu:0") == []
    EngineConfig(device="cpu:0")


@pytest.mark.parametrize("command", ["demo", "generate"])
def test_the_commands_refuse_a_missing_device_before_loading(
    command: str,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """--device cuda without CUDA: exit 2, one line naming the device, nothing loaded (the
    model directory does not even exist)."""
    _no_cuda(monkeypatch, built_with=None)
    argv = [command, "--device", "cuda"]
    if command == "generate":
        (tmp_path / "in.jsonl").write_text('{"id": "a", "input_ids": [1]}\n')
        argv += ["--model", str(tmp_path / "missing"), "--input", str(tmp_path / "in.jsonl")]
        argv += ["--output", str(tmp_path / "out.jsonl")]
    assert main(argv) == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in captured.err
    assert lines[0].startswith(f"specstate {command}: EngineConfig: device 'cuda' is not available")
    assert captured.out == ""


def test_generate_on_a_device_reproduces_hf(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--device cpu:0 takes the engine's device paths (a device-side slot table, one packed
    result copy) and still emits HF's greedy tokens; the summary names the device."""
    hf = make_checkpoint(tmp_path / "ckpt")
    prompts = {"a": [3, 4, 5], "b": [9, 8]}
    lines = [json.dumps({"id": k, "input_ids": v, "max_new_tokens": 6}) for k, v in prompts.items()]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    argv = ["generate", "--model", str(tmp_path / "ckpt"), "--algorithm", "ngram"]
    argv += ["--device", "cpu:0", "--input", str(tmp_path / "in.jsonl")]
    argv += ["--output", str(tmp_path / "out.jsonl"), "--check-invariants"]
    assert main(argv) == 0
    rows = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert {r["id"]: r["output_ids"] for r in rows} == {
        k: greedy(hf, v, 6) for k, v in prompts.items()
    }
    assert "overlap loop on cpu:0)" in capsys.readouterr().err


def test_demo_on_a_device_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """demo --device cpu:0 runs every check on the device paths and names the device."""
    argv = ["demo", "--algorithm", "ngram", "--requests", "1", "--max-new-tokens", "4"]
    assert main([*argv, "--device", "cpu:0", "--quiet"]) == 0
    out = capsys.readouterr().out
    assert ", on cpu:0," in out and "lossless (all runs emit identical tokens): yes" in out
