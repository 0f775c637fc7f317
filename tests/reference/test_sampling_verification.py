"""Speculative sampling in the reference workers: the verify math, and outputs ~ the target.

The statistical tests run thousands of short generations of one prompt through the engine with
a tiny 16-token target and a deliberately different drafter, then compare the emitted tokens
with the target's exact filtered distributions (computed from transformers' logits) by a
chi-square test. The same harness with a broken verifier must fail it, so a pass means
something. Seeds are fixed: every p-value here is deterministic on one machine.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
import torch
from hf_oracle import greedy, make_checkpoint
from sampling_oracle import (
    ChiSquare,
    chi_square,
    conditional_chi_square,
    exact_next_token,
    reference_filter,
)
from spec_checkpoints import FAMILIES, family_options
from transformers import LlamaForCausalLM

from specstate import InvalidConfig, RequestLimits, SamplingInfo, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.reference.checkpoint import load_paged_llama
from specstate.reference.eagle_head import EagleHead, EagleHeadConfig, save_eagle_head
from specstate.reference.workers import (
    ChainVerdict,
    TokenSampler,
    default_registry,
    filtered_probs,
    verify_sampled_chain,
)
from specstate.reference.workers import target as target_runner
from specstate.reference.workers.verify import truncate_to_budgets

VOCAB = 16
PROMPT = (3, 1, 4, 1, 5)
NUM_NEW = 3
NUM_STEPS = 2
NUM_SAMPLES = 3000
STRICT = 1e-3  # a correct sampler passes above this; a broken one must land far below
BROKEN = 1e-6
CPU = torch.device("cpu")


@attrs.frozen
class Models:
    """A tiny target, a different random drafter and a random EAGLE head for the target."""

    target: Path
    draft: Path
    eagle: Path
    hf: LlamaForCausalLM


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Models:
    """Checkpoints shared by the module."""
    root = tmp_path_factory.mktemp("sampling")
    hf = make_checkpoint(root / "target", seed=0, vocab_size=VOCAB, layers=1)
    make_checkpoint(root / "draft", seed=1, vocab_size=VOCAB, hidden=16, layers=1)
    paged = load_paged_llama(root / "target", num_token_slots=2)
    torch.manual_seed(2)
    head = EagleHead(EagleHeadConfig.for_target(paged.config, intermediate_size=48), paged)
    save_eagle_head(head, root / "eagle")
    return Models(target=root / "target", draft=root / "draft", eagle=root / "eagle", hf=hf)


def make_worker(models: Models, algorithm: str, *, seed: int) -> WorkerProtocol:
    """A seeded worker of ``algorithm`` (K = 2) whose drafter is not the target."""
    options: dict[str, object] = {"target": models.target, "seed": seed}
    if algorithm != "none":
        options["num_steps"] = NUM_STEPS
    if algorithm == "draft_model":
        options["draft"] = models.draft
    if algorithm == "eagle":
        options["eagle"] = models.eagle
    if algorithm in FAMILIES:
        options.update(family_options(models.target, algorithm))
    return default_registry().create(algorithm, **options)


@attrs.frozen
class Generation:
    """Every request's emitted tokens, and the engine's accept-length histogram."""

    samples: list[tuple[int, ...]]
    accept_histogram: dict[int, int]


def generate(
    worker: WorkerProtocol,
    params: list[SamplingParams],
    *,
    overlap: bool,
    max_running: int = 256,
) -> Generation:
    """Runs one request of ``PROMPT`` per entry of ``params`` through the checked engine."""
    config = EngineConfig(
        overlap=overlap,
        kv_tokens=max_running * 2 * 24,
        max_running=max_running,
        check_invariants=True,
        check_ownership=True,
    )
    limits = RequestLimits(vocab_size=VOCAB, max_context_len=16)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [engine.submit(f"s{i}", PROMPT, p) for i, p in enumerate(params)]
        engine.run_until_idle()
        snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    return Generation([r.emitted_ids for r in reqs], dict(snap.metrics.histogram))


@attrs.frozen
class FitReport:
    """Goodness of fit of the first three generated tokens, each given the ones before."""

    first: ChiSquare
    second: ChiSquare
    third: ChiSquare

    @property
    def min_p_value(self) -> float:
        """The smallest of the three p-values."""
        return min(self.first.p_value, self.second.p_value, self.third.p_value)


def fit(models: Models, samples: list[tuple[int, ...]], params: SamplingParams) -> FitReport:
    """Compares ``samples`` with the target's exact filtered distributions."""
    assert all(len(s) == NUM_NEW for s in samples)
    top_k = params.top_k or VOCAB
    exact: dict[tuple[int, ...], list[float]] = {}
    for length in range(NUM_NEW):
        prefixes = list(itertools.product(range(VOCAB), repeat=length))
        exact |= exact_next_token(
            models.hf,
            PROMPT,
            prefixes,
            temperature=params.temperature,
            top_k=top_k,
            top_p=params.top_p,
        )
    first = chi_square(Counter(s[0] for s in samples), exact[()])
    return FitReport(
        first=first,
        second=conditional_chi_square(samples, 1, exact),
        third=conditional_chi_square(samples, 2, exact),
    )


