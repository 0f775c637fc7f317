"""Sampled penalties: the emitted tokens follow the target's exact penalized distribution.

Thousands of 3-token generations of one prompt through the engine, with a tiny 16-token target,
a deliberately different drafter (so drafts are rejected and accepted), repetition, frequency
and presence penalties, ``min_new_tokens`` masking EOS, top-k and top-p. The exact distribution
of each token given the ones before it is computed from transformers' logits with the controls
applied by definition (float64, `controls_oracle.controlled_logits`), and compared by a
chi-square test: for speculative sampling (the worker's generator, draft position ``j`` judged
against the penalties of drafts ``d1 .. dj``), for non-speculative rows in the same batch, and
for seeded rows (coupled draws). A verifier that penalizes every position as the first must
fail the same test, so a pass means something. Logprobs of sampled tokens equal the log of the
exact probability.
"""

from __future__ import annotations

import itertools
import math
from collections import Counter
from pathlib import Path

import attrs
import pytest
import torch
from controls_oracle import Controls, exact_controlled
from hf_oracle import make_checkpoint
from sampling_oracle import ChiSquare, chi_square, conditional_chi_square
from transformers import LlamaForCausalLM

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry
from specstate.reference.workers.sampler import TokenCounts

VOCAB = 16
PROMPT = (3, 1, 4, 1, 5)
EOS = 0
NUM_NEW = 3
NUM_STEPS = 2
NUM_SAMPLES = 3000
STRICT = 1e-3
BROKEN = 1e-6
CONTROLS = Controls(
    repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=0.5, min_new_tokens=2
)


def params(
    *, seed: int | None = None, speculative: bool = True, temperature: float = 1.0
) -> SamplingParams:
    """A sampled request with every control on."""
    return SamplingParams(
        max_new_tokens=NUM_NEW,
        temperature=temperature,
        top_k=12,
        top_p=0.97,
        repetition_penalty=CONTROLS.repetition_penalty,
        frequency_penalty=CONTROLS.frequency_penalty,
        presence_penalty=CONTROLS.presence_penalty,
        min_new_tokens=CONTROLS.min_new_tokens,
        seed=seed,
        speculative=speculative,
        logprobs=True,
    )


@attrs.frozen
class Models:
    """A tiny target and a different random drafter."""

    target: Path
    draft: Path
    hf: LlamaForCausalLM


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """Checkpoints shared by the module."""
    root = tmp_path_factory.mktemp("sampled_controls")
    hf = make_checkpoint(root / "target", seed=0, vocab_size=VOCAB, layers=1)
    make_checkpoint(root / "draft", seed=1, vocab_size=VOCAB, hidden=16, layers=1)
    return Models(target=root / "target", draft=root / "draft", hf=hf)


@pytest.fixture(scope="module")
def exact(models: Models) -> dict[tuple[int, ...], list[float]]:
    """The exact filtered, penalized distribution after every generated prefix (len 0..2)."""
    table: dict[tuple[int, ...], list[float]] = {}
    example = params()
    for length in range(NUM_NEW):
        table |= exact_controlled(
            models.hf,
            PROMPT,
            list(itertools.product(range(VOCAB), repeat=length)),
            controls=CONTROLS,
            stop_ids=[EOS],
            temperature=example.temperature,
            top_k=example.top_k or VOCAB,
            top_p=example.top_p,
        )
    return table


def worker(models: Models, algorithm: str) -> WorkerProtocol:
    """A seeded worker (K = 2) whose drafter is not the target."""
    options: dict[str, object] = {"target": models.target, "seed": 11, "num_steps": NUM_STEPS}
    if algorithm == "draft_model":
        options["draft"] = models.draft
    return default_registry().create(algorithm, **options)


@attrs.frozen
class Generation:
    """Every request's tokens and logprobs, and the accept-length histogram."""

    samples: list[tuple[int, ...]]
    logprobs: list[tuple[float, ...]]
    histogram: dict[int, int]


