"""The persistent decode rows: rows stay in place, joiners refill them, the rest condense."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.batch.sampling import SamplingInfo
from specstate.core.ownership import OwnershipChecker
from specstate.core.request import Req
from specstate.engine.invariants import check_engine
from specstate.engine.schedule.decode_columns import DecodeColumns
from specstate.engine.schedule.decode_rows import DecodeRows
from specstate.tools.timed_worker import TimedWaitWorker


def _req(i: int, temperature: float = 0.0) -> Req:
    limits = RequestLimits(vocab_size=32, max_context_len=64)
    params = SamplingParams(temperature=temperature)
    return Req.new(f"r{i}", [1, 2], params, limits, checker=OwnershipChecker(enabled=False))


def _builder(slot_of: dict[Req, int]) -> object:
    def build(reqs: tuple[Req, ...]) -> DecodeColumns:
        slots = torch.tensor([slot_of[r] for r in reqs], dtype=torch.int64)
        return DecodeColumns(
            reqs=reqs,
            slots=slots,
            slots_host=slots.numpy(),
            device_slots=slots,
            incarnations=tuple(r.incarnation for r in reqs),
            sampling=SamplingInfo.from_params(
                [r.sampling for r in reqs], vocab_size=32, device=torch.device("cpu")
            ),
            epochs=np.array([10 * slot_of[r] for r in reqs], dtype=np.int64),
            request_ids=tuple(r.request_id for r in reqs),
        )

    return build


def _assert_rows_match(cols: DecodeColumns, slot_of: dict[Req, int]) -> None:
    """Every column's row i describes reqs[i] (no stale row anywhere)."""
    want = [slot_of[r] for r in cols.reqs]
    assert cols.slots.tolist() == want
    assert cols.slots_host.tolist() == want
    assert cols.device_slots.tolist() == want
    assert cols.epochs.tolist() == [10 * s for s in want]
    assert cols.request_ids == tuple(r.request_id for r in cols.reqs)
    assert cols.incarnations == tuple(r.incarnation for r in cols.reqs)
    temps = torch.tensor([r.sampling.temperature for r in cols.reqs])
    assert torch.equal(cols.sampling.temperatures, temps)


def test_a_joiner_takes_a_freed_row_and_the_others_stay_in_place() -> None:
    """A leaving request's row goes to the joiner; every other row keeps its position."""
    reqs = [_req(i) for i in range(5)]
    slot_of = {r: i + 1 for i, r in enumerate(reqs)}
    rows = DecodeRows(_builder(slot_of))  # type: ignore[arg-type]
    first = rows.columns(lambda: tuple(reqs))
    new = _req(9, temperature=0.5)
    slot_of[new] = 9
    rows.leave(reqs[2])
    rows.join(new)
    cols = rows.columns(lambda: ())
    assert cols.reqs == (reqs[0], reqs[1], new, reqs[3], reqs[4])
    _assert_rows_match(cols, slot_of)
    assert first.slots.tolist() == [1, 2, 3, 4, 5]  # the earlier columns are untouched


def test_condense_moves_the_last_rows_into_the_holes() -> None:
    """With fewer joiners than leavers the last live rows fill the holes, dense and fresh."""
    reqs = [_req(i, temperature=0.1 * i) for i in range(6)]
    slot_of = {r: i + 1 for i, r in enumerate(reqs)}
    rows = DecodeRows(_builder(slot_of))  # type: ignore[arg-type]
    rows.columns(lambda: tuple(reqs))
    for i in (0, 2, 3):
        rows.leave(reqs[i])
    cols = rows.columns(lambda: ())
    assert set(cols.reqs) == {reqs[1], reqs[4], reqs[5]} and len(cols.reqs) == 3
    assert cols.reqs[1] is reqs[1]  # in place
    _assert_rows_match(cols, slot_of)


