"""Tests for specstate.relay.future_map: publish/stash/resolve, the fence and consume once."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specstate.core.errors import InvalidConfig, RelayError
from specstate.relay.future_map import (
    DraftDims,
    FutureMap,
    RelayPayload,
    Unresolved,
    is_unresolved,
)
from specstate.relay.streams import CpuStream, make_stream

CPU = torch.device("cpu")
MAX_SLOTS = 16
GATE_TIMEOUT_S = 10.0


def _idx(*slots: int) -> torch.Tensor:
    return torch.tensor(slots, dtype=torch.int64)


def _gate_wait(gate: threading.Event) -> None:
    if not gate.wait(GATE_TIMEOUT_S):
        raise TimeoutError("gate never opened")


@settings(max_examples=60, deadline=None)
@given(
    data=st.dictionaries(
        st.integers(0, MAX_SLOTS - 1), st.integers(0, 1 << 40), min_size=1, max_size=MAX_SLOTS
    ),
    host_mirror=st.booleans(),
    debug=st.booleans(),
)
def test_publish_resolve_round_trip(data: dict[int, int], host_mirror: bool, debug: bool) -> None:
    """Each published slot resolves to its own value, in the order the indices ask for."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=debug)
    slots = list(data)
    fm.publish(_idx(*slots), torch.tensor([data[s] for s in slots]))
    order = list(reversed(slots))
    resolved = fm.resolve_seq_lens(_idx(*order), host_mirror=host_mirror)
    assert resolved.seq_lens.tolist() == [data[s] for s in order]
    assert resolved.seq_lens.dtype == torch.int64
    assert resolved.seq_lens_cpu == ([data[s] for s in order] if host_mirror else None)


def test_publish_does_not_alter_caller_tensors() -> None:
    """publish neither writes nor rebinds the caller's index and value tensors."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    indices, values = _idx(2, 5), torch.tensor([7, 9], dtype=torch.int32)
    before = (indices.clone(), values.clone())
    fm.publish(indices, values)
    assert torch.equal(indices, before[0])
    assert torch.equal(values, before[1])
    assert values.dtype == torch.int32


def test_resolved_tensors_do_not_alias_buffers() -> None:
    """A later publish does not change an earlier resolved tensor, nor a write to it the map."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    fm.publish(_idx(1, 2), torch.tensor([10, 20]))
    first = fm.resolve_seq_lens(_idx(1, 2)).seq_lens
    fm.publish(_idx(1, 2), torch.tensor([11, 21]))
    assert first.tolist() == [10, 20]
    first.add_(100)
    assert fm.resolve_seq_lens(_idx(1, 2)).seq_lens.tolist() == [11, 21]


def test_resolve_waits_for_the_publish_fence() -> None:
    """A resolve returns the values of a publish still gated on the forward stream, not stale."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    fm.publish(_idx(3, 4), torch.tensor([1, 1]))
    gate = threading.Event()
    with CpuStream("forward") as forward:
        forward.submit(_gate_wait, gate)
        fm.publish(_idx(3, 4), torch.tensor([40, 50]), stream=forward)
        releaser = threading.Timer(0.05, gate.set)
        releaser.start()
        resolved = fm.resolve_seq_lens(_idx(3, 4), host_mirror=True)
        releaser.join()
    assert resolved.seq_lens_cpu == [40, 50]
    assert fm.snapshot().num_fence_waits == 1


def test_resolve_forward_inputs_waits_for_the_stash_fence() -> None:
    """Forward inputs come from a stash still gated on the forward stream, not stale rows."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    gate = threading.Event()
    with CpuStream("forward") as forward:
        forward.submit(_gate_wait, gate)
        fm.stash(_idx(2, 9), RelayPayload(bonus_tokens=_idx(12, 19)), stream=forward)
        threading.Timer(0.05, gate.set).start()
        assert fm.resolve_forward_inputs(_idx(9, 2)).bonus_tokens.tolist() == [19, 12]
    assert fm.snapshot().num_fence_waits == 1


def test_host_publish_lands_after_a_pending_stream_publish() -> None:
    """A publish without a stream waits for the pending one, so the later write wins."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    gate = threading.Event()
    with CpuStream("forward") as forward:
        forward.submit(_gate_wait, gate)
        fm.publish(_idx(5), torch.tensor([1]), stream=forward)
        threading.Timer(0.05, gate.set).start()
        fm.publish(_idx(5), torch.tensor([2]))
        assert fm.resolve_seq_lens(_idx(5)).seq_lens.tolist() == [2]


def test_armed_fences_cover_writes_from_inside_the_forward() -> None:
    """A publish and a stash from inside the forward are seen once the host armed the fences."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    gate = threading.Event()
    with CpuStream("forward") as forward:

        def forward_n() -> None:
            _gate_wait(gate)
            fm.publish(_idx(6), torch.tensor([66]), stream=forward)  # inline on the worker
            fm.stash(_idx(6), RelayPayload(bonus_tokens=torch.tensor([5])), stream=forward)

        forward.submit(forward_n)
        fm.arm_fences(forward)
        threading.Timer(0.05, gate.set).start()
        assert fm.resolve_forward_inputs(_idx(6)).bonus_tokens.tolist() == [5]
        assert fm.resolve_seq_lens(_idx(6)).seq_lens.tolist() == [66]


