"""Benchmarks of the memory layer's per-iteration work: reserve and release, by batch size.

Run with ``python -m pytest tests/benchmarks --benchmark-enable``; without that flag each case
runs once as a smoke test. No assertion is made on time. The memory layer runs as in production
(no ownership checks, no per-row validation).
"""

from __future__ import annotations

import pytest
import torch
from memory_harness import Memory, build_memory
from pytest_benchmark.fixture import BenchmarkFixture

from specstate import Req
from specstate.internals import Role

BATCH_SIZES = [1, 64, 256, 1024]


def _running(batch_size: int, page_size: int) -> tuple[Memory, list[Req]]:
    mem = build_memory(
        page_size=page_size,
        num_pages=batch_size * 96 // page_size + 8,
        max_requests=batch_size,
        row_width=128,
        production=True,
    )
    reqs = [mem.new_req(f"r{i}", 8 + i % 16) for i in range(batch_size)]
    with mem.checker.acting(Role.SCHEDULER):
        slots = torch.tensor([mem.allocator.admit(r) for r in reqs])
        ends = torch.tensor([len(r.prompt_ids) for r in reqs])
        mem.allocator.alloc_for_extend(slots, ends)
        mem.ledger.commit_extend(slots, ends)
    return mem, reqs


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_bench_spec_reserve(benchmark: BenchmarkFixture, batch_size: int, page_size: int) -> None:
    """One speculative reservation of a whole batch after each request accepted 3 tokens."""
    mem, reqs = _running(batch_size, page_size)
    slots = mem.slots(*reqs)
    step = torch.full_like(slots, 3)

    def one_round() -> None:
        with mem.checker.acting(Role.SCHEDULER):
            mem.allocator.reserve_for_spec_decode(slots)
        with mem.checker.acting(Role.RESULT_PROCESSOR):
            mem.ledger.advance_committed(slots, step)

    benchmark.pedantic(one_round, rounds=12, iterations=1, warmup_rounds=1)
    mem.allocator.check_balance()


@pytest.mark.parametrize("batch_size", BATCH_SIZES)
def test_bench_release(benchmark: BenchmarkFixture, batch_size: int) -> None:
    """Releasing every request of a batch in one call (a flush of finished requests)."""

    def setup() -> tuple[tuple[Memory, list[Req]], dict[str, object]]:
        return _running(batch_size, 16), {}

    def release_all(mem: Memory, reqs: list[Req]) -> None:
        with mem.checker.acting(Role.SCHEDULER):
            mem.allocator.release_many(reqs)

    benchmark.pedantic(release_all, setup=setup, rounds=3, iterations=1)
