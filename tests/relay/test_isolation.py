"""Forward isolation: bindings restored by identity, sampling copies, the keep-alive ring."""

from __future__ import annotations

import pytest
import torch

from specstate import Req, RequestLimits, SamplingParams
from specstate.batch.forward_mode import ForwardMode
from specstate.batch.isolation import ForwardIsolator, IsolationError
from specstate.batch.relay_inputs import resolve_batch_forward_inputs, resolve_batch_seq_lens
from specstate.batch.sampling import SamplingInfo
from specstate.batch.schedule_batch import ScheduleBatch
from specstate.internals import OwnershipChecker
from specstate.relay.future_map import FutureMap, RelayPayload, Unresolved

LIMITS = RequestLimits(vocab_size=16, max_context_len=32)


def _batch(n: int = 2) -> ScheduleBatch:
    checker = OwnershipChecker(enabled=False)
    params = [SamplingParams() for _ in range(n)]
    reqs = tuple(Req.new(f"r{i}", [1, 2], params[i], LIMITS, checker=checker) for i in range(n))
    slots = torch.arange(1, n + 1)
    return ScheduleBatch(
        reqs=reqs,
        incarnations=(0,) * n,
        forward_mode=ForwardMode.DECODE,
        req_pool_indices=slots,
        seq_lens=torch.full((n,), 5),
        sampling_info=SamplingInfo.from_params(
            params, vocab_size=16, device=torch.device("cpu"), frequency_penalties=[1.0] * n
        ),
        future_indices=slots.clone(),
    )


def _worker_scribbles(batch: ScheduleBatch) -> None:
    """What a speculative worker does to the batch inside its forward."""
    batch.forward_mode = ForwardMode.TARGET_VERIFY
    batch.seq_lens = torch.full((2,), 9)
    batch.input_ids = torch.arange(8)
    batch.out_cache_loc = torch.arange(8)
    batch.prefix_lens, batch.extend_lens = (5, 5), (4, 4)
    batch.spec_info = RelayPayload(bonus_tokens=torch.zeros(2, dtype=torch.int64))


def test_speculative_restores_every_field_by_identity_even_on_error() -> None:
    """A worker that rebinds every field and then raises leaves every binding as it was."""
    isolator = ForwardIsolator(overlap=False)
    batch = _batch()
    before = batch.field_bindings()
    seen = []

    def worker() -> None:
        seen.append(batch.sampling_info)
        _worker_scribbles(batch)
        raise RuntimeError("worker failed")

    with (
        pytest.raises(RuntimeError, match="worker failed"),
        isolator.forward_isolation(batch, speculative=True),
    ):
        worker()
    assert seen[0] is not before["sampling_info"]
    assert seen[0].accumulator is None  # the worker saw the forward-only copy
    after = batch.field_bindings()
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before), [
        k for k in before if after[k] is not before[k]
    ]
    assert batch.forward_mode is ForwardMode.DECODE


def test_non_speculative_restores_only_sampling() -> None:
    """Without speculation only the sampling state is isolated; other rebinding persists."""
    isolator = ForwardIsolator(overlap=False)
    batch = _batch()
    sampling = batch.sampling_info
    with isolator.forward_isolation(batch, speculative=False):
        batch.input_ids = torch.arange(2)
        batch.sampling_info = SamplingInfo.from_params(
            [SamplingParams()] * 2, vocab_size=16, device=torch.device("cpu")
        )
    assert batch.sampling_info is sampling
    assert batch.input_ids is not None and batch.input_ids.tolist() == [0, 1]


def test_dynamic_attributes_are_untouched() -> None:
    """Attributes that are not declared fields are neither snapshotted nor restored."""
    isolator = ForwardIsolator(overlap=False)
    batch = _batch()
    batch.engine_note = "before"  # type: ignore[attr-defined]
    with isolator.forward_isolation(batch, speculative=True):
        batch.engine_note = "during"  # type: ignore[attr-defined]
        batch.engine_extra = 1  # type: ignore[attr-defined]
    assert batch.engine_note == "during"  # type: ignore[attr-defined]
    assert batch.engine_extra == 1  # type: ignore[attr-defined]


def test_single_use_and_not_nested_on_one_batch() -> None:
    """Re-entering a scope or nesting two scopes over one batch raises IsolationError."""
    isolator = ForwardIsolator(overlap=False)
    batch = _batch()
    scope = isolator.forward_isolation(batch, speculative=True)
    with (
        scope,
        pytest.raises(IsolationError, match="already inside a forward isolation"),
        isolator.forward_isolation(batch, speculative=True),
    ):
        pass
    with pytest.raises(IsolationError, match="single-use"), scope:
        pass
    with isolator.forward_isolation(batch, speculative=True):  # a fresh scope works again
        pass
    with pytest.raises(IsolationError, match="keep_alive outside"):
        scope.keep_alive(("x",))


def test_overlap_ring_pins_the_last_two_iterations() -> None:
    """Under overlap the ring holds (batch, snapshot, result refs) of the last two forwards."""
    isolator = ForwardIsolator(overlap=True)
    batches = [_batch() for _ in range(3)]
    refs = [torch.zeros(1) for _ in range(3)]
    for b, ref in zip(batches, refs, strict=True):
        with isolator.forward_isolation(b, speculative=True) as iso:
            pinned_sampling = b.sampling_info
            iso.keep_alive((ref,))
    entries = [e for e in isolator.ring.entries() if e is not None]
    assert {id(e.batch) for e in entries} == {id(batches[1]), id(batches[2])}
    newest = next(e for e in entries if e.batch is batches[2])
    assert newest.refs == [refs[2]]
    assert newest.bindings["sampling_info"] is batches[2].sampling_info
    assert pinned_sampling is not batches[2].sampling_info  # the forward copy, pinned too


def test_non_overlap_never_writes_the_ring() -> None:
    """Without overlap the ring stays empty."""
    isolator = ForwardIsolator(overlap=False)
    with isolator.forward_isolation(_batch(), speculative=True) as iso:
        iso.keep_alive(("x",))
    assert isolator.ring.entries() == (None, None)


def test_batch_relay_resolves_and_rebinds() -> None:
    """Unresolved frontier and bonus tokens are rebound from the FutureMap; resolved ones stay."""
    fm = FutureMap(4, device=torch.device("cpu"), debug=True)
    batch = _batch()
    idx = batch.req_pool_indices
    fm.publish(idx, torch.tensor([9, 12]))
    fm.stash(idx, RelayPayload(bonus_tokens=torch.tensor([3, 4])))
    batch.seq_lens = Unresolved(idx.clone())
    batch.input_ids = Unresolved(idx.clone())
    resolve_batch_seq_lens(fm, batch, host_mirror=True)
    resolve_batch_forward_inputs(fm, batch)
    assert isinstance(batch.seq_lens, torch.Tensor) and batch.seq_lens.tolist() == [9, 12]
    assert batch.seq_lens_cpu == (9, 12)
    assert isinstance(batch.input_ids, torch.Tensor) and batch.input_ids.tolist() == [3, 4]
    assert batch.spec_info is not None and batch.spec_info.bonus_tokens.tolist() == [3, 4]
    seq_lens = batch.seq_lens
    resolve_batch_seq_lens(fm, batch)  # already resolved: unchanged, no consume
    assert batch.seq_lens is seq_lens
