"""Draft trees at the edges: a ``topk`` the vocabulary cannot fill, a request at the context end.

A tree reserves ``R = 2 * max(K * topk, D)`` tokens a round, far more than its verify width D;
a request whose prompt plus ``max_new_tokens`` is exactly the model's context must still run to
its length cap, token for token what HF ``generate()`` gives, with every invariant checked.
"""

from __future__ import annotations

import pytest
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import SpecCheckpoints

from specstate import RequestLimits, SamplingParams
from specstate.core.errors import InvalidConfig
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.reference.workers import default_registry

CONTEXT = 40


@pytest.mark.parametrize("algorithm", ["eagle", "draft_model"])
def test_a_topk_above_the_vocabulary_is_refused_where_the_worker_is_made(
    partial_ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """``topk`` > vocab: `InvalidConfig` at creation naming both, not an ERROR on every request."""
    drafter = (
        {"eagle": partial_ckpt.eagle} if algorithm == "eagle" else {"draft": partial_ckpt.draft}
    )
    with pytest.raises(InvalidConfig, match=r"topk 98 exceeds the vocabulary of 97 tokens"):
        default_registry().create(
            algorithm, target=partial_ckpt.target, num_steps=2, topk=98, **drafter
        )
    worker = default_registry().create(  # the whole vocabulary is a legal topk
        algorithm, target=partial_ckpt.target, num_steps=1, topk=97, **drafter
    )
    assert worker.capabilities.topk == 97


@pytest.mark.parametrize(
    ("algorithm", "topk", "nodes", "page_size", "overlap"),
    [
        ("eagle", 4, 4, 1, False),  # R = 24, D = 4: the reservation is 6x the verify width
        ("eagle", 4, 4, 1, True),
        ("draft_model", 3, 8, 1, True),
        ("eagle", 2, 5, 4, False),
        ("eagle", 1, None, 1, True),  # a chain too
    ],
)
def test_a_legal_tree_at_the_context_end_runs_to_its_cap(
    partial_ckpt: SpecCheckpoints,
    algorithm: str,
    topk: int,
    nodes: int | None,
    page_size: int,
    overlap: bool,
) -> None:
    """prompt + max_new_tokens == max_context_len: no LedgerViolation, HF's tokens, idle after."""
    drafter = (
        {"eagle": partial_ckpt.eagle} if algorithm == "eagle" else {"draft": partial_ckpt.draft}
    )
    worker = default_registry().create(
        algorithm,
        target=partial_ckpt.target,
        num_steps=3,
        topk=topk,
        num_draft_tokens=nodes,
        **drafter,
    )
    limits = RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=CONTEXT)
    config = EngineConfig(
        overlap=overlap,
        page_size=page_size,
        kv_tokens=1024,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    prompts = [[5, 9, 13, 2, 7, 61, 3, 3], [88, 1]]
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=CONTEXT - len(p)))
            for i, p in enumerate(prompts)
        ]
        run_checked(engine, max_steps=200)
        snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    for req, prompt in zip(reqs, prompts, strict=True):
        assert req.finish is not None and req.finish.reason.value == "length"
        assert list(req.emitted_ids) == greedy(partial_ckpt.hf, prompt, CONTEXT - len(prompt))
        assert len(prompt) + len(req.emitted_ids) == CONTEXT
    assert any(a > 1 for r in reqs for a in r.accept_lengths)  # drafts were accepted
