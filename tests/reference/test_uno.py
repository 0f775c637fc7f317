"""UNO: drafts of the LoRA pathway against a plain computation, routing, and the tree sampler.

The adapter is distilled from the target (`block_checkpoints`), so routed rows accept drafts
beyond the root sometimes. The oracle of the drafts is `uno_oracle.pathway_logits`:
transformers' unpaged model over the whole sequence with the adapter added on the noise rows.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from block_checkpoints import NOISE_TOKEN, UNO_STEPS, BlockCheckpoints
from block_rounds import Served, serve_recorded
from hf_oracle import greedy
from safetensors.torch import load_file, save_file
from spec_checkpoints import MIXED_PROMPTS
from uno_oracle import adapter_scale, load_pairs, pathway_logits

from specstate import InvalidConfig, InvalidRequest, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.grammar.spec import Grammar
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.lora import LoraAdapter
from specstate.reference.workers.layout import chain_attention

NEW_TOKENS = 20


def _serve(worker: object, **options: Any) -> Served:
    return serve_recorded(
        worker,
        MIXED_PROMPTS,
        vocab_size=97,
        max_new_tokens=NEW_TOKENS,
        observer="chain_observer",
        **options,
    )


@pytest.mark.parametrize(
    ("overlap", "page_size", "chunking"), [(False, 1, (None, False)), (True, 16, (3, True))]
)
def test_drafts_equal_the_plain_lora_pathway(
    block_ckpt: BlockCheckpoints, overlap: bool, page_size: int, chunking: tuple[int | None, bool]
) -> None:
    """Every round's root and drafts are the argmax of transformers' unpaged model with the
    adapter on the noise rows; the tokens equal greedy generate(); drafts get accepted."""
    served = _serve(
        block_ckpt.worker("uno"),
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunking[0],
        mixed_chunk=chunking[1],
    )
    pairs = load_pairs(block_ckpt.adapter)
    accepts = []
    for i, prompt in enumerate(MIXED_PROMPTS):
        assert served.outputs[i] == greedy(block_ckpt.hf, prompt, NEW_TOKENS)
        settled = list(prompt) + served.outputs[i]
        for row in served.rounds[f"p{i}"]:
            if row.start >= len(settled):  # the overlap loop's round past the cap
                continue
            assert settled[row.start] == row.bonus
            sequence = settled[: row.start] + [row.bonus] + [NOISE_TOKEN] * (UNO_STEPS - 1)
            logits = pathway_logits(
                block_ckpt.hf, pairs, adapter_scale(block_ckpt.adapter), sequence, row.start + 1
            )
            assert row.proposed == tuple(logits[row.start :].argmax(-1).tolist()), f"p{i}"
            accepts.append(row.accept_len)
    assert min(accepts) >= 2 and max(accepts) > 2  # the root always, drafts sometimes


def test_a_request_with_speculation_off_decodes_plainly(block_ckpt: BlockCheckpoints) -> None:
    """Requests with speculative=False share rounds with routed ones: one exact token each
    round (no adapter on their rows); the routed ones accept the root and more."""
    params = [
        SamplingParams(max_new_tokens=NEW_TOKENS, speculative=i % 2 == 1)
        for i in range(len(MIXED_PROMPTS))
    ]
    served = serve_recorded(
        block_ckpt.worker("uno"),
        MIXED_PROMPTS,
        vocab_size=97,
        max_new_tokens=NEW_TOKENS,
        observer="chain_observer",
        params=params,
        overlap=True,
    )
    pairs = load_pairs(block_ckpt.adapter)
    for i, prompt in enumerate(MIXED_PROMPTS):
        assert served.outputs[i] == greedy(block_ckpt.hf, prompt, NEW_TOKENS)
        lens = {r.accept_len for r in served.rounds[f"p{i}"]}
        assert lens == {1} if i % 2 == 0 else min(lens) >= 2, (i, lens)
        # What each row drafted shows where the adapter went: nowhere for the plain rows.
        settled = list(prompt) + served.outputs[i]
        row = served.rounds[f"p{i}"][2]
        sequence = settled[: row.start] + [row.bonus] + [NOISE_TOKEN] * (UNO_STEPS - 1)
        routed = pairs if i % 2 == 1 else {}
        logits = pathway_logits(
            block_ckpt.hf, routed, adapter_scale(block_ckpt.adapter), sequence, row.start + 1
        )
        assert row.proposed == tuple(logits[row.start :].argmax(-1).tolist()), f"p{i}"


def test_a_worker_without_an_adapter_decodes_plainly(block_ckpt: BlockCheckpoints) -> None:
    """No adapter: nothing is drafted, one exact token per round."""
    served = _serve(block_ckpt.worker("uno", adapter=None))
    for i, prompt in enumerate(MIXED_PROMPTS):
        assert served.outputs[i] == greedy(block_ckpt.hf, prompt, NEW_TOKENS)
        assert {(r.proposed, r.accept_len) for r in served.rounds[f"p{i}"]} == {((), 1)}


def test_the_adapter_reaches_only_the_routed_rows_and_only_inside(
    block_ckpt: BlockCheckpoints,
) -> None:
    """Inside `applied`, the routed rows change and the others are bit-identical to the plain
    model; after it, the model is the plain model again."""
    model = load_paged_llama(block_ckpt.target, num_token_slots=16)
    adapter = LoraAdapter.load(block_ckpt.adapter, model)
    table = torch.zeros(2, 8, dtype=torch.int64)
    table[1] = torch.arange(1, 9)
    tokens = torch.tensor([[5, 9, 96, 96]])
    start = torch.tensor([0])
    plain = model(chain_attention(torch.tensor([1]), table, start, tokens)).logits
    rows = torch.tensor([False, False, True, True])
    with adapter.applied(rows):
        adapted = model(chain_attention(torch.tensor([1]), table, start, tokens)).logits
    after = model(chain_attention(torch.tensor([1]), table, start, tokens)).logits
    assert torch.equal(adapted[:2], plain[:2]) and not torch.allclose(adapted[2:], plain[2:])
    assert torch.equal(after, plain)
    assert len(adapter.module_names) == 14  # seven projections of both layers


def test_random_noise_rows_stay_lossless(block_ckpt: BlockCheckpoints) -> None:
    """Noise drawn from the worker's generator (no noise token): still exact."""
    served = _serve(block_ckpt.worker("uno", noise_token_id=None, seed=3), overlap=True)
    for i, prompt in enumerate(MIXED_PROMPTS):
        assert served.outputs[i] == greedy(block_ckpt.hf, prompt, NEW_TOKENS)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_tree_sampler_is_lossless(block_ckpt: BlockCheckpoints, overlap: bool) -> None:
    """topk 3: a tree of every position's best tokens, through the tree verification."""
    worker = block_ckpt.worker("uno", topk=3, num_draft_tokens=8)
    accepts: list[int] = []
    worker.observer = lambda verified: accepts.extend(verified.verdict.accept_lens.tolist())  # type: ignore[attr-defined]
    limits = RequestLimits(vocab_size=97, max_context_len=96)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(
        worker, limits=limits, config=EngineConfig(overlap=overlap, check_invariants=True)
    ) as engine:
        reqs = [engine.submit(f"t{i}", list(p), params) for i, p in enumerate(MIXED_PROMPTS)]
        engine.run_until_idle()
        with pytest.raises(InvalidRequest, match="grammar"):
            engine.submit("g", [1, 2], SamplingParams(grammar=Grammar.regex("[a-c]+")))
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert list(req.emitted_ids) == greedy(block_ckpt.hf, prompt, NEW_TOKENS)
    assert min(accepts) >= 2 and max(accepts) > 2


