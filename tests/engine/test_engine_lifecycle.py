"""Engine lifecycle under pressure: retraction, aborts, stop tokens, worker failures, bad input."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest
import torch
from hf_oracle import greedy, make_checkpoint
from spy_worker import SpyWorker
from transformers import LlamaForCausalLM

from specstate import FinishReason, InvalidRequest, ReqStatus, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish, WorkerMemory
from specstate.internals import KvLedger
from specstate.reference.workers import PlainWorker

LIMITS = RequestLimits(vocab_size=97, max_context_len=64)
PROMPTS = [[3, 14, 15, 92, 65], [35, 89], [79, 32, 38, 46, 26, 43, 38, 32], [7], [11, 12, 13]]


@pytest.fixture
def hf(tmp_path: Path) -> LlamaForCausalLM:
    """A tiny random checkpoint saved in tmp_path."""
    return make_checkpoint(tmp_path)


def _engine(tmp_path: Path, **options: object) -> Engine:
    base: dict[str, object] = {
        "kv_tokens": 1024,
        "check_invariants": True,
        "check_ownership": True,
        "debug_relay": True,
    }
    return Engine(SpyWorker.plain(tmp_path), limits=LIMITS, config=EngineConfig(**(base | options)))  # type: ignore[arg-type]


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_kv_pressure_is_lossless(
    tmp_path: Path, hf: LlamaForCausalLM, overlap: bool, page_size: int
) -> None:
    """A pool too small for every request retracts some; all still produce HF's tokens."""
    engine = _engine(tmp_path, overlap=overlap, page_size=page_size, kv_tokens=72)
    reqs = [
        engine.submit(f"r{i}", p, SamplingParams(max_new_tokens=20)) for i, p in enumerate(PROMPTS)
    ]
    retracted: list[str] = []
    for _ in range(1000):
        if engine.is_idle:
            break
        retracted.extend(engine.step().retracted)
    assert engine.is_idle
    engine.close()
    assert retracted, "the pool was meant to force retractions"
    assert [r.emitted_ids for r in reqs] == [tuple(greedy(hf, p, 20)) for p in PROMPTS]
    assert max(r.incarnation for r in reqs) >= 1


@pytest.mark.parametrize("overlap", [False, True])
def test_aborts_stop_requests_and_others_still_match(
    tmp_path: Path, hf: LlamaForCausalLM, overlap: bool
) -> None:
    """Aborting waiting, prefilling and running requests ends them; the rest match HF."""
    engine = _engine(tmp_path, overlap=overlap, max_running=2)
    params = SamplingParams(max_new_tokens=10)
    reqs = [engine.submit(f"r{i}", p, params) for i, p in enumerate(PROMPTS)]
    assert engine.abort("r4")  # still waiting (max_running 2)
    engine.step()
    engine.step()
    assert engine.abort("r0")  # running, maybe with a round in flight
    engine.run_until_idle()
    for i in (0, 4):
        assert reqs[i].status is ReqStatus.ABORTED
        finish = reqs[i].finish
        assert finish is not None and finish.reason is FinishReason.ABORT
    assert len(reqs[0].emitted_ids) < 10
    for i in (1, 2, 3):
        assert list(reqs[i].emitted_ids) == greedy(hf, PROMPTS[i], 10)
    assert not engine.abort("r0")  # already ended
    again = engine.submit("r0", PROMPTS[0], params)  # the id is reusable right after
    engine.run_until_idle()
    engine.close()
    assert list(again.emitted_ids) == greedy(hf, PROMPTS[0], 10)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_token_ends_the_request_including_it(
    tmp_path: Path, hf: LlamaForCausalLM, overlap: bool
) -> None:
    """A stop token found in the output ends the request right after it."""
    full = greedy(hf, PROMPTS[2], 16)
    stop = full[5]
    expected = full[: full.index(stop) + 1]
    engine = _engine(tmp_path, overlap=overlap)
    req = engine.submit("s", PROMPTS[2], SamplingParams(max_new_tokens=16, stop_token_ids={stop}))
    engine.run_until_idle()
    engine.close()
    assert list(req.emitted_ids) == expected
    assert req.finish is not None and req.finish.reason is FinishReason.STOP


