"""Requests: validation before any state, the checked lifecycle, append-only output."""

from __future__ import annotations

import itertools

import pytest

from specstate import (
    FinishReason,
    FinishState,
    InvalidConfig,
    InvalidRequest,
    InvalidTransition,
    OwnershipError,
    Req,
    ReqStatus,
    RequestLimits,
    SamplingParams,
    StaleResult,
)
from specstate.internals import OwnershipChecker, Role

LIMITS = RequestLimits(vocab_size=100, max_context_len=16, eos_token_ids={2})


def _req(checker: OwnershipChecker, rid: str = "r1", prompt: tuple[int, ...] = (5, 6, 7)) -> Req:
    return Req.new(rid, prompt, SamplingParams(max_new_tokens=4), LIMITS, checker=checker)


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ((), SamplingParams(), "prompt is empty"),
        ((1, 2), SamplingParams(max_new_tokens=0), "max_new_tokens must be an integer >= 1, got 0"),
        (
            (1, 2),
            SamplingParams(max_new_tokens=-3),
            "max_new_tokens must be an integer >= 1, got -3",
        ),
        ((1, 100, 101), SamplingParams(), r"2 prompt token ids outside .*\[0, 100\), first 100"),
        ((1, -1), SamplingParams(), "first -1"),
        (tuple(range(16)), SamplingParams(), "prompt of 16 tokens leaves no room in .* 16"),
        ((1,), SamplingParams(stop_token_ids={100}), r"stop_token_ids \[100\] outside"),
        ((1,), SamplingParams(temperature=-0.5), "temperature must be a finite number >= 0"),
        ((1,), SamplingParams(top_k=0), "top_k must be an integer >= 1"),
        ((1,), SamplingParams(top_p=0.0), r"top_p must be a number in \(0, 1\]"),
    ],
)
def test_bad_input_is_rejected_naming_the_request(
    checker: OwnershipChecker, prompt: tuple[int, ...], params: SamplingParams, message: str
) -> None:
    """Each kind of bad input raises InvalidRequest naming the request and the numbers."""
    with pytest.raises(InvalidRequest, match=rf"request 'bad': .*{message}"):
        Req.new("bad", prompt, params, LIMITS, checker=checker)


def test_every_problem_is_reported_at_once(checker: OwnershipChecker) -> None:
    """Several problems come in one message, so a user fixes them in one go."""
    with pytest.raises(InvalidRequest, match="prompt is empty; max_new_tokens"):
        Req.new("x", (), SamplingParams(max_new_tokens=0), LIMITS, checker=checker)


def test_empty_request_id_is_rejected(checker: OwnershipChecker) -> None:
    """A request needs a non-empty id."""
    with pytest.raises(InvalidRequest, match="non-empty string"):
        Req.new("", (1,), SamplingParams(), LIMITS, checker=checker)


def test_new_request_is_waiting_with_seqlen_of_prompt(checker: OwnershipChecker) -> None:
    """A valid request starts WAITING, incarnation 0, seqlen = prompt length."""
    req = _req(checker)
    assert (req.status, req.incarnation, req.seqlen, req.finish) == (ReqStatus.WAITING, 0, 3, None)


_LEGAL = {
    (ReqStatus.WAITING, ReqStatus.PREFILL),
    (ReqStatus.WAITING, ReqStatus.ABORTED),
    (ReqStatus.PREFILL, ReqStatus.RUNNING),
    (ReqStatus.PREFILL, ReqStatus.FINISHED),
    (ReqStatus.PREFILL, ReqStatus.RETRACTED),
    (ReqStatus.PREFILL, ReqStatus.ABORTED),
    (ReqStatus.RUNNING, ReqStatus.FINISHED),
    (ReqStatus.RUNNING, ReqStatus.RETRACTED),
    (ReqStatus.RUNNING, ReqStatus.ABORTED),
    (ReqStatus.RETRACTED, ReqStatus.WAITING),
    (ReqStatus.RETRACTED, ReqStatus.ABORTED),
}

_PATH_TO = {
    ReqStatus.WAITING: [],
    ReqStatus.PREFILL: [ReqStatus.PREFILL],
    ReqStatus.RUNNING: [ReqStatus.PREFILL, ReqStatus.RUNNING],
    ReqStatus.RETRACTED: [ReqStatus.PREFILL, ReqStatus.RETRACTED],
    ReqStatus.FINISHED: [ReqStatus.PREFILL, ReqStatus.FINISHED],
    ReqStatus.ABORTED: [ReqStatus.ABORTED],
}


