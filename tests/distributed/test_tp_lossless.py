"""Tensor parallelism is lossless: TP = 2 with speculation emits what TP = 2 without it does.

One spawn of two gloo ranks (the session's healthy group, `conftest.py`) serves a whole matrix
(`tp_matrix`: every algorithm, chain and tree, both loops, page 1 and 16, chunked prefill with
mixed chunks, aborts, KV pressure with retraction, the adaptive draft width, seeded and unseeded
sampled requests), with every rank's plans and results compared each round
(``check_agreement``) and the invariant checker after each step.

A sharded matmul sums in another order than the whole one (about 4e-6 apart in float32), so a
greedy token of TP = 2 equals one of TP = 1 only where the top two logits are further apart than
that. The greedy prompts are screened (`margin_screen`): Hugging Face ``generate()`` runs each
candidate with its scores recorded, and a prompt is kept only if the top-2 margin exceeds 1e-3
at every step. On those, TP = 2 must equal TP = 1 and ``generate()`` token for token.
"""

from __future__ import annotations

from typing import Any

import pytest
from spec_checkpoints import SpecCheckpoints
from tp_matrix import NEW_TOKENS
from tp_programs import LIMITS_VOCAB, reference_worker

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams


@pytest.fixture(scope="module")
def ranks(tp_healthy: list[dict[str, Any]]) -> list[dict[str, dict[str, Any]]]:
    """Both ranks' results of the whole matrix."""
    return [rank["matrix"] for rank in tp_healthy]


def test_every_run_is_clean_and_checked(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """No run raised, the pools balance, and the ranks compared plans and results each round."""
    for result in ranks:
        for name, run in result.items():
            assert run["error"] is None, (name, run["error"])
            assert run["balanced"], name
            assert run["checked"] > 2 * run["steps"] // 2, name


def test_every_rank_emits_the_same(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """Tokens, finishes and accept lengths are identical on both ranks, sampled rows included."""
    first, second = ranks
    assert first.keys() == second.keys()
    for name in first:
        assert first[name]["outputs"] == second[name]["outputs"], name


def test_speculation_equals_no_speculation(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """Every algorithm, loop, page, chunking and pressure run: greedy and seeded rows as none's."""
    runs = ranks[0]
    baseline = runs["none/normal-p1"]["outputs"]
    for name, run in runs.items():
        for rid, (tokens, reason, _, _) in run["outputs"].items():
            if rid == "unseeded" or reason == "abort":
                continue
            assert reason == "length", (name, rid, reason)
            assert tokens == baseline[rid][0], (name, rid)


def test_speculating_runs_accept_partly(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """Each speculative run has accept lengths strictly between 1 and its maximum."""
    for name, run in ranks[0].items():
        if name.startswith("none/"):
            continue
        accepts = {a for _, _, _, lens in run["outputs"].values() for a in lens}
        top = 4  # chains: 3 steps + bonus; trees: 3 levels + root
        assert any(1 < a < top for a in accepts), (name, accepts)


def test_ragged_budgets_take_rank_0s_plan(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """Each rank's own policy plans differently; the rounds run rank 0's budgets on both (the
    plan digests agree, the run is clean), ragged and including 0, and the tokens are none's."""
    first, second = ranks
    run = first["eagle/budgets"]
    assert run["error"] is None and run["checked"] > 0
    assert run["outputs"] == second["eagle/budgets"]["outputs"]
    assert run["verified"] == second["eagle/budgets"]["verified"]
    verified = {v for lengths in run["verified"].values() for v in lengths}
    assert 0 in verified and len(verified) > 2, verified


def test_pressure_retracts_and_aborts_land(ranks: list[dict[str, dict[str, Any]]]) -> None:
    """The small pool made requests retract; the aborted request ended as aborted everywhere."""
    runs = ranks[0]
    assert runs["eagle_tree/pressure"]["retracted"] > 0
    assert runs["none/pressure"]["retracted"] > 0
    for name, run in runs.items():
        if name.endswith("overlap-p16-chunked"):
            assert run["outputs"]["g0"][1] == "abort", name


def test_tp2_equals_tp1_and_hf_on_screened_prompts(
    ranks: list[dict[str, dict[str, Any]]],
    tp_screened: dict[tuple[int, ...], list[int]],
    partial_ckpt: SpecCheckpoints,
) -> None:
    """On prompts whose greedy margin exceeds MARGIN, TP = 2 == TP = 1 == transformers."""
    worker = reference_worker({"target": str(partial_ckpt.target)}, "none")
    limits = RequestLimits(vocab_size=LIMITS_VOCAB, max_context_len=256)
    with Engine(worker, limits=limits, config=EngineConfig(kv_tokens=2048)) as engine:
        single = engine.generate(list(tp_screened), SamplingParams(max_new_tokens=NEW_TOKENS))
    hf = list(tp_screened.values())
    assert [list(t) for t in single] == hf
    tp2 = ranks[0]["none/normal-p1"]["outputs"]
    assert [list(tp2[f"g{i}"][0]) for i in range(len(hf))] == hf
