"""Stop sequences in the output table: cut at the first complete occurrence, vectorized.

A sequence may begin in an earlier round (or before a retraction) and end anywhere inside an
accepted run; the matched sequence is included, tokens after it are never emitted, and a stop
— token or sequence — counts only from output ``min_new_tokens`` on. The batch settlement must
agree with the one finish resolver (`resolve_finish`, with ``outputs_before``) row by row.
"""

from __future__ import annotations

import numpy as np
import pytest
from engine_driver import run_checked
from hypothesis import given, settings
from hypothesis import strategies as st

from specstate import Engine, EngineConfig, Req, RequestLimits, SamplingParams
from specstate.core.status import FinishReason, ReqStatus
from specstate.engine.settle.outputs import OutputTable
from specstate.engine.settle.stop_sequences import StopSequences
from specstate.internals import OwnershipChecker, Role
from specstate.testing.finish_oracle import resolve_finish
from specstate.tools.timed_worker import TimedWaitWorker

VOCAB = 6
EOS = frozenset({5})
RUN = 4


def _table() -> tuple[OutputTable, OwnershipChecker]:
    checker = OwnershipChecker(enabled=True)
    table = OutputTable(
        max_slots=8, max_outputs=64, max_run=RUN, eos_token_ids=EOS, checker=checker
    )
    return table, checker


def _running(
    table: OutputTable, checker: OwnershipChecker, slot: int, params: SamplingParams
) -> Req:
    limits = RequestLimits(vocab_size=VOCAB, max_context_len=128, eos_token_ids=EOS)
    req = Req.new(f"r{slot}", [1, 2, 3], params, limits, checker=checker)
    with checker.acting(Role.SCHEDULER):
        table.open_row(slot, req)
    req.transition(ReqStatus.PREFILL)
    req.transition(ReqStatus.RUNNING)
    return req


def _append(
    table: OutputTable, checker: OwnershipChecker, slots: list[int], runs: list[list[int]]
) -> dict[int, tuple[int, int, int]]:
    """Append one run per slot (padded to RUN); ``{slot: (stop_at, stop_token, sequence)}``."""
    tokens = np.array([run + [0] * (RUN - len(run)) for run in runs])
    accept = np.array([len(run) for run in runs])
    with checker.acting(Role.RESULT_PROCESSOR):
        ended = table.append_runs(np.array(slots), tokens, accept, verifies=True)
    if ended is None:
        return {}
    sequences = ended.stop_sequence or (-1,) * len(ended.rows)
    return {
        slots[row]: (ended.stop_at[k], ended.stop_token[k], sequences[k])
        for k, row in enumerate(ended.rows)
    }


def test_a_sequence_spanning_rounds_is_cut_inside_the_run() -> None:
    """(1, 2, 3) begins in round 1 and ends at the second token of round 2's run of 4."""
    table, checker = _table()
    _running(table, checker, 1, SamplingParams(max_new_tokens=40, stop_sequences=[[1, 2, 3]]))
    assert _append(table, checker, [1], [[4, 0, 1]]) == {}
    assert _append(table, checker, [1], [[2, 3, 4, 1]]) == {1: (5, 3, 0)}


def test_only_the_first_complete_occurrence_counts_and_the_earliest_stop_wins() -> None:
    """An earlier stop token beats a later sequence; an earlier sequence beats a later token;
    the first listed sequence wins a tie; partial occurrences never match."""
    table, checker = _table()
    sequences = [[2, 2], [4, 2]]
    _running(table, checker, 1, SamplingParams(max_new_tokens=40, stop_sequences=sequences))
    _running(
        table,
        checker,
        2,
        SamplingParams(max_new_tokens=40, stop_token_ids=[3], stop_sequences=[[0, 1]]),
    )
    _running(table, checker, 3, SamplingParams(max_new_tokens=40, stop_sequences=[[1, 1]]))
    _running(table, checker, 4, SamplingParams(max_new_tokens=40, stop_sequences=[[0, 2], [2]]))
    runs = [[4, 2, 2, 2], [0, 1, 3], [1, 0, 1, 0], [0, 2, 2]]
    got = _append(table, checker, [1, 2, 3, 4], runs)
    assert got == {1: (2, 2, 1), 2: (2, 1, 0), 4: (2, 2, 0)}  # row 3: 1 0 1 0 has no "1 1"


def test_min_new_tokens_suppresses_early_stops() -> None:
    """Before output ``min_new_tokens`` neither a stop token nor a sequence ends the request."""
    table, checker = _table()
    params = SamplingParams(
        max_new_tokens=40, min_new_tokens=3, stop_token_ids=[4], stop_sequences=[[1, 2]]
    )
    _running(table, checker, 1, params)
    assert _append(table, checker, [1], [[4, 1, 2]]) == {}  # outputs 0..2: all too early
    assert _append(table, checker, [1], [[1, 2, 4]]) == {1: (5, 2, 0)}  # index 4 >= 3


def test_a_sequence_survives_retraction_and_rows_do_not_share_sequences() -> None:
    """Re-admission brings the outputs that began the sequence; other rows' sequences are
    theirs alone, and a finished row's slot forgets its sequences."""
    table, checker = _table()
    params = SamplingParams(max_new_tokens=40, stop_sequences=[[3, 3, 3]])
    req = _running(table, checker, 1, params)
    _running(table, checker, 2, SamplingParams(max_new_tokens=40))
    assert _append(table, checker, [1, 2], [[3, 3], [3, 3, 3]]) == {}
    req.transition(ReqStatus.RETRACTED)
    req.transition(ReqStatus.WAITING)
    with checker.acting(Role.SCHEDULER):
        table.open_row(4, req)
    req.transition(ReqStatus.PREFILL)
    req.transition(ReqStatus.RUNNING)
    assert _append(table, checker, [4, 2], [[3, 0], [3]]) == {4: (3, 3, 0)}
    req.transition(
        ReqStatus.FINISHED,
        finish=resolve_finish(
            [3], num_outputs_before=2, params=params, eos_token_ids=EOS, outputs_before=[3, 3]
        ),
    )
    fresh = _running(table, checker, 4, SamplingParams(max_new_tokens=40))
    assert _append(table, checker, [4], [[3, 3, 3, 3]]) == {}
    assert fresh.output_ids == (3, 3, 3, 3)


