"""Inject each class of bug at this boundary; the checks name the invariant that broke.

Every run is the real engine on real checkpoints with ``check_invariants``, ``check_ownership``
and ``debug_relay`` on; one bug is injected per test, either into the engine (monkeypatched:
the kind of bug a refactor introduces) or into a worker (a buggy adapter):

| bug | named by |
|---|---|
| double commit, skipped commit | ``commit-settlement`` |
| a result applied after its request was retracted | ``commit-settlement`` |
| a reservation one page short | ``reserve`` |
| a worker writing ``kv_committed_len`` | the ownership checker (``OwnershipError``) |
| a publish dropped, a publish doubled | ``relay`` (consume once; at most one publish) |
| a worker writing a scheduler-owned tensor in place | ``isolation`` |

Engine bugs raise `InvariantViolation` out of ``step()`` (they are specstate's); worker bugs end
their batch with `FinishReason.ERROR` whose detail names the rule. The same workloads without
the bug run clean (the last test), so nothing here passes by accident.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch
from engine_driver import run_checked
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.errors import InvariantViolation
from specstate.core.ownership import Role
from specstate.core.request import Req
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.launch import launcher as launch
from specstate.engine.settle import results
from specstate.engine.settle.outputs import OutputTable
from specstate.engine.worker import OnPublish, WorkerProtocol
from specstate.memory.sizing import SpecWindow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module (drafters that agree: full-length runs happen)."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("inject"))


def _engine(
    worker: WorkerProtocol, *, overlap: bool = True, kv_tokens: int = 1024, page_size: int = 1
) -> Engine:
    config = EngineConfig(
        overlap=overlap,
        kv_tokens=kv_tokens,
        page_size=page_size,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    limits = RequestLimits(vocab_size=97, max_context_len=64)
    return Engine(worker, limits=limits, config=config)


def _serve(engine: Engine, n: int = 3, max_new: int = 16) -> list[Req]:
    params = SamplingParams(max_new_tokens=max_new)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS[:n])]
    run_checked(engine, max_steps=400)
    return reqs


def _violation(engine: Engine) -> InvariantViolation:
    with pytest.raises(InvariantViolation) as caught:
        _serve(engine)
    engine.close()
    return caught.value


@pytest.mark.parametrize("twice", [True, False], ids=["double-commit", "skipped-commit"])
def test_a_wrong_commit_is_named(
    ckpt: SpecCheckpoints, monkeypatch: pytest.MonkeyPatch, twice: bool
) -> None:
    """The result processor commits a run twice, or not at all."""
    original = results.ResultProcessor._commit

    def commit(self: results.ResultProcessor, slots: object, accept: object, rows: object) -> None:
        if twice:
            original(self, slots, accept, rows)  # type: ignore[arg-type]
            original(self, slots, accept, rows)  # type: ignore[arg-type]

    monkeypatch.setattr(results.ResultProcessor, "_commit", commit)
    error = _violation(_engine(ckpt.worker("eagle")))
    assert error.invariant == "commit-settlement", error
    assert "accept length" in str(error)


@pytest.mark.parametrize("how", ["retraction", "abort"])
def test_a_result_applied_after_its_request_left_is_named(
    ckpt: SpecCheckpoints, monkeypatch: pytest.MonkeyPatch, how: str
) -> None:
    """Settlement stops recognising stale rows (every epoch reads 0); a request leaves while
    its round is in flight (retracted by a small pool, or aborted by the user)."""
    monkeypatch.setattr(
        OutputTable, "epochs", lambda self, slots: np.zeros(len(slots), dtype=np.int64)
    )
    if how == "retraction":
        engine = _engine(ckpt.worker("eagle"), kv_tokens=64, page_size=4)
        with pytest.raises(InvariantViolation) as caught:
            _serve(engine, n=4, max_new=20)
    else:
        engine = _engine(ckpt.worker("eagle"))
        params = SamplingParams(max_new_tokens=16)
        for i, p in enumerate(MIXED_PROMPTS[:3]):
            engine.submit(f"r{i}", p, params)
        for _ in range(4):  # prefill, then decode rounds in flight
            engine.step()
        assert engine.in_flight is not None and engine.in_flight.plan.is_decode
        engine.abort("r0")
        with pytest.raises(InvariantViolation) as caught:
            run_checked(engine, max_steps=100)
    engine.close()
    assert caught.value.invariant == "commit-settlement", caught.value
    assert "ended or was retracted" in str(caught.value)


def test_a_reservation_one_page_short_is_named(
    ckpt: SpecCheckpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The speculative reserve is R - P instead of R = 2·L."""
    monkeypatch.setattr(
        SpecWindow,
        "reserve",
        property(lambda self: 2 * self.alloc_len_per_decode - self.page_size),
    )
    error = _violation(_engine(ckpt.worker("eagle")))
    assert error.invariant == "reserve", error


