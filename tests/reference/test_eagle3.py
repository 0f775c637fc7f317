"""``eagle3``: the head's files, and drafts equal to a plain unpaged recomputation.

Drafts do not change the output (verification is lossless), so what shows that the worker
relays and stores the right auxiliary hidden states (three target layers, exactly the accepted
position) is this: every chain round's drafts equal a from-scratch recomputation of the head
(`eagle3_oracle.dense_eagle3_drafts`: transformers' target, the head's math in plain torch, no
cache), whatever the loop, page size, chunking or prefix cache; and the feature store holds the
target's true auxiliary states below every frontier.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from eagle3_oracle import (
    Eagle3Checkpoints,
    dense_eagle3_drafts,
    make_eagle3_checkpoints,
    target_aux,
)
from engine_driver import checked_config, run_checked
from safetensors.torch import load_file, save_file

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.core.errors import InvalidConfig
from specstate.engine.engine import Engine
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.eagle3_config import read_eagle3_config
from specstate.reference.eagle3_head import load_eagle3_head
from specstate.reference.workers import default_registry
from specstate.reference.workers.eagle3 import Eagle3Worker
from specstate.reference.workers.verify import DraftChain

PROMPTS = (
    (3, 14, 15, 92, 65, 35, 89),
    (79, 32),
    (38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93),
    (7,),
)
NEW_TOKENS = 14
STEPS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Eagle3Checkpoints:
    """A three-layer target and its EAGLE-3 head (trained briefly on the target)."""
    return make_eagle3_checkpoints(tmp_path_factory.mktemp("eagle3"))


class RecordingEagle3(Eagle3Worker):
    """The ``eagle3`` worker, recording every chain round's drafts and the store below S."""

    def __init__(self, **options: Any) -> None:
        super().__init__(**options)
        self.rounds: list[tuple[str, int, list[int], torch.Tensor]] = []

    def _propose(self, batch: ForwardBatch, start: torch.Tensor, roots: torch.Tensor) -> DraftChain:
        chain = super()._propose(batch, start, roots)
        table = self._target.req_to_token
        for i, rid in enumerate(batch.request_ids):
            s = int(start[i])
            stored = self.features[table[int(batch.req_pool_indices[i]), :s].long()].clone()
            self.rounds.append((rid, s, chain.tokens[i].tolist(), stored))
        return chain


def serve(
    ckpt: Eagle3Checkpoints, prompts: Sequence[Sequence[int]], **options: Any
) -> tuple[RecordingEagle3, dict[str, list[int]]]:
    """Serve ``prompts`` greedily with a recording worker, every check on; full sequences."""
    worker = RecordingEagle3(target=ckpt.target, eagle3=ckpt.eagle3, num_steps=STEPS)
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=checked_config(**options)) as engine:
        params = SamplingParams(max_new_tokens=NEW_TOKENS)
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        run_checked(engine)
        accept = engine.snapshot().metrics.mean_accept_length
    assert 1.0 < accept < STEPS + 1
    return worker, {
        f"p{i}": list(p) + list(r.emitted_ids)
        for i, (p, r) in enumerate(zip(prompts, reqs, strict=True))
    }


CONFIGS = [
    pytest.param({"overlap": False, "page_size": 1}, id="normal-page1"),
    pytest.param(
        {"overlap": True, "page_size": 16, "chunked_prefill": 4, "mixed_chunk": True},
        id="overlap-page16-chunked-mixed",
    ),
    pytest.param({"overlap": True, "page_size": 4, "prefix_cache": True}, id="overlap-prefix"),
]


