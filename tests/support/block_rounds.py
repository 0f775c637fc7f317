"""Test-only: serve prompts through a block drafter and keep what every round drafted.

`serve_recorded` runs requests through the checked engine with the worker's round observer on
and returns, per request, the rounds in order: the frontier ``S``, the bonus ``x0``, the
proposed tokens (``chain[1:]``: a DFlash block's drafts, UNO's root and drafts) and the accept
length (and the drafter's confidences, if any); `Served` also keeps the emitted tokens and
the engine's mean accept length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
from engine_driver import checked_config, run_checked

from specstate import RequestLimits, SamplingParams
from specstate.engine.engine import Engine
from specstate.reference.workers.round import VerifiedRound


@attrs.frozen
class RoundRow:
    """One request's share of one round."""

    start: int
    bonus: int
    proposed: tuple[int, ...]
    accept_len: int
    confidences: tuple[float, ...] | None = None


@attrs.frozen
class Served:
    """Emitted tokens, rounds per request id, and the engine's mean accept length."""

    outputs: list[list[int]]
    rounds: dict[str, list[RoundRow]]
    mean_accept: float


def serve_recorded(
    worker: Any,
    prompts: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    max_new_tokens: int,
    observer: str = "observer",
    params: Sequence[SamplingParams] | None = None,
    **config: Any,
) -> Served:
    """Serve ``prompts`` (request ``p<i>``) to completion with every check on, recording rounds
    through the worker attribute ``observer``; ``config``: `EngineConfig` fields."""
    rounds: dict[str, list[RoundRow]] = {}

    def keep(verified: VerifiedRound) -> None:
        chain, lens = verified.chain.tolist(), verified.verdict.accept_lens.tolist()
        conf = None if verified.confidences is None else verified.confidences.tolist()
        for row, rid in enumerate(verified.batch.request_ids):
            rounds.setdefault(rid, []).append(
                RoundRow(
                    start=int(verified.start[row]),
                    bonus=chain[row][0],
                    proposed=tuple(chain[row][1:]),
                    accept_len=lens[row],
                    confidences=None if conf is None else tuple(conf[row]),
                )
            )

    setattr(worker, observer, keep)
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=96)
    default = SamplingParams(max_new_tokens=max_new_tokens)
    with Engine(worker, limits=limits, config=checked_config(**config)) as engine:
        reqs = [
            engine.submit(f"p{i}", list(p), default if params is None else params[i])
            for i, p in enumerate(prompts)
        ]
        run_checked(engine)
        mean = engine.snapshot().metrics.mean_accept_length
    return Served([list(r.emitted_ids) for r in reqs], rounds, mean)
