"""Sampled block drafting emits exactly the target's distribution (chi-square, p > 1e-3).

Thousands of short generations of one prompt through the engine with a tiny 16-token target
and block drafters that do not agree with it (a random DFlash assistant, a random UNO
adapter), compared with the target's exact filtered distributions (transformers' logits) token
by token, each given the ones before. The same harness with a verifier that accepts every
draft must fail it, so a pass means something. Seeds are fixed: the p-values are deterministic
on one machine.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from dflash_oracle import assistant_config
from hf_oracle import make_checkpoint
from sampling_oracle import chi_square, conditional_chi_square, exact_next_token
from transformers import LlamaForCausalLM
from transformers.models.muse_glimmer_assistant import MuseGlimmerAssistantModel
from uno_oracle import projection_names, save_adapter

from specstate import RequestLimits, SamplingParams
from specstate.engine.budgets import BudgetRows, SettledBudgets, VerifyBudgetPolicy
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.memory.host_arrays import IntArray
from specstate.reference.dspark_checkpoint import save_dspark_assistant
from specstate.reference.dspark_heads import DSparkHeadConfig, DSparkHeads
from specstate.reference.workers import ChainVerdict, TokenSampler, default_registry
from specstate.reference.workers import target as target_runner

VOCAB = 16
PROMPT = (3, 1, 4, 1, 5)
NUM_NEW = 3
NUM_SAMPLES = 3000
STRICT = 1e-3
BROKEN = 1e-6


@attrs.frozen
class Models:
    """A two-layer 16-token target, a random assistant (block 3) and a random adapter."""

    target: Path
    assistant: Path
    adapter: Path
    hf: LlamaForCausalLM


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """Checkpoints shared by the module."""
    root = tmp_path_factory.mktemp("block_sampling")
    hf = make_checkpoint(root / "target", seed=0, vocab_size=VOCAB, layers=2)
    torch.manual_seed(5)
    config = assistant_config(VOCAB, 32, block_size=3, layer_ids=(0, 1))
    MuseGlimmerAssistantModel(config).save_pretrained(root / "assistant")
    modules = dict(hf.named_modules())
    pairs = {}
    for name in projection_names(hf):
        linear = modules[name]
        assert isinstance(linear, torch.nn.Linear)
        a = torch.randn(4, linear.in_features) * 0.3
        pairs[name] = (a, torch.randn(linear.out_features, 4) * 0.3)
    save_adapter(pairs, rank=4, alpha=4.0, directory=root / "adapter")
    return Models(
        target=root / "target", assistant=root / "assistant", adapter=root / "adapter", hf=hf
    )


def _worker(models: Models, family: str) -> WorkerProtocol:
    options: dict[str, object] = {"target": models.target, "seed": 11}
    if family == "dflash":
        options["assistant"] = models.assistant
    else:
        options |= {"adapter": models.adapter, "num_steps": 2, "noise_token_id": VOCAB - 1}
    if family == "uno-tree":  # two levels of the 2 best tokens of each marginal, 4 nodes
        options |= {"topk": 2, "num_draft_tokens": 4}
        family = "uno"
    return default_registry().create(family, **options)


def _generate(
    worker: WorkerProtocol,
    params: SamplingParams,
    *,
    overlap: bool,
    verify_budget: VerifyBudgetPolicy | None = None,
    verified: list[tuple[int, ...]] | None = None,
) -> tuple[list[tuple[int, ...]], dict[int, int]]:
    """``NUM_SAMPLES`` requests of ``PROMPT``: their tokens and the accept-length histogram
    (``verified``, if given, receives each request's verified lengths)."""
    config = EngineConfig(
        overlap=overlap, kv_tokens=256 * 2 * 24, max_running=256, check_invariants=True
    )
    with Engine(
        worker,
        limits=RequestLimits(vocab_size=VOCAB, max_context_len=16),
        config=config,
        verify_budget=verify_budget,
    ) as engine:
        reqs = [engine.submit(f"s{i}", PROMPT, params) for i in range(NUM_SAMPLES)]
        engine.run_until_idle()
        histogram = dict(engine.snapshot().metrics.histogram)
    if verified is not None:
        verified += [r.verified_lengths for r in reqs]
    return [r.emitted_ids for r in reqs], histogram


def _min_p_value(models: Models, samples: list[tuple[int, ...]], params: SamplingParams) -> float:
    """The smallest p-value of the first three tokens against the exact distributions."""
    assert all(len(s) == NUM_NEW for s in samples)
    exact: dict[tuple[int, ...], list[float]] = {}
    for length in range(NUM_NEW):
        prefixes = list(itertools.product(range(VOCAB), repeat=length))
        exact |= exact_next_token(
            models.hf,
            PROMPT,
            prefixes,
            temperature=params.temperature,
            top_k=params.top_k or VOCAB,
            top_p=params.top_p,
        )
    first = chi_square(Counter(s[0] for s in samples), exact[()])
    later = [conditional_chi_square(samples, i, exact) for i in (1, 2)]
    return min(first.p_value, *(c.p_value for c in later))


T1 = SamplingParams(max_new_tokens=NUM_NEW, temperature=1.0)
FILTERED = SamplingParams(max_new_tokens=NUM_NEW, temperature=0.8, top_k=6, top_p=0.9)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("family", "params", "overlap"),
    [
        pytest.param("dflash", T1, True, id="dflash-T1-overlap"),
        pytest.param("dflash", FILTERED, False, id="dflash-topk-topp-normal"),
        pytest.param("uno", T1, False, id="uno-T1-normal"),
        pytest.param("uno", FILTERED, True, id="uno-topk-topp-overlap"),
        pytest.param("uno-tree", T1, True, id="uno-tree-T1-overlap"),
    ],
)
def test_sampled_tokens_follow_the_target_distribution(
    models: Models, family: str, params: SamplingParams, overlap: bool
) -> None:
    """Each of three tokens fits the target's filtered distribution; both a rejection at the
    first draft and a whole accepted block happen many times."""
    samples, histogram = _generate(_worker(models, family), params, overlap=overlap)
    assert _min_p_value(models, samples, params) > STRICT
    shortest = 2 if family == "uno" else 1  # a uno chain's root is the target's own draw
    longest = 2 if family == "uno-tree" else 3  # a tree rarely keeps a random second level
    assert histogram.get(shortest, 0) > 100 and histogram.get(longest, 0) > 100, histogram