@pytest.mark.parametrize("options", CONFIGS)
def test_drafts_equal_an_unpaged_recomputation_of_the_head(
    ckpt: Eagle3Checkpoints, options: dict[str, object]
) -> None:
    """Every chain round's drafts equal the head recomputed from scratch at its frontier."""
    prompts = [*PROMPTS, (*PROMPTS[2][:10], 4, 4)] if options.get("prefix_cache") else PROMPTS
    worker, sequences = serve(ckpt, prompts, **options)
    config = read_eagle3_config(ckpt.eagle3)
    checked = 0
    for rid, start, drafts, _ in worker.rounds:
        if start >= len(sequences[rid]):
            continue  # the round in flight past the end (overlap)
        want = dense_eagle3_drafts(ckpt.eagle3, config, ckpt.hf, sequences[rid][: start + 1], STEPS)
        assert drafts == want, (rid, start)
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("options", CONFIGS[1:])
def test_the_feature_store_holds_the_targets_aux_states(
    ckpt: Eagle3Checkpoints, options: dict[str, object]
) -> None:
    """Below every frontier the store holds the outputs of target layers 0, 1 and 2 of each
    position (chunk boundaries, mixed tails and cache hits included)."""
    prompts = [*PROMPTS, (*PROMPTS[2][:10], 4, 4)]
    worker, sequences = serve(ckpt, prompts, **options)
    for rid, start, _, stored in worker.rounds:
        if start > len(sequences[rid]) or start == 0:
            continue
        truth = target_aux(ckpt.hf, sequences[rid][:start], ckpt.aux_layer_ids)
        assert torch.allclose(stored, truth, atol=1e-4), (rid, start)


def edited_head(ckpt: Eagle3Checkpoints, root: Path, **config: object) -> Path:
    """A copy of the head with ``config`` merged into its config.json."""
    shutil.copytree(ckpt.eagle3, root)
    raw = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**raw, **config}))
    return root


def test_head_round_trips_in_the_sglang_format(ckpt: Eagle3Checkpoints) -> None:
    """config.json names the architecture and the aux layers; d2t maps onto distinct ids."""
    raw = json.loads((ckpt.eagle3 / "config.json").read_text())
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}
    head = load_eagle3_head(ckpt.eagle3, load_paged_llama(ckpt.target, num_token_slots=4))
    ids = head.target_ids()
    assert ids.shape == (raw["draft_vocab_size"],) and len(set(ids.tolist())) == ids.numel()
    assert int(head.t2d.sum()) == ids.numel() and bool(head.t2d[ids].all())


def test_a_bad_head_is_refused(ckpt: Eagle3Checkpoints, tmp_path: Path) -> None:
    """Wrong architecture, a d2t mapping two ids onto one, and aux layers the target lacks."""
    target = load_paged_llama(ckpt.target, num_token_slots=4)
    arch = edited_head(ckpt, tmp_path / "arch", architectures=["LlamaForCausalLMEagle"])
    with pytest.raises(InvalidConfig, match=r"field 'architectures'.*LlamaForCausalLMEagle3"):
        load_eagle3_head(arch, target)
    dup = edited_head(ckpt, tmp_path / "dup")
    tensors = load_file(dup / "model.safetensors")
    tensors["d2t"] = torch.zeros_like(tensors["d2t"])  # every draft id -> target i: fine
    tensors["d2t"][1] = -1  # draft id 1 -> target 0, as draft id 0
    save_file(tensors, str(dup / "model.safetensors"))
    with pytest.raises(InvalidConfig, match=r"tensor 'd2t' maps .* onto one target id twice"):
        load_eagle3_head(dup, target)
    deep = edited_head(
        ckpt, tmp_path / "deep", eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 1, 7]}
    )
    with pytest.raises(InvalidConfig, match=r"target layers \[0, 1, 7\] but the target has 3"):
        default_registry().create("eagle3", target=ckpt.target, eagle3=deep)
    no_ids = edited_head(ckpt, tmp_path / "default", eagle_config=None)
    with pytest.raises(InvalidConfig, match=r"target layers \[1, 0, -1\]"):  # SGLang's default
        default_registry().create("eagle3", target=ckpt.target, eagle3=no_ids)
