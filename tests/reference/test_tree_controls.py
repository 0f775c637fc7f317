"""The per-request sampling controls on draft trees (``topk > 1``) equal the chain's and HF's.

Tree workers of both drafting algorithms (EAGLE head, draft model), drafters that agree with
the target only partly (so paths of every depth, through non-first branches, are accepted), a
few tree sizes, both loops, every engine check on:

* ``speculative=False`` rows ride the tree verify and accept exactly one token every round,
  while their speculative twins accept longer runs; every output equals HF's greedy one;
* penalties and ``min_new_tokens``: each node is processed with the counts of its own path, so
  greedy outputs equal HF ``generate()`` with the same processors, and their logprobs HF's;
* a seeded sampled request emits the same tokens (and logprobs) with a tree, a chain and no
  speculation: a tree verifies it against the target's seeded draws.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from controls_oracle import Controls, hf_greedy
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import (
    MIXED_PROMPTS,
    SpecCheckpoints,
    make_partial_drafters,
    make_spec_checkpoints,
)

from specstate import Req, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import TreeRoundWorker, VerifiedTree, default_registry

NEW_TOKENS = 16
STEPS = 3
TREES = [
    pytest.param("eagle", 4, False, id="eagle-D4-normal"),
    pytest.param("eagle", 7, True, id="eagle-D7-overlap"),
    pytest.param("draft_model", 7, False, id="draft_model-D7-normal"),
    pytest.param("draft_model", 5, True, id="draft_model-D5-overlap"),
]
ROW_CONTROLS = (
    Controls(repetition_penalty=1.5),
    Controls(frequency_penalty=0.8, presence_penalty=0.5),
    Controls(repetition_penalty=1.2, frequency_penalty=0.3, min_new_tokens=6),
    Controls(min_new_tokens=4),
    Controls(),
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """A target with partially agreeing drafters."""
    root = tmp_path_factory.mktemp("tree_controls")
    return make_partial_drafters(make_spec_checkpoints(root), root)


def make_worker(
    ckpt: SpecCheckpoints, algorithm: str, *, topk: int = 2, nodes: int | None = None
) -> WorkerProtocol:
    """A reference worker of STEPS steps (a tree for ``topk > 1``), its generator seeded 0."""
    options: dict[str, object] = {"target": ckpt.target, "seed": 0}
    if algorithm != "none":
        options.update(num_steps=STEPS, topk=topk, num_draft_tokens=nodes)
    if algorithm == "draft_model":
        options["draft"] = ckpt.draft
    if algorithm == "eagle":
        options["eagle"] = ckpt.eagle
    return default_registry().create(algorithm, **options)


def tree_worker(
    ckpt: SpecCheckpoints, algorithm: str, nodes: int, verified: list[VerifiedTree]
) -> TreeRoundWorker:
    """A topk-2 tree worker that records every verified tree in ``verified``."""
    worker = make_worker(ckpt, algorithm, nodes=nodes)
    assert isinstance(worker, TreeRoundWorker) and worker.tree_shape is not None
    caps = worker.capabilities
    assert caps.supports_per_request_speculation and caps.supports_logprobs
    assert caps.supports_penalties and caps.supports_min_new_tokens and caps.supports_seeds
    worker.observer = verified.append
    return worker


def serve(
    worker: WorkerProtocol,
    ckpt: SpecCheckpoints,
    requests: Sequence[tuple[Sequence[int], SamplingParams]],
    *,
    eos: int | None = None,
    **config: object,
) -> list[Req]:
    """Serve ``requests`` in one engine with every check on."""
    engine_config = EngineConfig(
        kv_tokens=2048,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **config,  # type: ignore[arg-type]
    )
    limits = RequestLimits(
        vocab_size=ckpt.vocab_size,
        max_context_len=64,
        eos_token_ids=set() if eos is None else {eos},
    )
    with Engine(worker, limits=limits, config=engine_config) as engine:
        reqs = [engine.submit(f"r{i}", list(p), params) for i, (p, params) in enumerate(requests)]
        run_checked(engine)
        snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    return reqs


def deep_paths(verified: list[VerifiedTree]) -> bool:
    """Some round accepted a path of depth >= 2 through a node that is not a first choice."""
    return any(
        bool((v.verdict.accept_lens > 2).any()) and bool(v.verdict.non_first_branch(v.tree).any())
        for v in verified
    )


# ------------------------------------------------------------------ per-request speculation


@pytest.mark.parametrize(("algorithm", "nodes", "overlap"), TREES)
def test_non_speculative_rows_on_a_tree_accept_one_token_and_all_equal_hf(
    ckpt: SpecCheckpoints, algorithm: str, nodes: int, overlap: bool
) -> None:
    """Each prompt twice (speculative or not) plus a sampled non-speculative row: lossless."""
    requests: list[tuple[Sequence[int], SamplingParams]] = [
        (prompt, SamplingParams(max_new_tokens=NEW_TOKENS, speculative=spec))
        for prompt in MIXED_PROMPTS
        for spec in (True, False)
    ]
    requests.append(
        (
            MIXED_PROMPTS[0],
            SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, speculative=False),
        )
    )
    verified: list[VerifiedTree] = []
    reqs = serve(tree_worker(ckpt, algorithm, nodes, verified), ckpt, requests, overlap=overlap)
    expected = [greedy(ckpt.hf, p, NEW_TOKENS) for p in MIXED_PROMPTS]
    assert [list(r.emitted_ids) for r in reqs[:-1]] == [e for e in expected for _ in range(2)]
    for req in [*reqs[1:-1:2], reqs[-1]]:  # one verify per output after the prefill's token
        assert req.accept_lengths == (1,) * (NEW_TOKENS - 1)
    assert len(reqs[-1].emitted_ids) == NEW_TOKENS
    assert any(a > 1 for r in reqs[0:-1:2] for a in r.accept_lengths)
    assert deep_paths(verified)


# ------------------------------------------------------- penalties, min_new_tokens, logprobs


@pytest.fixture(scope="module")
def eos(ckpt: SpecCheckpoints) -> int:
    """An EOS id that row 2 would emit early without ``min_new_tokens`` (so the mask matters)."""
    early, _ = hf_greedy(
        ckpt.hf, MIXED_PROMPTS[2], NEW_TOKENS, controls=Controls(repetition_penalty=1.2)
    )
    return early[2]


@pytest.fixture(scope="module")
def expected_controlled(ckpt: SpecCheckpoints, eos: int) -> list[tuple[list[int], list[float]]]:
    """HF's tokens and logprobs of every row under its controls (EOS stops every row)."""
    return [
        hf_greedy(ckpt.hf, prompt, NEW_TOKENS, controls=controls, eos=[eos])
        for prompt, controls in zip(MIXED_PROMPTS, ROW_CONTROLS, strict=True)
    ]