class _Buggy(SpyWorker):
    """A worker wrapper whose second decode forward misbehaves in the given way."""

    def __init__(
        self, inner: WorkerProtocol, bug: Callable[[_Buggy, ForwardBatch, OnPublish | None], None]
    ) -> None:
        super().__init__(inner)
        self._bug = bug
        self._decodes = 0
        self.engine: Engine | None = None

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Misbehave on the second decode, then do the real work."""
        if batch.forward_mode.is_decode():
            self._decodes += 1
            if self._decodes == 2:
                self._bug(self, batch, on_publish)
        return self._inner.forward_batch_generation(batch, on_publish=on_publish)


def _error_details(ckpt: SpecCheckpoints, bug: Callable[..., None]) -> list[str]:
    worker = _Buggy(ckpt.worker("eagle"), bug)
    engine = _engine(worker)
    worker.engine = engine
    reqs = _serve(engine)
    engine.close()
    return [
        r.finish.detail
        for r in reqs
        if r.finish is not None and r.finish.reason is FinishReason.ERROR
    ]


def _write_committed(worker: _Buggy, batch: ForwardBatch, on_publish: OnPublish | None) -> None:
    assert worker.engine is not None
    slots = batch.req_pool_indices.numpy()
    worker.engine.ledger.advance_committed(slots, np.ones_like(slots))  # acting as WORKER


def _publish_twice(worker: _Buggy, batch: ForwardBatch, on_publish: OnPublish | None) -> None:
    assert on_publish is not None
    on_publish(batch.seq_lens + 1)  # and the real worker publishes again


def _write_in_place(worker: _Buggy, batch: ForwardBatch, on_publish: OnPublish | None) -> None:
    batch.req_pool_indices.add_(0)  # same values, but an in-place write


@pytest.mark.parametrize(
    ("bug", "rule"),
    [
        (_write_committed, "OwnershipError"),
        (_publish_twice, "[relay] on_publish called 2 times"),
        (_write_in_place, "[isolation] the scheduler-owned tensor req_pool_indices"),
    ],
    ids=["worker-writes-committed", "doubled-publish", "in-place-write"],
)
def test_a_worker_bug_fails_its_batch_naming_the_rule(
    ckpt: SpecCheckpoints, bug: Callable[..., None], rule: str
) -> None:
    """The batch ends with ERROR; the detail names the rule that was broken."""
    details = _error_details(ckpt, bug)
    assert details and all(rule in d for d in details), details


def test_a_dropped_publish_is_named_by_the_relay(
    ckpt: SpecCheckpoints, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The launcher loses one publish: the next forward reads a frontier nobody published."""
    original = launch._PublishOnce.__call__
    dropped: list[bool] = []

    def publish(self: launch._PublishOnce, new_seq_lens: torch.Tensor) -> None:
        if not dropped and new_seq_lens.numel() > 1 and self._flight.plan.is_decode:
            dropped.append(True)
            self.calls += 1  # the launcher believes it was published
            self.published = new_seq_lens
            return
        original(self, new_seq_lens)

    monkeypatch.setattr(launch._PublishOnce, "__call__", publish)
    engine = _engine(ckpt.worker("eagle"))
    reqs = _serve(engine)
    engine.close()
    assert dropped
    details = [r.finish.detail for r in reqs if r.finish and r.finish.reason is FinishReason.ERROR]
    assert details and all("[relay] consume once" in d for d in details), details


@pytest.mark.parametrize("overlap", [False, True])
def test_the_same_runs_without_a_bug_report_nothing(ckpt: SpecCheckpoints, overlap: bool) -> None:
    """No injection: every check on, every request finishes by length."""
    reqs = _serve(_engine(ckpt.worker("eagle"), overlap=overlap))
    assert all(r.finish is not None and r.finish.reason is FinishReason.LENGTH for r in reqs)
    with_pressure = _serve(_engine(ckpt.worker("eagle"), kv_tokens=64, page_size=4), n=4)
    assert all(
        r.finish is not None and r.finish.reason is FinishReason.LENGTH for r in with_pressure
    )
    assert Role.WORKER  # the ownership roles are in force in these runs
