"""Test-only: an engine with every check on, driven to idle with the invariant checker after
every step, and the stops a lossless test puts inside accepted runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs

from specstate import Req, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerProtocol


@attrs.frozen(kw_only=True)
class DriveLog:
    """What happened while driving: retractions and deferred releases seen, steps taken."""

    steps: int
    retracted: tuple[str, ...]
    deferred: frozenset[str]


def run_checked(engine: Engine, *, max_steps: int = 1000) -> DriveLog:
    """Step until idle, checking every invariant after each step; fail past ``max_steps``."""
    retracted: list[str] = []
    deferred: set[str] = set()
    for steps in range(max_steps + 1):
        if engine.is_idle:
            return DriveLog(steps=steps, retracted=tuple(retracted), deferred=frozenset(deferred))
        retracted.extend(engine.step().retracted)
        deferred.update(engine.snapshot().deferred_releases)
        check_engine(engine)
    raise AssertionError(f"engine not idle after {max_steps} steps")


def serve_to_completion(
    engine: Engine,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stops: Sequence[int | None],
) -> list[Req]:
    """Submit ``prompts`` (request ``i`` stops at ``stops[i]`` when given), drive the engine
    to idle with every invariant checked after each step, and assert the pools balance and
    each request ended by its stop token or its length cap."""
    reqs = [
        engine.submit(
            f"p{i}",
            prompt,
            SamplingParams(
                max_new_tokens=max_new_tokens, stop_token_ids=() if stop is None else (stop,)
            ),
        )
        for i, (prompt, stop) in enumerate(zip(prompts, stops, strict=True))
    ]
    run_checked(engine)
    snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    reasons = [r.finish is not None and r.finish.reason.value for r in reqs]
    assert reasons == ["length" if stop is None else "stop" for stop in stops]
    return reqs


def checked_config(*, checks: bool = True, **options: Any) -> EngineConfig:
    """An `EngineConfig` with the invariant checker, ownership checks and the consume-once relay
    on (``checks=False``: production mode, every check off); ``options`` are the other fields
    (``kv_tokens`` 2048 unless given)."""
    return EngineConfig(
        check_invariants=checks,
        check_ownership=checks,
        debug_relay=checks,
        **{"kv_tokens": 2048, **options},
    )


def with_stops(expected: list[list[int]]) -> tuple[list[int | None], list[list[int]]]:
    """Every other request stops at a token from the middle of its output (inside a run): the
    stop token of each request (None for none) and the output it must then emit."""
    stops: list[int | None] = []
    wants = []
    for i, out in enumerate(expected):
        stop = out[6] if i % 2 == 0 else None
        stops.append(stop)
        wants.append(out if stop is None else out[: out.index(stop) + 1])
    return stops, wants


def serve_under_pressure(
    worker: WorkerProtocol,
    prompts: Sequence[Sequence[int]],
    *,
    vocab_size: int,
    max_new_tokens: int,
    overlap: bool,
    page_size: int,
    kv_tokens: int = 112,
) -> tuple[list[list[int]], DriveLog, Engine]:
    """Serve ``prompts`` greedily from a pool too small for all of them at once, every check
    on; the outputs, what happened, and the (closed) engine to inspect."""
    config = checked_config(overlap=overlap, page_size=page_size, kv_tokens=kv_tokens)
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=64)
    params = SamplingParams(max_new_tokens=max_new_tokens)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [engine.submit(f"p{i}", p, params) for i, p in enumerate(prompts)]
        log = run_checked(engine)
    return [list(r.emitted_ids) for r in reqs], log, engine
