"""Benchmarks of the engine's host work per iteration, and of the overlap loop.

With a worker whose device work is a timed wait, an iteration of the normal loop costs host +
device and one of the overlap loop about max(host, device). Run with
``python -m pytest tests/benchmarks --benchmark-enable``; without it each case runs once.
"""

from __future__ import annotations

import pytest
from pytest_benchmark.fixture import BenchmarkFixture

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
from specstate.tools.timed_worker import TimedWaitWorker

LIMITS = RequestLimits(vocab_size=32, max_context_len=256)


def _decode_run(batch_size: int, *, overlap: bool, device_seconds: float) -> None:
    config = EngineConfig(
        overlap=overlap, page_size=16, kv_tokens=batch_size * 256 + 1024, max_running=batch_size
    )
    worker = TimedWaitWorker(device_seconds=device_seconds)
    with Engine(worker, limits=LIMITS, config=config) as engine:
        params = SamplingParams(max_new_tokens=40, ignore_eos=True)
        for i in range(batch_size):
            engine.submit(f"r{i}", [1, 2, 3, 4], params)
        engine.run_until_idle()


@pytest.mark.parametrize("batch_size", [1, 64, 256])
@pytest.mark.parametrize("overlap", [False, True])
def test_bench_engine_host_only(
    benchmark: BenchmarkFixture, batch_size: int, overlap: bool
) -> None:
    """20 decode rounds (2 tokens accepted each) with no device time: pure host cost."""
    benchmark.pedantic(
        _decode_run,
        args=(batch_size,),
        kwargs={"overlap": overlap, "device_seconds": 0.0},
        rounds=3,
        iterations=1,
    )


@pytest.mark.parametrize("overlap", [False, True])
def test_bench_engine_overlap_gain(benchmark: BenchmarkFixture, overlap: bool) -> None:
    """The same workload with 5 ms of device time per forward: overlap hides the host work."""
    benchmark.pedantic(
        _decode_run,
        args=(64,),
        kwargs={"overlap": overlap, "device_seconds": 0.005},
        rounds=3,
        iterations=1,
    )
