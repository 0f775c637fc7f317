"""DSpark: the heads, the worker's drafts and confidences against a plain recomputation, and the
assistant loader.

The plain recomputation is unpaged: transformers' DFlash assistant on the target's hidden
states (`dspark_checkpoints.block_states`), then the heads' formulas written out on the tensors
read straight from the checkpoint file; the worker's drafts must equal it token for token and
its reported confidences value for value, every round of every request.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from block_checkpoints import BlockCheckpoints
from block_rounds import serve_recorded
from dspark_checkpoints import block_states, make_dspark_assistant
from hf_oracle import greedy
from safetensors.torch import load_file, save_file
from spec_checkpoints import MIXED_PROMPTS

from specstate import InvalidConfig
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.dspark_checkpoint import (
    load_dspark_assistant,
    read_dspark_config,
    save_dspark_assistant,
)
from specstate.reference.dspark_heads import DSparkHeadConfig, DSparkHeads, MarkovVariant
from specstate.reference.workers import default_registry

NEW_TOKENS = 20


@pytest.fixture(scope="module")
def gated_assistant(block_ckpt: BlockCheckpoints, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A DSpark assistant with a gated Markov head, fitted like the vanilla one."""
    torch.set_num_threads(1)
    return make_dspark_assistant(
        block_ckpt, tmp_path_factory.mktemp("gated") / "assistant", variant="gated"
    )


def _random_heads(variant: MarkovVariant, seed: int) -> DSparkHeads:
    config = DSparkHeadConfig(vocab_size=11, hidden_size=6, markov_rank=3, markov_variant=variant)
    heads = DSparkHeads(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    return heads


@pytest.mark.parametrize("variant", ["vanilla", "gated"])
def test_the_heads_compute_their_formulas(variant: MarkovVariant) -> None:
    """Markov bias ``B @ A[prev]`` (times ``sigmoid(g . h + g0)`` gated) and confidence
    ``sigmoid(w . h + w0)``, against the formulas on the raw tensors."""
    heads = _random_heads(variant, seed=3)
    w = {name: t.clone() for name, t in heads.state_dict().items()}
    prev, hidden = torch.tensor([0, 7, 10, 7]), torch.randn(4, 6)
    bias = w["markov_head.prev_embed.weight"][prev] @ w["markov_head.out_proj.weight"].T
    if variant == "gated":
        bias = bias * torch.sigmoid(
            hidden @ w["markov_head.gate.weight"].T + w["markov_head.gate.bias"]
        )
    torch.testing.assert_close(heads.markov_bias(prev, hidden), bias)
    assert float(bias.abs().min()) > 0  # a zeroed bias would not pass
    block = torch.randn(4, 3, 6)
    conf = torch.sigmoid(block @ w["confidence_head.weight"][0] + w["confidence_head.bias"][0])
    torch.testing.assert_close(heads.confidences(block), conf)
    assert heads.confidences(block).shape == (4, 3)


def _plain_round(
    ckpt: BlockCheckpoints,
    hf_assistant: Any,
    weights: dict[str, torch.Tensor],
    text: list[int],
    start: int,
    num_drafts: int,
) -> tuple[tuple[int, ...], list[float]]:
    """The drafts and confidences of a round at ``start`` (bonus ``text[start]``), unpaged."""
    hidden, base = block_states(ckpt, hf_assistant, torch.tensor([text[: start + 1]]), start)
    a, b = weights["markov_head.prev_embed.weight"], weights["markov_head.out_proj.weight"]
    prev, drafts, conf = text[start], [], []
    for i in range(num_drafts):
        h = hidden[0, i]
        bias = b @ a[prev]
        if "markov_head.gate.weight" in weights:
            gate = weights["markov_head.gate.weight"][0] @ h + weights["markov_head.gate.bias"][0]
            bias = torch.sigmoid(gate) * bias
        prev = int((base[0, i] + bias).argmax())
        drafts.append(prev)
        c = weights["confidence_head.weight"][0] @ h + weights["confidence_head.bias"][0]
        conf.append(float(torch.sigmoid(c)))
    return tuple(drafts), conf


@pytest.mark.parametrize(
    ("variant", "overlap", "page_size", "budget"),
    [
        ("vanilla", False, 1, None),
        ("vanilla", True, 16, "confidence"),
        ("gated", True, 1, None),
        ("gated", False, 16, "confidence"),
    ],
)
def test_drafts_and_confidences_equal_a_plain_recomputation(
    block_ckpt: BlockCheckpoints,
    dspark_assistant: Path,
    gated_assistant: Path,
    variant: str,
    overlap: bool,
    page_size: int,
    budget: str | None,
) -> None:
    """Every round's drafts equal the unpaged backbone + Markov head's sequential argmax and
    its reported confidences the confidence head on the same block (also when the verify
    budget cuts a row short: the draft does not depend on it); the heads change drafts."""
    assistant = dspark_assistant if variant == "vanilla" else gated_assistant
    served = serve_recorded(
        default_registry().create(
            "dspark", target=block_ckpt.target, assistant=assistant, check_commit_order=True
        ),
        MIXED_PROMPTS,
        vocab_size=97,
        max_new_tokens=NEW_TOKENS,
        overlap=overlap,
        page_size=page_size,
        verify_budget=budget,
    )
    hf_assistant = block_ckpt.hf_assistant()
    weights = load_file(str(assistant / "model.safetensors"))
    changed = compared = 0
    for i, prompt in enumerate(MIXED_PROMPTS):
        out = greedy(block_ckpt.hf, list(prompt), NEW_TOKENS)
        assert served.outputs[i] == out
        text = [*prompt, *out]
        # under overlap a round may run past the length cap; its tokens are discarded
        for r in (r for r in served.rounds[f"p{i}"] if r.start < len(text)):
            assert text[r.start] == r.bonus
            drafts, conf = _plain_round(
                block_ckpt, hf_assistant, weights, text, r.start, len(r.proposed)
            )
            assert r.proposed == drafts, (i, r.start)
            assert r.confidences is not None
            torch.testing.assert_close(torch.tensor(r.confidences), torch.tensor(conf))
            plain = _plain_round(block_ckpt, hf_assistant, _no_markov(weights), text, r.start, 3)
            changed += plain[0] != drafts
            compared += 1
    assert compared > 20 and 0 < changed < compared  # the Markov head matters, not always


def _no_markov(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        **weights,
        "markov_head.out_proj.weight": torch.zeros_like(weights["markov_head.out_proj.weight"]),
    }


def test_the_worker_reports_confidences_and_dflash_does_not(
    block_ckpt: BlockCheckpoints, dspark_assistant: Path
) -> None:
    """``dspark`` declares its confidences (what ConfidenceBudget needs); ``dflash`` on the
    same directory (its backbone) does not, and the DSpark heads are set aside there."""
    registry = default_registry()
    dspark = registry.create("dspark", target=block_ckpt.target, assistant=dspark_assistant)
    caps = dspark.capabilities
    assert caps.algorithm == "dspark" and caps.reports_draft_confidences
    assert caps.supports_verify_budgets
    assert not block_ckpt.worker("dflash").capabilities.reports_draft_confidences


def _copy(source: Path, root: Path, **fields: object) -> Path:
    shutil.copytree(source, root)
    raw = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**raw, **fields}))
    return root


