"""Verify budgets on the reference workers: every chain family is exact against HF ``generate()``
with ragged budgets (0 to the width), and a row at budget 0 for many rounds speculates again with
a fresh request's acceptance (the chain families and the block drafters dflash, uno, dspark)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from block_checkpoints import BLOCK_FAMILIES, BlockCheckpoints
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints

from specstate import Engine, EngineConfig, Req, RequestLimits, SamplingParams
from specstate.engine.budgets import BudgetRows, SettledBudgets
from specstate.engine.worker import WorkerProtocol
from specstate.memory.host_arrays import IntArray
from specstate.reference.workers import default_registry

NEW_TOKENS = 14
ALGORITHMS = ("draft_model", "eagle", "ngram", "mtp", "eagle3", "frozen_kv_mtp")


class _Ragged:
    """Budgets cycle with the request and the round: every budget from 0 to the width occurs,
    for every request, and changes from round to round."""

    def __init__(self) -> None:
        self.rounds = 0

    def plan(self, rows: BudgetRows) -> IntArray:
        self.rounds += 1
        return np.array(
            [(int(r[1:]) + self.rounds) % (rows.width + 1) for r in rows.request_ids],
            dtype=np.int64,
        )

    def observe(self, settled: SettledBudgets) -> None:
        pass

    def forget(self, request_ids: Sequence[str]) -> None:
        pass


def _engine(
    ckpt: SpecCheckpoints,
    algorithm: str,
    policy: object,
    *,
    overlap: bool,
    page_size: int,
    kv_tokens: int = 2048,
    prefix_cache: bool = True,
    chunked: int | None = None,
) -> Engine:
    return Engine(
        ckpt.worker(algorithm, agreeing=False),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(
            overlap=overlap,
            page_size=page_size,
            kv_tokens=kv_tokens,
            check_invariants=True,
            prefix_cache=prefix_cache,
            chunked_prefill=chunked,
        ),
        verify_budget=policy,  # type: ignore[arg-type]
    )


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize(("overlap", "page_size"), [(False, 1), (True, 16)])
def test_ragged_budgets_are_lossless(
    partial_ckpt: SpecCheckpoints, algorithm: str, overlap: bool, page_size: int
) -> None:
    """Greedy output equals HF generate() whatever each row's budget, and budgets really cut
    runs (a run of budget + 1 where the full width would have gone on)."""
    policy = _Ragged()
    engine = _engine(partial_ckpt, algorithm, policy, overlap=overlap, page_size=page_size)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    with engine:
        run_checked(engine, max_steps=400)
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert list(req.emitted_ids) == greedy(partial_ckpt.hf, list(prompt), NEW_TOKENS)
        assert all(
            a <= v + 1 for a, v in zip(req.accept_lengths, req.verified_lengths, strict=True)
        )
    widths = {v for r in reqs for v in r.verified_lengths}
    assert 0 in widths and len(widths) > 2
    assert any(
        1 < a < v + 1
        for r in reqs
        for a, v in zip(r.accept_lengths, r.verified_lengths, strict=True)
    )


@pytest.mark.parametrize("algorithm", ["draft_model", "eagle"])
def test_ragged_budgets_under_kv_pressure_and_chunked_prefill(
    partial_ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """A pool too small for every request retracts some; chunked prefill, no prefix cache;
    still exact."""
    policy = _Ragged()
    engine = _engine(
        partial_ckpt,
        algorithm,
        policy,
        overlap=True,
        page_size=4,
        kv_tokens=96,
        prefix_cache=False,
        chunked=8,
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    with engine:
        log = run_checked(engine, max_steps=600)
    assert log.retracted, "the pool was meant to force a retraction"
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert list(req.emitted_ids) == greedy(partial_ckpt.hf, list(prompt), NEW_TOKENS)


class _ZeroThenFull:
    """Request ``late`` verifies nothing for its first ``rounds_off`` rounds, then everything;
    every other request always verifies the full width."""

    def __init__(self, rounds_off: int) -> None:
        self.rounds_off = rounds_off
        self.planned = 0

    def plan(self, rows: BudgetRows) -> IntArray:
        out = np.full(rows.batch_size, rows.width, dtype=np.int64)
        if "late" in rows.request_ids:
            self.planned += 1
            if self.planned <= self.rounds_off:
                out[rows.request_ids.index("late")] = 0
        return out

    def observe(self, settled: SettledBudgets) -> None:
        pass

    def forget(self, request_ids: Sequence[str]) -> None:
        pass


@pytest.mark.parametrize("algorithm", ["draft_model", "eagle", "mtp"])
def test_a_row_back_from_budget_zero_accepts_as_a_fresh_request(
    partial_ckpt: SpecCheckpoints, algorithm: str
) -> None:
    """Ten rounds at budget 0 (plain decoding), then the full width: its accept lengths from
    there equal those of a fresh request started on its text at that point (the drafter's state
    kept up while it did not speculate)."""
    prompt = list(MIXED_PROMPTS[1])
    off = 10
    engine = _engine(partial_ckpt, algorithm, _ZeroThenFull(off), overlap=False, page_size=1)
    with engine:
        late = engine.submit("late", prompt, SamplingParams(max_new_tokens=off + 12))
        run_checked(engine, max_steps=400)
    assert late.accept_lengths[:off] == (1,) * off and late.verified_lengths[:off] == (0,) * off
    resumed = late.accept_lengths[off:]
    text = prompt + list(late.emitted_ids[:off])
    fresh_engine = _engine(partial_ckpt, algorithm, _ZeroThenFull(0), overlap=False, page_size=1)
    with fresh_engine:
        fresh = fresh_engine.submit("fresh", text, SamplingParams(max_new_tokens=12))
        run_checked(fresh_engine, max_steps=400)
    assert list(late.emitted_ids[off:]) == list(fresh.emitted_ids)
    assert resumed[: len(fresh.accept_lengths)] == fresh.accept_lengths
    assert any(a > 1 for a in resumed)  # it really speculates again


def _block_worker(
    ckpt: BlockCheckpoints, family: str, dspark_assistant: Path, **options: object
) -> WorkerProtocol:
    if family == "dspark":
        return default_registry().create(
            "dspark", target=ckpt.target, assistant=dspark_assistant, **options
        )
    return ckpt.worker(family, **options)


@pytest.mark.parametrize("family", [*BLOCK_FAMILIES, "dspark"])
@pytest.mark.parametrize(("overlap", "page_size"), [(False, 1), (True, 16)])
def test_a_block_drafter_back_from_budget_zero_accepts_as_a_fresh_request(
    block_ckpt: BlockCheckpoints,
    dspark_assistant: Path,
    family: str,
    overlap: bool,
    page_size: int,
) -> None:
    """The block drafters keep their state up while a row verifies nothing (the TensorRT-LLM
    #16888 class): ten rounds at budget 0, then the full width, accept as a fresh request
    started on the same text does."""
    prompt = list(MIXED_PROMPTS[1])
    off = 10

    def serve(rid: str, text: list[int], rounds_off: int, new: int) -> Req:
        engine = Engine(
            _block_worker(block_ckpt, family, dspark_assistant),
            limits=RequestLimits(vocab_size=block_ckpt.vocab_size, max_context_len=96),
            config=EngineConfig(overlap=overlap, page_size=page_size, check_invariants=True),
            verify_budget=_ZeroThenFull(rounds_off),
        )
        with engine:
            req = engine.submit(rid, text, SamplingParams(max_new_tokens=new))
            run_checked(engine, max_steps=400)
        return req

    late = serve("late", prompt, off, off + 16)
    assert late.accept_lengths[:off] == (1,) * off and late.verified_lengths[:off] == (0,) * off
    fresh = serve("fresh", prompt + list(late.emitted_ids[:off]), 0, 16)
    assert list(late.emitted_ids[off:]) == list(fresh.emitted_ids)
    resumed = late.accept_lengths[off:]
    assert resumed[: len(fresh.accept_lengths)] == fresh.accept_lengths
    assert any(a > 1 for a in resumed)  # it really speculates again


@pytest.mark.slow
@pytest.mark.parametrize("family", BLOCK_FAMILIES)
@pytest.mark.parametrize(("overlap", "page_size"), [(False, 1), (True, 16)])
def test_ragged_budgets_are_lossless_for_the_block_drafters(
    block_ckpt: BlockCheckpoints, family: str, overlap: bool, page_size: int
) -> None:
    """DFLASH and UNO under ragged budgets: HF's greedy tokens, each run at most its budget
    + 1, every budget from 0 to the width used (the worker declares budget support)."""
    options: dict[str, object] = {"check_commit_order": True} if family == "dflash" else {}
    worker = block_ckpt.worker(family, **options)
    assert worker.capabilities.supports_verify_budgets
    engine = Engine(
        worker,
        limits=RequestLimits(vocab_size=block_ckpt.vocab_size, max_context_len=96),
        config=EngineConfig(overlap=overlap, page_size=page_size, check_invariants=True),
        verify_budget=_Ragged(),
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    with engine:
        run_checked(engine, max_steps=400)
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert list(req.emitted_ids) == greedy(block_ckpt.hf, list(prompt), NEW_TOKENS)
        pairs = zip(req.accept_lengths, req.verified_lengths, strict=True)
        assert all(a <= v + 1 for a, v in pairs)
    width = worker.capabilities.num_steps
    assert {v for r in reqs for v in r.verified_lengths} >= set(range(width + 1))


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
@pytest.mark.parametrize(("overlap", "page_size", "kv_tokens"), [(True, 1, 64), (False, 16, 128)])
def test_ragged_budgets_of_the_block_drafters_under_kv_pressure(
    block_ckpt: BlockCheckpoints, family: str, overlap: bool, page_size: int, kv_tokens: int
) -> None:
    """A pool too small for every request: retracted requests' slots are reused while other
    rows run short budgets. A block draft writes nothing past its row's budget (DFLASH's
    scratch K/V, UNO's first pass into the target's KV would land in slots a stale table
    entry names), so the tokens stay exact and DFLASH's reads find their commits."""
    options: dict[str, object] = {"check_commit_order": True} if family == "dflash" else {}
    engine = Engine(
        block_ckpt.worker(family, **options),
        limits=RequestLimits(vocab_size=block_ckpt.vocab_size, max_context_len=96),
        config=EngineConfig(
            overlap=overlap,
            page_size=page_size,
            kv_tokens=kv_tokens,
            check_invariants=True,
            prefix_cache=False,
        ),
        verify_budget=_Ragged(),
    )
    params = SamplingParams(max_new_tokens=16)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    with engine:
        log = run_checked(engine, max_steps=800)
    assert log.retracted, "the pool was meant to force a retraction"
    for req, prompt in zip(reqs, MIXED_PROMPTS, strict=True):
        assert list(req.emitted_ids) == greedy(block_ckpt.hf, list(prompt), 16)
