"""Prefill → decode with both engines on a CUDA device (one process, one GPU): the record is
exported from device buffers and written back into device buffers; greedy output equals
transformers' ``generate()``. The two-process NCCL path is in test_pd_processes.py (two GPUs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from block_checkpoints import BlockCheckpoints
from handoff_harness import linked, run_pd
from hf_oracle import greedy, greedy_scored
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import SamplingParams
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerProtocol
from specstate.handoff.link import serve_disaggregated
from specstate.reference.workers import default_registry

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


@pytest.mark.parametrize("algorithm", ["frozen_kv_mtp", "dflash", "uno", "eagle_tree"])
@pytest.mark.parametrize("overlap", [False, True])
def test_the_newer_families_and_logprobs_cross_on_cuda(
    partial_ckpt: SpecCheckpoints, block_ckpt: BlockCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Frozen-KV MTP (its seed state), DFLASH (its context KV, commit order checked), UNO and an
    EAGLE tree cross between two CUDA engines with logprobs: HF's greedy tokens, and the
    decode engine's logprobs continue the prefill engine's first one (one per token)."""
    block = algorithm in ("dflash", "uno")
    hf: Any = block_ckpt.hf if block else partial_ckpt.hf

    def worker() -> WorkerProtocol:
        if algorithm == "dflash":
            return block_ckpt.worker("dflash", check_commit_order=True)
        if algorithm == "uno":
            return block_ckpt.worker("uno")
        if algorithm == "eagle_tree":
            options = partial_ckpt.options("eagle", agreeing=False)
            return default_registry().create("eagle", **options, topk=2, num_draft_tokens=5)
        return partial_ckpt.worker(algorithm, agreeing=False)

    params = SamplingParams(max_new_tokens=10, logprobs=True)
    requests = [(f"r{i}", list(p), params) for i, p in enumerate(MIXED_PROMPTS)]
    vocab = block_ckpt.vocab_size if block else partial_ckpt.vocab_size
    options: dict[str, Any] = {"device": "cuda", "overlap": overlap, "page_size": 16}
    with linked(worker(), worker(), vocab_size=vocab, **options) as link:
        reqs = serve_disaggregated(link, requests, after_step=check_engine)
    for rid, prompt, _ in requests:
        tokens, logprobs = greedy_scored(hf, prompt, 10)
        assert list(reqs[rid].emitted_ids) == tokens
        assert reqs[rid].logprobs == pytest.approx(logprobs, abs=1e-3)
