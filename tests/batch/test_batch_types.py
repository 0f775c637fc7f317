"""Batch types: mode predicates, rebinding filter/merge, frozen forward views and results."""

from __future__ import annotations

import attrs
import pytest
import torch

from specstate import InvalidConfig, RelayError, Req, RequestLimits, SamplingParams
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.result import GenerationBatchResult
from specstate.batch.sampling import SamplingInfo
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.internals import OwnershipChecker
from specstate.relay.future_map import RelayPayload, Unresolved

LIMITS = RequestLimits(vocab_size=32, max_context_len=64)


def _batch(n: int, *, unresolved: bool = False, penalties: bool = False) -> ScheduleBatch:
    checker = OwnershipChecker(enabled=False)
    params = [SamplingParams(temperature=0.5 * (i % 2), top_k=i + 1) for i in range(n)]
    reqs = tuple(Req.new(f"r{i}", [1, 2, 3], params[i], LIMITS, checker=checker) for i in range(n))
    slots = torch.arange(1, n + 1, dtype=torch.int64)
    return ScheduleBatch(
        reqs=reqs,
        incarnations=(0,) * n,
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=slots,
        seq_lens=Unresolved(slots.clone()) if unresolved else torch.arange(10, 10 + n),
        sampling_info=SamplingInfo.from_params(
            params,
            vocab_size=32,
            device=torch.device("cpu"),
            frequency_penalties=[0.5] * n if penalties else None,
        ),
        seq_lens_cpu=None if unresolved else tuple(range(10, 10 + n)),
        future_indices=slots.clone(),
        spec_info=RelayPayload(bonus_tokens=torch.arange(n), hidden_states=torch.randn(n, 4)),
    )


def test_mode_predicates_keep_the_two_levels_apart() -> None:
    """Scheduler modes and worker-internal modes are disjoint; is_extend is explicit."""
    internal = {m for m in ForwardMode if m.is_worker_internal()}
    assert internal == {ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND}
    extend = {m for m in ForwardMode if m.is_extend()}
    assert extend == {ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY}
    assert ForwardMode.DRAFT_EXTEND.is_extend(include_draft_extend=True)
    assert {m for m in ForwardMode if m.is_decode_or_idle()} == {
        ForwardMode.DECODE,
        ForwardMode.IDLE,
    }


def test_a_schedule_batch_refuses_worker_modes() -> None:
    """A worker-internal mode cannot be the scheduler's mode at construction."""
    b = _batch(2)
    with pytest.raises(InvalidConfig, match="target_verify is worker-internal"):
        attrs.evolve(b, forward_mode=ForwardMode.TARGET_VERIFY)


def test_filter_rebinds_and_never_changes_earlier_references() -> None:
    """filter keeps rows in order with new tensors; values taken before do not change."""
    b = _batch(4)
    before = b.field_bindings()
    seq_lens = b.seq_lens
    assert isinstance(seq_lens, torch.Tensor)
    seq_copy = seq_lens.clone()
    temps = b.sampling_info.temperatures.clone()
    b.filter([3, 1])
    assert b.request_ids == ("r3", "r1")
    assert b.req_pool_indices.tolist() == [4, 2]
    assert isinstance(b.seq_lens, torch.Tensor) and b.seq_lens.tolist() == [13, 11]
    assert b.seq_lens_cpu == (13, 11)
    assert b.future_indices is not None and b.future_indices.tolist() == [4, 2]
    assert b.spec_info is not None and b.spec_info.bonus_tokens.tolist() == [3, 1]
    assert torch.equal(seq_lens, seq_copy)  # the old tensor is untouched
    assert torch.equal(before["sampling_info"].temperatures, temps)  # type: ignore[attr-defined]
    for name, value in before.items():
        if isinstance(value, torch.Tensor):
            assert getattr(b, name) is not value, name


