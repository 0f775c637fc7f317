"""The output table: batch-wide settlement agrees with the one finish resolver, row by row;
`Req.end_many` copies each request's row back from its own table, however many are involved."""

from __future__ import annotations

import gc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specstate import Req, RequestLimits, SamplingParams
from specstate.core.errors import InvalidTransition, LedgerViolation
from specstate.core.status import FinishReason, FinishState, ReqStatus
from specstate.engine.settle.outputs import OutputTable
from specstate.internals import OwnershipChecker, Role
from specstate.testing.finish_oracle import resolve_finish

VOCAB = 12
EOS = frozenset({11})
RUN = 4


def _table(slots: int = 8, max_outputs: int = 64) -> tuple[OutputTable, OwnershipChecker]:
    checker = OwnershipChecker(enabled=True)
    table = OutputTable(
        max_slots=slots, max_outputs=max_outputs, max_run=RUN, eos_token_ids=EOS, checker=checker
    )
    return table, checker


def _req(name: str, params: SamplingParams, checker: OwnershipChecker) -> Req:
    limits = RequestLimits(vocab_size=VOCAB, max_context_len=128, eos_token_ids=EOS)
    return Req.new(name, [1, 2, 3], params, limits, checker=checker)


def _open(table: OutputTable, checker: OwnershipChecker, slot: int, req: Req) -> None:
    with checker.acting(Role.SCHEDULER):
        table.open_row(slot, req)


def test_rows_hold_outputs_until_the_request_leaves() -> None:
    """Outputs settle in the row; leaving copies them back and bumps the slot's epoch."""
    table, checker = _table()
    req = _req("a", SamplingParams(max_new_tokens=50), checker)
    _open(table, checker, 3, req)
    slots = np.array([3])
    with checker.acting(Role.RESULT_PROCESSOR):
        ended = table.append_runs(slots, np.array([[4, 5, 6, 7]]), np.array([3]), verifies=True)
    assert ended is None
    assert req.output_ids == (4, 5, 6) and req.seqlen == 6 and req.accept_lengths == (3,)
    before = table.epochs(slots).copy()
    req.transition(ReqStatus.PREFILL)
    req.transition(ReqStatus.RETRACTED)
    assert not table.is_open(3) and (table.epochs(slots) == before + 1).all()
    assert req.output_ids == (4, 5, 6) and req.accept_lengths == (3,)
    again = _req("b", SamplingParams(max_new_tokens=50), checker)
    _open(table, checker, 3, again)  # a new request reuses the row from an empty start
    assert again.output_ids == () and again.accept_lengths == ()


def test_a_reopened_request_brings_its_outputs() -> None:
    """Re-admission copies the outputs settled before into the new row."""
    table, checker = _table()
    req = _req("a", SamplingParams(max_new_tokens=50), checker)
    with checker.acting(Role.RESULT_PROCESSOR):
        req.append_outputs([9, 8])
    _open(table, checker, 2, req)
    assert req.output_ids == (9, 8) and req.num_outputs == 2


def test_a_held_row_cannot_be_opened_again() -> None:
    """Opening a row that another request holds raises and changes nothing."""
    table, checker = _table()
    _open(table, checker, 1, _req("a", SamplingParams(), checker))
    with pytest.raises(LedgerViolation, match="output row 1 is out of range or held by a"):
        _open(table, checker, 1, _req("b", SamplingParams(), checker))


def test_a_stop_token_past_the_accepted_run_does_not_end_the_request() -> None:
    """Only the accepted prefix of a run counts: a stop in a rejected draft is ignored."""
    table, checker = _table()
    req = _req("a", SamplingParams(max_new_tokens=50, stop_token_ids=[9]), checker)
    _open(table, checker, 1, req)
    with checker.acting(Role.RESULT_PROCESSOR):
        assert (
            table.append_runs(np.array([1]), np.array([[4, 5, 9, 9]]), np.array([2]), verifies=True)
            is None
        )
        ended = table.append_runs(
            np.array([1]), np.array([[6, 9, 7, 7]]), np.array([3]), verifies=True
        )
    assert ended is not None and ended.rows == (0,)
    assert ended.stop_at == (4,) and ended.stop_token == (9,)


