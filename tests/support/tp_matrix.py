"""Test-only: the tensor-parallel lossless matrix (`tests/distributed/test_tp_lossless.py`).

Every algorithm (chain and tree; mtp and eagle3 among them) in two configurations (normal
loop at page 1; overlap loop at page 16 with chunked prefill, mixed chunks and an abort), KV
pressure with retraction, and the adaptive draft width, each serving the same margin-screened
greedy prompts plus a seeded and an unseeded sampled request.
"""

from __future__ import annotations

from typing import Any

import attrs

from specstate import EngineConfig, SamplingParams
from specstate.engine.worker import WorkerCapabilities
from specstate.reference.workers.tree_draft import tree_capabilities

NEW_TOKENS = 12
TREE: dict[str, object] = {"topk": 2, "num_draft_tokens": 6}
WORKERS: dict[str, tuple[str, dict[str, object]]] = {
    "ngram": ("ngram", {}),
    "draft_model": ("draft_model", {}),
    "draft_model_tree": ("draft_model", TREE),
    "eagle": ("eagle", {}),
    "eagle_tree": ("eagle", TREE),
    "mtp": ("mtp", {}),
    "eagle3": ("eagle3", {}),
    "eagle3_tree": ("eagle3", TREE),
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
"""KV pressure; the pool holds one and a half of the longest request (`pressure_tokens`)."""


def matrix_requests(
    screened: dict[tuple[int, ...], list[int]],
) -> list[tuple[str, tuple[int, ...], SamplingParams]]:
    """The screened greedy prompts, a seeded and an unseeded sampled request."""
    greedy = [
        (f"g{i}", p, SamplingParams(max_new_tokens=NEW_TOKENS)) for i, p in enumerate(screened)
    ]
    sampled = SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.8, top_p=0.9)
    return [
        *greedy,
        ("seeded", (5, 17, 33, 5, 17), attrs.evolve(sampled, seed=1234)),
        ("unseeded", (8, 9, 10), sampled),
    ]


def pressure_tokens(
    requests: list[tuple[str, tuple[int, ...], SamplingParams]], caps: WorkerCapabilities
) -> int:
    """A pool that holds the longest request alone (prompt, outputs, reservation) but not all."""
    page = PRESSURE.page_size
    longest = max(len(p) for _, p, _ in requests) + NEW_TOKENS + caps.spec_window(page).reserve
    need = -(-longest // page) * page + page
    return need + need // 2 + page


def matrix_scenarios(screened: dict[tuple[int, ...], list[int]]) -> list[dict[str, Any]]:
    """Every algorithm in both configurations (aborts in the overlap one), two pressure runs,
    an adaptive one and one with ragged verify budgets, all serving `matrix_requests`."""
    requests = matrix_requests(screened)
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
                "config": attrs.evolve(PRESSURE, kv_tokens=pressure_tokens(requests, caps)),
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
    out.append(  # ragged verify budgets, rank 0's plan broadcast (and digested) every round
        {
            "name": "eagle/budgets",
            "algorithm": "eagle",
            "options": {},
            "config": CONFIGS["overlap-p16-chunked"],
            "requests": requests,
            "budgets": True,
        }
    )
    return out
