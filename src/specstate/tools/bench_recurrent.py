"""``specstate bench recurrent``: the host cost of committing recurrent states, per round.

A hybrid worker's states are committed at settlement by the result processor: one vectorized
add over the round's rows (`RecurrentStatePool.settle_states`), in the same settle call that
advances ``kv_committed_len``. This bench times, for each batch size B:

* ``commit``: that call alone in a steady decode round (production mode: no ownership checks,
  no per-row validation), median µs over ``--rounds`` rounds;
* ``step`` / ``step_stateless``: `Engine.step` of a steady decode round of B requests with a
  zero-cost worker that declares a recurrent state, and the same worker without one, in
  alternated runs (``--repeats`` each), median µs; their difference is what the state costs
  the whole round (within the noise of a shared machine).

Results go to stdout (a table, or JSON with ``--json``); progress to stderr. The op-count test
(tests/engine/test_recurrent_op_budget.py) pins that the commit is flat in B.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Final

import attrs
import numpy as np
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.ownership import OwnershipChecker
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.memory.recurrent import recurrent_pool_for
from specstate.memory.recurrent_layout import (
    RecurrentGroupSpec,
    RecurrentStateSpec,
    StateTensorSpec,
)
from specstate.tools.bench_steady import decode_whole
from specstate.tools.cli_types import positive
from specstate.tools.timed_worker import TimedWaitWorker

__all__ = ["STATE_SPEC", "StatefulTimedWorker", "add_parser", "run"]

STATE_SPEC: Final = RecurrentStateSpec(
    groups=(
        RecurrentGroupSpec(
            name="target.mamba2",
            num_layers=4,
            tensors=(
                StateTensorSpec(name="conv", shape=(64, 3), dtype=torch.float32),
                StateTensorSpec(name="ssm", shape=(4, 8, 8), dtype=torch.float32),
            ),
        ),
    )
)
"""The state the bench's worker declares (its size does not change the host cost)."""

_BATCH_SIZES: Final = (1, 256, 1024)


class StatefulTimedWorker(TimedWaitWorker):
    """`TimedWaitWorker` declaring a recurrent state: the engine lays out and commits states
    for it, while its forwards stay free (it keeps no state buffers of its own)."""

    @property
    def capabilities(self) -> WorkerCapabilities:
        """The timed worker's, with `STATE_SPEC`."""
        return attrs.evolve(super().capabilities, recurrent=STATE_SPEC)

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build; the layout must be there."""
        if memory.recurrent is None:
            raise RuntimeError("the engine laid out no state rows for a recurrent worker")

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """The timed worker's forward."""
        return super().forward_batch_generation(batch, on_publish=on_publish)


def _sizes(text: str) -> tuple[int, ...]:
    return tuple(positive(item) for item in text.split(","))


def add_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench recurrent`` under the ``bench`` command's subcommands."""
    parser = benches.add_parser("recurrent", help="host cost of the recurrent-state commit")
    parser.add_argument(
        "--batch-sizes",
        type=_sizes,
        default=_BATCH_SIZES,
        metavar="LIST",
        help="default 1,256,1024",
    )
    parser.add_argument("--rounds", type=positive, default=200, help="timed rounds per run")
    parser.add_argument(
        "--repeats", type=positive, default=3, help="alternated engine runs each way"
    )
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")


def _commit_us(batch_size: int, rounds: int) -> float:
    """Median µs of one steady round's commit of ``batch_size`` states (production mode)."""
    pool = recurrent_pool_for(
        STATE_SPEC,
        num_draft_tokens=4,
        topk=1,
        num_request_slots=batch_size + 1,
        checker=OwnershipChecker(enabled=False),
        validate=False,
    )
    if pool is None:
        raise RuntimeError("no pool for a declared state")
    slots = np.arange(1, batch_size + 1, dtype=np.int64)
    for slot in slots.tolist():
        pool.open_state(slot, f"r{slot}", 0)
    accept = np.full(batch_size, 2, dtype=np.int64)
    none: list[int] = []
    empty = slots[:0]
    samples = []
    for _ in range(rounds):
        start = time.perf_counter()
        pool.settle_states(slots, accept, None, none, empty)
        samples.append(time.perf_counter() - start)
    return round(statistics.median(samples) * 1e6, 3)


def _step_us(batch_size: int, rounds: int, *, stateful: bool) -> float:
    """Median µs of `Engine.step` over ``rounds`` steady decode rounds."""
    from specstate import Engine, EngineConfig, RequestLimits, SamplingParams

    worker = (StatefulTimedWorker if stateful else TimedWaitWorker)(device_seconds=0.0)
    max_new = worker.accept * (rounds + 16)
    config = EngineConfig(
        overlap=True,
        page_size=16,
        kv_tokens=batch_size * (max_new + 64) + 64,
        max_running=batch_size,
        max_prefill_tokens=max(4096, batch_size * 8),
    )
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    limits = RequestLimits(vocab_size=32, max_context_len=max_new + 16)
    with Engine(worker, limits=limits, config=config) as engine:
        for i in range(batch_size):
            engine.submit(f"bench-{i}", range(1, 9), params)
        decode_whole(engine, batch_size)
        samples = []
        for _ in range(rounds):
            start = time.perf_counter()
            report = engine.step()
            samples.append(time.perf_counter() - start)
            if report.launched_size != batch_size:
                raise RuntimeError(f"bs {batch_size}: a round ran {report.launched_size} rows")
    return statistics.median(samples) * 1e6


@attrs.frozen(kw_only=True)
class _Row:
    bs: int
    commit_us: float
    step_us: float
    step_stateless_us: float


def run(args: argparse.Namespace) -> int:
    """Run the bench; print a table or JSON."""
    rows = []
    for bs in args.batch_sizes:
        print(f"bench recurrent: bs {bs}", file=sys.stderr, flush=True)
        commit = _commit_us(bs, max(args.rounds, 50))
        stateful: list[float] = []
        stateless: list[float] = []
        for _ in range(args.repeats):  # alternated: the machine's drift hits both alike
            stateful.append(_step_us(bs, args.rounds, stateful=True))
            stateless.append(_step_us(bs, args.rounds, stateful=False))
        rows.append(
            _Row(
                bs=bs,
                commit_us=commit,
                step_us=round(statistics.median(stateful), 1),
                step_stateless_us=round(statistics.median(stateless), 1),
            )
        )
    if args.json:
        report = {"bench": "recurrent", "results": [attrs.asdict(r) for r in rows]}
        print(json.dumps(report, indent=2))
        return 0
    print("Recurrent-state commit per steady decode round, µs (Engine.step: overlap, page 16)")
    print(f"{'bs':>5} {'commit':>8} {'step':>10} {'stateless':>10}")
    for r in rows:
        print(f"{r.bs:>5} {r.commit_us:>8.2f} {r.step_us:>10.1f} {r.step_stateless_us:>10.1f}")
    return 0
