"""The conformance kit's workload: one request per prompt, plus one per declared control.

`build_jobs` turns the prompts and the worker's capabilities into the requests every
configuration serves (the same ones everywhere, so configurations can be compared):

==================  ==========================================================================
``g<i>``            greedy, prompt ``i``: the oracle's tokens, the same in every configuration
``sampled``         (``supports_sampling``) temperature 0.8; with ``supports_seeds`` a
                    ``seed``, so its tokens must be the same in every configuration
``controls``        greedy with every other control the worker declares: the three penalties
                    (``supports_penalties``); ``min_new_tokens`` of half the cap with half the
                    vocabulary as stop tokens, none of which may come before that many outputs
                    (``supports_min_new_tokens``); ``logprobs``, one per emitted token
                    (``supports_logprobs``), with ``supports_top_logprobs`` 3 alternatives
                    per emitted token; its tokens the same in every configuration
==================  ==========================================================================

`job_problems` checks one finished request against what its job asks (the ``controls`` rule).

Invariant: job ids are unique; a job whose tokens the kit compares across configurations is
deterministic for a conforming worker (greedy, or seeded).
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from specstate.core.params import SamplingParams
from specstate.core.request import Req
from specstate.engine.worker import WorkerCapabilities

__all__ = ["DEFAULT_PROMPTS", "Job", "build_jobs", "job_problems"]

DEFAULT_PROMPTS: tuple[tuple[int, ...], ...] = (
    (3, 14, 15, 92, 65, 35, 89),
    (79, 32),
    (38, 46, 26, 43, 38, 32, 79, 50, 28, 84, 19, 71, 69, 39, 93),
    (5, 5, 5, 5),
)
"""The kit's default prompts (token ids below 94: any vocabulary of 94 or more holds them)."""


@attrs.frozen(kw_only=True)
class Job:
    """One request of the kit's workload.

    Attributes:
        request_id: its id (``g<i>`` for prompt ``i``).
        prompt: its prompt.
        params: its sampling parameters.
        oracle: its tokens are compared with the oracle's greedy tokens.
        same_everywhere: its tokens must be the same in every configuration.
    """

    request_id: str
    prompt: tuple[int, ...]
    params: SamplingParams
    oracle: bool = False
    same_everywhere: bool = True


def build_jobs(
    caps: WorkerCapabilities,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    vocab_size: int,
) -> tuple[Job, ...]:
    """The workload of every configuration (module docstring)."""
    greedy = SamplingParams(max_new_tokens=max_new_tokens)
    jobs = [
        Job(request_id=f"g{i}", prompt=tuple(p), params=greedy, oracle=True)
        for i, p in enumerate(prompts)
    ]
    first = tuple(prompts[0])
    if caps.supports_sampling:
        seed = 7 if caps.supports_seeds else None
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=0.8, seed=seed)
        jobs.append(
            Job(request_id="sampled", prompt=first, params=params, same_everywhere=seed is not None)
        )
    controls: dict[str, object] = {}
    if caps.supports_penalties:
        controls.update(repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.4)
    if caps.supports_min_new_tokens:
        controls.update(
            min_new_tokens=max(1, max_new_tokens // 2),
            stop_token_ids=frozenset(range(vocab_size // 2)),
        )
    if caps.supports_logprobs:
        controls.update(logprobs=True)
        if caps.supports_top_logprobs:
            controls.update(top_logprobs=min(3, vocab_size))
    if controls:
        params = SamplingParams(max_new_tokens=max_new_tokens, **controls)  # type: ignore[arg-type]
        jobs.append(Job(request_id="controls", prompt=first, params=params))
    return tuple(jobs)


def job_problems(job: Job, req: Req) -> list[str]:
    """What ``req`` (finished) did against its job's controls; empty when nothing."""
    found = []
    params = job.params
    emitted = req.emitted_ids
    if params.min_new_tokens:
        early = [t for t in emitted[: params.min_new_tokens] if t in params.stop_token_ids]
        if early:
            found.append(
                f"request {job.request_id}: stop token {early[0]} among its first "
                f"{params.min_new_tokens} outputs (min_new_tokens masks stop tokens until then)"
            )
    if params.logprobs:
        logprobs = req.logprobs
        if logprobs is None or len(logprobs) != len(emitted):
            got = None if logprobs is None else len(logprobs)
            found.append(
                f"request {job.request_id}: {got} logprobs for {len(emitted)} emitted tokens"
            )
    if params.top_logprobs:
        found += _top_problems(job, req)
    return found


def _top_problems(job: Job, req: Req) -> list[str]:
    """One list of ``top_logprobs`` alternatives per emitted token, each of that many."""
    emitted, tops, k = req.emitted_ids, req.top_logprobs, job.params.top_logprobs
    if tops is None or len(tops) != len(emitted):
        got = None if tops is None else len(tops)
        return [f"request {job.request_id}: {got} top logprobs for {len(emitted)} emitted tokens"]
    short = [n for n, top in enumerate(tops) if len(top) != k]
    if short:
        return [
            f"request {job.request_id}: {len(tops[short[0]])} top logprobs at output {short[0]}, "
            f"not {k}"
        ]
    return []