def _always_accept(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampler: TokenSampler,
) -> ChainVerdict:
    """A broken verifier: accepts every draft, then samples the bonus from ``p_K``."""
    del draft_probs
    num_rows, num_steps = drafts.shape
    bonus = sampler.sample(target_probs[:, num_steps])
    return ChainVerdict(
        run_tokens=torch.cat([drafts, bonus[:, None]], dim=1),
        accept_lens=torch.full((num_rows,), num_steps + 1, dtype=torch.int64),
        bonus_tokens=bonus,
    )


@pytest.mark.slow
def test_the_same_harness_rejects_a_broken_verifier(
    models: Models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Accepting every block draft misfits the later tokens: p < 1e-6 (the test has power)."""
    monkeypatch.setattr(target_runner, "verify_sampled_chain", _always_accept)
    samples, _ = _generate(_worker(models, "dflash"), T1, overlap=True)
    assert _min_p_value(models, samples, T1) < BROKEN


class _ByRequest:
    """Ragged rows: request ``s<i>`` verifies ``i mod (width + 1)`` drafts every round."""

    def plan(self, rows: BudgetRows) -> IntArray:
        return np.array([int(r[1:]) % (rows.width + 1) for r in rows.request_ids], np.int64)

    def observe(self, settled: SettledBudgets) -> None:
        pass

    def forget(self, request_ids: Sequence[str]) -> None:
        pass


@pytest.mark.slow
@pytest.mark.parametrize(("params", "overlap"), [(T1, True), (FILTERED, False)])
def test_sampled_dspark_with_ragged_budgets_follows_the_target_distribution(
    models: Models, tmp_path: Path, params: SamplingParams, overlap: bool
) -> None:
    """DSpark (the random assistant with random Markov and confidence heads: each draft drawn
    from the biased distribution given the draft before it) with rows verifying 0, 1 or 2
    drafts in one batch: each of three tokens fits the target's filtered distribution."""
    gen = torch.Generator().manual_seed(8)
    heads = DSparkHeads(DSparkHeadConfig(vocab_size=VOCAB, hidden_size=32, markov_rank=4))
    with torch.no_grad():
        for p in heads.parameters():
            p.copy_(0.3 * torch.randn(p.shape, generator=gen))  # a bias, not the whole draft
    save_dspark_assistant(tmp_path / "dspark", backbone=models.assistant, heads=heads)
    worker = default_registry().create(
        "dspark", target=models.target, assistant=tmp_path / "dspark", seed=11
    )
    verified: list[tuple[int, ...]] = []
    samples, histogram = _generate(
        worker, params, overlap=overlap, verify_budget=_ByRequest(), verified=verified
    )
    assert _min_p_value(models, samples, params) > STRICT
    assert {v for lens in verified for v in lens} == {0, 1, 2}
    assert histogram.get(1, 0) > 100 and histogram.get(3, 0) > 100, histogram
