"""Sampled verification of draft trees: every emitted token follows the target exactly.

Unit level: `verify_sampled_tree` on hand-made distributions (a 5-token vocabulary, a tree of
depth 3 with two children per expanded node, deterministic top-2 children of a different
"drafter"), rounds repeated until every trial emitted two tokens: the first token and the first
two tokens jointly fit the target's exact distributions by a chi-square test, and the same
harness with a broken acceptance rule (accept any child of positive mass; forget to renormalize
after a rejection) fails it. Engine level: EAGLE and draft-model trees (topk 2) serve sampled
requests (temperature 1, some with top-k / top-p) next to greedy ones under overlap and not,
with the invariant checker after every step; the greedy rows equal HF ``generate()`` and
sampled rows accept more than one token. End to end: the second and third tokens of a tiny
16-token target served by a draft-model tree fit the target's filtered distribution.
Seeds are fixed: every p-value here is deterministic on one machine.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch
from engine_driver import run_checked
from hf_oracle import greedy, make_checkpoint
from sampling_oracle import chi_square, conditional_chi_square, exact_next_token
from spec_checkpoints import (
    MIXED_PROMPTS,
    SpecCheckpoints,
    make_partial_drafters,
    make_spec_checkpoints,
)
from transformers import LlamaForCausalLM

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.reference.workers import (
    TokenSampler,
    TreeRoundWorker,
    VerifiedTree,
    default_registry,
)
from specstate.reference.workers import tree_verify as tree_module
from specstate.reference.workers.tree_draft import DraftTree
from specstate.reference.workers.tree_verify import TreeVerdict, verify_sampled_tree

STRICT = 1e-3  # a correct sampler passes above this; a broken one must land far below
BROKEN = 1e-6


# ------------------------------------------------------------ the sampler on hand-made p and trees

VOCAB = 5
TRIALS = 20_000
# node:    0  1  2  3  4  5  6  7  8      depth-major, parents first; two children per
PARENTS = [0, 0, 0, 1, 1, 2, 2, 3, 3]  # expanded node, depth 3 under the first branch
RANKS = [0, 0, 1, 0, 1, 0, 1, 0, 1]  # each child's rank among its parent's top-2
PATH_WIDTH = 4


def _distribution(prefix: tuple[int, ...], salt: int) -> torch.Tensor:
    """A fixed random distribution over VOCAB for ``prefix``; one token has no mass (a filter)."""
    seed = salt + sum((t + 1) * 7**i for i, t in enumerate(prefix))
    gen = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(VOCAB, generator=gen, dtype=torch.float64) * 1.3, -1)
    probs[(seed * 3 + salt) % VOCAB] = 0.0  # the drafter's children may be massless tokens
    return probs / probs.sum()


TARGET = {
    prefix: _distribution(prefix, 0)
    for length in range(5)
    for prefix in itertools.product(range(VOCAB), repeat=length)
}
PREFIXES = list(TARGET)
TABLE = torch.stack([TARGET[prefix] for prefix in PREFIXES]).float()
INDEX = {prefix: i for i, prefix in enumerate(PREFIXES)}
CHILDREN = {  # the drafter's deterministic top-2 after each prefix, best first
    prefix: _distribution(prefix, 1000).argsort(descending=True, stable=True)[:2].tolist()
    for prefix in PREFIXES[: -(VOCAB**4)]
}


def hand_trees(prefixes: Sequence[tuple[int, ...]]) -> tuple[DraftTree, torch.Tensor]:
    """Each row's tree after its ``prefix`` (the drafter's top-2 children), and ``p`` per node."""
    tokens: list[list[int]] = []
    contexts: list[int] = []
    for prefix in prefixes:
        row_contexts = [prefix]
        row = [prefix[-1] if prefix else 0]
        for node in range(1, len(PARENTS)):
            parent_context = row_contexts[PARENTS[node]]
            token = CHILDREN[parent_context][RANKS[node]]
            row.append(token)
            row_contexts.append((*parent_context, token))
        tokens.append(row)
        contexts.extend(INDEX[c] for c in row_contexts)
    num_rows = len(prefixes)
    tree = DraftTree.from_parents(
        torch.tensor(tokens),
        torch.tensor(PARENTS).expand(num_rows, -1).contiguous(),
        ranks=torch.tensor(RANKS).expand(num_rows, -1).contiguous(),
    )
    return tree, TABLE[torch.tensor(contexts)].view(num_rows, len(PARENTS), VOCAB)


def emit_two(seed: int) -> list[tuple[int, int]]:
    """TRIALS generations from the empty prefix, verified round by round until two tokens."""
    sampler = TokenSampler(seed)
    outputs: list[list[int]] = [[] for _ in range(TRIALS)]
    while pending := [i for i, out in enumerate(outputs) if len(out) < 2]:
        tree, probs = hand_trees([tuple(outputs[i]) for i in pending])
        verdict: TreeVerdict = verify_sampled_tree(tree, probs, PATH_WIDTH, sampler)
        runs = verdict.run_tokens.tolist()
        for i, run, length in zip(pending, runs, verdict.accept_lens.tolist(), strict=True):
            outputs[i].extend(run[:length])
    return [(out[0], out[1]) for out in outputs]


def unit_fit(seed: int) -> tuple[float, float]:
    """p-values of the first token and of the first two jointly against the target."""
    pairs = emit_two(seed)
    first = chi_square(Counter(a for a, _ in pairs), TARGET[()].tolist())
    joint_probs = [
        float(TARGET[()][a] * TARGET[(a,)][b]) for a, b in itertools.product(range(VOCAB), repeat=2)
    ]
    joint = chi_square(Counter(a * VOCAB + b for a, b in pairs), joint_probs)
    return first.p_value, joint.p_value


def test_hand_trees_exercise_every_branch() -> None:
    """The harness is meaningful: massless children, deep paths and non-first branches occur."""
    tree, probs = hand_trees([()] * TRIALS)
    child_mass = probs.gather(2, tree.tokens[:, None, :].expand(-1, len(PARENTS), -1))
    parents = torch.tensor(PARENTS)
    masses = child_mass[0, parents[1:], torch.arange(1, len(PARENTS))]
    assert bool((masses > 0).all())  # the first tree: every child can be accepted
    verdict = verify_sampled_tree(tree, probs, PATH_WIDTH, TokenSampler(0))
    lengths = Counter(verdict.accept_lens.tolist())
    assert set(lengths) == {1, 2, 3, 4}, lengths
    assert bool(verdict.non_first_branch(tree).any())
    rows = torch.arange(TRIALS)
    assert bool((verdict.run_tokens[rows, verdict.accept_lens - 1] == verdict.bonus_tokens).all())
    on_path = torch.arange(PATH_WIDTH - 1)[None, :] < (verdict.accept_lens - 1)[:, None]
    drafted = tree.tokens.gather(1, verdict.path[:, 1:])
    assert bool(((verdict.run_tokens[:, :-1] == drafted) | ~on_path).all())
    past = torch.arange(PATH_WIDTH)[None, :] >= verdict.accept_lens[:, None]
    assert bool((verdict.run_tokens[past] == 0).all())


def test_first_token_and_first_two_follow_the_target() -> None:
    """Chi-square of the first token (3 dof) and of the first two jointly (15): p > 1e-3."""
    first, joint = unit_fit(seed=7)
    assert first > STRICT and joint > STRICT, (first, joint)


AcceptRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def accept_any_with_mass(
    uniforms: torch.Tensor, mass: torch.Tensor, child_mass: torch.Tensor
) -> torch.Tensor:
    """Broken: a child of positive mass is always accepted."""
    del uniforms, mass
    return child_mass > 0


def never_renormalize(
    uniforms: torch.Tensor, mass: torch.Tensor, child_mass: torch.Tensor
) -> torch.Tensor:
    """Broken: after a rejection the next child is tested against unrenormalized p."""
    del mass
    return uniforms < child_mass


@pytest.mark.parametrize("broken", [accept_any_with_mass, never_renormalize])
def test_the_same_harness_rejects_a_broken_acceptance_rule(
    monkeypatch: pytest.MonkeyPatch, broken: AcceptRule
) -> None:
    """A wrong acceptance rule misfits the first two tokens: p < 1e-6 (the test has power)."""
    monkeypatch.setattr(tree_module, "_accept_child", broken)
    first, joint = unit_fit(seed=7)
    assert min(first, joint) < BROKEN, (first, joint)


# ------------------------------------------------------------------ through the engine: mixed rows

NEW_TOKENS = 10
TREE_STEPS = 3


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """A one-layer target with a draft model and an EAGLE head that agree with it partly."""
    root = tmp_path_factory.mktemp("tree_sampling")
    return make_partial_drafters(make_spec_checkpoints(root), root)


def tree_worker(source: Path, drafter: Path, algorithm: str, *, seed: int) -> TreeRoundWorker:
    """A seeded topk-2 ``algorithm`` tree worker of TREE_STEPS levels."""
    worker = default_registry().create(
        algorithm,
        target=source,
        num_steps=TREE_STEPS,
        topk=2,
        num_draft_tokens=6,
        seed=seed,
        **{"eagle" if algorithm == "eagle" else "draft": drafter},
    )
    assert isinstance(worker, TreeRoundWorker)
    return worker


MIXED_PARAMS = [
    SamplingParams(max_new_tokens=NEW_TOKENS),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_k=5),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, top_p=0.8),
    SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, top_k=8, top_p=0.9),
]


@pytest.mark.parametrize(
    ("algorithm", "overlap"),
    [("eagle", True), ("draft_model", False), ("draft_model", True)],
)
def test_sampled_rows_ride_a_tree_next_to_greedy_ones(
    ckpt: SpecCheckpoints, algorithm: str, overlap: bool
) -> None:
    """Sampled requests finish with valid tokens and accept > 1; greedy rows equal HF."""
    drafter = ckpt.eagle if algorithm == "eagle" else ckpt.draft
    worker = tree_worker(ckpt.target, drafter, algorithm, seed=3)
    assert worker.capabilities.supports_sampling
    rounds: list[VerifiedTree] = []
    worker.observer = rounds.append
    config = EngineConfig(
        overlap=overlap, kv_tokens=2048, check_invariants=True, check_ownership=True
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    prompts = [list(p) for p in MIXED_PROMPTS] * 2
    params = [MIXED_PARAMS[i % len(MIXED_PARAMS)] for i in range(len(prompts))]
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(f"r{i}", p, sp)
            for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
        ]
        run_checked(engine)
    for req, prompt, sp in zip(reqs, prompts, params, strict=True):
        out = list(req.emitted_ids)
        assert len(out) == NEW_TOKENS and all(0 <= t < ckpt.vocab_size for t in out)
        if sp.temperature == 0:
            assert out == greedy(ckpt.hf, prompt, NEW_TOKENS), req.request_id
    sampled_lens = torch.cat(
        [r.verdict.accept_lens[r.batch.sampling_info.temperatures > 0] for r in rounds]
    )
    assert int(sampled_lens.max()) > 1, sampled_lens.tolist()


# ---------------------------------------------------- end to end: the target's exact distribution

E2E_VOCAB = 16
E2E_PROMPT = (3, 1, 4, 1, 5)
E2E_NEW = 3
E2E_SAMPLES = 2000


def test_engine_tree_tokens_follow_the_target_distribution(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """A draft-model tree (topk 2) on a 16-token target: tokens 2 and 3, each given the ones
    before it, fit the target's filtered distribution (p > 1e-3), with accept lengths > 1."""
    root = tmp_path_factory.mktemp("tree_sampling_e2e")
    hf: LlamaForCausalLM = make_checkpoint(root / "target", seed=0, vocab_size=E2E_VOCAB, layers=1)
    make_checkpoint(root / "draft", seed=1, vocab_size=E2E_VOCAB, hidden=16, layers=1)
    worker = default_registry().create(
        "draft_model",
        target=root / "target",
        draft=root / "draft",
        num_steps=2,
        topk=2,
        seed=11,
    )
    params = SamplingParams(max_new_tokens=E2E_NEW, temperature=1.0, top_k=10, top_p=0.95)
    config = EngineConfig(overlap=True, kv_tokens=256 * 2 * 24, max_running=256)
    limits = RequestLimits(vocab_size=E2E_VOCAB, max_context_len=16)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [engine.submit(f"s{i}", E2E_PROMPT, params) for i in range(E2E_SAMPLES)]
        engine.run_until_idle()
        histogram = dict(engine.snapshot().metrics.histogram)
    samples = [tuple(r.emitted_ids) for r in reqs]
    assert all(len(s) == E2E_NEW for s in samples)
    exact: dict[tuple[int, ...], list[float]] = {}
    for length in range(E2E_NEW):
        prefixes = list(itertools.product(range(E2E_VOCAB), repeat=length))
        exact |= exact_next_token(
            hf, E2E_PROMPT, prefixes, temperature=1.0, top_k=10, top_p=params.top_p
        )
    first = chi_square(Counter(s[0] for s in samples), exact[()])
    second = conditional_chi_square(samples, 1, exact)
    third = conditional_chi_square(samples, 2, exact)
    assert min(first.p_value, second.p_value, third.p_value) > STRICT, (first, second, third)
    assert sum(n for length, n in histogram.items() if length > 1) > 100, histogram
