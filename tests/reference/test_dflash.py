"""DFLASH: the paged assistant and the worker against transformers' DFlash generation.

The assistant is distilled from the target (`block_checkpoints`), so it agrees with it partly:
the rounds compared hold rejections, partial runs and whole blocks.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from block_checkpoints import BLOCK_SIZE, BlockCheckpoints
from block_rounds import serve_recorded
from dflash_oracle import DFlashRound, assistant_config, hf_dflash_rounds
from hf_oracle import greedy
from safetensors.torch import load_file, save_file
from spec_checkpoints import MIXED_PROMPTS
from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantModel

from specstate import InvalidConfig, SamplingParams
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.dflash_checkpoint import load_dflash_assistant
from specstate.reference.layer_tap import LayerTap
from specstate.reference.model import AttentionBatch

NEW_TOKENS = 24


def _uncropped(rounds: list[DFlashRound], max_new_tokens: int) -> list[DFlashRound]:
    """transformers' rounds before the length cap could crop one (the prefill emits one)."""
    kept, emitted = [], 1
    for r in rounds:
        emitted += r.accept_len
        if emitted >= max_new_tokens:
            break
        kept.append(r)
    return kept


def test_the_paged_assistant_equals_transformers(
    tmp_path: Path, block_ckpt: BlockCheckpoints
) -> None:
    """Context from the tapped target (its last layer after the norm), materialized, then a
    block draft: the logits equal transformers' assistant fed transformers' hidden states."""
    torch.manual_seed(4)
    config = assistant_config(97, 32, block_size=5, layer_ids=(1, 0), num_layers=2)
    hf_assistant = MuseGlimmerAssistantModel(config)
    with torch.no_grad():  # norms away from 1, so a missed norm shows
        for p in hf_assistant.parameters():
            p.add_(0.3 * torch.randn_like(p))
    hf_assistant.save_pretrained(tmp_path / "assistant")
    prompt = [5, 17, 3, 88, 41, 41, 9]
    target = load_paged_llama(block_ckpt.target, num_token_slots=64)
    assistant = load_dflash_assistant(tmp_path / "assistant", target, num_token_slots=64)
    table = torch.zeros(2, 32, dtype=torch.int64)
    table[1] = torch.arange(1, 33)
    n = len(prompt)
    tap = LayerTap(target, (1, 0))
    target(_extend(table, prompt, 0))
    assistant.materialize(tap.take(), torch.arange(n), table[1, :n])
    block = [60] + [96] * 4
    ours = assistant(_extend(table, block, n))[0]
    with torch.no_grad():
        hidden = block_ckpt.hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        context = torch.cat([hidden[2], hidden[1]], -1)  # hidden[2]: after the final norm
        embed = block_ckpt.hf.get_input_embeddings()
        out = hf_assistant(
            noise_embeds=embed(torch.tensor([block])),
            context_hidden_states=context,
            position_ids=torch.arange(n + 5)[None],
            use_cache=False,
        ).last_hidden_state
        want = block_ckpt.hf.lm_head(out[:, 1:])[0]
    torch.testing.assert_close(ours, want, rtol=1e-4, atol=1e-4)


def _extend(table: torch.Tensor, tokens: list[int], start: int) -> AttentionBatch:
    """Request slot 1's ``tokens`` at positions ``start ..`` (slot = position + 1)."""
    width = len(tokens)
    return AttentionBatch(
        input_ids=torch.tensor(tokens),
        positions=torch.arange(start, start + width),
        out_cache_loc=table[1, start : start + width],
        req_pool_indices=torch.tensor([1]),
        req_to_token=table,
        prefix_lens=torch.tensor([start]),
        extend_lens=torch.tensor([width]),
    )


@pytest.mark.parametrize(
    ("overlap", "page_size", "chunked_prefill"), [(False, 1, None), (True, 16, 3)]
)
def test_drafts_and_accept_lengths_equal_transformers(
    block_ckpt: BlockCheckpoints, overlap: bool, page_size: int, chunked_prefill: int | None
) -> None:
    """Every round's drafts and accept length equal transformers' DFlash generation, the
    tokens equal plain greedy generate(), and acceptance is real: 1 < mean accept < block.

    No mixed chunks here: a running request that rides a prefill batch decodes one token
    without drafting, a round transformers does not have (the lossless tests cover them)."""
    served = serve_recorded(
        block_ckpt.worker("dflash", check_commit_order=True),
        MIXED_PROMPTS,
        vocab_size=97,
        max_new_tokens=NEW_TOKENS,
        overlap=overlap,
        page_size=page_size,
        chunked_prefill=chunked_prefill,
    )
    assistant = block_ckpt.hf_assistant()
    compared = []
    for i, prompt in enumerate(MIXED_PROMPTS):
        tokens, rounds = hf_dflash_rounds(block_ckpt.hf, assistant, prompt, NEW_TOKENS)
        assert served.outputs[i] == tokens == greedy(block_ckpt.hf, prompt, NEW_TOKENS)
        want = [(r.drafts, r.accept_len) for r in _uncropped(rounds, NEW_TOKENS)]
        ours = [(r.proposed, r.accept_len) for r in served.rounds[f"p{i}"]]
        assert ours[: len(want)] == want, f"request p{i}"
        compared += [accept for _, accept in want]
    assert {1, BLOCK_SIZE} <= set(compared) and any(1 < a < BLOCK_SIZE for a in compared)
    assert 1.0 < served.mean_accept < BLOCK_SIZE


