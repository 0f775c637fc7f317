"""Per-request seeds: a seeded sampled request emits the same tokens whatever happens around it.

Its token at position ``p`` is the inverse CDF of the target's (processed, filtered)
distribution at the counter-based uniform ``u(seed, p)``; speculation only decides how many of
those tokens a round accepts. So the output must not change with its batch mates, the loop,
the worker's own seed, the algorithm (the drafter), chunked prefill with mixed chunks, or a
retraction and re-prefill under KV pressure.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from engine_driver import DriveLog, run_checked
from spec_checkpoints import (
    FAMILIES,
    MIXED_PROMPTS,
    SpecCheckpoints,
    family_options,
)

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import WorkerProtocol
from specstate.reference.workers import default_registry

NEW_TOKENS = 20
STEPS = 3
SEEDED = SamplingParams(
    max_new_tokens=NEW_TOKENS,
    temperature=0.9,
    top_k=40,
    top_p=0.95,
    repetition_penalty=1.2,
    seed=1234,
    logprobs=True,
)
PROMPT = MIXED_PROMPTS[0]


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


def worker_of(ckpt: SpecCheckpoints, algorithm: str, *, worker_seed: int = 0) -> WorkerProtocol:
    """A reference worker with its own generator seeded ``worker_seed``."""
    options: dict[str, object] = {"target": ckpt.target, "seed": worker_seed}
    if algorithm != "none":
        options["num_steps"] = STEPS
    if algorithm == "draft_model":
        options["draft"] = ckpt.draft
    if algorithm == "eagle":
        options["eagle"] = ckpt.eagle
    if algorithm in FAMILIES:
        options.update(family_options(ckpt.target, algorithm))
    return default_registry().create(algorithm, **options)


def run(
    worker: WorkerProtocol,
    ckpt: SpecCheckpoints,
    mates: Sequence[tuple[Sequence[int], SamplingParams]],
    **config: object,
) -> tuple[tuple[int, ...], tuple[float, ...], tuple[int, ...], int, DriveLog]:
    """The seeded request (submitted after ``mates``): tokens, logprobs, accepts, incarnation."""
    engine_config = EngineConfig(
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
        **{"kv_tokens": 2048, **config},  # type: ignore[arg-type]
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=engine_config) as engine:
        for i, (prompt, params) in enumerate(mates):
            engine.submit(f"m{i}", prompt, params)
        req = engine.submit("seeded", PROMPT, SEEDED)
        log = run_checked(engine)
    assert req.logprobs is not None
    return req.emitted_ids, req.logprobs, req.accept_lengths, req.incarnation, log


def test_a_seeded_request_emits_the_same_tokens_whatever_happens_around_it(
    ckpt: SpecCheckpoints,
) -> None:
    """Alone, batched, either loop, any worker seed, any drafter, chunked, retracted: equal."""
    mates = [
        (prompt, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=1.0, seed=None))
        for prompt in MIXED_PROMPTS[1:]
    ] + [(PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS, temperature=0.7, seed=99))]
    alone = run(worker_of(ckpt, "draft_model"), ckpt, [], overlap=False)
    tokens, logprobs, accepts, _, _ = alone
    assert len(tokens) == NEW_TOKENS
    assert any(1 < a < STEPS + 1 for a in accepts)  # it speculated, and runs were cut
    variants = {
        "batched, overlap, another worker seed": run(
            worker_of(ckpt, "draft_model", worker_seed=7), ckpt, mates, overlap=True
        ),
        "no speculation": run(worker_of(ckpt, "none"), ckpt, mates[:2], overlap=True),
        "eagle, chunked, mixed": run(
            worker_of(ckpt, "eagle"), ckpt, mates, overlap=True, chunked_prefill=3, mixed_chunk=True
        ),
        "ngram, normal": run(worker_of(ckpt, "ngram"), ckpt, mates[2:], overlap=False),
        "mtp, page 16": run(worker_of(ckpt, "mtp"), ckpt, mates, overlap=True, page_size=16),
        "eagle3, normal": run(worker_of(ckpt, "eagle3"), ckpt, mates, overlap=False),
        "frozen_kv_mtp, chunked": run(
            worker_of(ckpt, "frozen_kv_mtp"), ckpt, mates, overlap=True, chunked_prefill=3
        ),
        "retracted under KV pressure": run(
            worker_of(ckpt, "draft_model"), ckpt, mates, overlap=True, kv_tokens=120, page_size=4
        ),
    }
    for name, (got, lps, _, _, _) in variants.items():
        assert got == tokens, name
        assert lps == pytest.approx(logprobs, abs=1e-4), name
    retracted = variants["retracted under KV pressure"]
    assert retracted[3] >= 1 and "seeded" in retracted[4].retracted


def test_different_seeds_give_different_tokens(ckpt: SpecCheckpoints) -> None:
    """The seed matters: nine seeds of one prompt give more than one continuation."""
    requests = [SamplingParams(max_new_tokens=8, temperature=1.0, seed=seed) for seed in range(9)]
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    config = EngineConfig(kv_tokens=2048, check_invariants=True)
    with Engine(worker_of(ckpt, "draft_model"), limits=limits, config=config) as engine:
        reqs = [engine.submit(f"s{i}", PROMPT, p) for i, p in enumerate(requests)]
        run_checked(engine)
    assert len({r.emitted_ids for r in reqs}) > 1