def test_random_churn_never_leaves_a_stale_row() -> None:
    """Random leaves and joins (condense included): every column matches its request."""
    rng = random.Random(7)
    slot_of: dict[Req, int] = {}
    counter = 0

    def fresh() -> Req:
        nonlocal counter
        counter += 1
        req = _req(counter, temperature=rng.choice([0.0, 0.7]))
        slot_of[req] = counter
        return req

    running = [fresh() for _ in range(8)]
    rows = DecodeRows(_builder(slot_of))  # type: ignore[arg-type]
    rows.columns(lambda: tuple(running))
    for _ in range(200):
        for req in rng.sample(running, rng.randint(0, min(4, len(running)))):
            running.remove(req)
            rows.leave(req)
        for _ in range(rng.randint(0, 4)):
            req = fresh()
            running.append(req)
            rows.join(req)
        cols = rows.columns(lambda: tuple(running))
        assert set(cols.reqs) == set(running) and len(cols.reqs) == len(running)
        if running:
            _assert_rows_match(cols, slot_of)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_churned_engine_stays_consistent_and_relays_the_right_rows(overlap: bool) -> None:
    """Requests of staggered lengths finish and join under overlap; every row's relay is its own.

    A stale relay row would run a request from another request's frontier: the worker's result
    check (published frontier = seq_lens + accept) and the ledger's committed length catch it.
    """
    worker = TimedWaitWorker(device_seconds=0.0, accept=2)
    config = EngineConfig(
        overlap=overlap, page_size=4, kv_tokens=8192, max_running=8, check_invariants=True
    )
    with Engine(
        worker, limits=RequestLimits(vocab_size=32, max_context_len=256), config=config
    ) as eng:
        reqs = []
        for i in range(40):  # bunches finish together: refills, then condenses at the tail
            params = SamplingParams(max_new_tokens=3 + (7 * i) % 17 + 8 * (i % 3), ignore_eos=True)
            reqs.append(eng.submit(f"r{i}", [1 + i % 3] * (3 + i % 7), params))
        eng.run_until_idle()
        check_engine(eng)
    for req in reqs:
        assert req.finish is not None and req.finish.reason.value == "length"
        assert len(req.emitted_ids) == req.sampling.max_new_tokens


def test_plain_and_general_patches_match_a_fresh_build() -> None:
    """Requests with and without sampling controls join and leave: every patched set of rows
    (host arrays for plain rows, tensors otherwise) equals the columns built from scratch."""
    worker = TimedWaitWorker(device_seconds=0.0, accept=2)
    config = EngineConfig(
        overlap=False, page_size=4, kv_tokens=8192, max_running=6, check_invariants=True
    )
    with Engine(
        worker, limits=RequestLimits(vocab_size=32, max_context_len=256), config=config
    ) as eng:
        for i in range(36):
            plain = i < 18 or i % 3  # later, every third request has a seed: not plain
            params = SamplingParams(
                max_new_tokens=3 + (5 * i) % 11,
                ignore_eos=True,
                temperature=(0.0, 0.7, 1.3)[i % 3],
                top_k=None if i % 4 else 5 + i,
                top_p=1.0 if i % 5 else 0.5,
                seed=None if plain else i,
            )
            eng.submit(f"r{i}", [1 + i % 3] * (3 + i % 4), params)
        eng.run_until_idle()
        rows = eng.scheduler.decode_rows_snapshot()
    assert rows.num_plain_patches > 3
    assert rows.num_patches - rows.num_plain_patches > 3  # the general path ran too


def test_running_slots_see_pending_changes_without_patching() -> None:
    """Admission asks for the next round's slots: rows that left are out, joiners are in,
    and the columns are not patched for it (the round patches once, when it is built)."""
    reqs = [_req(i) for i in range(6)]
    slot_of = {r: i + 1 for i, r in enumerate(reqs)}
    rows = DecodeRows(_builder(slot_of))  # type: ignore[arg-type]
    assert rows.running_slots(slot_of.__getitem__) is None  # nothing built yet
    rows.columns(lambda: tuple(reqs))
    new = _req(9)
    slot_of[new] = 9
    for i in (1, 4):
        rows.leave(reqs[i])
    rows.join(new)
    pending = rows.running_slots(slot_of.__getitem__)
    assert pending is not None and sorted(pending.tolist()) == [1, 3, 4, 6, 9]
    assert rows.snapshot().num_patches == 0
    cols = rows.columns(lambda: ())
    assert sorted(cols.slots_host.tolist()) == sorted(pending.tolist())
    assert rows.snapshot().num_patches == 1