@pytest.mark.parametrize(("algorithm", "nodes", "overlap"), TREES)
def test_penalties_min_new_tokens_and_logprobs_on_a_tree_equal_hf(
    ckpt: SpecCheckpoints,
    eos: int,
    expected_controlled: list[tuple[list[int], list[float]]],
    algorithm: str,
    nodes: int,
    overlap: bool,
) -> None:
    """Every row's controls through a tree give HF's tokens exactly and its logprobs (2e-4)."""
    requests = [
        (
            prompt,
            SamplingParams(
                max_new_tokens=NEW_TOKENS,
                repetition_penalty=controls.repetition_penalty,
                frequency_penalty=controls.frequency_penalty,
                presence_penalty=controls.presence_penalty,
                min_new_tokens=controls.min_new_tokens,
                logprobs=True,
            ),
        )
        for prompt, controls in zip(MIXED_PROMPTS, ROW_CONTROLS, strict=True)
    ]
    verified: list[VerifiedTree] = []
    worker = tree_worker(ckpt, algorithm, nodes, verified)
    reqs = serve(worker, ckpt, requests, eos=eos, overlap=overlap)
    assert [list(r.emitted_ids) for r in reqs] == [tokens for tokens, _ in expected_controlled]
    for req, (_, want) in zip(reqs, expected_controlled, strict=True):
        assert req.logprobs is not None
        assert list(req.logprobs) == pytest.approx(want, abs=2e-4)
    assert reqs[2].emitted_ids[2] != eos  # the min_new_tokens mask changed the output
    assert any(a > 2 for r in reqs[:4] for a in r.accept_lengths), "no deep path was judged"
    assert deep_paths(verified)


# --------------------------------------------------------------------------------- seeds

SEEDED = SamplingParams(
    max_new_tokens=20,
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    repetition_penalty=1.2,
    seed=1234,
    logprobs=True,
)


@pytest.mark.parametrize(("algorithm", "nodes", "overlap"), TREES)
def test_a_seeded_request_emits_the_same_tokens_with_a_tree_a_chain_and_no_speculation(
    ckpt: SpecCheckpoints, algorithm: str, nodes: int, overlap: bool
) -> None:
    """The seeded row's tokens and logprobs are the chain's and the plain worker's; batch mates
    (an unseeded sampled row, a greedy row) ride along."""
    mates: list[tuple[Sequence[int], SamplingParams]] = [
        (MIXED_PROMPTS[1], SamplingParams(max_new_tokens=12, temperature=1.0)),
        (MIXED_PROMPTS[2], SamplingParams(max_new_tokens=12)),
    ]
    requests = [*mates, (MIXED_PROMPTS[0], SEEDED)]
    verified: list[VerifiedTree] = []
    tree = serve(tree_worker(ckpt, algorithm, nodes, verified), ckpt, requests, overlap=overlap)
    chain = serve(make_worker(ckpt, algorithm, topk=1), ckpt, requests[-1:], overlap=not overlap)
    plain = serve(make_worker(ckpt, "none"), ckpt, requests[1:], overlap=overlap)
    got = tree[-1]
    assert len(got.emitted_ids) == SEEDED.max_new_tokens
    for other in (chain[-1], plain[-1]):
        assert got.emitted_ids == other.emitted_ids
        assert got.logprobs is not None and other.logprobs is not None
        assert list(got.logprobs) == pytest.approx(list(other.logprobs), abs=1e-4)
    assert any(a > 1 for a in got.accept_lengths), got.accept_lengths
