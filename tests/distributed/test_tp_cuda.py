"""Tensor parallelism over NCCL: two GPUs, one rank each (skipped without two CUDA devices)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hf_oracle import make_checkpoint
from spec_checkpoints import SpecCheckpoints
from tp_programs import greedy_requests, lossless_matrix, sharded_forwards

from specstate import EngineConfig
from specstate.distributed import spawn_ranks

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(
        not torch.cuda.is_available() or torch.cuda.device_count() < 2,
        reason="needs two CUDA devices (NCCL, one rank per device)",
    ),
]


def test_sharded_model_on_two_gpus(tmp_path_factory: pytest.TempPathFactory) -> None:
    """NCCL shards compute the whole model's logits; both ranks hold the same bits."""
    root = tmp_path_factory.mktemp("tp_cuda_model")
    make_checkpoint(root, layers=2)
    outcomes = spawn_ranks(
        sharded_forwards, (str(root),), world_size=2, timeout_s=300, device="cuda"
    )
    for outcome in outcomes:
        assert outcome.ok, outcome.traceback or outcome.error
        assert outcome.result["logit_diff"] < 1e-3
    first, second = (o.result["outputs"] for o in outcomes)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)


def test_engines_on_two_gpus_agree_and_are_lossless(partial_ckpt: SpecCheckpoints) -> None:
    """Overlap loop on the GPUs: every rank emits the same; eagle trees and n-gram equal none."""
    paths = {k: str(getattr(partial_ckpt, k)) for k in ("target", "draft", "eagle")}
    prompts = [(3, 14, 15, 92, 65, 35, 89), (79, 32), (38, 46, 26, 43, 38, 32, 79, 50, 28, 84)]
    config = EngineConfig(overlap=True, page_size=16, kv_tokens=2048, check_invariants=True)
    scenarios: list[dict[str, Any]] = [
        {"name": name, "algorithm": algorithm, "options": options, "config": config,
         "requests": greedy_requests(prompts, 10)}
        for name, algorithm, options in (
            ("none", "none", {}),
            ("ngram", "ngram", {}),
            ("eagle_tree", "eagle", {"topk": 2, "num_draft_tokens": 6}),
        )
    ]  # fmt: skip
    outcomes = spawn_ranks(
        lossless_matrix, (paths, scenarios), world_size=2, timeout_s=600, device="cuda"
    )
    for outcome in outcomes:
        assert outcome.ok, outcome.traceback or outcome.error
    first, second = (o.result for o in outcomes)
    for name, run in first.items():
        assert run["error"] is None, (name, run["error"])
        assert run["outputs"] == second[name]["outputs"], name
        tokens = {rid: out[0] for rid, out in run["outputs"].items()}
        assert tokens == {rid: out[0] for rid, out in first["none"]["outputs"].items()}, name
