"""``specstate bench budget``: verify-budget policies on a workload whose acceptance varies.

The engine serves a churned workload (requests arrive over time, finish at different lengths,
the batch grows and shrinks) in which some requests are predictable (their drafts are mostly
accepted) and some are not, on a synthetic worker whose round costs device time by a stated
throughput profile (`CostProfile`: a round of ``b`` rows verifying ``n`` drafts each costs
``cost(n, b)``; a ragged round, ``cost`` at the rows' mean budget). The device time is modelled,
not slept: the bench compares policies, not the host.

For each policy — the fixed width, a batch-size schedule, the goodput policy and confidence
scheduling — it reports, as medians over alternated runs of the same seeded workload:

* goodput: accepted tokens per second of modelled device time;
* verified-but-rejected drafts (verify work that bought no token) and their share;
* KV reserved but unused: ``kv_allocated_len - kv_committed_len`` summed over the running
  requests, averaged over the decode rounds (what the reservation holds ahead of the clock).

The worker reports calibrated confidences (a request's per-position acceptance rates, the
probabilities its drafts are drawn with), as a well-trained confidence head would.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import zlib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import numpy as np
import torch

from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.params import RequestLimits, SamplingParams
from specstate.engine.budgets import (
    BatchSizeSchedule,
    ConfidenceBudget,
    CostProfile,
    FixedBudget,
    GoodputBudget,
    VerifyBudgetPolicy,
)
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.memory.prefix_cache import PrefixSharing
from specstate.relay.future_map import RelayPayload
from specstate.tools.cli_types import positive

__all__ = ["DEFAULT_PROFILE", "BudgetRun", "VaryingAcceptanceWorker", "add_parser", "run"]

STEPS: Final = 4
PREDICTABLE: Final = (0.92, 0.88, 0.85, 0.8)
UNPREDICTABLE: Final = (0.35, 0.2, 0.1, 0.05)
"""The per-position acceptance of the two kinds of requests (a draft accepted given the ones
before it were)."""

DEFAULT_PROFILE: Final = CostProfile(
    (1, 16, 64),
    (
        (1.0, 1.08, 1.16, 1.24, 1.32),
        (1.6, 1.9, 2.2, 2.5, 2.8),
        (4.0, 5.2, 6.4, 7.6, 8.8),
    ),
)
"""Milliseconds of a decode round by rows and drafts verified each: a small batch is bound by
memory (a draft costs 8% of a step), a large one by compute (30%). Give a measured one with
``--cost-profile FILE`` (`CostProfile.to_json`'s format)."""


class VaryingAcceptanceWorker:
    """A chain worker of `STEPS` drafts whose acceptance depends on the request, and whose
    rounds cost modelled device time (module docstring). Tokens are a constant."""

    def __init__(self, profile: CostProfile, *, seed: int) -> None:
        self._profile = profile
        self._rng = np.random.default_rng(seed)
        self.device_ms = 0.0
        self._capabilities = attrs.evolve(
            WorkerCapabilities.chain("varying", num_steps=STEPS, keeps_draft_kv=True),
            supports_verify_budgets=True,
            reports_draft_confidences=True,
            prefix_sharing=PrefixSharing.NONE,
        )

    @property
    def capabilities(self) -> WorkerCapabilities:
        """A chain of `STEPS` that honours budgets and reports confidences."""
        return self._capabilities

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build."""

    @staticmethod
    def rates(request_id: str) -> tuple[float, ...]:
        """The request's per-position acceptance: predictable for two requests in three."""
        return UNPREDICTABLE if zlib.crc32(request_id.encode()) % 3 == 0 else PREDICTABLE

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        """Accept by the rows' rates within their budgets; charge the round's modelled time."""
        rows = batch.batch_size
        if not batch.forward_mode.is_decode():
            return _result(batch, np.ones(rows, dtype=np.int64), 1, on_publish)
        rates = np.array([self.rates(r) for r in batch.request_ids])
        budgets = (
            np.full(rows, STEPS, dtype=np.int64)
            if batch.verify_budgets is None
            else batch.verify_budgets.numpy()
        )
        hits = self._rng.random((rows, STEPS)) < rates
        runs = 1 + np.cumprod(hits, axis=1).sum(axis=1)
        accept = np.minimum(runs, budgets + 1)
        self.device_ms += self._profile.cost(round(float(budgets.mean())), rows)
        return _result(batch, accept, STEPS + 1, on_publish, budgets, rates)


def _result(
    batch: ForwardBatch,
    accept: np.ndarray[Any, np.dtype[np.int64]],
    stride: int,
    on_publish: OnPublish | None,
    budgets: np.ndarray[Any, np.dtype[np.int64]] | None = None,
    rates: np.ndarray[Any, np.dtype[np.float64]] | None = None,
) -> GenerationBatchResult:
    rows = batch.batch_size
    accept_lens = torch.from_numpy(accept.astype(np.int64))
    new_seq_lens = batch.seq_lens + accept_lens if stride > 1 else batch.seq_lens.clone()
    if on_publish is not None:
        on_publish(new_seq_lens)
    return GenerationBatchResult(
        next_token_ids=torch.full((rows * stride,), 7, dtype=torch.int64),
        accept_lens=accept_lens,
        stride=stride,
        new_seq_lens=new_seq_lens,
        next_draft_input=RelayPayload(bonus_tokens=torch.full((rows,), 7, dtype=torch.int64)),
        verified_lens=None if budgets is None else torch.from_numpy(budgets.astype(np.int64)),
        draft_confidences=None if rates is None else torch.from_numpy(rates.astype(np.float32)),
    )


@attrs.frozen(kw_only=True)
class BudgetRun:
    """One policy's run of the workload."""

    policy: str
    goodput_tokens_per_s: float
    accepted_tokens: int
    verified_drafts: int
    rejected_drafts: int
    reserved_unused_tokens: float

    @property
    def rejected_share(self) -> float:
        """Rejected drafts over verified drafts."""
        return self.rejected_drafts / self.verified_drafts if self.verified_drafts else 0.0


def policies(profile: CostProfile) -> dict[str, Callable[[], VerifyBudgetPolicy]]:
    """The policies the bench compares, each built fresh for a run."""
    return {
        "fixed": FixedBudget,
        "batch-size schedule": lambda: BatchSizeSchedule({8: STEPS, 24: 2}, beyond=1),
        "goodput": lambda: GoodputBudget(profile),
        "confidence": lambda: ConfidenceBudget(profile),
    }


def run_policy(
    name: str, policy: VerifyBudgetPolicy, profile: CostProfile, *, requests: int, seed: int
) -> BudgetRun:
    """Serve the workload under ``policy``: ``requests`` arrive in waves, caps 16 to 112."""
    worker = VaryingAcceptanceWorker(profile, seed=seed)
    config = EngineConfig(overlap=True, page_size=16, kv_tokens=requests * 512, max_running=48)
    limits = RequestLimits(vocab_size=32, max_context_len=256)
    caps = np.random.default_rng(seed).integers(16, 113, size=requests)
    reserved: list[int] = []
    with Engine(worker, limits=limits, config=config, verify_budget=policy) as engine:
        for wave in range(0, requests, 8):  # arrivals over time: the batch grows and shrinks
            for i in range(wave, min(wave + 8, requests)):
                params = SamplingParams(max_new_tokens=int(caps[i]), ignore_eos=True)
                engine.submit(f"req-{i}", [1, 2, 3, 4], params)
            for _ in range(6):
                engine.step()
                reserved.append(_reserved_unused(engine))
        while not engine.is_idle:
            engine.step()
            reserved.append(_reserved_unused(engine))
        metrics = engine.snapshot().metrics
    seconds = worker.device_ms / 1e3
    return BudgetRun(
        policy=name,
        goodput_tokens_per_s=metrics.num_accepted_tokens / seconds if seconds else 0.0,
        accepted_tokens=metrics.num_accepted_tokens,
        verified_drafts=metrics.num_proposed_drafts,
        rejected_drafts=metrics.num_rejected_drafts,
        reserved_unused_tokens=statistics.fmean(reserved) if reserved else 0.0,
    )


def _reserved_unused(engine: Engine) -> int:
    entries = engine.ledger.batch_snapshot().entries
    return sum(e.kv_allocated_len - e.kv_committed_len for e in entries)


def add_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench budget`` under the ``bench`` command's subcommands."""
    parser = benches.add_parser(
        "budget", help="verify-budget policies on a workload whose acceptance varies"
    )
    parser.add_argument("--requests", type=positive, default=96, help="requests per run")
    parser.add_argument("--rounds", type=positive, default=3, help="alternated runs per policy")
    parser.add_argument("--seed", type=int, default=0, help="the workload's seed")
    parser.add_argument(
        "--cost-profile", type=Path, metavar="FILE", help="a measured cost profile (JSON)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")


def run(args: argparse.Namespace) -> int:
    """Run every policy ``--rounds`` times, alternated; print medians."""
    profile = (
        DEFAULT_PROFILE if args.cost_profile is None else CostProfile.from_json(args.cost_profile)
    )
    runs: dict[str, list[BudgetRun]] = {name: [] for name in policies(profile)}
    for r in range(args.rounds):
        for name, make in policies(profile).items():
            print(f"bench budget: run {r + 1}/{args.rounds}, {name}", file=sys.stderr, flush=True)
            runs[name].append(
                run_policy(name, make(), profile, requests=args.requests, seed=args.seed + r)
            )
    summary = [_median(name, done) for name, done in runs.items()]
    if args.json:
        print(
            json.dumps(
                {
                    "bench": "budget",
                    "profile": profile.to_json(),
                    "config": {"requests": args.requests, "rounds": args.rounds},
                    "policies": [attrs.asdict(s) for s in summary],
                }
            )
        )
        return 0
    _print(summary, args)
    return 0


def _median(name: str, done: Sequence[BudgetRun]) -> BudgetRun:
    def med(field: str) -> Any:
        return statistics.median(getattr(d, field) for d in done)

    return BudgetRun(
        policy=name,
        goodput_tokens_per_s=med("goodput_tokens_per_s"),
        accepted_tokens=int(med("accepted_tokens")),
        verified_drafts=int(med("verified_drafts")),
        rejected_drafts=int(med("rejected_drafts")),
        reserved_unused_tokens=med("reserved_unused_tokens"),
    )


def _print(summary: Sequence[BudgetRun], args: argparse.Namespace) -> None:
    print(
        f"bench budget: {args.requests} requests, {STEPS} drafts; medians of {args.rounds} "
        "alternated runs; device time modelled by the cost profile"
    )
    print(
        f"{'policy':<22}{'goodput tok/s':>14}{'verified':>10}{'rejected':>10}{'rejected %':>12}"
        f"{'KV unused':>11}"
    )
    for s in summary:
        print(
            f"{s.policy:<22}{s.goodput_tokens_per_s:>14.0f}{s.verified_drafts:>10}"
            f"{s.rejected_drafts:>10}{100 * s.rejected_share:>11.1f}%"
            f"{s.reserved_unused_tokens:>11.0f}"
        )
