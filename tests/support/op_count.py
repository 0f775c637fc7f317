"""Test-only: the operations of one `Engine.step`, counted (the op-budget tests).

Counted, not timed: Python-level calls (function calls and calls into C, through
``sys.setprofile``) and torch operations (through a ``TorchFunctionMode``). The normal loop runs
the whole round on the calling thread, so every call is seen.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Callable
from types import FrameType
from typing import Any

from torch.overrides import TorchFunctionMode

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.engine.invariants import check_engine
from specstate.engine.worker import WorkerProtocol


class TorchCallCounter(TorchFunctionMode):
    """Counts every torch function call made while it is entered."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        self.calls += 1
        return func(*args, **(kwargs or {}))


def steady_engine(worker: WorkerProtocol, batch_size: int, page_size: int) -> Engine:
    """An engine on ``worker`` whose whole batch decodes (no request can finish for many
    rounds), stepped until the running batch is steady; the normal loop, checks off."""
    config = EngineConfig(
        overlap=False,
        page_size=page_size,
        kv_tokens=batch_size * 512 + 64,
        max_running=batch_size,
        check_invariants=False,
    )
    engine = Engine(worker, limits=RequestLimits(vocab_size=32, max_context_len=256), config=config)
    for i in range(batch_size):
        engine.submit(f"r{i}", [1, 2, 3, 4, 5], SamplingParams(max_new_tokens=200, ignore_eos=True))
    for _ in range(4):  # prefill, then decode rounds until the running batch is steady
        engine.step()
        check_engine(engine)
    return engine


def count_decode_step(engine: Engine) -> tuple[int, int]:
    """(Python calls, torch operations) of one `Engine.step`, which must launch a decode round;
    every invariant is checked after it."""
    python_calls = 0

    def profile(frame: FrameType, event: str, arg: object) -> None:
        nonlocal python_calls
        if event in ("call", "c_call"):
            python_calls += 1

    counter = TorchCallCounter()
    # NOTE: no collection inside the counted step: finalizers of objects that earlier tests
    # left behind would run (and count) at whatever allocation happened to trigger them.
    gc.collect()
    gc.disable()
    with counter:
        sys.setprofile(profile)
        try:
            report = engine.step()
        finally:
            sys.setprofile(None)
            gc.enable()
    assert report.launched_mode == "decode"
    check_engine(engine)
    return python_calls, counter.calls
