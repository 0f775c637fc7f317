"""``mtp`` drafts equal independent implementations, round by round.

With ``K = L`` every decode round's drafts and accept length equal transformers'
``generate(use_mtp=True)`` on the same Ernie MoE checkpoint (one MTP layer, and two: step ``i``
on layer ``i``), whatever the loop, page size, chunking or prefix cache; with ``K > L`` (the last
layer reused) they equal a from-scratch recomputation with transformers' modules and no cache.
Drafts do not change the output (verification is lossless), so these comparisons are what
catch a layer run at the wrong step, a chain value taken from the wrong position, a boundary
feature lost at a chunk or cache boundary, or a layer that sees positions it must not.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import checked_config, run_checked
from mtp_oracle import (
    MtpCheckpoints,
    RecordingMtp,
    hf_mtp_rounds,
    make_mtp_checkpoints,
    unpaged_chain,
    unpaged_drafts,
)
from transformers.modeling_layers import MtpModel

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine

PROMPTS = (
    (3, 14, 15, 92, 65, 35, 89),
    (79, 32),
    (38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93),
    (7,),
)
NEW_TOKENS = 14


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> MtpCheckpoints:
    """Ernie MoE targets with one and with two MTP layers."""
    return make_mtp_checkpoints(tmp_path_factory.mktemp("mtp_drafts"))


def serve(
    ckpt: MtpCheckpoints, target: Path, prompts: Sequence[Sequence[int]], **options: Any
) -> tuple[RecordingMtp, list[list[int]]]:
    """Serve ``prompts`` with a recording ``mtp`` worker, every check on."""
    num_steps = options.pop("num_steps", None)
    worker = RecordingMtp(target=target, num_steps=num_steps)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=checked_config(**options)) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        run_checked(engine)
    return worker, [list(r.emitted_ids) for r in reqs]


CONFIGS = [
    pytest.param({"overlap": False, "page_size": 1}, id="normal-page1"),
    pytest.param(
        {"overlap": True, "page_size": 16, "chunked_prefill": 4}, id="overlap-page16-chunked"
    ),
    pytest.param({"overlap": True, "page_size": 4, "prefix_cache": True}, id="overlap-prefix"),
]


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("options", CONFIGS)
def test_drafts_and_accepts_equal_transformers_mtp_generation(
    ckpt: MtpCheckpoints, layers: int, options: dict[str, object]
) -> None:
    """Round by round, the same drafts and accept lengths as ``generate(use_mtp=True)``."""
    hf, target = (ckpt.hf_single, ckpt.single) if layers == 1 else (ckpt.hf_multi, ckpt.multi)
    prompts = [*PROMPTS, PROMPTS[0] + (5, 5)] if options.get("prefix_cache") else list(PROMPTS)
    if layers > 1:  # transformers' multi-layer path fails on a one-token prompt (its own bug)
        prompts = [p for p in prompts if len(p) > 1]
    worker, outputs = serve(ckpt, target, prompts, **options)
    accepts = []
    for i, prompt in enumerate(prompts):
        oracle = hf_mtp_rounds(hf, prompt, NEW_TOKENS)
        assert outputs[i] == oracle.tokens
        ours = worker.rounds[f"p{i}"]
        # Under overlap one more round may run after the last one that counted; transformers
        # crops its last round's accepts at the length limit, so that one is compared as <=.
        assert [r.drafts for r in ours[: len(oracle.drafts)]] == oracle.drafts
        got = [r.accept - 1 for r in ours[: len(oracle.accepted)]]
        assert got[:-1] == oracle.accepted[:-1] and got[-1] >= oracle.accepted[-1]
        accepts += [r.accept for r in ours[: len(oracle.drafts) - 1]]
    assert 1 < sum(accepts) / len(accepts) < layers + 1  # real, partial acceptance
    assert max(accepts) == layers + 1


@pytest.mark.parametrize(
    ("layers", "num_steps", "mixed"), [(1, 3, False), (2, 3, False), (2, 2, True)]
)
def test_drafts_equal_an_unpaged_recomputation(
    ckpt: MtpCheckpoints, layers: int, num_steps: int, mixed: bool
) -> None:
    """K > L reuses the last layer, and mixed chunks make rounds transformers has no match for
    (a running request's 1-token extend): every round's drafts equal a from-scratch
    recomputation at its frontier."""
    hf, target = (ckpt.hf_single, ckpt.single) if layers == 1 else (ckpt.hf_multi, ckpt.multi)
    mtp = MtpModel.from_pretrained(hf, device_map={"": torch.device("cpu")})
    chunking = {"chunked_prefill": 4, "mixed_chunk": True} if mixed else {}
    worker, outputs = serve(
        ckpt, target, PROMPTS[:3], overlap=True, page_size=16, num_steps=num_steps, **chunking
    )
    assert worker.capabilities.num_draft_tokens == num_steps + 1
    accepts = []
    for i, prompt in enumerate(PROMPTS[:3]):
        sequence = list(prompt) + outputs[i]
        for r in worker.rounds[f"p{i}"]:
            if r.start >= len(sequence):
                break  # the round in flight past the end (overlap)
            assert r.drafts == unpaged_drafts(hf, mtp, sequence[: r.start + 1], num_steps)
            accepts.append(r.accept)
    assert 1 < sum(accepts) / len(accepts) < num_steps + 1


@pytest.mark.parametrize("options", [*CONFIGS[1:], {"chunked_prefill": 3, "mixed_chunk": True}])
def test_the_feature_store_holds_the_true_chain_below_every_frontier(
    ckpt: MtpCheckpoints, options: dict[str, object]
) -> None:
    """At every decode round, the stored ``g_(k-1)`` of each position below the frontier equals
    a from-scratch recomputation: chunk boundaries, mixed tails and prefix-cache hits included
    (a boundary value lost there changes little in the drafts, so it is checked here)."""
    mtp = MtpModel.from_pretrained(ckpt.hf_multi, device_map={"": torch.device("cpu")})
    prompts = [*PROMPTS[:3], (*PROMPTS[2][:9], 1, 2)]
    worker, outputs = serve(ckpt, ckpt.multi, prompts, **options)
    sequences = {f"p{i}": list(p) + outputs[i] for i, p in enumerate(prompts)}
    checked = 0
    for rid, stored in worker.stores:
        if stored.shape[1] > len(sequences[rid]):
            continue  # the round in flight past the end (overlap)
        truth = unpaged_chain(ckpt.hf_multi, mtp, sequences[rid][: stored.shape[1]])
        for k, values in enumerate(truth):
            rows = slice(k, None)  # g_(k-1) is defined from position k on
            assert torch.allclose(stored[k, rows], values[rows], atol=1e-4), (rid, k)
        checked += 1
    assert checked >= 20