RUNS = st.lists(
    st.tuples(st.lists(st.integers(0, VOCAB - 1), min_size=RUN, max_size=RUN), st.integers(1, RUN)),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.integers(1, 12),  # max_new_tokens
            st.frozensets(st.integers(0, VOCAB - 1), max_size=3),  # stop ids
            st.booleans(),  # ignore_eos
            RUNS,
        ),
        min_size=1,
        max_size=5,
    )
)
def test_batch_settlement_matches_the_finish_resolver(
    rows: list[tuple[int, frozenset[int], bool, list[tuple[list[int], int]]]],
) -> None:
    """Every row ends exactly where `resolve_finish` says, with the same reason and length."""
    table, checker = _table()
    reqs = []
    for i, (cap, stops, ignore_eos, _) in enumerate(rows):
        params = SamplingParams(max_new_tokens=cap, stop_token_ids=stops, ignore_eos=ignore_eos)
        req = _req(f"r{i}", params, checker)
        _open(table, checker, i + 1, req)
        req.transition(ReqStatus.PREFILL)
        req.transition(ReqStatus.RUNNING)
        reqs.append(req)
    for k in range(max(len(r[3]) for r in rows)):
        live = [i for i, r in enumerate(rows) if k < len(r[3]) and not reqs[i].is_finished]
        if not live:
            break
        tokens = np.array([rows[i][3][k][0] for i in live])
        accept = np.array([rows[i][3][k][1] for i in live])
        want = {
            i: resolve_finish(
                rows[i][3][k][0][: rows[i][3][k][1]],
                num_outputs_before=reqs[i].num_outputs,
                params=reqs[i].sampling,
                eos_token_ids=EOS,
            )
            for i in live
        }
        with checker.acting(Role.RESULT_PROCESSOR):
            ended = table.append_runs(np.array(live) + 1, tokens, accept, verifies=True)
        got = {}
        if ended is not None:
            for j, row in enumerate(ended.rows):
                stop_at = ended.stop_at[j]
                got[live[row]] = (
                    (FinishReason.STOP, stop_at)
                    if stop_at >= 0
                    else (FinishReason.LENGTH, reqs[live[row]].sampling.max_new_tokens)
                )
        for i in live:
            expect = want[i]
            assert got.get(i) == (None if expect is None else (expect.reason, expect.finished_len))
            if expect is not None:
                reqs[i].transition(ReqStatus.FINISHED, finish=expect)


