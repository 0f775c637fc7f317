"""`specstate generate --model DIR` on a hybrid checkpoint: NemotronH (Mamba2 + attention) or
LFM2 (short convolutions + attention).

The reference workers serve hybrid targets; the command loads one as it loads a Llama. With a
partly agreeing hybrid drafter (accept lengths strictly between 1 and the maximum) its outputs
equal transformers' greedy `generate()`, and `KvLayout.from_config` counts only the attention
layers' KV (the recurrent layers hold state rows, not KV).
"""

from __future__ import annotations

import argparse
import gc
import json
import types
from pathlib import Path
from typing import TypeVar

import pytest
import torch
from hf_oracle import greedy
from hybrid_oracle import make_hybrid_checkpoints
from lfm2_oracle import make_lfm2_checkpoint, make_lfm2_checkpoints

from specstate.engine.planning import (
    KvLayout,
    format_bytes,
    kv_bytes_for_tokens,
    kv_layouts,
    kv_tokens_for_budget,
    recurrent_state_bytes,
)
from specstate.reference.hybrid import read_hybrid_config
from specstate.reference.hybrid.mamba import StateBuffers
from specstate.tools.cli import main
from specstate.tools.engine_options import engine_config
from specstate.tools.generate.kv_memory import resolve_kv_tokens
from specstate.tools.generate.options import add_arguments
from specstate.tools.generate.workers import load_engine

T = TypeVar("T")
_LEAVES = (
    type,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    torch.Tensor,
    str,
    bytes,
)

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


def _reachable(root: object, kind: type[T]) -> list[T]:
    """Every ``kind`` instance reachable from ``root`` through object references (functions,
    classes and modules are not followed: they lead to every global)."""
    found: list[T] = []
    seen: set[int] = set()
    stack = [root]
    while stack:
        obj = stack.pop()
        if id(obj) in seen or isinstance(obj, _LEAVES):
            continue
        seen.add(id(obj))
        if isinstance(obj, kind):
            found.append(obj)
            continue
        stack.extend(gc.get_referents(obj))
    return found


@pytest.mark.parametrize("algorithm", ["none", "draft_model"])
@pytest.mark.parametrize("kind", ["nemotron_h", "lfm2"])
def test_kv_memory_takes_a_hybrids_state_rows_off_the_budget_first(
    kind: str, algorithm: str, tmp_path: Path
) -> None:
    """--kv-memory on a hybrid: the state rows the engine allocates (every state buffer it
    holds, summed) come off the budget, and the pool is what the rest buys."""
    ckpt = (make_hybrid_checkpoints if kind == "nemotron_h" else make_lfm2_checkpoints)(tmp_path)
    flags = ["--model", str(ckpt.target), "--max-running", "3", "--kv-memory", "1MiB",
             "--page-size", "4", "--no-overlap", "--input", "-", "--output", "-"]  # fmt: skip
    if algorithm == "draft_model":
        flags += ["--draft", str(ckpt.partial), "--algorithm", "draft_model", "--num-steps", "3"]
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(flags)
    line = resolve_kv_tokens(args)
    with load_engine(args, engine_config(args), None, None) as engine:
        state = sum(b.num_bytes for b in _reachable(engine, StateBuffers))
        groups = 2 if algorithm == "draft_model" else 1  # the hybrid drafter keeps its own
        assert len(_reachable(engine, StateBuffers)) == groups
    layouts = kv_layouts(ckpt.target, draft=ckpt.partial if algorithm == "draft_model" else None)
    assert state > 0
    assert args.kv_tokens == kv_tokens_for_budget((1 << 20) - state, layouts, page_size=4)
    assert line is not None and f"{format_bytes(state)} of recurrent state" in line


def test_kv_memory_below_a_hybrids_state_rows_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A budget the state rows alone exceed exits 2 naming them, before any model loads."""
    ckpt = make_hybrid_checkpoints(tmp_path)
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "input_ids": [3, 4]}) + "\n")
    argv = ["generate", "--model", str(ckpt.target), "--max-running", "64",
            "--kv-memory", "4KiB", "--input", str(tmp_path / "in.jsonl"),
            "--output", str(tmp_path / "out.jsonl")]  # fmt: skip
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "the recurrent state rows alone take" in err and "129 slots x 2 rows" in err


def test_a_pool_and_state_rows_past_the_free_memory_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kv-tokens on a hybrid: the check against the free memory counts the state rows too
    (one byte short of KV + state is refused, naming both; exactly enough runs)."""
    import specstate.tools.generate.kv_memory as kv_memory

    ckpt = make_hybrid_checkpoints(tmp_path)
    (tmp_path / "in.jsonl").write_text(json.dumps({"id": "a", "input_ids": [3, 4]}) + "\n")
    files = ["--input", str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl")]
    argv = ["generate", "--model", str(ckpt.target), "--max-running", "4", "--kv-tokens", "256",
            *files]  # fmt: skip
    kv = kv_bytes_for_tokens(256, kv_layouts(ckpt.target))
    spec = read_hybrid_config(ckpt.target).recurrent_spec()
    state = recurrent_state_bytes(spec, max_running=4, num_draft_tokens=1)
    assert state > 0
    monkeypatch.setattr(kv_memory, "free_memory", lambda device: kv + state - 1)
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "of recurrent state (9 slots x 2 rows" in err and "available on cpu" in err
    monkeypatch.setattr(kv_memory, "free_memory", lambda device: kv + state)
    assert main(argv) == 0
