"""A worker result that breaks the forward contract fails its batch, never the engine.

Each case wraps a real reference worker (draft_model, drafting with the target, so runs of
several tokens happen) and corrupts one decode result in one way. The batch's requests end with
`FinishReason.ERROR` naming the rule; nothing wrong is emitted; a request submitted afterwards
is served exactly as HF generate serves it; the pools balance. The invariant checker runs after
every step, with the engine's checks on and in production mode.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import pytest
import torch
from engine_driver import run_checked
from hf_oracle import greedy
from spec_checkpoints import MIXED_PROMPTS, SpecCheckpoints, make_spec_checkpoints
from spy_worker import SpyWorker

from specstate import RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.status import FinishReason
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish, WorkerProtocol
from specstate.relay.future_map import RelayPayload

Corrupt = Callable[[GenerationBatchResult], GenerationBatchResult]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> SpecCheckpoints:
    """Checkpoints shared by the module."""
    return make_spec_checkpoints(tmp_path_factory.mktemp("result_check"))


class _CorruptOnce(SpyWorker):
    """Passes a real worker through, corrupting its second decode result (and what it publishes)."""

    def __init__(self, inner: WorkerProtocol, corrupt: Corrupt, *, frontier_shift: int = 0):
        super().__init__(inner)
        self._corrupt = corrupt
        self._shift = frontier_shift
        self._decodes = 0
        self.corrupted = False
        self.decode_frontiers: list[list[int]] = []  # seq_lens of every decode forward

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Corrupt the second decode forward of a batch of two or more rows."""
        if batch.forward_mode.is_decode():
            self.decode_frontiers.append(batch.seq_lens.tolist())
        if not batch.forward_mode.is_decode() or batch.batch_size < 2:
            return self._inner.forward_batch_generation(batch, on_publish=on_publish)
        self._decodes += 1
        if self._decodes != 2:
            return self._inner.forward_batch_generation(batch, on_publish=on_publish)
        self.corrupted = True
        shift = self._shift

        def publish(new_seq_lens: torch.Tensor) -> None:
            assert on_publish is not None
            bump = torch.zeros_like(new_seq_lens)
            bump[0] = shift
            on_publish(new_seq_lens + bump)

        result = self._inner.forward_batch_generation(
            batch, on_publish=None if on_publish is None else publish
        )
        return self._corrupt(result)


def _shift_row0(result: GenerationBatchResult) -> GenerationBatchResult:
    assert result.new_seq_lens is not None
    bump = torch.zeros_like(result.new_seq_lens)
    bump[0] = 100
    return attrs.evolve(result, new_seq_lens=result.new_seq_lens + bump)


def _set_token(value: int) -> Corrupt:
    def corrupt(result: GenerationBatchResult) -> GenerationBatchResult:
        tokens = result.next_token_ids.clone()
        tokens[0] = value  # row 0, run position 0: always accepted
        return attrs.evolve(result, next_token_ids=tokens)

    return corrupt


def _wider_stride(result: GenerationBatchResult) -> GenerationBatchResult:
    """Stride past the declared width, with one run longer than ``max_accept``."""
    b, stride = result.batch_size, result.stride
    tokens = result.next_token_ids.view(b, stride)
    wide = torch.cat([tokens, tokens[:, :2]], dim=1).reshape(-1)
    accept = result.accept_lens.clone()
    accept[0] = stride + 1
    return attrs.evolve(result, next_token_ids=wide, accept_lens=accept, stride=stride + 2)


