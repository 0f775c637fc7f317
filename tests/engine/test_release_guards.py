"""Ending a request while a batch that reads it is in flight: its pages, and a later incarnation.

* Pages: under the overlap loop on a jittery forward stream (a random delay before every item),
  requests are aborted while their batch is in flight and new requests arrive at once to take
  free pages. Before every step, every request of the batch in flight still holds its KV, and
  no page that batch reads is handed to another request during the step (which settles that
  batch only at its end). Checked page by page, not only that a release was deferred.
* Incarnations: a batch that fails after one of its requests was retracted and re-admitted
  leaves the new incarnation alone (`RequestLifecycle.fail`'s guard). The only way a request is
  re-admitted before its batch settles is a step interrupted between scheduling and settlement
  (a draft policy raising ``KeyboardInterrupt`` right after a retraction).
"""

from __future__ import annotations

import random

import numpy as np
import numpy.typing as npt
import pytest
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints
from spy_worker import SpyWorker

from specstate import FinishReason, Req, ReqStatus, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.launch import launcher as launch
from specstate.relay.streams import CpuStream, Stream

NEW_TOKENS = 12


@pytest.fixture
def jittery_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every forward stream the engine makes sleeps 0-3 ms before each item."""
    rng = random.Random(1)

    def make(device: object, *, name: str = "forward") -> Stream:
        return CpuStream(name, delay=lambda: rng.uniform(0.0, 0.003))

    monkeypatch.setattr(launch, "make_stream", make)


def _pages(engine: Engine, req: Req) -> set[int]:
    """The KV pages ``req``'s row maps below its allocated length."""
    slot = engine.allocator.slot_of(req)
    _, allocated = engine.ledger.host_lengths(np.array([slot], dtype=np.int64))
    row = engine.allocator.req_to_token_host[slot, : int(allocated[0])]
    return {int(t) // engine.config.page_size for t in row}


def _holders(engine: Engine) -> list[Req]:
    return [*engine.scheduler.prefilling, *engine.scheduler.running]


@pytest.mark.usefixtures("jittery_stream")
@pytest.mark.parametrize("page_size", [1, 4])
def test_no_page_of_a_batch_in_flight_changes_hands(
    partial_ckpt: SpecCheckpoints, page_size: int
) -> None:
    """Aborts under a batch in flight, arrivals at once: no page it reads goes to another."""
    engine = Engine(
        partial_ckpt.worker("eagle", agreeing=False),
        limits=RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(
            overlap=True, page_size=page_size, kv_tokens=160, check_invariants=True
        ),
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    aborted: set[str] = set()
    arrivals = 0
    checked = 0
    with engine:
        for step in range(400):
            if engine.is_idle:
                break
            flight = engine.in_flight
            reading: dict[Req, set[int]] = {}
            if flight is not None:
                for req in flight.plan.batch.reqs:
                    assert engine.allocator.holds_slot(req), f"{req.request_id} lost its KV"
                    reading[req] = _pages(engine, req)
            live = [r for r in reqs if not r.is_finished and r.output_ids]
            if step % 3 == 1 and live and flight is not None and len(aborted) < 6:
                victim = live[0]
                if victim in reading:
                    engine.abort(victim.request_id)  # its batch is in flight
                    aborted.add(victim.request_id)
                    prompt = MIXED_PROMPTS[arrivals % len(MIXED_PROMPTS)]
                    reqs.append(engine.submit(f"late{arrivals}", prompt, params))
                    arrivals += 1
            engine.step()
            check_engine(engine)
            for other in _holders(engine):
                for req, pages in reading.items():
                    if req is not other:
                        shared = pages & _pages(engine, other)
                        assert not shared, (
                            f"pages {sorted(shared)} of {req.request_id} (batch in flight) "
                            f"went to {other.request_id}"
                        )
                        checked += 1
        assert engine.is_idle
    assert len(aborted) >= 3 and checked > 50
    for i, req in enumerate(reqs):
        assert req.finish is not None
        if req.request_id in aborted:
            assert req.finish.reason is FinishReason.ABORT
            continue
        prompt = (
            MIXED_PROMPTS[i]
            if i < len(MIXED_PROMPTS)
            else MIXED_PROMPTS[(i - len(MIXED_PROMPTS)) % len(MIXED_PROMPTS)]
        )
        assert list(req.emitted_ids) == greedy(partial_ckpt.hf, list(prompt), NEW_TOKENS)


class _InterruptAfterRetraction:
    """Width 3; raises KeyboardInterrupt from the first round chosen for fewer rows than the
    one before (a retraction just happened), once."""

    def __init__(self) -> None:
        self._last = 0
        self.fired = False

    @property
    def max_steps(self) -> int:
        """The worker's width."""
        return 3

    def choose(self, batch_size: int) -> int:
        """3, or the interrupt."""
        shrank = 0 < batch_size < self._last
        self._last = batch_size
        if shrank and not self.fired:
            self.fired = True
            raise KeyboardInterrupt
        return 3

    def observe(self, num_steps: int, accept_lens: npt.NDArray[np.int64]) -> None:
        """Nothing to learn."""


def _run_interrupted(
    ckpt: SpecCheckpoints, fail_on: int | None
) -> tuple[list[Req], dict[str, object]]:
    """Serve the prompts under pressure with the interrupting policy; what happened."""
    policy = _InterruptAfterRetraction()
    engine = Engine(
        SpyWorker(ckpt.worker("eagle", agreeing=False), fail_on=fail_on),
        limits=RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(overlap=True, page_size=4, kv_tokens=96, check_invariants=True),
        draft_policy=policy,
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    seen: dict[str, object] = {}
    with engine:
        for _ in range(400):
            if engine.is_idle:
                break
            try:
                engine.step()
            except KeyboardInterrupt:
                flight = engine.in_flight
                assert flight is not None  # launched before the interrupt, not settled
                seen["batch"] = flight.batch_id
                seen["retracted"] = [
                    (r, r.incarnation)
                    for r in flight.plan.batch.reqs
                    if r.status is ReqStatus.WAITING
                ]
            check_engine(engine)
        assert engine.is_idle
    assert policy.fired
    return reqs, seen


def test_a_batch_failing_after_a_retraction_leaves_the_retracted_request_alone(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """Batch F holds R; the next step retracts R and is interrupted before F settles; F then
    settles as failed: R (waiting for re-admission) is untouched and later ends exactly, F's
    other requests end with ERROR."""
    _, first = _run_interrupted(partial_ckpt, fail_on=None)
    batch = first["batch"]
    assert isinstance(batch, int)
    reqs, seen = _run_interrupted(partial_ckpt, fail_on=batch)  # the same run; F fails
    assert seen["batch"] == batch
    retracted = seen["retracted"]
    assert isinstance(retracted, list) and retracted
    for req, incarnation in retracted:
        assert incarnation >= 1 and req.incarnation >= incarnation
        assert req.finish is not None and req.finish.reason is FinishReason.LENGTH, req.finish
        i = int(req.request_id[1:])
        want = greedy(partial_ckpt.hf, list(MIXED_PROMPTS[i]), NEW_TOKENS)
        assert list(req.emitted_ids) == want
    failed = [r for r in reqs if r.finish is not None and r.finish.reason is FinishReason.ERROR]
    assert failed and not {r.request_id for r in failed} & {r.request_id for r, _ in retracted}


def test_a_stale_failure_leaves_a_readmitted_incarnation_alone(
    partial_ckpt: SpecCheckpoints,
) -> None:
    """A plan captured before a real retraction, failed after its request was re-admitted:
    the new incarnation is not touched (`RequestLifecycle.fail`'s guard).

    The engine keeps one batch in flight and a retracted request needs more room than it freed,
    so no batch settles after its request came back; the guard is checked on the real objects.
    """
    engine = Engine(
        partial_ckpt.worker("eagle", agreeing=False),
        limits=RequestLimits(vocab_size=partial_ckpt.vocab_size, max_context_len=64),
        config=EngineConfig(overlap=True, page_size=4, kv_tokens=96, check_invariants=True),
    )
    params = SamplingParams(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
    plans = []
    found = None
    with engine:
        while found is None and not engine.is_idle:
            engine.step()
            if engine.in_flight is not None:
                plans.append(engine.in_flight.plan)
            back = [r for r in reqs if r.incarnation >= 1 and r.status is ReqStatus.RUNNING]
            for req in back:
                stale = [p for p in plans if req in p.batch.reqs]
                old = [p for p in stale if p.batch.incarnations[p.batch.reqs.index(req)] == 0]
                if old:
                    found = (req, old[-1])
        assert found is not None, "no request was retracted and re-admitted"
        req, plan = found
        row = plan.batch.reqs.index(req)
        ended = engine.lifecycle.fail(
            [req],
            [plan.batch.incarnations[row]],
            RuntimeError("x"),
            until_batch=engine.num_launched,
        )
        assert ended == [] and req.status is ReqStatus.RUNNING and req.finish is None