def test_filter_and_merge_of_unresolved_frontiers() -> None:
    """Unresolved frontiers slice and concatenate their future indices."""
    a, b = _batch(3, unresolved=True), _batch(2, unresolved=True)
    a.filter([2, 0])
    a.merge(b)
    assert isinstance(a.seq_lens, Unresolved)
    assert a.seq_lens.future_indices.tolist() == [3, 1, 1, 2]
    assert a.batch_size == 4 and a.seq_lens_cpu is None
    with pytest.raises(InvalidConfig, match="resolved frontier with an unresolved"):
        a.merge(_batch(1))


def test_merge_keeps_rows_and_clears_forward_inputs() -> None:
    """merge appends rows; per-forward inputs are cleared for the next prepare."""
    a, b = _batch(2), _batch(3)
    a.out_cache_loc = torch.arange(2)
    a.merge(b)
    assert a.request_ids == ("r0", "r1", "r0", "r1", "r2")
    assert a.out_cache_loc is None and a.input_ids is None
    assert a.sampling_info.top_ks.tolist() == [1, 2, 1, 2, 3]
    assert a.spec_info is not None and a.spec_info.hidden_states is not None
    assert a.spec_info.hidden_states.shape == (5, 4)


def test_forward_batch_is_a_frozen_view_that_needs_resolved_values() -> None:
    """from_schedule never mutates the batch; unresolved values raise RelayError."""
    with pytest.raises(RelayError, match="unresolved relay values"):
        ForwardBatch.from_schedule(_batch(2, unresolved=True))
    b = _batch(2)
    bindings = b.field_bindings()
    fb = ForwardBatch.from_schedule(b)
    assert b.field_bindings() == bindings
    assert fb.positions is not None and fb.positions.tolist() == [10, 11]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        fb.seq_lens = torch.zeros(2)  # type: ignore[misc]


def test_extend_positions_follow_prefix_and_extend_lens() -> None:
    """EXTEND positions are prefix_len + i for each new token of each row."""
    b = _batch(2)
    b.forward_mode = ForwardMode.EXTEND
    b.prefix_lens, b.extend_lens = (4, 0), (2, 3)
    fb = ForwardBatch.from_schedule(b)
    assert fb.positions is not None and fb.positions.tolist() == [4, 5, 0, 1, 2]


def test_copy_for_forward_never_double_counts_penalties() -> None:
    """Folding happens once per settled token, however many forward copies are made."""
    b = _batch(2, penalties=True)
    acc = b.sampling_info.accumulator
    assert acc is not None
    acc.cumulate(torch.tensor([0, 1, 1]), torch.tensor([5, 7, 7]))
    first = b.sampling_info.copy_for_forward()
    second = b.sampling_info.copy_for_forward()
    assert first.accumulator is None and second.accumulator is None
    assert first.penalty_counts is not None and second.penalty_counts is not None
    assert torch.equal(first.penalty_counts, second.penalty_counts)
    assert first.penalty_counts[1, 7] == 2 and first.penalty_counts.sum() == 3
    logits = torch.zeros(2, 32)
    out = first.apply_penalties(logits, torch.tensor([0, 1]))
    assert out[1, 7] == -1.0 and logits.abs().sum() == 0  # input untouched
    acc.cumulate(torch.tensor([0]), torch.tensor([5]))
    third = b.sampling_info.copy_for_forward()
    assert third.penalty_counts is not None and third.penalty_counts[0, 5] == 2
    assert first.penalty_counts[0, 5] == 1  # an earlier copy keeps its value


def test_result_checks_its_stride() -> None:
    """A result's token count must be batch_size × stride; drafts are accepted minus bonus."""
    r = GenerationBatchResult(
        next_token_ids=torch.arange(8), accept_lens=torch.tensor([3, 1]), stride=4
    )
    assert r.num_correct_drafts == 2
    r.wait_copied()
    with pytest.raises(InvalidConfig, match="2 rows with stride 4 needs 8 tokens, got 7"):
        GenerationBatchResult(
            next_token_ids=torch.arange(7), accept_lens=torch.tensor([3, 1]), stride=4
        )