@pytest.mark.parametrize("overlap", [False, True])
def test_worker_failure_ends_its_batch_and_the_engine_keeps_serving(
    tmp_path: Path, hf: LlamaForCausalLM, overlap: bool
) -> None:
    """The failed batch's requests end with ERROR and release KV; later requests match HF."""
    worker = SpyWorker.plain(tmp_path, fail_on=3)
    config = EngineConfig(
        overlap=overlap,
        kv_tokens=1024,
        check_invariants=True,
        check_ownership=True,
        debug_relay=True,
    )
    engine = Engine(worker, limits=LIMITS, config=config)
    first = [
        engine.submit(f"a{i}", p, SamplingParams(max_new_tokens=8))
        for i, p in enumerate(PROMPTS[:2])
    ]
    engine.run_until_idle()
    failed = [r for r in first if r.finish is not None and r.finish.reason is FinishReason.ERROR]
    assert failed and "device lost" in (failed[0].finish.detail if failed[0].finish else "")
    later = engine.submit("b", PROMPTS[2], SamplingParams(max_new_tokens=8))
    engine.run_until_idle()
    snap = engine.snapshot()
    engine.close()
    assert list(later.emitted_ids) == greedy(hf, PROMPTS[2], 8)
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages


def test_bad_requests_are_rejected_and_change_nothing(tmp_path: Path, hf: LlamaForCausalLM) -> None:
    """InvalidRequest at submit, naming the request; the engine's state is unchanged."""
    engine = _engine(tmp_path)
    before = engine.snapshot()
    with pytest.raises(InvalidRequest, match="request 'x': prompt is empty"):
        engine.submit("x", [], SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidRequest, match="token ids outside the vocabulary"):
        engine.submit("y", [5, 97], SamplingParams(max_new_tokens=4))
    with pytest.raises(InvalidRequest, match="exceeds the context of 64"):
        engine.submit("z", [5] * 60, SamplingParams(max_new_tokens=10))
    live = engine.submit("dup", [5, 6], SamplingParams(max_new_tokens=3))
    with pytest.raises(InvalidRequest, match="'dup': a live request already has this id"):
        engine.submit("dup", [5, 6], SamplingParams())
    assert engine.snapshot().num_waiting == before.num_waiting + 1
    engine.run_until_idle()
    engine.close()
    assert len(live.emitted_ids) == 3


class _Overeager(SpyWorker):
    """Claims one more accepted token than its stride allows, on every decode."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Corrupt the accept lengths of decode results."""
        result = super().forward_batch_generation(batch, on_publish=on_publish)
        if not batch.forward_mode.is_decode():
            return result
        return attrs.evolve(result, accept_lens=result.accept_lens + result.stride)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_malformed_result_fails_its_batch_not_the_engine(
    tmp_path: Path, hf: LlamaForCausalLM, overlap: bool
) -> None:
    """Accept lengths past the stride are refused: the batch ends with ERROR, nothing leaks."""
    worker = _Overeager(PlainWorker(target=tmp_path))
    config = EngineConfig(overlap=overlap, kv_tokens=1024, check_invariants=True, debug_relay=True)
    engine = Engine(worker, limits=LIMITS, config=config)
    req = engine.submit("m", PROMPTS[0], SamplingParams(max_new_tokens=6))
    engine.run_until_idle()
    snap = engine.snapshot()
    engine.close()
    assert req.finish is not None and req.finish.reason is FinishReason.ERROR
    assert "request m: accept length 2 outside [1, 1]" in req.finish.detail
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages


class _Meddler(SpyWorker):
    """A worker that tries to commit KV itself, through the ledger view it was handed."""

    def attach(self, memory: WorkerMemory) -> None:
        """Keep the (read-only) view, and the concrete ledger behind it."""
        super().attach(memory)
        self.ledger = memory.ledger

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Advance committed on decode, as a buggy adapter might."""
        if batch.forward_mode.is_decode():
            forged = self.ledger
            assert isinstance(forged, KvLedger)
            forged.advance_committed(
                batch.req_pool_indices, torch.ones_like(batch.req_pool_indices)
            )
        return super().forward_batch_generation(batch, on_publish=on_publish)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_worker_writing_a_counter_is_refused_at_run_time(
    tmp_path: Path, hf: LlamaForCausalLM, overlap: bool
) -> None:
    """The worker acts as Role.WORKER: its commit raises OwnershipError and fails its batch."""
    worker = _Meddler(PlainWorker(target=tmp_path))
    config = EngineConfig(
        overlap=overlap, kv_tokens=1024, check_invariants=True, check_ownership=True
    )
    engine = Engine(worker, limits=LIMITS, config=config)
    req = engine.submit("w", PROMPTS[0], SamplingParams(max_new_tokens=6))
    engine.run_until_idle()
    snap = engine.snapshot()
    engine.close()
    assert req.finish is not None and req.finish.reason is FinishReason.ERROR
    assert (
        "OwnershipError: request w: role 'worker' may not write kv_committed_len"
        in req.finish.detail
    )
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
