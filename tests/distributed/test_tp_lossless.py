"""Tensor parallelism is lossless: TP = 2 with speculation emits what TP = 2 without it does.

One spawn of two gloo ranks serves a whole matrix (every algorithm, chain and tree, both loops,
page 1 and 16, chunked prefill with mixed chunks, aborts, KV pressure with retraction, the
adaptive draft width, seeded and unseeded sampled requests), with every rank's plans and
results compared each round (``check_agreement``) and the invariant checker after each step.

A sharded matmul sums in another order than the whole one (about 4e-6 apart in float32), so a
greedy token of TP = 2 equals one of TP = 1 only where the top two logits are further apart than
that. The greedy prompts are screened: Hugging Face ``generate()`` runs each candidate with its
scores recorded, and a prompt is kept only if the top-2 margin exceeds ``MARGIN`` at every step.
On those, TP = 2 must equal TP = 1 and ``generate()`` token for token.
"""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from margin_screen import screen
from spec_checkpoints import SpecCheckpoints
from tp_programs import LIMITS_VOCAB, lossless_matrix, reference_worker

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.distributed import spawn_ranks
from specstate.engine.worker import WorkerCapabilities
from specstate.reference.workers.tree import tree_capabilities

NEW_TOKENS = 12
TREE: dict[str, object] = {"topk": 2, "num_draft_tokens": 6}
WORKERS: dict[str, tuple[str, dict[str, object]]] = {
    "ngram": ("ngram", {}),
    "draft_model": ("draft_model", {}),
    "draft_model_tree": ("draft_model", TREE),
    "eagle": ("eagle", {}),
    "eagle_tree": ("eagle", TREE),
}
TREE_CAPS = tree_capabilities("eagle", num_steps=3, topk=2, num_draft_tokens=6)
CHECKED = EngineConfig(check_invariants=True, check_ownership=True, debug_relay=True)
CONFIGS = {
    "normal-p1": attrs.evolve(CHECKED, overlap=False, page_size=1, kv_tokens=2048),
    "overlap-p16-chunked": attrs.evolve(
        CHECKED, overlap=True, page_size=16, kv_tokens=2048, chunked_prefill=4, mixed_chunk=True
    ),
}
PRESSURE = attrs.evolve(CHECKED, overlap=True, page_size=4, kv_tokens=128)
"""KV pressure; the pool holds one and a half of the longest request (`_pressure_tokens`)."""


@pytest.fixture(scope="module")
def screened(partial_ckpt: SpecCheckpoints) -> dict[tuple[int, ...], list[int]]:
    """Greedy prompts whose top-2 margin exceeds MARGIN at every step, with HF's tokens."""
    return screen(
        partial_ckpt.hf,
        (2, 7, 15, 4, 11, 3, 9, 5, 13, 6),
        vocab_size=LIMITS_VOCAB,
        max_new_tokens=NEW_TOKENS,
        keep=4,
    )


def _requests(
    screened: dict[tuple[int, ...], list[int]],
) -> list[tuple[str, tuple[int, ...], SamplingParams]]:
    greedy = [
        (f"g{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS)) for i, p in enumerate(screened)
    ]
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9)
    return [
        *greedy,
        ("seeded", (5, 17, 33, 5, 17), attrs.evolve(sampled, seed=1234)),
        ("unseeded", (8, 9, 10), sampled),
    ]


def _pressure_tokens(
    requests: list[tuple[str, tuple[int, ...], SamplingParams]], caps: WorkerCapabilities
) -> int:
    """A pool that holds the longest request alone (prompt, outputs, reservation) but not all."""
    page = PRESSURE.page_size
    longest = max(len(p) for _, p, _ in requests) + NEW_TOKENS + caps.spec_window(page).reserve
    need = -(-longest // page) * page + page
    return need + need // 2 + page


def _scenarios(screened: dict[tuple[int, ...], list[int]]) -> list[dict[str, Any]]:
    requests = _requests(screened)
    out = []
    for config_name, config in CONFIGS.items():
        aborts = ((3, "g0"),) if config.overlap else ()
        for name, (algorithm, options) in {"none": ("none", {}), **WORKERS}.items():
            out.append(
                {
                    "name": f"{name}/{config_name}",
                    "algorithm": algorithm,
                    "options": options,
                    "config": config,
                    "requests": requests,
                    "aborts": aborts,
                }
            )
    for name, caps in (("none", WorkerCapabilities(algorithm="none")), ("eagle_tree", TREE_CAPS)):
        algorithm, options = ("none", {}) if name == "none" else WORKERS[name]
        out.append(
            {
                "name": f"{name}/pressure",
                "algorithm": algorithm,
                "options": options,
                "config": attrs.evolve(PRESSURE, kv_tokens=_pressure_tokens(requests, caps)),
                "requests": requests,
            }
        )
    out.append(
        {
            "name": "draft_model/adaptive",
            "algorithm": "draft_model",
            "options": {},
            "config": attrs.evolve(CONFIGS["overlap-p16-chunked"], adaptive_draft=True),
            "requests": requests,
        }
    )
    return out


@pytest.fixture(scope="module")
def ckpt_paths(partial_ckpt: SpecCheckpoints) -> dict[str, str]:
    """The partly agreeing drafters' checkpoints, as paths."""
    return {k: str(getattr(partial_ckpt, k)) for k in ("target", "draft", "eagle")}


@pytest.fixture(scope="module")
def ranks(
    ckpt_paths: dict[str, str], screened: dict[tuple[int, ...], list[int]]
) -> list[dict[str, dict[str, Any]]]:
    """Both ranks' results of the whole matrix, from one spawn."""
    outcomes = spawn_ranks(
        lossless_matrix, (ckpt_paths, _scenarios(screened)), world_size=2, timeout_s=300
    )
    for outcome in outcomes:
        assert outcome.ok, outcome.traceback or outcome.error
    return [o.result for o in outcomes]


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
    screened: dict[tuple[int, ...], list[int]],
    partial_ckpt: SpecCheckpoints,
) -> None:
    """On prompts whose greedy margin exceeds MARGIN, TP = 2 == TP = 1 == transformers."""
    worker = reference_worker({"target": str(partial_ckpt.target)}, "none")
    limits = RequestLimits(vocab_size=LIMITS_VOCAB, max_context_len=256)
    with Engine(worker, limits=limits, config=EngineConfig(kv_tokens=2048)) as engine:
        single = engine.generate(list(screened), SamplingParams(max_new_tokens=NEW_TOKENS))
    hf = list(screened.values())
    assert [list(t) for t in single] == hf
    tp2 = ranks[0]["none/normal-p1"]["outputs"]
    assert [list(tp2[f"g{i}"][0]) for i in range(len(hf))] == hf
