"""Prefill → decode with both engines on a CUDA device (one process, one GPU): the record is
exported from device buffers and written back into device buffers; greedy output equals
transformers' ``generate()``. The two-process NCCL path is in test_pd_processes.py (two GPUs)."""

from __future__ import annotations

import pytest
import torch
from handoff_harness import run_pd
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("pdcuda"))


@pytest.mark.parametrize("algorithm", ["ngram", "draft_model", "eagle", "mtp"])
@pytest.mark.parametrize("overlap", [False, True])
def test_prefill_and_decode_on_cuda_are_lossless(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Every request crosses between two CUDA engines; HF's greedy tokens, no recompute."""
    requests = [
        (f"r{i}", list(p), SamplingParams(max_new_tokens=10)) for i, p in enumerate(MIXED_PROMPTS)
    ]
    run = run_pd(
        ckpt.worker(algorithm),
        ckpt.worker(algorithm),
        [requests],
        vocab_size=ckpt.vocab_size,
        device="cuda",
        overlap=overlap,
        page_size=16,
    )
    assert run.outputs == {rid: greedy(ckpt.hf, p, 10) for rid, p, _ in requests}
    assert run.prefill_tokens_on_decode == 0 and run.drafter_prefill_tokens_on_decode == 0
