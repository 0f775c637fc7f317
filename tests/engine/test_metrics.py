"""Prometheus metrics: the exported counters reconcile exactly with every request's sums.

A run with partially agreeing drafters (every accept length occurs) and an abort while the
request's round is in flight (its unsettled draft never counts): scraped through a real
``prometheus_client`` registry and parsed back from the exposition text.
"""

from __future__ import annotations

import pytest
from engine_driver import run_checked
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from spec_checkpoints import (
    MIXED_PROMPTS,
    SpecCheckpoints,
)

from specstate import RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.metrics import register_metrics


@pytest.fixture(scope="module")
def ckpt(partial_ckpt: SpecCheckpoints) -> SpecCheckpoints:
    """A target with partially agreeing drafters (built once per session)."""
    return partial_ckpt


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_exported_counters_equal_the_per_request_sums(ckpt: SpecCheckpoints) -> None:
    """Accepted tokens, verifies, drafts and the per-position counts reconcile exactly."""
    engine = Engine(
        ckpt.worker("eagle", agreeing=False),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(overlap=True, kv_tokens=1024, check_invariants=True),
    )
    registry = CollectorRegistry()
    register_metrics(engine, registry)
    params = SamplingParams(max_new_tokens=20)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    for _ in range(4):
        engine.step()
    live = _scrape(registry)
    assert live[("specstate_requests", (("state", "running"),))] > 0
    assert engine.in_flight is not None
    engine.abort("r0")  # its round in flight never settles: not a verify, not a draft
    run_checked(engine, max_steps=300)
    engine.close()
    got = _scrape(registry)
    lengths = [a for r in reqs for a in r.accept_lengths]
    d = engine.worker.capabilities.num_draft_tokens
    assert got[("specstate_spec_verifies_total", ())] == len(lengths) > 0
    assert got[("specstate_spec_accepted_tokens_total", ())] == sum(lengths)
    assert got[("specstate_spec_accepted_drafts_total", ())] == sum(lengths) - len(lengths)
    assert got[("specstate_spec_draft_tokens_total", ())] == len(lengths) * (d - 1)
    for k in range(1, d):
        at_k = got[("specstate_spec_accepted_drafts_by_position_total", (("position", str(k)),))]
        assert at_k == sum(1 for a in lengths if a >= k + 1)
    assert got[("specstate_spec_accepted_drafts_by_position_total", (("position", "2"),))] > 0
    for length in set(lengths):
        key = ("specstate_spec_verifies_by_accept_length_total", (("length", str(length)),))
        assert got[key] == lengths.count(length)
    assert got[("specstate_kv_free_pages", ())] == got[("specstate_kv_pages", ())]
    assert got[("specstate_requests", (("state", "running"),))] == 0


def test_budget_counters_reconcile_with_what_each_request_verified() -> None:
    """Under a verify-budget policy: drafts verified and rejected, per position, and the rows
    planned at each budget equal the sums over the requests' verified and accept lengths."""
    import numpy as np

    from specstate.engine.budgets import BudgetRows, SettledBudgets
    from specstate.memory.host_arrays import IntArray
    from specstate.tools.timed_worker import TimedWaitWorker

    class _Ragged:
        def plan(self, rows: BudgetRows) -> IntArray:
            return np.array([int(r[1:]) % (rows.width + 1) for r in rows.request_ids])

        def observe(self, settled: SettledBudgets) -> None:
            pass

        def forget(self, request_ids: object) -> None:
            pass

    worker = TimedWaitWorker(device_seconds=0.0, num_steps=3, accept_rates=[0.8, 0.6, 0.4], seed=3)
    engine = Engine(
        worker,
        limits=RequestLimits(vocab_size=64, max_context_len=256),
        config=EngineConfig(overlap=True, kv_tokens=2048, check_invariants=True),
        verify_budget=_Ragged(),
    )
    registry = CollectorRegistry()
    register_metrics(engine, registry)
    params = SamplingParams(max_new_tokens=24, ignore_eos=True)
    reqs = [engine.submit(f"r{i}", [1, 2, 3], params) for i in range(6)]
    run_checked(engine, max_steps=300)
    engine.close()
    got = _scrape(registry)
    verified = [v for r in reqs for v in r.verified_lengths]
    accepted = [a - 1 for r in reqs for a in r.accept_lengths]
    assert got[("specstate_spec_draft_tokens_total", ())] == sum(verified)
    assert got[("specstate_spec_rejected_drafts_total", ())] == sum(verified) - sum(accepted)
    for k in (1, 2, 3):
        per_position = sum(v >= k for v in verified)
        assert got[
            ("specstate_spec_verified_drafts_by_position_total", (("position", str(k)),))
        ] == (per_position)
    rows = got[("specstate_verify_budget_rows_total", (("budget", "0"), ("policy", "_Ragged")))]
    settled = sum(1 for r in reqs for v in r.verified_lengths if v == 0)
    # Planned rows include the rounds in flight when a request ended (under overlap, at most
    # one a request): planned, never settled.
    assert settled > 0 and settled <= rows <= settled + len(reqs)
    assert sum(accepted) < sum(verified)  # some verified drafts were rejected