def generate(w: WorkerProtocol, requests: list[SamplingParams]) -> Generation:
    """One request of ``PROMPT`` per entry, through the checked engine (overlap)."""
    config = EngineConfig(
        overlap=True,
        kv_tokens=256 * 2 * 24,
        max_running=256,
        check_invariants=True,
        check_ownership=True,
    )
    limits = RequestLimits(vocab_size=VOCAB, max_context_len=16, eos_token_ids={EOS})
    with Engine(w, limits=limits, config=config) as engine:
        reqs = [engine.submit(f"s{i}", PROMPT, p) for i, p in enumerate(requests)]
        engine.run_until_idle()
        histogram = dict(engine.snapshot().metrics.histogram)
    logprobs = []
    for req in reqs:
        assert req.logprobs is not None
        logprobs.append(req.logprobs)
    return Generation([r.emitted_ids for r in reqs], logprobs, histogram)


def fit(samples: list[tuple[int, ...]], exact: dict[tuple[int, ...], list[float]]) -> ChiSquare:
    """Pooled fit of the three tokens, each given the ones before it."""
    assert all(len(s) == NUM_NEW for s in samples)
    first = chi_square(Counter(s[0] for s in samples), exact[()])
    return (
        first
        + conditional_chi_square(samples, 1, exact)
        + conditional_chi_square(samples, 2, exact)
    )


def assert_logprobs_exact(gen: Generation, exact: dict[tuple[int, ...], list[float]]) -> None:
    """Every emitted token's logprob is the log of its exact probability."""
    for tokens, lps in zip(gen.samples[:200], gen.logprobs[:200], strict=True):
        want = [math.log(exact[tokens[:k]][t]) for k, t in enumerate(tokens)]
        assert lps == pytest.approx(want, abs=1e-4)


def test_speculative_sampling_with_penalties_follows_the_exact_distribution(
    models: Models, exact: dict[tuple[int, ...], list[float]]
) -> None:
    """Unseeded rows (the worker's generator): speculative and non-speculative rows both fit."""
    requests = [params(speculative=i % 3 != 0) for i in range(NUM_SAMPLES)]
    gen = generate(worker(models, "draft_model"), requests)
    speculating = [s for i, s in enumerate(gen.samples) if i % 3 != 0]
    plain = [s for i, s in enumerate(gen.samples) if i % 3 == 0]
    assert fit(speculating, exact).p_value > STRICT
    assert fit(plain, exact).p_value > STRICT
    assert all(EOS not in s[: CONTROLS.min_new_tokens] for s in gen.samples)
    assert gen.histogram.get(1, 0) > 100 and gen.histogram.get(NUM_STEPS + 1, 0) > 100
    assert_logprobs_exact(gen, exact)


@pytest.mark.parametrize("algorithm", ["draft_model", "ngram"])
def test_seeded_rows_with_penalties_follow_the_exact_distribution(
    models: Models, exact: dict[tuple[int, ...], list[float]], algorithm: str
) -> None:
    """One seed per request: coupled draws fit too, and drafts are accepted."""
    gen = generate(worker(models, algorithm), [params(seed=s) for s in range(NUM_SAMPLES)])
    assert fit(gen.samples, exact).p_value > STRICT
    assert sum(n for a, n in gen.histogram.items() if a > 1) > 50, gen.histogram
    assert_logprobs_exact(gen, exact)


def test_the_same_harness_rejects_penalties_that_ignore_earlier_drafts(
    models: Models, exact: dict[tuple[int, ...], list[float]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Verify positions penalized as if no draft came before them: the fit fails (p < 1e-6)."""

    def first_position_only(self: TokenCounts, drafts: torch.Tensor) -> TokenCounts:
        steps = torch.arange(drafts.shape[1] + 1, device=drafts.device)[None, :]
        return TokenCounts(
            seen=self.seen[:, None].expand(-1, drafts.shape[1] + 1, -1),
            output=self.output[:, None].expand(-1, drafts.shape[1] + 1, -1),
            num_outputs=self.num_outputs[:, None] + steps,
        )

    monkeypatch.setattr(TokenCounts, "chain", first_position_only)
    gen = generate(worker(models, "draft_model"), [params() for _ in range(NUM_SAMPLES)])
    assert fit(gen.samples, exact).p_value < BROKEN