def test_sequences_cost_nothing_again_once_their_rows_close() -> None:
    """`StopSequences` counts the open rows with sequences; closing them returns to zero, and
    a closed row's old sequence no longer matches."""
    seqs = StopSequences(8)
    seqs.open(2, ((1, 2),))
    seqs.open(3, ())
    seqs.open(5, ((3,), (4, 1)))
    assert seqs.num_rows == 2
    slots, run = np.array([2, 5]), np.array([[9, 9], [1, 3]])
    outputs = np.zeros(8 * 16, dtype=np.int64)
    outputs[2 * 16 : 2 * 16 + 2], outputs[5 * 16 : 5 * 16 + 2] = [1, 2], [1, 3]
    accepted = np.ones((2, 2), dtype=np.bool_)
    before = np.zeros(2, dtype=np.int64)
    matched = seqs.match(slots, run, before, accepted, outputs, 16, None)
    assert matched is not None and matched[0][1] == 2 and matched[1][1] == 0
    seqs.close(np.array([2, 3]))
    assert seqs.num_rows == 1
    seqs.close(np.array([5]))
    assert seqs.num_rows == 0
    assert seqs.match(slots, run, before, accepted, outputs, 16, None) is None


@settings(max_examples=60, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(1, 12),  # max_new_tokens
            st.integers(0, 4),  # min_new_tokens (clamped to the cap)
            st.lists(st.lists(st.integers(0, 4), min_size=1, max_size=4), max_size=3),
            st.frozensets(st.integers(0, 4), max_size=1),
            st.lists(
                st.tuples(
                    st.lists(st.integers(0, 5), min_size=RUN, max_size=RUN), st.integers(1, RUN)
                ),
                min_size=1,
                max_size=6,
            ),
        ),
        min_size=1,
        max_size=4,
    )
)
def test_batch_settlement_matches_the_finish_resolver(
    rows: list[tuple[int, int, list[list[int]], frozenset[int], list[tuple[list[int], int]]]],
) -> None:
    """Every row ends exactly where `resolve_finish` says: reason, length and detail."""
    table, checker = _table()
    reqs = []
    for i, (cap, min_new, sequences, stops, _) in enumerate(rows):
        params = SamplingParams(
            max_new_tokens=cap,
            min_new_tokens=min(min_new, cap),
            stop_sequences=sequences,
            stop_token_ids=stops,
        )
        reqs.append(_running(table, checker, i + 1, params))
    for k in range(max(len(r[4]) for r in rows)):
        live = [i for i, r in enumerate(rows) if k < len(r[4]) and not reqs[i].is_finished]
        if not live:
            break
        runs = [rows[i][4][k][0][: rows[i][4][k][1]] for i in live]
        want = {
            i: resolve_finish(
                run,
                num_outputs_before=reqs[i].num_outputs,
                params=reqs[i].sampling,
                eos_token_ids=EOS,
                outputs_before=reqs[i].output_ids,
            )
            for i, run in zip(live, runs, strict=True)
        }
        got = _append(table, checker, [i + 1 for i in live], runs)
        for i in live:
            expect = want[i]
            ended = got.get(i + 1)
            if expect is None:
                assert ended is None
                continue
            assert ended is not None
            if expect.reason is FinishReason.STOP:
                assert ended[0] == expect.finished_len
                seq = ended[2]
                detail = (
                    str(ended[1])
                    if seq < 0
                    else f"stop sequence {reqs[i].sampling.stop_sequences[seq]}"
                )
                assert detail == expect.detail  # a token wins a tie, then the first listed
            else:
                assert ended[0] == -1 and expect.finished_len == reqs[i].sampling.max_new_tokens
            reqs[i].transition(ReqStatus.FINISHED, finish=expect)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_engine_cuts_a_sequence_inside_a_run(overlap: bool) -> None:
    """Constant tokens 7, two a round: (7, 7, 7, 7) ends at output 3, the first token of the
    second decode run; output 4 is settled but never emitted; the detail names the sequence."""
    worker = TimedWaitWorker(device_seconds=0.0, accept=2)
    config = EngineConfig(
        overlap=overlap, kv_tokens=512, check_invariants=True, check_ownership=True
    )
    with Engine(
        worker, limits=RequestLimits(vocab_size=32, max_context_len=64), config=config
    ) as engine:
        req = engine.submit(
            "a", [1, 2, 3], SamplingParams(max_new_tokens=20, stop_sequences=[(7,) * 4])
        )
        plain = engine.submit("b", [1, 2, 3], SamplingParams(max_new_tokens=9))
        run_checked(engine)
    assert req.finish is not None and req.finish.reason is FinishReason.STOP
    assert req.finish.detail == "stop sequence (7, 7, 7, 7)"
    assert req.emitted_ids == (7, 7, 7, 7) and len(req.output_ids) == 5
    assert req.accept_lengths == (2, 2)
    assert plain.emitted_ids == (7,) * 9  # its batch mate's sequence is not its own