def _edited(source: Path, root: Path, **fields: object) -> Path:
    """A copy of the assistant at ``source`` with ``fields`` replaced in its config."""
    shutil.copytree(source, root)
    raw = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**raw, **fields}))
    return root


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"model_type": "llama"}, "field 'model_type' is 'llama'"),
        (
            {"layer_types": ["sliding_attention"], "sliding_window": 8},
            "layer 0 is 'sliding_attention' with sliding_window 8 below max_position_embeddings",
        ),
        ({"target_layer_ids": [0, 5]}, r"reads target layers \[0, 5\] but the target has layers"),
        ({"mask_token_id": 97}, "mask_token_id 97 outside the vocabulary of 97"),
        ({"rope_parameters": {"rope_type": "yarn"}}, "default RoPE only"),
    ],
)
def test_a_bad_assistant_config_is_refused_naming_the_file(
    tmp_path: Path, block_ckpt: BlockCheckpoints, fields: dict[str, object], match: str
) -> None:
    """Each refused config names the assistant's config.json and the numbers."""
    edited = _edited(block_ckpt.assistant, tmp_path / "bad", **fields)
    with pytest.raises(InvalidConfig, match=match) as caught:
        BlockCheckpoints(
            target=block_ckpt.target,
            assistant=edited,
            adapter=block_ckpt.adapter,
            hf=block_ckpt.hf,
            vocab_size=97,
        ).worker("dflash")
    assert "bad" in str(caught.value)


def test_num_steps_outside_the_block_and_a_missing_tensor_are_refused(
    tmp_path: Path, block_ckpt: BlockCheckpoints
) -> None:
    """num_steps must leave the bonus in the block; the weights must hold every tensor."""
    with pytest.raises(InvalidConfig, match=r"num_steps 4 outside \[1, 3\]"):
        block_ckpt.worker("dflash", num_steps=4)
    broken = _edited(block_ckpt.assistant, tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    del tensors["encoder.fc.weight"]
    save_file(tensors, str(broken / "model.safetensors"))
    target = load_paged_llama(block_ckpt.target, num_token_slots=8)
    with pytest.raises(InvalidConfig, match="missing tensor 'encoder.fc.weight'"):
        load_dflash_assistant(broken, target)


def test_a_request_with_speculation_off_decodes_plainly(block_ckpt: BlockCheckpoints) -> None:
    """speculative=False rows share rounds with drafting ones: one exact token each round."""
    params = [
        SamplingParams(max_new_tokens=NEW_TOKENS, speculative=i % 2 == 1)
        for i in range(len(MIXED_PROMPTS))
    ]
    served = serve_recorded(
        block_ckpt.worker("dflash", check_commit_order=True),
        MIXED_PROMPTS,
        vocab_size=97,
        max_new_tokens=NEW_TOKENS,
        params=params,
        overlap=True,
    )
    for i, prompt in enumerate(MIXED_PROMPTS):
        assert served.outputs[i] == greedy(block_ckpt.hf, prompt, NEW_TOKENS)
        lens = {r.accept_len for r in served.rounds[f"p{i}"]}
        assert lens == {1} if i % 2 == 0 else max(lens) > 1, (i, lens)


@pytest.mark.parametrize("num_steps", [1, 2, 3])
def test_the_reservation_covers_the_whole_block(
    block_ckpt: BlockCheckpoints, num_steps: int
) -> None:
    """A draft writes its scratch K/V over the whole block, whatever it verifies: the window
    the engine reserves (L per round, 2L from the committed length) spans the block."""
    caps = block_ckpt.worker("dflash", num_steps=num_steps).capabilities
    assert (caps.num_steps, caps.max_accept, caps.num_draft_tokens) == (
        num_steps,
        num_steps + 1,
        BLOCK_SIZE,
    )
    for page in (1, 16):
        assert caps.spec_window(page).alloc_len_per_decode >= BLOCK_SIZE
