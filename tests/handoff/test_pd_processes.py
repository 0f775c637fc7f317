"""Prefill and decode in two processes over torch.distributed (gloo on the CPU; NCCL on a GPU).

Rank 0 prefills and sends each record point to point; rank 1 admits a request only once every
tensor of its record has landed, while it keeps decoding the others, and acknowledges it. Greedy
output equals transformers' ``generate()``. Faults: either process dying mid-transfer, a record
that does not decode; each test bounds the time and checks the surviving engine's pools are back
to their start.
"""

from __future__ import annotations

from typing import Any

import pytest
from handoff_processes import pd_rank
from hf_oracle import greedy, greedy_scored
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints

from specstate import SamplingParams
from specstate.distributed.spawn import RankOutcome, spawn_ranks

NEW_TOKENS = 10
BOUND_S = 20.0  # a fault is noticed and cleaned up within this (processes start in ~5 s)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("pdproc"))


def _spec(ckpt: SpecCheckpoints, algorithm: str, **extra: Any) -> dict[str, Any]:
    requests = [
        (f"r{i}", list(p), SamplingParams(max_new_tokens=NEW_TOKENS))
        for i, p in enumerate(MIXED_PROMPTS)
    ]
    spec: dict[str, Any] = {
        "algorithm": algorithm,
        "worker": ckpt.options(algorithm),
        "config": {"page_size": 4},
        "vocab_size": ckpt.vocab_size,
        "requests": requests,
        "device": "cpu",
        "fault": None,
        "ack_timeout_s": 10.0,
        "idle_timeout_s": 10.0,
    }
    spec.update(extra)
    return spec


def _spawn(spec: dict[str, Any], *, device: str = "cpu") -> list[RankOutcome]:
    return spawn_ranks(pd_rank, (spec,), world_size=2, timeout_s=120.0, device=device)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("algorithm", "overlap", "page_size"), [("eagle", True, 16), ("draft_model", False, 1)]
)
def test_two_processes_on_gloo_are_lossless(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool, page_size: int
) -> None:
    """Every request crosses; the decode process emits HF's greedy tokens; both pools full."""
    spec = _spec(ckpt, algorithm, config={"overlap": overlap, "page_size": page_size})
    prefill, decode = _spawn(spec)
    assert prefill.ok and decode.ok, (prefill.traceback, decode.traceback)
    want = {f"r{i}": greedy(ckpt.hf, list(p), NEW_TOKENS) for i, p in enumerate(MIXED_PROMPTS)}
    assert decode.result["outputs"] == want
    assert decode.result["failure"] is None
    assert {r for r, _ in prefill.result["finish"].values()} == {"handed_off"}
    assert prefill.result["pools_full"] and decode.result["pools_full"]
    assert prefill.result["handoffs"] == (len(want), 0)
    assert decode.result["handoffs"] == (0, len(want))


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ["frozen_kv_mtp", "eagle_tree"])
def test_newer_families_and_logprobs_cross_two_processes(
    ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """Frozen-KV MTP (its seed state in the record) and an EAGLE tree, every request with
    logprobs, over gloo: HF's greedy tokens and logprobs on the decode process."""
    name = "eagle" if algorithm == "eagle_tree" else algorithm
    options = ckpt.options(name)
    if algorithm == "eagle_tree":
        options |= {"topk": 2, "num_draft_tokens": 5}
    params = SamplingParams(max_new_tokens=NEW_TOKENS, logprobs=True)
    requests = [(f"r{i}", list(p), params) for i, p in enumerate(MIXED_PROMPTS)]
    spec = _spec(ckpt, name, worker=options, requests=requests, config={"overlap": True})
    prefill, decode = _spawn(spec)
    assert prefill.ok and decode.ok, (prefill.traceback, decode.traceback)
    assert decode.result["failure"] is None
    for rid, prompt, _ in requests:
        tokens, logprobs = greedy_scored(ckpt.hf, prompt, NEW_TOKENS)
        assert decode.result["outputs"][rid] == tokens
        assert decode.result["logprobs"][rid] == pytest.approx(logprobs, abs=1e-4)
    assert prefill.result["pools_full"] and decode.result["pools_full"]


@pytest.mark.slow
def test_the_decode_process_dies_mid_transfer(ckpt: SpecCheckpoints) -> None:
    """The prefill side fails the request with a clear error, fails the rest at once, and frees
    every page, within the bound."""
    spec = _spec(ckpt, "eagle", fault="decode_dies")
    prefill, _ = _spawn(spec)
    assert prefill.ok, prefill.traceback
    finishes = prefill.result["finish"]
    assert {reason for reason, _ in finishes.values()} == {"error"}
    assert all(
        "handoff failed" in d or "decode side unavailable" in d for _, d in finishes.values()
    )
    assert prefill.result["pools_full"]
    assert prefill.result["seconds"] < BOUND_S


@pytest.mark.slow
def test_the_prefill_process_dies_mid_transfer(ckpt: SpecCheckpoints) -> None:
    """The decode side does not hang: it reports the failure within the bound, admitted
    nothing from the half-sent record, and its pools are full."""
    spec = _spec(ckpt, "eagle", fault="prefill_dies")
    _, decode = _spawn(spec)
    assert decode.ok, decode.traceback
    assert decode.result["failure"] is not None and "rank 0" in decode.result["failure"]
    assert decode.result["outputs"] == {}
    assert decode.result["handoffs"] == (0, 0)
    assert decode.result["pools_full"]
    assert decode.result["seconds"] < BOUND_S


@pytest.mark.slow
def test_a_malformed_record_over_the_wire_is_refused(ckpt: SpecCheckpoints) -> None:
    """The decode side NACKs every corrupted record without writing; the prefill side ends each
    request with ERROR naming the refusal; both pools are full."""
    spec = _spec(ckpt, "ngram", fault="malformed")
    prefill, decode = _spawn(spec)
    assert prefill.ok and decode.ok, (prefill.traceback, decode.traceback)
    finishes = prefill.result["finish"].values()
    assert {reason for reason, _ in finishes} == {"error"}
    assert all("MalformedRecord" in d and "bonus token" in d for _, d in finishes)
    assert decode.result["outputs"] == {} and decode.result["failure"] is None
    assert prefill.result["pools_full"] and decode.result["pools_full"]


@pytest.mark.cuda
@pytest.mark.slow
def test_two_processes_on_nccl_are_lossless(ckpt: SpecCheckpoints) -> None:
    """The same handoff with every tensor crossing on the GPU (NCCL; one GPU per rank)."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("NCCL handoff needs two GPUs")
    spec = _spec(ckpt, "eagle", device="cuda", config={"page_size": 16, "device": "cuda"})
    prefill, decode = _spawn(spec, device="cuda")
    assert prefill.ok and decode.ok, (prefill.traceback, decode.traceback)
    want = {f"r{i}": greedy(ckpt.hf, list(p), NEW_TOKENS) for i, p in enumerate(MIXED_PROMPTS)}
    assert decode.result["outputs"] == want