CASES: dict[str, tuple[Corrupt, int, str]] = {
    "frontier +100 on one row": (_shift_row0, 100, "published frontier"),
    "float token ids": (
        lambda r: attrs.evolve(r, next_token_ids=r.next_token_ids.double()),
        0,
        "next_token_ids of dtype torch.float64",
    ),
    "NaN token ids": (
        lambda r: attrs.evolve(r, next_token_ids=r.next_token_ids.double() * float("nan")),
        0,
        "next_token_ids of dtype torch.float64",
    ),
    "2-D token ids": (
        lambda r: attrs.evolve(r, next_token_ids=r.next_token_ids.view(r.batch_size, r.stride)),
        0,
        "must be a 1-D integer tensor",
    ),
    "float accept lengths": (
        lambda r: attrs.evolve(r, accept_lens=r.accept_lens.float()),
        0,
        "accept_lens of dtype torch.float32",
    ),
    "token id past the vocabulary": (_set_token(100_000), 0, "outside the vocabulary"),
    "negative token id": (_set_token(-7), 0, "accepted token -7"),
    "run longer than max_accept": (_wider_stride, 0, "outside [1, 4]"),
    "invalid_rows of the wrong dtype": (
        lambda r: attrs.evolve(r, invalid_rows=torch.zeros(r.batch_size, dtype=torch.int64)),
        0,
        "invalid_rows of dtype torch.int64",
    ),
    "invalid_rows of the wrong shape": (
        lambda r: attrs.evolve(r, invalid_rows=torch.zeros(r.batch_size + 1, dtype=torch.bool)),
        0,
        "it must be a bool tensor of shape",
    ),
    "no next_draft_input": (
        lambda r: attrs.evolve(r, next_draft_input=None),
        0,
        "no next_draft_input",
    ),
    "bonus tokens of the wrong shape": (
        lambda r: attrs.evolve(
            r,
            next_draft_input=RelayPayload(
                bonus_tokens=torch.zeros(r.batch_size + 1, dtype=torch.int64)
            ),
        ),
        0,
        "next_draft_input.bonus_tokens of dtype torch.int64 and shape",
    ),
}


NORMAL_LOOP_CASES: dict[str, tuple[Corrupt, int, str]] = {
    # Under overlap the worker publishes through ``on_publish`` and the result's own frontier
    # is not the one relayed or checked; in the normal loop the engine publishes it.
    "frontier of the wrong shape": (
        lambda r: attrs.evolve(r, new_seq_lens=r.accept_lens[:, None]),
        0,
        "worker published a frontier of dtype torch.int64 and shape",
    ),
}


@pytest.mark.parametrize("device", ["cpu", "cpu:0"])
@pytest.mark.parametrize("checks", [True, False], ids=["checks-on", "production"])
@pytest.mark.parametrize("case", list(NORMAL_LOOP_CASES))
def test_a_bad_frontier_fails_its_batch_in_the_normal_loop(
    ckpt: SpecCheckpoints, case: str, checks: bool, device: str
) -> None:
    """The frontier's form is checked before it is relayed, on the host and on a device."""
    _run_case(ckpt, case, overlap=False, checks=checks, device=device)


@pytest.mark.parametrize("checks", [True, False], ids=["checks-on", "production"])
@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_result_fails_its_batch_and_the_engine_keeps_serving(
    ckpt: SpecCheckpoints, case: str, overlap: bool, checks: bool
) -> None:
    """The corrupted batch ends with ERROR naming the rule; a later request is exact."""
    _run_case(ckpt, case, overlap=overlap, checks=checks, device="cpu")


DEVICE_CASES = [
    "frontier +100 on one row",
    "float token ids",
    "token id past the vocabulary",
    "run longer than max_accept",
    "invalid_rows of the wrong shape",
]


@pytest.mark.parametrize("overlap", [False, True], ids=["normal", "overlap"])
@pytest.mark.parametrize("case", DEVICE_CASES)
def test_on_a_device_a_bad_result_is_caught_after_its_copy(
    ckpt: SpecCheckpoints, case: str, overlap: bool
) -> None:
    """The device path (values checked after the copy, the relayed frontier clamped in the
    meantime) contains the same faults: the batch fails, nothing wrong is emitted, and a
    shifted frontier moves a row only inside its own reservation (the other rows stay exact)."""
    _run_case(ckpt, case, overlap=overlap, checks=True, device="cpu:0")