def test_ending_many_requests_copies_every_row_back_or_changes_nothing() -> None:
    """`Req.end_many` checks every request before any ends, then copies each row back."""
    table, checker = _table()
    names = ("a", "b", "c", "d")
    reqs = [_req(n, SamplingParams(max_new_tokens=50, logprobs=n == "b"), checker) for n in names]
    for slot, req in zip((2, 3, 5, 6), reqs, strict=True):
        _open(table, checker, slot, req)
        req.transition(ReqStatus.PREFILL)
        req.transition(ReqStatus.RUNNING)
    slots = np.array([2, 3, 5, 6])
    runs = [np.array([[4, 5, 6, 7]] * 4) + 10 * np.arange(4)[:, None], np.full((4, RUN), 9)]
    accepts = [np.array([1, 2, 3, 4]), np.array([4, 1, 2, 3])]
    with checker.acting(Role.RESULT_PROCESSOR):
        for run, accept in zip(runs, accepts, strict=True):
            probs = -np.arange(run.size, dtype=np.float32).reshape(run.shape) / 8
            assert table.append_runs(slots, run, accept, verifies=True, logprobs=probs) is None
    outputs = [tuple(r.output_ids) for r in reqs]
    expect = [
        tuple(runs[0][i, : accepts[0][i]]) + tuple(runs[1][i, : accepts[1][i]]) for i in range(4)
    ]
    assert outputs == expect
    b_probs = reqs[1].stored_logprobs()
    epochs = table.epochs(slots).copy()
    a, b, c, d = reqs
    stop = FinishState(reason=FinishReason.STOP, finished_len=2)
    too_long = FinishState(reason=FinishReason.LENGTH, finished_len=len(expect[2]) + 1)
    with pytest.raises(InvalidTransition, match="request c: finished_len 6 outside 0..5"):
        Req.end_many([a, b, c], [stop, stop, too_long])
    with pytest.raises(InvalidTransition, match="ended twice"):
        Req.end_many([a, a], [stop, stop])
    with pytest.raises(InvalidTransition, match="requests a, b: 2 requests to end, 1 finishes"):
        Req.end_many([a, b], [stop])
    # Nothing changed: every request runs, every row is open with its outputs and epoch.
    assert all(r.status is ReqStatus.RUNNING and r.finish is None for r in reqs)
    assert all(table.is_open(int(s)) for s in slots) and (table.epochs(slots) == epochs).all()
    assert [tuple(r.output_ids) for r in reqs] == expect
    abort = FinishState(reason=FinishReason.ABORT, finished_len=1, detail="user")
    length = FinishState(reason=FinishReason.LENGTH, finished_len=len(expect[1]))
    Req.end_many([c, a, b], [abort, stop, length])
    assert [r.status for r in reqs] == [
        ReqStatus.FINISHED,
        ReqStatus.FINISHED,
        ReqStatus.ABORTED,
        ReqStatus.RUNNING,
    ]
    assert [r.finish for r in (a, b, c)] == [stop, length, abort]
    assert [tuple(r.output_ids) for r in reqs] == expect  # copied back, d still in its row
    assert a.emitted_ids == expect[0][:2] and c.emitted_ids == expect[2][:1]
    assert [r.accept_lengths for r in reqs] == [
        (int(x), int(y)) for x, y in zip(*accepts, strict=True)
    ]
    assert b.stored_logprobs() == b_probs and b.logprobs == tuple(b_probs)
    assert a.logprobs is None
    assert [table.is_open(int(s)) for s in slots] == [False, False, False, True]
    assert (table.epochs(slots) == epochs + np.array([1, 1, 1, 0])).all()
    with pytest.raises(InvalidTransition, match="request a: finished -> finished"):
        Req.end_many([d, a], [stop, stop])  # an ended request cannot end again
    assert d.status is ReqStatus.RUNNING and table.is_open(6)
    waiting = _req("w", SamplingParams(max_new_tokens=50), checker)
    aborted = FinishState(reason=FinishReason.ABORT, finished_len=0)
    Req.end_many([waiting, d], [aborted, FinishState(reason=FinishReason.LENGTH, finished_len=3)])
    assert [waiting.status, d.status] == [ReqStatus.ABORTED, ReqStatus.FINISHED]
    assert tuple(d.output_ids) == expect[3] and not table.is_open(6)