def _edited_adapter(source: Path, root: Path, **fields: object) -> Path:
    shutil.copytree(source, root)
    raw = json.loads((root / "adapter_config.json").read_text())
    (root / "adapter_config.json").write_text(json.dumps({**raw, **fields}))
    return root


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"use_dora": True}, "field 'use_dora' is True"),
        ({"bias": "all"}, "field 'bias' is 'all'"),
        ({"peft_type": "IA3"}, "field 'peft_type' is 'IA3'"),
        ({"r": 0}, "field 'r' must be an integer >= 1, got 0"),
        ({"r": 4}, r"'layers.0.mlp.down_proj' has lora_A \(8, 64\) .* expected \(4, 64\)"),
    ],
)
def test_a_bad_adapter_is_refused_naming_the_file(
    tmp_path: Path, block_ckpt: BlockCheckpoints, fields: dict[str, object], match: str
) -> None:
    """Each refused adapter names its file and the field or tensor."""
    bad = _edited_adapter(block_ckpt.adapter, tmp_path / "bad", **fields)
    model = load_paged_llama(block_ckpt.target, num_token_slots=8)
    with pytest.raises(InvalidConfig, match=match) as caught:
        LoraAdapter.load(bad, model)
    assert "bad" in str(caught.value)
    if "lora_A" not in match:  # the config is read when the worker is built
        with pytest.raises(InvalidConfig, match=match):
            block_ckpt.worker("uno", adapter=bad)


def test_a_pair_for_a_module_the_target_lacks_is_refused(
    tmp_path: Path, block_ckpt: BlockCheckpoints
) -> None:
    """A LoRA pair named for a layer the target does not have."""
    bad = _edited_adapter(block_ckpt.adapter, tmp_path / "bad")
    tensors = load_file(str(bad / "adapter_model.safetensors"))
    a = tensors["base_model.model.model.layers.0.mlp.up_proj.lora_A.weight"]
    tensors["base_model.model.model.layers.7.mlp.up_proj.lora_A.weight"] = a.clone()
    save_file(tensors, str(bad / "adapter_model.safetensors"))
    model = load_paged_llama(block_ckpt.target, num_token_slots=8)
    with pytest.raises(InvalidConfig, match="'layers.7.mlp.up_proj', a module the model lacks"):
        LoraAdapter.load(bad, model)
    with pytest.raises(InvalidConfig, match="noise_token_id 97 outside the vocabulary of 97"):
        block_ckpt.worker("uno", noise_token_id=97)
    with pytest.raises(InvalidConfig, match="a tree .* drafts through an adapter"):
        block_ckpt.worker("uno", adapter=None, topk=2)
