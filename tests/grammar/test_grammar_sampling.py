"""Sampled grammar requests: every output is grammatical, and the tokens follow masked sampling.

A tiny 16-token target whose ids 0-14 are the letters a-o and 15 is EOS, a deliberately
different random drafter (drafts are rejected and accepted), and a small grammar whose allowed
set at each position depends on the tokens before it. The exact distribution of masked sampling
without speculation — the target's softmax over the tokens the grammar allows after the prefix,
zero elsewhere — is computed from transformers' logits and a fresh llguidance matcher (float64),
and the engine's samples are compared with it by a chi-square test, token by token given the
ones before. Thousands of one-request generations run through the checked engine under overlap.
The larger vocabulary's grammars (JSON schema, regex, EBNF, Lark) are sampled through every
algorithm and loop too: each output parses.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections import Counter
from pathlib import Path

import attrs
import numpy as np
import pytest
import torch
from engine_driver import run_checked
from grammar_oracle import GRAMMARS, VOCAB, ascii_vocabulary, matches
from hf_oracle import make_checkpoint
from sampling_oracle import (
    ChiSquare,
    chi_square,
    conditional_chi_square,
    last_logits,
    reference_filter,
)
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints
from transformers import LlamaForCausalLM

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.grammar.spec import Grammar, GrammarVocabulary
from specstate.grammar.state import GrammarCompiler
from specstate.reference.workers import default_registry

SMALL_VOCAB = 16
SMALL_EOS = 15
LETTERS = "abcdefghijklmno"
PATTERN = "([a-d][a-f]|[e-h][g-k])[a-c]"
SMALL_GRAMMAR = Grammar.regex(PATTERN)
PROMPT = (3, 1, 4, 1, 5)
NUM_NEW = 4  # three letters, then the EOS the grammar forces
TEMPERATURE = 0.9
NUM_SAMPLES = 2000
STRICT = 1e-3


@attrs.frozen
class Models:
    """A tiny letter target and a different random drafter."""

    target: Path
    draft: Path
    hf: LlamaForCausalLM


def small_vocabulary() -> GrammarVocabulary:
    """Ids 0-14: the letters a-o; 15: EOS."""
    return GrammarVocabulary.from_tokens([*LETTERS, None])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """Checkpoints shared by the module."""
    root = tmp_path_factory.mktemp("grammar_sampling")
    hf = make_checkpoint(root / "target", seed=3, vocab_size=SMALL_VOCAB, layers=1)
    make_checkpoint(root / "draft", seed=4, vocab_size=SMALL_VOCAB, hidden=16, layers=1)
    return Models(target=root / "target", draft=root / "draft", hf=hf)


@functools.cache
def small_compiler() -> GrammarCompiler:
    """The letter vocabulary's compiler (built once)."""
    return GrammarCompiler(
        small_vocabulary(), vocab_size=SMALL_VOCAB, eos_token_ids=frozenset({SMALL_EOS})
    )


def allowed_after(prefix: tuple[int, ...]) -> list[int] | None:
    """The ids the grammar allows after ``prefix`` (a fresh matcher), or None if it refuses it."""
    _, matcher = small_compiler().compile(SMALL_GRAMMAR)
    if matcher.validate_tokens(list(prefix)) != len(prefix):
        return None
    assert matcher.consume_tokens(list(prefix))
    packed = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint8)
    return np.flatnonzero(np.unpackbits(packed, bitorder="little")[:SMALL_VOCAB]).tolist()


@pytest.fixture(scope="module")
def exact(models: Models) -> dict[tuple[int, ...], list[float]]:
    """Masked sampling without speculation, by definition, after every grammatical prefix."""
    table: dict[tuple[int, ...], list[float]] = {}
    for length in range(3):
        prefixes = [
            p
            for p in itertools.product(range(SMALL_EOS), repeat=length)
            if allowed_after(p) is not None
        ]
        for prefix, row in zip(prefixes, last_logits(models.hf, PROMPT, prefixes), strict=True):
            allowed = allowed_after(prefix)
            assert allowed is not None and SMALL_EOS not in allowed
            masked = torch.full_like(row, float("-inf"))
            masked[allowed] = row[allowed]
            table[prefix] = reference_filter(masked, TEMPERATURE, SMALL_VOCAB, 1.0)
    return table


def small_worker(models: Models, algorithm: str) -> WorkerProtocol:
    """A seeded worker (K = 2) whose drafter is not the target."""
    options: dict[str, object] = {"target": models.target, "seed": 5, "num_steps": 2}
    if algorithm == "draft_model":
        options["draft"] = models.draft
    return default_registry().create(algorithm, **options)