def test_ending_requests_of_different_output_sources_at_once() -> None:
    """`Req.end_many` over requests attached to two tables (the same slot number in each) and
    one attached to none: each gets its own outputs back, and each table closes only its row."""
    checker = OwnershipChecker(enabled=True)
    tables = [
        OutputTable(max_slots=4, max_outputs=16, max_run=RUN, eos_token_ids=EOS, checker=checker)
        for _ in range(2)
    ]
    a, b, loose = (_req(n, SamplingParams(max_new_tokens=9), checker) for n in ("a", "b", "w"))
    runs = {"a": [4, 5, 6, 7], "b": [8, 9, 10, 3]}
    for table, req in zip(tables, (a, b), strict=True):
        _open(table, checker, 2, req)
        req.transition(ReqStatus.PREFILL)
        req.transition(ReqStatus.RUNNING)
        with checker.acting(Role.RESULT_PROCESSOR):
            table.append_runs(
                np.array([2]), np.array([runs[req.request_id]]), np.array([3]), verifies=True
            )
    assert (tuple(a.output_ids), tuple(b.output_ids)) == ((4, 5, 6), (8, 9, 10))
    stop = FinishState(reason=FinishReason.STOP, finished_len=2)
    abort = FinishState(reason=FinishReason.ABORT, finished_len=0)
    Req.end_many([a, loose, b], [stop, abort, stop])
    assert (tuple(a.output_ids), tuple(b.output_ids)) == ((4, 5, 6), (8, 9, 10))
    assert (a.emitted_ids, b.emitted_ids) == ((4, 5), (8, 9))
    assert [r.status for r in (a, loose, b)] == [
        ReqStatus.FINISHED,
        ReqStatus.ABORTED,
        ReqStatus.FINISHED,
    ]
    assert not tables[0].is_open(2) and not tables[1].is_open(2)
    assert [int(t.epochs(np.array([2]))[0]) for t in tables] == [1, 1]
    c, d = (_req(n, SamplingParams(max_new_tokens=9), checker) for n in ("c", "d"))
    for table, req in zip(reversed(tables), (c, d), strict=True):  # c in table 1, d in table 0
        _open(table, checker, 2, req)
        req.transition(ReqStatus.PREFILL)
        req.transition(ReqStatus.RUNNING)
    with checker.acting(Role.RESULT_PROCESSOR):
        tables[1].append_runs(np.array([2]), np.array([[1, 1, 1, 1]]), np.array([1]), verifies=True)
    one = FinishState(reason=FinishReason.STOP, finished_len=1)
    Req.end_many([c, d], [one, abort])  # attached, both, to different tables
    assert (tuple(c.output_ids), tuple(d.output_ids)) == ((1,), ())
    assert not tables[0].is_open(2) and not tables[1].is_open(2)


def test_a_streaming_read_takes_each_grown_row_from_where_it_was_seen() -> None:
    """`read_all_since` returns exactly the new outputs of every attached row that grew."""
    table, checker = _table()
    reqs = {s: _req(f"r{s}", SamplingParams(max_new_tokens=50), checker) for s in (2, 4, 5, 7)}
    for slot, req in reqs.items():
        _open(table, checker, slot, req)
    slots = np.array(sorted(reqs))
    with checker.acting(Role.RESULT_PROCESSOR):
        table.append_runs(
            slots, np.array([[4, 5, 6, 7]] * 4), np.array([2, 1, 3, 4]), verifies=True
        )
    seen = table.all_lengths()
    grown = np.array([2, 5, 7])  # row 4 does not grow; row 7 ends before the read
    with checker.acting(Role.RESULT_PROCESSOR):
        table.append_runs(grown, np.array([[1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 9, 10]]),
                          np.array([1, 4, 2]), verifies=True)  # fmt: skip
    reqs[7].transition(ReqStatus.PREFILL)
    reqs[7].transition(ReqStatus.RETRACTED)  # leaves its row: read it from the request
    read = list(table.read_all_since(seen))
    assert [(req.request_id, run) for req, run in read] == [("r2", [1]), ("r5", [5, 6, 7, 8])]
    for req, run in read:
        assert run == list(req.output_ids[-len(run) :])
    assert list(table.read_all_since(table.all_lengths())) == []


