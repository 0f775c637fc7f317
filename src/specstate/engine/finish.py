"""One finish resolver for multi-token runs: abort, then stop token / EOS, then the length cap.

A speculative round settles several tokens at once, so a stop token can sit in the middle of
the run and the length cap can fall inside it. Every output path (streamed, final, metrics)
asks this one function, so they agree on where a request ended:

1. an abort requested by the user wins;
2. the first stop token in the run (a ``stop_token_ids`` member, or an EOS unless
   ``ignore_eos``) ends the request *including* that token;
3. otherwise, reaching ``max_new_tokens`` ends it at the cap;
4. a stop that lies past the cap is a length finish at the cap: never more than the cap.

Tokens settled after the stop stay in ``output_ids`` (their KV is committed and freed at
release) but are never emitted: ``finished_len`` marks the end of what the user sees.
"""

from __future__ import annotations

from collections.abc import Sequence

from specstate.core.request import FinishReason, FinishState, SamplingParams

__all__ = ["resolve_finish"]


def resolve_finish(
    run: Sequence[int],
    *,
    num_outputs_before: int,
    params: SamplingParams,
    eos_token_ids: frozenset[int],
    abort_reason: str | None = None,
) -> FinishState | None:
    """Where, if anywhere, a request ends after settling ``run``.

    Args:
        run: the tokens this result appends (already appended or about to be).
        num_outputs_before: output tokens the request had before ``run``.
        params: the request's sampling parameters (cap, stop ids, ignore_eos).
        eos_token_ids: the model's end-of-sequence ids.
        abort_reason: set when the user aborted the request; it wins over everything.

    Returns:
        The finish state, or None when the request goes on.
    """
    total = num_outputs_before + len(run)
    if abort_reason is not None:
        emitted = min(total, params.max_new_tokens)
        return FinishState(reason=FinishReason.ABORT, finished_len=emitted, detail=abort_reason)
    stops = params.stop_token_ids if params.ignore_eos else params.stop_token_ids | eos_token_ids
    cap = params.max_new_tokens
    for i, token in enumerate(run):
        if token in stops:
            at = num_outputs_before + i + 1
            if at <= cap:
                return FinishState(reason=FinishReason.STOP, finished_len=at, detail=str(token))
            break
    if total >= cap:
        return FinishState(reason=FinishReason.LENGTH, finished_len=cap)
    return None