T1 = SamplingParams(max_new_tokens=NUM_NEW, temperature=1.0)
FILTERED = SamplingParams(max_new_tokens=NUM_NEW, temperature=0.8, top_k=6, top_p=0.9)
CASES = [
    pytest.param("draft_model", T1, True, id="draft_model-T1-overlap"),
    pytest.param("draft_model", FILTERED, False, id="draft_model-topk-topp-normal"),
    pytest.param("eagle", T1, True, id="eagle-T1-overlap"),
    pytest.param("ngram", FILTERED, True, id="ngram-topk-topp-overlap"),
    pytest.param("mtp", T1, True, id="mtp-T1-overlap"),
    pytest.param("eagle3", FILTERED, False, id="eagle3-topk-topp-normal"),
    pytest.param("frozen_kv_mtp", T1, True, id="frozen_kv_mtp-T1-overlap"),
]


@pytest.mark.parametrize(("algorithm", "params", "overlap"), CASES)
def test_emitted_tokens_follow_the_target_distribution(
    models: Models, algorithm: str, params: SamplingParams, overlap: bool
) -> None:
    """First, second and third tokens fit the target's filtered distribution (p > 1e-3).

    Rounds that reject at the first draft and rounds that accept every draft both happen, so
    the residual and the bonus paths are both exercised.
    """
    worker = make_worker(models, algorithm, seed=11)
    run = generate(worker, [params] * NUM_SAMPLES, overlap=overlap)
    report = fit(models, run.samples, params)
    assert report.min_p_value > STRICT, report
    assert run.accept_histogram.get(1, 0) > 100, run.accept_histogram
    assert run.accept_histogram.get(NUM_STEPS + 1, 0) > 100, run.accept_histogram


