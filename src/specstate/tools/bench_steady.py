"""The steady decode batch the engine benches time: sized, brought up, and timed quietly.

``bench engine``, ``bench overlap``, ``bench tp``, ``bench grammar`` and ``bench recurrent``
each time steady decode rounds of a batch whose requests all run and none finishes inside the
timed window. What they share lives here: the pool that holds such a batch (`steady_config`),
stepping until one round decodes the whole batch (`decode_whole`), and a timed window with
one torch thread and no collector pass (`quiet_heap`).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from specstate.engine.config import EngineConfig
    from specstate.engine.engine import Engine
    from specstate.engine.worker import WorkerCapabilities

__all__ = ["decode_whole", "quiet_heap", "steady_config"]


def steady_config(
    capabilities: WorkerCapabilities,
    *,
    batch_size: int,
    context: int,
    prompt_len: int,
    page_size: int,
    overlap: bool,
) -> EngineConfig:
    """An `EngineConfig` whose pool holds ``batch_size`` requests of ``context`` tokens each
    with their speculative reservation (in whole pages, plus two), all running at once and
    prefilled in one batch; every check off."""
    from specstate.engine.config import EngineConfig

    reserve = capabilities.spec_window(page_size).reserve
    per_request = -(-(context + reserve) // page_size) * page_size + 2 * page_size
    return EngineConfig(
        overlap=overlap,
        page_size=page_size,
        kv_tokens=batch_size * per_request + 2 * page_size,
        max_running=batch_size,
        max_prefill_tokens=max(4096, batch_size * prompt_len),
        check_invariants=False,
        check_ownership=False,
    )


def decode_whole(engine: Engine, batch_size: int) -> None:
    """Step ``engine`` until a round decodes all ``batch_size`` requests.

    Raises:
        RuntimeError: no such round within ``64 + batch_size`` steps.
    """
    for _ in range(64 + batch_size):
        report = engine.step()
        if report.launched_mode == "decode" and report.launched_size == batch_size:
            return
    raise RuntimeError(f"bs {batch_size}: the batch never decoded whole")


@contextmanager
def quiet_heap() -> Iterator[None]:
    """One torch thread and a collected, frozen heap while a timed window runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        torch.set_num_threads(threads)
