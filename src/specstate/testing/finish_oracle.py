"""The finish rule for multi-token runs, written plainly: the oracle the engine is tested against.

A speculative round settles several tokens at once, so a stop token can sit in the middle of
the run and the length cap can fall inside it. The engine decides finishes for a whole batch
with array operations (`OutputTable.append_runs` finds each row's first stop and its cap;
`ResultProcessor` turns them into `FinishState` verdicts); `resolve_finish` states the same rule
one request and one token at a time, so a test can compare the two row by row:

1. an abort requested by the user wins;
2. the first stop in the run ends the request *including* it: a stop token (a
   ``stop_token_ids`` member, or an EOS unless ``ignore_eos``), or the last token of the first
   complete occurrence of a ``stop_sequences`` entry inside the output (it may begin in an
   earlier round); a stop counts only when its last token is output ``min_new_tokens``
   (0-based) or later;
3. otherwise, reaching ``max_new_tokens`` ends it at the cap;
4. a stop that lies past the cap is a length finish at the cap: never more than the cap.

Tokens settled after the stop stay in ``output_ids`` (their KV is committed and freed at
release) but are never emitted: ``finished_len`` marks the end of what the user sees.
"""

from __future__ import annotations

from collections.abc import Sequence

from specstate.core.params import SamplingParams
from specstate.core.status import FinishReason, FinishState

__all__ = ["resolve_finish"]


def resolve_finish(
    run: Sequence[int],
    *,
    num_outputs_before: int,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    abort_reason: str | None = None,
    outputs_before: Sequence[int] = (),
) -> FinishState | None:
    """Where, if anywhere, a request ends after settling ``run``.

    Args:
        run: the tokens this result appends (already appended or about to be).
        num_outputs_before: output tokens the request had before ``run``.
        params: the request's sampling parameters (cap, stop ids, ignore_eos).
        eos_token_ids: the model's end-of-sequence ids.
        abort_reason: set when the user aborted the request; it wins over everything.
        outputs_before: the outputs settled before ``run`` (at least their last
            ``len(longest stop sequence) - 1``), for stop sequences that began earlier.

    Returns:
        The finish state, or None when the request goes on.
    """
    total = num_outputs_before + len(run)
    if abort_reason is not None:
        emitted = min(total, params.max_new_tokens)
        return FinishState(reason=FinishReason.ABORT, finished_len=emitted, detail=abort_reason)
    stops = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | eos_token_ids
    cap = params.max_new_tokens
    tail = list(outputs_before)
    for i, token in enumerate(run):
        index = num_outputs_before + i  # the token's output index
        tail.append(token)
        if index < params.min_new_tokens:
            continue
        detail = str(token) if token in stops else _sequence_ending(tail, index, params)
        if detail is not None:
            at = index + 1
            if at <= cap:
                return FinishState(reason=FinishReason.STOP, finished_len=at, detail=detail)
            break
    if total >= cap:
        return FinishState(reason=FinishReason.LENGTH, finished_len=cap)
    return None


def _sequence_ending(tail: list[int], index: int, params: SamplingParams) -> str | None:
    """The detail of the first stop sequence that ends at output ``index`` (``tail[-1]``)."""
    for seq in params.stop_sequences:
        n = len(seq)
        if n <= index + 1 and n <= len(tail) and tuple(tail[-n:]) == seq:
            return f"stop sequence {seq}"
    return None