@pytest.mark.parametrize("rows", [3, 40])
def test_a_streaming_read_agrees_with_the_requests_at_any_number_of_rows(rows: int) -> None:
    """Few grown rows are sliced one by one, many are gathered at once: the same runs."""
    table, checker = _table(slots=48)
    rng = np.random.default_rng(rows)
    slots = np.arange(1, rows + 2)  # one more row that does not grow
    reqs = [_req(f"r{s}", SamplingParams(max_new_tokens=50), checker) for s in slots.tolist()]
    for slot, req in zip(slots.tolist(), reqs, strict=True):
        _open(table, checker, slot, req)
    run = rng.integers(0, VOCAB - 1, size=(slots.size, RUN))  # no EOS: nobody stops
    with checker.acting(Role.RESULT_PROCESSOR):
        table.append_runs(slots, run, rng.integers(1, RUN + 1, slots.size), verifies=True)
    seen = table.all_lengths()
    before = {req: req.num_outputs for req in reqs}
    grown = slots[:-1]
    run = rng.integers(0, VOCAB - 1, size=(grown.size, RUN))
    with checker.acting(Role.RESULT_PROCESSOR):
        table.append_runs(grown, run, rng.integers(1, RUN + 1, grown.size), verifies=True)
    reqs[1].transition(ReqStatus.PREFILL)
    reqs[1].transition(ReqStatus.RETRACTED)  # left its row: read from the request
    read = list(table.read_all_since(seen))
    want = [r for i, r in enumerate(reqs[:-1]) if i != 1]
    assert [req for req, _ in read] == want
    assert all(new == list(req.output_ids[before[req] :]) for req, new in read)
    assert all(new for _, new in read)


def test_a_streaming_read_of_a_large_batch_leaves_no_young_objects_behind() -> None:
    """`read_all_since` makes its pairs as they are taken: for 500 grown rows the read itself
    allocates a fixed handful of tracked objects, and a reader that drops each pair leaves the
    collector's young generation as it found it (a list of 500 pairs put 1000 objects there,
    and Python walked them all at each collection of a large batch's round)."""
    rows = 500
    table, checker = _table(slots=rows + 1)
    reqs = [_req(f"r{s}", SamplingParams(max_new_tokens=50), checker) for s in range(1, rows + 1)]
    for slot, req in enumerate(reqs, start=1):
        _open(table, checker, slot, req)
    slots = np.arange(1, rows + 1)
    seen = table.all_lengths()
    with checker.acting(Role.RESULT_PROCESSOR):
        table.append_runs(slots, np.full((rows, RUN), 4), np.full(rows, 2), verifies=True)
    gc.collect()
    gc.disable()  # the count of tracked objects is then exact
    try:
        before = gc.get_count()[0]
        read = table.read_all_since(seen)
        made = gc.get_count()[0] - before
        sent = 0
        for pair in read:
            sent += len(pair[1])
        left = gc.get_count()[0] - before
    finally:
        gc.enable()
    assert sent == 2 * rows
    assert made <= 32, made  # a fixed few (the arrays' lists), not a pair per row
    assert left <= 32, left


def test_a_batch_reusing_its_slots_array_sees_a_reopened_row() -> None:
    """The per-batch row constants (caps, stop ids) are not reused across a reopened row."""
    table, checker = _table()
    first = _req("a", SamplingParams(max_new_tokens=50), checker)
    _open(table, checker, 2, first)
    slots = np.array([2])  # the same array each round, as a persistent batch passes it
    run = np.array([[4, 5, 6, 7]])
    with checker.acting(Role.RESULT_PROCESSOR):
        assert table.append_runs(slots, run, np.array([2]), verifies=True) is None
    first.transition(ReqStatus.PREFILL)
    first.transition(ReqStatus.RETRACTED)
    second = _req("b", SamplingParams(max_new_tokens=2, stop_token_ids=frozenset({9})), checker)
    _open(table, checker, 2, second)
    with checker.acting(Role.RESULT_PROCESSOR):
        ended = table.append_runs(slots, np.array([[9, 5, 6, 7]]), np.array([2]), verifies=True)
    assert ended is not None and ended.rows == (0,) and ended.stop_token == (9,)