def _finish_for(status: ReqStatus) -> FinishState | None:
    if status is ReqStatus.FINISHED:
        return FinishState(reason=FinishReason.LENGTH, finished_len=0)
    if status is ReqStatus.ABORTED:
        return FinishState(reason=FinishReason.ABORT, finished_len=0)
    return None


@pytest.mark.parametrize(("src", "dst"), list(itertools.product(ReqStatus, ReqStatus)))
def test_transition_table(checker: OwnershipChecker, src: ReqStatus, dst: ReqStatus) -> None:
    """Exactly the lifecycle's edges are allowed; the rest raise and change nothing."""
    req = _req(checker)
    for step in _PATH_TO[src]:
        req.transition(step, finish=_finish_for(step))
    before = req.snapshot()
    if (src, dst) in _LEGAL:
        req.transition(dst, finish=_finish_for(dst))
        assert req.status is dst
    else:
        with pytest.raises(InvalidTransition, match=f"r1: {src.value} -> {dst.value}"):
            req.transition(dst, finish=_finish_for(dst))
        assert req.snapshot() == before


def test_retraction_bumps_incarnation_and_refuses_stale_results(checker: OwnershipChecker) -> None:
    """A result launched before a retraction is refused after it."""
    req = _req(checker)
    req.transition(ReqStatus.PREFILL)
    launched_for = req.incarnation
    req.transition(ReqStatus.RETRACTED)
    req.transition(ReqStatus.WAITING)
    assert req.incarnation == launched_for + 1
    with pytest.raises(
        StaleResult, match="r1: result for incarnation 0 refused \\(current incarnation 1"
    ):
        req.check_incarnation(launched_for)
    req.check_incarnation(req.incarnation)


def test_finish_requires_a_finish_state(checker: OwnershipChecker) -> None:
    """FINISHED needs a FinishState; RUNNING takes none; finished_len is bounded by outputs."""
    req = _req(checker)
    req.transition(ReqStatus.PREFILL)
    with pytest.raises(InvalidTransition, match="finished needs a finish"):
        req.transition(ReqStatus.FINISHED)
    with pytest.raises(InvalidTransition, match="running takes no finish"):
        req.transition(
            ReqStatus.RUNNING, finish=FinishState(reason=FinishReason.STOP, finished_len=0)
        )
    with pytest.raises(InvalidTransition, match="finished_len 1 outside 0..0"):
        req.transition(
            ReqStatus.FINISHED, finish=FinishState(reason=FinishReason.STOP, finished_len=1)
        )
    assert req.status is ReqStatus.PREFILL


def test_outputs_append_only_by_the_result_processor(checker: OwnershipChecker) -> None:
    """append_outputs needs the result processor role and grows seqlen."""
    req = _req(checker)
    with (
        pytest.raises(OwnershipError, match="r1: role 'scheduler' may not write output_ids"),
        checker.acting(Role.SCHEDULER),
    ):
        req.append_outputs([1])
    with checker.acting(Role.RESULT_PROCESSOR):
        req.append_outputs([8, 9])
        req.append_outputs([10])
    assert list(req.output_ids) == [8, 9, 10]
    assert req.seqlen == 6


def test_emitted_ids_stop_at_finished_len(checker: OwnershipChecker) -> None:
    """Tokens settled past the stop are never shown; appends after finish are stale."""
    req = _req(checker)
    req.transition(ReqStatus.PREFILL)
    with checker.acting(Role.RESULT_PROCESSOR):
        req.append_outputs([3, 2, 4])
    req.transition(ReqStatus.FINISHED, finish=FinishState(reason=FinishReason.STOP, finished_len=2))
    assert req.emitted_ids == (3, 2)
    with checker.acting(Role.RESULT_PROCESSOR), pytest.raises(StaleResult, match="finished"):
        req.append_outputs([5])
    assert req.snapshot().output_ids == (3, 2, 4)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"vocab_size": 10, "max_context_len": 64, "eos_token_ids": {10}}, r"\['10'\] are not ids"),
        ({"vocab_size": 10, "max_context_len": 64, "eos_token_ids": {-1}}, r"\['-1'\] are not ids"),
        ({"vocab_size": 0, "max_context_len": 64}, "vocab_size must be an integer >= 1"),
        ({"vocab_size": 10, "max_context_len": 1.5}, "max_context_len must be an integer"),
    ],
)
def test_request_limits_refuse_impossible_models(fields: dict[str, object], message: str) -> None:
    """An EOS id outside the vocabulary, or sizes no request can meet, are InvalidConfig."""
    with pytest.raises(InvalidConfig, match=f"RequestLimits: .*{message}"):
        RequestLimits(**fields)  # type: ignore[arg-type]