def test_failed_publish_work_is_reported_once_by_resolve() -> None:
    """A resolve behind a publish whose stream work failed re-raises that error once."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    with CpuStream("forward") as forward:
        forward.submit(lambda: 1 // 0)
        fm.publish(_idx(1), torch.tensor([3]), stream=forward)
        with pytest.raises(ZeroDivisionError):
            fm.resolve_seq_lens(_idx(1))
        with pytest.raises(ZeroDivisionError):
            forward.synchronize()  # the owner's recovery point resets the stream
        assert fm.resolve_seq_lens(_idx(1)).seq_lens.tolist() == [0]


def test_consume_once_violations_raise_in_debug() -> None:
    """In debug, reading a slot twice without a write between raises, naming the slots."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=True)
    fm.publish(_idx(1, 2), torch.tensor([10, 20]))
    fm.publish(_idx(2), torch.tensor([21]))  # overwriting an unread slot is allowed
    assert fm.resolve_seq_lens(_idx(1, 2)).seq_lens.tolist() == [10, 21]
    fm.publish(_idx(1), torch.tensor([11]))
    with pytest.raises(RelayError, match=r"slots \[2\] have no publish since their last read"):
        fm.resolve_seq_lens(_idx(1, 2))
    with pytest.raises(RelayError, match=r"slots \[9\] have no stash since their last read"):
        fm.resolve_forward_inputs(_idx(9))


def test_consume_once_is_not_checked_outside_debug() -> None:
    """Without debug mode, repeated reads return the same values and never raise."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    fm.publish(_idx(1), torch.tensor([10]))
    fm.stash(_idx(1), RelayPayload(bonus_tokens=torch.tensor([4])))
    for _ in range(2):
        assert fm.resolve_seq_lens(_idx(1)).seq_lens.tolist() == [10]
        assert fm.resolve_forward_inputs(_idx(1)).bonus_tokens.tolist() == [4]


def test_debug_poisons_unwritten_and_consumed_rows() -> None:
    """In debug, extras never written, or already read, come back poisoned, not stale."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=True, draft_dims=DraftDims(topk=2, hidden_size=3))
    fm.stash(_idx(1), RelayPayload(bonus_tokens=_idx(5)))
    fresh = fm.resolve_forward_inputs(_idx(1))
    assert fresh.topk_index is not None
    assert fresh.topk_index.tolist() == [[torch.iinfo(torch.int64).min] * 2]
    full = RelayPayload(
        bonus_tokens=_idx(6),
        topk_p=torch.ones(1, 2),
        topk_index=torch.ones(1, 2, dtype=torch.int64),
        hidden_states=torch.ones(1, 3),
    )
    fm.stash(_idx(1), full)
    assert fm.resolve_forward_inputs(_idx(1)).bonus_tokens.tolist() == [6]
    fm.stash(_idx(1), RelayPayload(bonus_tokens=_idx(7)))  # no extras this time
    again = fm.resolve_forward_inputs(_idx(1))
    assert again.hidden_states is not None
    assert bool(again.hidden_states.isnan().all())


def test_second_reader_of_a_consumed_frontier_is_refused() -> None:
    """In debug, a mixed-tail read of a frontier already resolved raises, naming the slot."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=True)
    fm.publish(_idx(1), torch.tensor([10]))
    assert fm.resolve_seq_lens(_idx(1)).seq_lens.tolist() == [10]
    with pytest.raises(RelayError, match=r"slots \[1\]"):
        fm.resolve_mixed_tails(_idx(1), torch.zeros(MAX_SLOTS, 32, dtype=torch.int64))


def test_debug_rejects_bad_indices() -> None:
    """In debug, out-of-range and repeated slots are refused before any write."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=True)
    with pytest.raises(RelayError, match=r"slots \[16\] outside \[0, 16\)"):
        fm.publish(_idx(0, 16), torch.tensor([1, 2]))
    with pytest.raises(RelayError, match="repeated slots"):
        fm.publish(_idx(3, 3), torch.tensor([1, 2]))