@pytest.mark.parametrize(
    ("edit", "match"),
    [
        ("drop", "missing tensor 'confidence_head.weight'"),
        (
            "reshape",
            r"tensor 'markov_head.prev_embed.weight' has shape \(97, 4\), expected \(97, 8\)",
        ),
        ("extra", "unexpected tensor 'markov_head.rnn.weight'"),
    ],
)
def test_missing_and_misshapen_head_weights_are_refused(
    tmp_path: Path, block_ckpt: BlockCheckpoints, dspark_assistant: Path, edit: str, match: str
) -> None:
    """The loader names the file and the tensor (InvalidConfig), before building anything."""
    broken = _copy(dspark_assistant, tmp_path / "broken")
    tensors = load_file(str(broken / "model.safetensors"))
    if edit == "drop":
        del tensors["confidence_head.weight"]
    elif edit == "reshape":
        tensors["markov_head.prev_embed.weight"] = tensors["markov_head.prev_embed.weight"][
            :, :4
        ].contiguous()
    else:
        tensors["markov_head.rnn.weight"] = torch.zeros(2)
    save_file(tensors, str(broken / "model.safetensors"))
    target = load_paged_llama(block_ckpt.target, num_token_slots=8)
    with pytest.raises(InvalidConfig, match=match) as caught:
        load_dspark_assistant(broken, target)
    assert "broken" in str(caught.value)


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"markov_rank": None}, "missing field 'markov_rank'"),
        ({"markov_rank": 0}, "markov_rank must be >= 1, got 0"),
        ({"markov_head_type": "rnn"}, "field 'markov_head_type' is 'rnn'"),
        ({"model_type": "llama"}, "field 'model_type' is 'llama'"),
    ],
)
def test_a_bad_dspark_config_is_refused_naming_the_file(
    tmp_path: Path,
    block_ckpt: BlockCheckpoints,
    dspark_assistant: Path,
    fields: dict[str, object],
    match: str,
) -> None:
    """The worker refuses the directory at construction, naming its config.json."""
    edited = _copy(dspark_assistant, tmp_path / "bad", **fields)
    with pytest.raises(InvalidConfig, match=match) as caught:
        default_registry().create("dspark", target=block_ckpt.target, assistant=edited)
    assert "bad" in str(caught.value)


def test_a_dflash_assistant_is_not_a_dspark_one(block_ckpt: BlockCheckpoints) -> None:
    """Without the heads' config the directory is refused (the heads would be missing)."""
    with pytest.raises(InvalidConfig, match="missing field 'markov_rank'"):
        default_registry().create(
            "dspark", target=block_ckpt.target, assistant=block_ckpt.assistant
        )


def test_save_round_trips_and_refuses_heads_of_another_size(
    tmp_path: Path, block_ckpt: BlockCheckpoints
) -> None:
    """Saved heads load back equal; heads for another vocabulary are refused."""
    config = DSparkHeadConfig(vocab_size=97, hidden_size=32, markov_rank=2, markov_variant="gated")
    heads = DSparkHeads(config)
    save_dspark_assistant(tmp_path / "a", backbone=block_ckpt.assistant, heads=heads)
    assert read_dspark_config(tmp_path / "a")[1] == config
    target = load_paged_llama(block_ckpt.target, num_token_slots=8)
    _, loaded = load_dspark_assistant(tmp_path / "a", target)
    for name, tensor in heads.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    with pytest.raises(InvalidConfig, match="vocab_size 11 and hidden_size 6 differ"):
        save_dspark_assistant(
            tmp_path / "b", backbone=block_ckpt.assistant, heads=_random_heads("vanilla", 1)
        )
