"""Sampling values at the edge of what the sampler computes in (float32), through a real engine.

* A value the sampler cannot hold (an int past the float range, a temperature or a penalty that
  float32 turns into 0 or inf) is refused at `Engine.submit` with `InvalidRequest` naming the
  field; nothing changes.
* A legal but extreme value never ends other requests: the smallest float32 temperature samples
  its limit (the greedy tokens), a ``top_k`` far past the vocabulary keeps every token, and a
  row whose penalties overflow into NaN ends alone with ERROR while its batch mates emit exactly
  Hugging Face ``generate()``'s tokens.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from engine_driver import run_checked
from hf_oracle import greedy, make_checkpoint
from spec_checkpoints import SpecCheckpoints
from transformers import LlamaForCausalLM

from specstate import FinishReason, InvalidRequest, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.reference.workers import default_registry

CLEAN = (3, 14, 15, 92, 65, 35, 89)
OVERFLOWS = (79, 32)  # with the penalties below its processed logits become NaN at decode
NEW_TOKENS = 12
TINY_T = 1.1754943508222875e-38  # the smallest normal float32
EXTREME: dict[str, Any] = {"repetition_penalty": TINY_T, "frequency_penalty": 3.4e38}


def _engine(ckpt: SpecCheckpoints, algorithm: str, *, overlap: bool, topk: int = 1) -> Engine:
    options: dict[str, object] = {"target": ckpt.target}
    if algorithm != "none":
        options.update(num_steps=3, topk=topk)
    if algorithm == "eagle":
        options["eagle"] = ckpt.eagle
    if algorithm == "draft_model":  # the drafter applies the controls to its own logits too
        options["draft"] = ckpt.draft
    if algorithm == "ngram":
        options.pop("topk")
    worker = default_registry().create(algorithm, **options)
    return Engine(
        worker,
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(
            overlap=overlap, kv_tokens=1024, check_invariants=True, check_ownership=True
        ),
    )


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temperature": 10**400}, "temperature must be a finite number >= 0, got 1000"),
        ({"temperature": 1e-40}, r"temperature .* got 1e-40 \(0 for greedy, else in \[1.18e-38"),
        ({"temperature": 3.5e38}, "temperature .* the sampler computes in float32"),
        ({"repetition_penalty": 1e-40}, "repetition_penalty must be a finite number > 0, got"),
        ({"repetition_penalty": 10**400}, "repetition_penalty must be a finite number > 0"),
        ({"frequency_penalty": 1e39}, r"frequency_penalty .* got 1e\+39 \(in \[-3.4e\+38"),
        ({"presence_penalty": -(10**400)}, "presence_penalty must be a finite number, got -1000"),
        ({"top_p": 10**400}, r"top_p must be a number in \(0, 1\], got 1000"),
        (
            {"min_new_tokens": 2, "stop_token_ids": frozenset(range(97))},
            "all 97 tokens of the vocabulary are stop tokens",
        ),
    ],
)
def test_a_value_the_sampler_cannot_hold_is_refused_at_submit(
    partial_ckpt: SpecCheckpoints, fields: dict[str, object], message: str
) -> None:
    """InvalidRequest naming the field (never OverflowError); the engine is unchanged."""
    with _engine(partial_ckpt, "none", overlap=False) as engine:
        with pytest.raises(InvalidRequest, match=message):
            engine.submit("x", [1, 2], SamplingParams(max_new_tokens=4, **fields))  # type: ignore[arg-type]
        assert engine.is_idle and engine.snapshot().num_waiting == 0
        req = engine.submit("x", [1, 2], SamplingParams(max_new_tokens=4))  # the id is free
        engine.run_until_idle()
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(("algorithm", "topk"), [("none", 1), ("eagle", 2)])
def test_the_smallest_temperature_samples_its_limit_beside_other_requests(
    partial_ckpt: SpecCheckpoints, algorithm: str, topk: int, overlap: bool
) -> None:
    """T = 1.18e-38 (logits / T overflow float32): greedy's tokens, seeded or not; nobody fails."""
    want = greedy(partial_ckpt.hf, CLEAN, NEW_TOKENS)
    with _engine(partial_ckpt, algorithm, overlap=overlap, topk=topk) as engine:
        reqs = [
            engine.submit("greedy", CLEAN, SamplingParams(max_new_tokens=NEW_TOKENS)),
            engine.submit(
                "tiny", CLEAN, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TINY_T)
            ),
            engine.submit(
                "tiny-seeded",
                CLEAN,
                SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TINY_T, seed=3),
            ),
            engine.submit(  # a top_k far past the vocabulary keeps every token
                "wide-top-k",
                CLEAN,
                SamplingParams(max_new_tokens=NEW_TOKENS, temperature=TINY_T, top_k=10**30),
            ),
        ]
        run_checked(engine, max_steps=200)
    for req in reqs:
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH, req.finish
        assert list(req.emitted_ids) == want, req.request_id


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize(
    ("algorithm", "topk"),
    [("none", 1), ("eagle", 2), ("draft_model", 1)],  # no drafts, a tree, a chain
)
def test_a_row_whose_penalties_overflow_ends_alone(
    partial_ckpt: SpecCheckpoints, algorithm: str, topk: int, overlap: bool
) -> None:
    """Legal penalties whose float32 arithmetic gives NaN end that row (greedy or sampled) with
    ERROR and a valid prefix; the clean request in the same batches is exact."""
    with _engine(partial_ckpt, algorithm, overlap=overlap, topk=topk) as engine:
        clean = engine.submit("clean", CLEAN, SamplingParams(max_new_tokens=NEW_TOKENS))
        poisoned = [  # sampled near T = 0 they follow the greedy path into the overflow
            engine.submit(f"nan-{i}", OVERFLOWS, SamplingParams(max_new_tokens=12, **fields))
            for i, fields in enumerate(
                [
                    EXTREME,
                    {**EXTREME, "temperature": TINY_T},
                    {**EXTREME, "temperature": TINY_T, "seed": 4},
                ]
            )
        ]
        run_checked(engine, max_steps=200)
    assert clean.finish is not None and clean.finish.reason is FinishReason.LENGTH
    assert list(clean.emitted_ids) == greedy(partial_ckpt.hf, CLEAN, NEW_TOKENS)
    for req in poisoned:
        assert req.finish is not None and req.finish.reason is FinishReason.ERROR, req.finish
        assert "marked the row invalid" in req.finish.detail
        assert len(req.emitted_ids) < 12 and all(0 <= t < 97 for t in req.emitted_ids)