def generate(
    worker: WorkerProtocol, requests: list[SamplingParams]
) -> tuple[list[tuple[int, ...]], list[tuple[float, ...] | None], dict[int, int]]:
    """One request of PROMPT per entry through the checked engine (overlap)."""
    config = EngineConfig(
        overlap=True, kv_tokens=256 * 2 * 24, max_running=256, check_invariants=True
    )
    limits = RequestLimits(
        vocab_size=SMALL_VOCAB,
        max_context_len=16,
        eos_token_ids={SMALL_EOS},
        grammar_vocabulary=small_vocabulary(),
    )
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [engine.submit(f"s{i}", PROMPT, p) for i, p in enumerate(requests)]
        engine.run_until_idle()
        histogram = dict(engine.snapshot().metrics.histogram)
    return [r.emitted_ids for r in reqs], [r.logprobs for r in reqs], histogram


def fit(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], list[float]]) -> ChiSquare:
    """Pooled fit of the three letters, each given the ones before it."""
    first = chi_square(Counter(s[0] for s in samples), exact[()])
    return (
        first
        + conditional_chi_square(samples, 1, exact)
        + conditional_chi_square(samples, 2, exact)
    )


def grammatical(sample: tuple[int, ...]) -> bool:
    """Three letters of the grammar (by Python's ``re``), then the EOS."""
    letters = "".join(LETTERS[t] for t in sample[:-1] if t < SMALL_EOS)
    return (
        len(sample) == NUM_NEW
        and sample[-1] == SMALL_EOS
        and re.fullmatch(PATTERN, letters) is not None
    )


def test_speculative_grammar_sampling_equals_masked_sampling(
    models: Models, exact: dict[tuple[int, ...], list[float]]
) -> None:
    """Speculative rows and rows with speculation off both follow masked sampling (p > 1e-3);
    every output is grammatical; drafts were rejected and accepted; logprobs are exact."""
    requests = [
        SamplingParams(
            max_new_tokens=NUM_NEW,
            temperature=TEMPERATURE,
            grammar=SMALL_GRAMMAR,
            speculative=i % 3 != 0,
            logprobs=i < 200,
        )
        for i in range(NUM_SAMPLES)
    ]
    samples, logprobs, histogram = generate(small_worker(models, "draft_model"), requests)
    assert all(grammatical(s) for s in samples)
    speculating = [s for i, s in enumerate(samples) if i % 3 != 0]
    plain = [s for i, s in enumerate(samples) if i % 3 == 0]
    assert fit(speculating, exact).p_value > STRICT
    assert fit(plain, exact).p_value > STRICT
    assert histogram.get(1, 0) > 50 and histogram.get(3, 0) > 50, histogram
    for tokens, lps in zip(samples[:200], logprobs[:200], strict=True):
        assert lps is not None
        want = [math.log(exact[tokens[:k]][t]) for k, t in enumerate(tokens[:3])]
        assert list(lps[:3]) == pytest.approx(want, abs=1e-4)
        assert lps[3] == pytest.approx(0.0, abs=1e-5)  # the forced EOS


def test_seeded_grammar_sampling_equals_masked_sampling(
    models: Models, exact: dict[tuple[int, ...], list[float]]
) -> None:
    """One seed per request (coupled draws, n-gram drafts checked against the grammar)."""
    requests = [
        SamplingParams(
            max_new_tokens=NUM_NEW, temperature=TEMPERATURE, grammar=SMALL_GRAMMAR, seed=s
        )
        for s in range(NUM_SAMPLES)
    ]
    samples, _, _ = generate(small_worker(models, "ngram"), requests)
    assert all(grammatical(s) for s in samples)
    assert fit(samples, exact).p_value > STRICT


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("algorithm", ["none", "draft_model", "eagle", "ngram"])
def test_every_sampled_output_is_grammatical(
    partial_ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Sampled (seeded and unseeded, with top-k / top-p) requests of every grammar parse."""
    config = EngineConfig(
        kv_tokens=4096, overlap=overlap, check_invariants=True, check_ownership=True
    )
    limits = RequestLimits(
        vocab_size=VOCAB,
        max_context_len=64,
        eos_token_ids={96},
        grammar_vocabulary=ascii_vocabulary(),
    )
    worker = partial_ckpt.worker(algorithm, num_steps=3, agreeing=False)
    kinds = list(GRAMMARS) * 2
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(
                f"s{i}",
                list(MIXED_PROMPTS[i % len(MIXED_PROMPTS)]),
                SamplingParams(
                    max_new_tokens=48,
                    temperature=1.3,
                    top_k=40 if i % 2 else None,
                    top_p=0.95,
                    seed=i if i % 3 == 0 else None,
                    grammar=GRAMMARS[kind][0],
                ),
            )
            for i, kind in enumerate(kinds)
        ]
        run_checked(engine)
    for req, kind in zip(reqs, kinds, strict=True):
        assert req.finish is not None
        if req.finish.reason.value == "stop":
            assert matches(kind, req.emitted_ids), (kind, req.emitted_ids)
        else:  # the cap came first: a grammatical prefix
            assert req.finish.reason.value == "length"
    assert sum(r.finish is not None and r.finish.reason.value == "stop" for r in reqs) >= 6