def test_shape_mismatch_is_refused() -> None:
    """Values whose shape differs from the indices are refused."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    with pytest.raises(RelayError, match=r"indices \(2,\) for values \(3,\)"):
        fm.publish(_idx(1, 2), torch.tensor([1, 2, 3]))
    with pytest.raises(RelayError, match="together"):
        fm.stash(_idx(1), RelayPayload(bonus_tokens=_idx(1), topk_p=torch.ones(1, 2)))


def test_empty_index_sets_are_no_ops() -> None:
    """Empty indices write nothing, wait for nothing and resolve to empty tensors."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=True)
    empty = _idx()
    fm.publish(empty, empty)
    fm.stash(empty, RelayPayload(bonus_tokens=empty))
    resolved = fm.resolve_seq_lens(empty, host_mirror=True)
    inputs = fm.resolve_forward_inputs(empty)
    tails = fm.resolve_mixed_tails(empty, torch.zeros(4, 4, dtype=torch.int32))
    assert resolved.seq_lens.shape == (0,)
    assert resolved.seq_lens_cpu == []
    assert inputs.bonus_tokens.shape == (0,)
    assert inputs.topk_p is None
    assert tails.out_cache_loc.dtype == torch.int32
    assert tails.seq_lens.shape == tails.prefix_lens.shape == (0,)
    snap = fm.snapshot()
    assert (snap.num_publishes, snap.num_stashes, snap.num_fence_waits) == (0, 0, 0)


def test_draft_extras_are_created_lazily() -> None:
    """Extras are None before the first stash that carries them and shaped by it after."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    fm.stash(_idx(1, 2), RelayPayload(bonus_tokens=torch.tensor([7, 8])))
    before = fm.resolve_forward_inputs(_idx(1, 2))
    assert (before.topk_p, before.topk_index, before.hidden_states) == (None, None, None)
    topk_index = torch.randint(0, 100, (2, 4))
    payload = RelayPayload(
        bonus_tokens=torch.tensor([7, 8]),
        topk_p=torch.rand(2, 4),
        topk_index=topk_index,
        hidden_states=torch.randn(2, 8, dtype=torch.bfloat16),
    )
    fm.stash(_idx(1, 2), payload)
    after = fm.resolve_forward_inputs(_idx(2, 1))
    assert after.topk_p is not None
    assert after.topk_index is not None
    assert after.hidden_states is not None
    assert after.topk_p.shape == after.topk_index.shape == (2, 4)
    assert after.hidden_states.shape == (2, 8)
    assert after.hidden_states.dtype == torch.bfloat16
    assert torch.equal(after.topk_index, topk_index.flip(0))
    assert (fm.snapshot().topk, fm.snapshot().hidden_size) == (4, 8)


def test_draft_dims_preallocate_and_pin_widths() -> None:
    """With DraftDims the extras exist from the start and a stash of another width is refused."""
    fm = FutureMap(MAX_SLOTS, device=CPU, draft_dims=DraftDims(topk=2, hidden_size=4))
    inputs = fm.resolve_forward_inputs(_idx(0, 1))
    assert inputs.hidden_states is not None
    assert inputs.hidden_states.shape == (2, 4)
    bad = RelayPayload(bonus_tokens=_idx(0), topk_p=torch.ones(1, 3), topk_index=_idx(0).view(1, 1))
    with pytest.raises(InvalidConfig, match="topk_p width 3 != buffer width 2"):
        fm.stash(_idx(0), bad)


def test_mixed_tails_rebuild_vector() -> None:
    """Slots [3, 7] at fresh [11, 21] give seq_lens [12, 22], prefix [11, 21], inputs untouched."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    req_to_token = torch.arange(MAX_SLOTS * 32, dtype=torch.int32).view(MAX_SLOTS, 32)
    slots, fresh = _idx(3, 7), _idx(11, 21)
    originals = (req_to_token.clone(), slots.clone(), fresh.clone())
    tails = fm.resolve_mixed_tails(slots, req_to_token, fresh)
    assert tails.seq_lens.tolist() == [12, 22]
    assert tails.out_cache_loc.tolist() == [req_to_token[3, 11].item(), req_to_token[7, 21].item()]
    assert tails.prefix_lens.tolist() == [11, 21]
    assert torch.equal(req_to_token, originals[0])
    assert torch.equal(slots, originals[1])
    assert torch.equal(fresh, originals[2])
    tails.prefix_lens.add_(1)
    assert fresh.tolist() == [11, 21]  # prefix_lens is a new tensor, not the caller's