@pytest.fixture(scope="module")
def loud(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, LlamaForCausalLM]:
    """A tiny target whose logits reach about 100 (an lm_head scaled up), as real models' do."""
    root = tmp_path_factory.mktemp("loud")
    hf = make_checkpoint(root, seed=5, layers=1)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40.0)
    hf.save_pretrained(root)
    return root, hf


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["none", "ngram"])
def test_a_logit_that_overflows_at_the_first_token_ends_nobody(
    loud: tuple[Path, LlamaForCausalLM], algorithm: str, overlap: bool
) -> None:
    """The smallest repetition penalty turns a seen token's logit into +inf at the prefill's
    token: it stays the likeliest token (greedy or sampled), and no request fails."""
    root, hf = loud
    options: dict[str, object] = {"num_steps": 3} if algorithm == "ngram" else {}
    worker = default_registry().create(algorithm, target=root, **options)
    config = EngineConfig(overlap=overlap, kv_tokens=1024, check_invariants=True)
    limits = RequestLimits(vocab_size=97, max_context_len=64)
    with Engine(worker, limits=limits, config=config) as engine:
        clean = engine.submit("clean", CLEAN, SamplingParams(max_new_tokens=NEW_TOKENS))
        variants: list[dict[str, Any]] = [
            {"repetition_penalty": TINY_T},
            {"repetition_penalty": TINY_T, "temperature": 0.7},
            {"repetition_penalty": TINY_T, "temperature": 0.7, "seed": 2},
        ]
        loud_rows = [
            engine.submit(f"loud-{i}", CLEAN, SamplingParams(max_new_tokens=6, **fields))
            for i, fields in enumerate(variants)
        ]
        run_checked(engine, max_steps=200)
    assert list(clean.emitted_ids) == greedy(hf, CLEAN, NEW_TOKENS)
    for req in [clean, *loud_rows]:
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH, req.finish
    # the first token is a prompt token: the only ones whose logit the penalty raised
    assert all(req.emitted_ids[0] in CLEAN for req in loud_rows)
