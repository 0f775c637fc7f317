"""Request intake: whether a request can be served by this engine, decided before it is queued.

`check_request` refuses, with `InvalidRequest` naming the request, the numbers and (its
``fields``) the request fields at fault, a request that the worker cannot serve (a sampling
control it does not declare), that cannot fit the model's context, or that could never fit the
KV pool even alone (prompt, outputs and the speculative reserve). A refused request changes
nothing. (A grammar that does not compile is refused next, by the grammar capability.)
"""

from __future__ import annotations

from specstate.core.errors import InvalidRequest
from specstate.core.params import RequestLimits, SamplingParams
from specstate.core.request import Req
from specstate.engine.worker import WorkerCapabilities
from specstate.memory.sizing import SpecWindow

__all__ = ["check_request"]


def check_request(
    req: Req,
    caps: WorkerCapabilities,
    limits: RequestLimits,
    *,
    window: SpecWindow,
    pool_tokens: int,
) -> None:
    """Refuse ``req`` if this worker, context or pool of ``pool_tokens`` cannot serve it.

    (A grammar that does not compile is refused after this, by the grammar capability's
    ``on_submit``.)

    Raises:
        InvalidRequest: naming the request and what it asks for.
    """
    rid, sampling = req.request_id, req.sampling
    if sampling.temperature > 0 and not caps.supports_sampling:
        raise InvalidRequest(
            f"request {rid!r}: temperature {sampling.temperature} asks for sampling, "
            f"but worker {caps.algorithm!r} is greedy-only (its capabilities do not declare "
            "supports_sampling)",
            fields=("temperature",),
        )
    if sampling.min_new_tokens:
        eos = frozenset() if sampling.ignore_eos else limits.eos_token_ids
        if len(sampling.stop_token_ids | eos) >= limits.vocab_size:
            raise InvalidRequest(
                f"request {rid!r}: min_new_tokens {sampling.min_new_tokens} masks the stop "
                f"tokens, but all {limits.vocab_size} tokens of the vocabulary are stop tokens "
                "(stop_token_ids and EOS): nothing could be emitted",
                fields=("min_new_tokens",),
            )
    unsupported = unsupported_controls(sampling, caps)
    if unsupported:
        raise InvalidRequest(
            f"request {rid!r}: worker {caps.algorithm!r} does not support "
            + "; ".join(text for _, text in unsupported),
            fields=[field for field, _ in unsupported],
        )
    prompt = len(req.prompt_ids)
    # The prompt alone fits the context (`Req.new`): what does not fit is max_new_tokens.
    if prompt + sampling.max_new_tokens > limits.max_context_len:
        raise InvalidRequest(
            f"request {rid!r}: prompt of {prompt} tokens plus max_new_tokens "
            f"{sampling.max_new_tokens} exceeds the context of {limits.max_context_len}",
            fields=("max_new_tokens",),
        )
    p = window.page_size
    need = -(-(prompt + sampling.max_new_tokens + window.reserve) // p) * p + p
    capacity = pool_tokens - p
    if need > capacity:
        raise InvalidRequest(
            f"request {rid!r}: needs up to {need} KV tokens (prompt {prompt}, max_new_tokens "
            f"{sampling.max_new_tokens}, reserve {window.reserve}) but the pool holds {capacity}",
            fields=("max_new_tokens",),
        )


def unsupported_controls(
    sampling: SamplingParams, caps: WorkerCapabilities
) -> list[tuple[str, str]]:
    """The sampling controls ``sampling`` uses that the worker does not declare: per control,
    the field that asks for it and a description with its values."""
    found = []
    if not sampling.speculative and caps.speculative and not caps.supports_per_request_speculation:
        found.append(("speculative", "speculative=False (per-request speculation)"))
    if sampling.has_penalties and not caps.supports_penalties:
        penalty = next(
            name
            for name, off in (
                ("repetition_penalty", 1.0),
                ("frequency_penalty", 0.0),
                ("presence_penalty", 0.0),
            )
            if getattr(sampling, name) != off
        )
        found.append(
            (
                penalty,
                f"penalties (repetition_penalty={sampling.repetition_penalty}, "
                f"frequency_penalty={sampling.frequency_penalty}, "
                f"presence_penalty={sampling.presence_penalty})",
            )
        )
    if sampling.min_new_tokens and not caps.supports_min_new_tokens:
        found.append(("min_new_tokens", f"min_new_tokens={sampling.min_new_tokens}"))
    if sampling.seed is not None and sampling.temperature > 0 and not caps.supports_seeds:
        found.append(("seed", f"seed={sampling.seed}"))
    if sampling.logprobs and not caps.supports_logprobs:
        found.append(("logprobs", "logprobs=True"))
    if sampling.top_logprobs and not caps.supports_top_logprobs:
        found.append(("top_logprobs", f"top_logprobs={sampling.top_logprobs}"))
    if sampling.grammar is not None and not caps.supports_grammar:
        tree = f" (a draft tree, topk {caps.topk}: use a chain, topk 1)" if caps.topk > 1 else ""
        found.append(("grammar", f"grammar{tree}"))
    return found