def always_accept(
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


def resamples_from_target(
    drafts: torch.Tensor,
    draft_probs: torch.Tensor | None,
    target_probs: torch.Tensor,
    sampler: TokenSampler,
) -> ChainVerdict:
    """A broken verifier: right acceptance, but a rejection resamples from ``p``, not the residual.

    (Treating sampled drafts as deterministic, ``q`` one-hot, would NOT be a bug: given ``d``
    it still emits exactly ``p``, only with fewer acceptances.)
    """
    verdict = verify_sampled_chain(drafts, draft_probs, target_probs, sampler)
    last = verdict.last_accepted
    rows = torch.arange(drafts.shape[0])
    fresh = sampler.sample(target_probs[rows, last])
    return ChainVerdict(
        run_tokens=verdict.run_tokens.scatter(1, last[:, None], fresh[:, None]),
        accept_lens=verdict.accept_lens,
        bonus_tokens=fresh,
    )


Verifier = Callable[[torch.Tensor, torch.Tensor | None, torch.Tensor, TokenSampler], ChainVerdict]


@pytest.mark.parametrize("broken", [always_accept, resamples_from_target])
def test_the_same_harness_rejects_a_broken_verifier(
    models: Models, monkeypatch: pytest.MonkeyPatch, broken: Verifier
) -> None:
    """A verifier that is wrong makes the second token misfit: p < 1e-6 (the test has power)."""
    monkeypatch.setattr(target_runner, "verify_sampled_chain", broken)
    worker = make_worker(models, "draft_model", seed=11)
    report = fit(models, generate(worker, [T1] * NUM_SAMPLES, overlap=True).samples, T1)
    assert report.first.p_value > STRICT  # the prefill token is sampled by the target alone
    assert report.second.p_value < BROKEN, report


def test_mixed_batch_greedy_rows_equal_hf_and_runs_reproduce(models: Models) -> None:
    """Greedy rows in a sampled batch equal HF greedy; a fixed seed reproduces every row."""
    params = [T1 if i % 2 else SamplingParams(max_new_tokens=8) for i in range(16)]
    first, again, other = (
        generate(make_worker(models, "draft_model", seed=seed), params, overlap=True).samples
        for seed in (5, 5, 6)
    )
    expected = tuple(greedy(models.hf, PROMPT, 8))
    assert all(out == expected for out in first[::2])
    assert first == again
    assert first[1::2] != other[1::2]
    assert first[::2] == other[::2]


# ----------------------------------------------------------------- verify math on hand-made p, q

P = torch.tensor([0.1, 0.2, 0.3, 0.4])
Q = torch.tensor([0.4, 0.3, 0.2, 0.1])
ROWS = 40_000


def verify_rows(
    drafts: list[int], q: torch.Tensor | None, p: torch.Tensor, *, seed: int
) -> ChainVerdict:
    """``ROWS`` identical one-row chains ``drafts`` verified against ``p`` (``[K+1, V]``)."""
    tokens = torch.tensor(drafts).repeat(ROWS, 1)
    draft_probs = None if q is None else q.expand(ROWS, -1, -1)
    return verify_sampled_chain(tokens, draft_probs, p.expand(ROWS, -1, -1), TokenSampler(seed))


def assert_rate(hits: torch.Tensor, rate: float) -> None:
    """The empirical rate of ``hits`` is within 5 standard errors of ``rate``."""
    spread = 5 * (rate * (1 - rate) / hits.numel()) ** 0.5
    assert abs(float(hits.float().mean()) - rate) <= max(spread, 1e-9)


@pytest.mark.parametrize("draft", [0, 1, 2, 3])
def test_acceptance_rate_is_min_one_p_over_q(draft: int) -> None:
    """d is accepted with probability min(1, p(d)/q(d)); rejections resample max(0, p − q)."""
    verdict = verify_rows([draft], Q[None], torch.stack([P, P]), seed=draft)
    accepted = verdict.accept_lens == 2
    assert_rate(accepted, min(1.0, float(P[draft] / Q[draft])))
    assert bool((verdict.run_tokens[accepted, 0] == draft).all())
    rejected = verdict.bonus_tokens[~accepted]
    if rejected.numel():
        residual = (P - Q).clamp_min(0)
        fit_ = chi_square(Counter(rejected.tolist()), (residual / residual.sum()).tolist())
        assert fit_.p_value > STRICT, fit_


def test_drafts_drawn_from_q_emit_exactly_p() -> None:
    """Drafts sampled from q, verified: the first emitted token is distributed as p."""
    gen = torch.Generator().manual_seed(0)
    drafts = torch.multinomial(Q, ROWS, replacement=True, generator=gen)[:, None]
    p = torch.stack([P, Q]).expand(ROWS, -1, -1)
    verdict = verify_sampled_chain(drafts, Q.expand(ROWS, 1, -1), p, TokenSampler(1))
    fit_ = chi_square(Counter(verdict.run_tokens[:, 0].tolist()), P.tolist())
    assert fit_.p_value > STRICT, fit_
    assert 1 < float(verdict.accept_lens.float().mean()) < 2  # both outcomes happen


def test_all_accepted_bonus_comes_from_the_last_position() -> None:
    """With q == p every draft is accepted and the bonus follows p_(K+1)."""
    verdict = verify_rows([2, 3], torch.stack([P, P]), torch.stack([P, P, Q]), seed=2)
    assert bool((verdict.accept_lens == 3).all())
    assert bool((verdict.run_tokens[:, :2] == torch.tensor([2, 3])).all())
    fit_ = chi_square(Counter(verdict.bonus_tokens.tolist()), Q.tolist())
    assert fit_.p_value > STRICT, fit_


def test_deterministic_drafts_accept_with_p_and_resample_p_without_them() -> None:
    """A one-hot q (n-gram) accepts d with probability p(d); a rejection never re-emits d."""
    verdict = verify_rows([1], None, torch.stack([P, P]), seed=3)
    accepted = verdict.accept_lens == 2
    assert_rate(accepted, float(P[1]))
    rejected = Counter(verdict.bonus_tokens[~accepted].tolist())
    fit_ = chi_square(rejected, [0.1 / 0.8, 0.0, 0.3 / 0.8, 0.4 / 0.8])
    assert fit_.p_value > STRICT, fit_


def test_run_layout_past_the_rejection_is_zero() -> None:
    """Rejected at step 1 of 2: run = [replacement, 0, 0], accept_len 1."""
    p = torch.tensor([[1.0, 0.0], [0.5, 0.5], [0.5, 0.5]])
    q = torch.tensor([[0.0, 1.0], [0.5, 0.5]])
    verdict = verify_sampled_chain(torch.tensor([[1, 0]]), q[None], p[None], TokenSampler(0))
    assert verdict.accept_lens.tolist() == [1]
    assert verdict.run_tokens.tolist() == [[0, 0, 0]]
    assert verdict.bonus_tokens.tolist() == [0]


def test_misshapen_probabilities_are_refused() -> None:
    """Probabilities that do not fit the chain raise InvalidConfig naming the shapes."""
    with pytest.raises(InvalidConfig, match=r"verify probabilities \(2, 2, 4\) do not fit"):
        verify_sampled_chain(
            torch.zeros(2, 2, dtype=torch.int64), None, torch.zeros(2, 2, 4), TokenSampler(0)
        )
    with pytest.raises(InvalidConfig, match=r"draft probabilities \(2, 1, 4\) must be"):
        verify_sampled_chain(
            torch.zeros(2, 2, dtype=torch.int64),
            torch.zeros(2, 1, 4),
            torch.zeros(2, 3, 4),
            TokenSampler(0),
        )


def test_filtered_probs_match_the_definition() -> None:
    """Temperature, top-k and top-p per row agree with the independent float64 filter."""
    gen = torch.Generator().manual_seed(4)
    logits = torch.randn(5, VOCAB, generator=gen) * 2
    rows = [(1.0, VOCAB, 1.0), (0.5, 3, 1.0), (1.3, VOCAB, 0.6), (0.7, 5, 0.8), (0.0, VOCAB, 1.0)]
    info = SamplingInfo(
        temperatures=torch.tensor([r[0] for r in rows]),
        top_ks=torch.tensor([r[1] for r in rows]),
        top_ps=torch.tensor([r[2] for r in rows]),
    )
    got = filtered_probs(logits, info)
    for row, (temperature, top_k, top_p) in enumerate(rows[:4]):
        want = reference_filter(logits[row], temperature, top_k, top_p)
        torch.testing.assert_close(
            got[row].double(), torch.tensor(want, dtype=torch.float64), rtol=1e-5, atol=1e-6
        )
    assert int((got[1] > 0).sum()) == 3


R = torch.tensor([0.25, 0.25, 0.25, 0.25])


@pytest.mark.parametrize("budget", [0, 1, 2])
def test_a_budget_cut_emits_exactly_p_at_every_position(budget: int) -> None:
    """Drafts from q at two positions, a row budget of 0, 1 or 2: the first emitted token follows
    p_0, a second one (after an accepted first draft) p_1, and nothing past the budget + 1."""
    gen = torch.Generator().manual_seed(budget)
    drafts = torch.multinomial(Q, ROWS * 2, replacement=True, generator=gen).view(ROWS, 2)
    p = torch.stack([P, R, Q]).expand(ROWS, -1, -1)
    sampler = TokenSampler(7 + budget)
    verdict = verify_sampled_chain(drafts, Q.expand(ROWS, 2, -1), p, sampler)
    budgets = torch.full((ROWS,), budget, dtype=torch.int64)
    cut = truncate_to_budgets(verdict, p, budgets, sampler)
    assert int(cut.accept_lens.max()) <= budget + 1
    assert bool(
        (cut.bonus_tokens == cut.run_tokens.gather(1, (cut.accept_lens - 1)[:, None])[:, 0]).all()
    )
    fit_ = chi_square(Counter(cut.run_tokens[:, 0].tolist()), P.tolist())
    assert fit_.p_value > STRICT, fit_
    if budget >= 1:  # rows that accepted their first draft: the second token follows p_1
        second = cut.run_tokens[cut.accept_lens >= 2, 1]
        fit_ = chi_square(Counter(second.tolist()), R.tolist())
        assert fit_.p_value > STRICT, fit_
        assert 1 < float(cut.accept_lens.float().mean()) < budget + 1  # runs end inside it


def test_the_same_harness_rejects_a_cut_that_draws_the_boundary_from_the_drafter() -> None:
    """Budget 1: a cut that takes the token at the budget from q (the drafter), not p_1, fails."""
    gen = torch.Generator().manual_seed(5)
    drafts = torch.multinomial(Q, ROWS * 2, replacement=True, generator=gen).view(ROWS, 2)
    p = torch.stack([P, R, Q]).expand(ROWS, -1, -1)
    q = torch.stack([Q, Q]).expand(ROWS, -1, -1)
    sampler = TokenSampler(11)
    verdict = verify_sampled_chain(drafts, q, p, sampler)
    wrong = torch.stack([P, Q, Q]).expand(ROWS, -1, -1)  # q where p_1 belongs
    cut = truncate_to_budgets(verdict, wrong, torch.ones(ROWS, dtype=torch.int64), sampler)
    second = cut.run_tokens[cut.accept_lens >= 2, 1]
    fit_ = chi_square(Counter(second.tolist()), R.tolist())
    assert fit_.p_value < BROKEN, fit_