def test_mixed_tails_default_to_the_published_frontier() -> None:
    """Without fresh_committed, the tails read the published new_seq_lens of their slots."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=True)
    req_to_token = torch.arange(MAX_SLOTS * 32, dtype=torch.int64).view(MAX_SLOTS, 32)
    fm.publish(_idx(3, 7), _idx(11, 21))
    tails = fm.resolve_mixed_tails(_idx(3, 7), req_to_token)
    assert tails.seq_lens.tolist() == [12, 22]
    assert tails.out_cache_loc.tolist() == [3 * 32 + 11, 7 * 32 + 21]


def test_unresolved_is_its_own_type() -> None:
    """An Unresolved value is recognised by is_unresolved and a tensor is not."""
    pending: torch.Tensor | Unresolved = Unresolved(_idx(1, 2))
    assert is_unresolved(pending)
    assert not is_unresolved(torch.tensor([-1]))
    assert pending.future_indices.tolist() == [1, 2]


def test_invalid_size_is_refused() -> None:
    """A map with no slots is an invalid configuration."""
    with pytest.raises(InvalidConfig, match="max_slots >= 1, got 0"):
        FutureMap(0, device=CPU)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_publish_fence_round_trip() -> None:
    """On CUDA, a publish on the forward stream is seen by a resolve on the current stream."""
    device = torch.device("cuda")
    fm = FutureMap(MAX_SLOTS, device=device, debug=True)
    with make_stream(device) as forward:
        slots = torch.tensor([1, 4], device=device)
        forward.submit(lambda: torch.cuda._sleep(20_000_000))  # type: ignore[no-untyped-call]
        fm.publish(slots, torch.tensor([5, 6], device=device), stream=forward)
        assert fm.resolve_seq_lens(slots, host_mirror=True).seq_lens_cpu == [5, 6]


# ------------------------------------------------------------ relay by reference
def _payload(bonus: list[int], hidden: float | None = None) -> RelayPayload:
    n = len(bonus)
    return RelayPayload(
        bonus_tokens=torch.tensor(bonus),
        hidden_states=None if hidden is None else torch.full((n, 3), hidden),
    )


@pytest.mark.parametrize("debug", [False, True])
def test_a_persistent_batch_resolves_its_own_writes_by_reference(debug: bool) -> None:
    """The same index tensor resolves the written tensors themselves: no scatter, no gather."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=debug)
    rows = _idx(4, 1, 7)
    lens, payload = torch.tensor([10, 11, 12]), _payload([5, 6, 7], hidden=0.5)
    fm.publish(rows, lens)
    fm.stash(rows, payload)
    got_lens = fm.resolve_seq_lens(rows).seq_lens
    got = fm.resolve_forward_inputs(rows)
    assert got_lens is lens and got.bonus_tokens is payload.bonus_tokens
    assert got.hidden_states is payload.hidden_states


def test_a_read_of_other_rows_sees_what_eager_writes_would_leave() -> None:
    """Pending writes reach the buffers before any read or write of other rows."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    first, second = _idx(1, 2), _idx(3)
    fm.publish(first, torch.tensor([20, 21]))
    fm.stash(first, _payload([8, 9], hidden=1.0))
    fm.publish(second, torch.tensor([30]))  # another batch's rows: flushes the first write
    fm.stash(second, _payload([4], hidden=2.0))
    assert fm.resolve_seq_lens(_idx(2, 1, 3)).seq_lens.tolist() == [21, 20, 30]
    got = fm.resolve_forward_inputs(_idx(3, 1))  # a new tensor with other rows: a gather
    assert got.bonus_tokens.tolist() == [4, 8]
    assert got.hidden_states is not None and got.hidden_states[:, 0].tolist() == [2.0, 1.0]


def test_a_rewrite_without_an_extra_keeps_the_extra_written_before() -> None:
    """Rewriting the same rows without hidden states leaves the earlier ones readable."""
    fm = FutureMap(MAX_SLOTS, device=CPU)
    rows = _idx(5, 6)
    fm.stash(rows, _payload([1, 2], hidden=3.0))
    fm.stash(rows, _payload([7, 8]))
    got = fm.resolve_forward_inputs(rows)
    assert got.bonus_tokens.tolist() == [7, 8]
    assert got.hidden_states is not None and got.hidden_states[:, 0].tolist() == [3.0, 3.0]


def test_consume_once_holds_for_writes_kept_by_reference() -> None:
    """Debug mode: a second resolve of the same rows without a new write still raises."""
    fm = FutureMap(MAX_SLOTS, device=CPU, debug=True)
    rows = _idx(2, 3)
    fm.publish(rows, torch.tensor([4, 5]))
    fm.stash(rows, _payload([1, 1]))
    fm.resolve_seq_lens(rows)
    fm.resolve_forward_inputs(rows)
    with pytest.raises(RelayError, match=r"consume once: slots \[2, 3\] have no publish"):
        fm.resolve_seq_lens(rows)
    with pytest.raises(RelayError, match=r"consume once: slots \[2, 3\] have no stash"):
        fm.resolve_forward_inputs(rows)