def _run_case(
    ckpt: SpecCheckpoints, case: str, *, overlap: bool, checks: bool, device: str
) -> None:
    corrupt, shift, rule = {**CASES, **NORMAL_LOOP_CASES}[case]
    worker = _CorruptOnce(ckpt.worker("draft_model"), corrupt, frontier_shift=shift)
    config = EngineConfig(
        overlap=overlap,
        kv_tokens=2048,
        check_invariants=checks,
        check_ownership=checks,
        device=device,
    )
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(worker, limits=limits, config=config) as engine:
        first = [engine.submit(f"a{i}", p, params) for i, p in enumerate(MIXED_PROMPTS[:3])]
        run_checked(engine, max_steps=200)
        later = engine.submit("later", MIXED_PROMPTS[3], params)
        run_checked(engine, max_steps=200)
        snap = engine.snapshot()
    assert worker.corrupted
    failed = [r for r in first if r.finish is not None and r.finish.reason is FinishReason.ERROR]
    assert failed, "the corrupted batch must fail"
    assert all(rule in r.finish.detail for r in failed if r.finish is not None)
    for req, prompt in zip(first, MIXED_PROMPTS[:3], strict=True):
        want = greedy(ckpt.hf, prompt, NEW_TOKENS)
        assert list(req.emitted_ids) == want[: len(req.emitted_ids)]  # nothing wrong emitted
    assert list(later.emitted_ids) == greedy(ckpt.hf, MIXED_PROMPTS[3], NEW_TOKENS)
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages


def test_on_a_device_a_shifted_frontier_is_relayed_clamped_into_the_reservation(
    ckpt: SpecCheckpoints,
) -> None:
    """Overlap on a device: the next forward starts before the host checks the result, so it
    must not see the worker's +100 frontier, only one clamped to ``seq_lens + max_accept``."""
    corrupt, shift, _ = CASES["frontier +100 on one row"]
    worker = _CorruptOnce(ckpt.worker("draft_model"), corrupt, frontier_shift=shift)
    config = EngineConfig(overlap=True, kv_tokens=2048, check_invariants=True, device="cpu:0")
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(worker, limits=limits, config=config) as engine:
        for i, p in enumerate(MIXED_PROMPTS[:3]):
            engine.submit(f"a{i}", p, params)
        run_checked(engine, max_steps=200)
    max_accept = worker.capabilities.max_accept
    frontiers = worker.decode_frontiers
    assert worker.corrupted and len(frontiers) >= 3
    corrupted, following = frontiers[1], frontiers[2]  # the second decode was corrupted
    assert following[0] <= corrupted[0] + max_accept, (corrupted, following)


def _back_row0(result: GenerationBatchResult) -> GenerationBatchResult:
    assert result.new_seq_lens is not None
    bump = torch.zeros_like(result.new_seq_lens)
    bump[0] = 100
    return attrs.evolve(result, new_seq_lens=result.new_seq_lens - bump)


def test_on_a_device_a_frontier_behind_its_round_is_relayed_clamped_to_one_token_past(
    ckpt: SpecCheckpoints,
) -> None:
    """Overlap on a device: a worker's -100 frontier reaches the next forward clamped up to
    ``seq_lens + 1`` (a verify accepts at least the bonus), never behind its own round."""
    worker = _CorruptOnce(ckpt.worker("draft_model"), _back_row0, frontier_shift=-100)
    config = EngineConfig(overlap=True, kv_tokens=2048, check_invariants=True, device="cpu:0")
    limits = RequestLimits(vocab_size=ckpt.vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=NEW_TOKENS)
    with Engine(worker, limits=limits, config=config) as engine:
        first = [engine.submit(f"a{i}", p, params) for i, p in enumerate(MIXED_PROMPTS[:3])]
        run_checked(engine, max_steps=200)
    frontiers = worker.decode_frontiers
    assert worker.corrupted and len(frontiers) >= 3
    corrupted, following = frontiers[1], frontiers[2]  # the second decode was corrupted
    assert following[0] == corrupted[0] + 1, (corrupted, following)
    assert any(r.finish is not None and r.finish.reason is FinishReason.ERROR for r in first)
