"""``specstate bench host``: the host bookkeeping of one speculative decode round, timed.

It replays a fixed EAGLE-chain workload (3 steps, 4 draft tokens, so L = 4 and the reserve is
R = 8; vocabulary 32000; no request finishes) through the calls the `Engine` makes in one
overlap iteration, and times three parts:

* **reserve** — `Scheduler.schedule` for the decode round (retraction check and the 2L
  reservation of every running request);
* **relay** — the FutureMap resolve of the frontier and the forward inputs, then, after the
  simulated forward, publish of the new frontier and stash of the next round's payload;
* **settle** — `ResultProcessor.settle` of the previous iteration's result.

Iteration ``i`` times reserve(i) + relay(i) + settle(i - 1), the order of the overlap loop.
The workload, the seeds, the pool sizes and the statistics are those of SGLang's host-cost
harness for the same configuration, so the two JSON outputs compare row for row
(`specstate bench compare`): prompt lengths from ``random.Random(1234)`` (100..2000), accept
lengths from ``random.Random(5678)`` (1..4, drawn iteration-major), result tokens and draft
payloads from ``torch.Generator().manual_seed(9012)``; KV pool ``ceil_P(bs * (2000 + 64 + 4 *
320 + 2P))`` tokens; ``torch.set_num_threads(1)``; ``gc.collect(); gc.freeze()`` before each
run's loop. Prefill is not timed. After each run the engine's invariants are checked, untimed.
"""

from __future__ import annotations

import gc
import math
import platform
import random
import time
from collections.abc import Callable, Sequence

import attrs
import torch

import specstate
from specstate.batch.forward_batch import ForwardBatch
from specstate.batch.result import GenerationBatchResult
from specstate.core.request import RequestLimits, SamplingParams
from specstate.engine.engine import Engine, EngineConfig
from specstate.engine.invariants import InvariantViolation, check_engine
from specstate.engine.result_copy import HostResult
from specstate.engine.scheduler import LaunchPlan
from specstate.engine.worker import OnPublish, WorkerCapabilities, WorkerMemory
from specstate.relay.batch_relay import resolve_batch_forward_inputs, resolve_batch_seq_lens
from specstate.relay.future_map import RelayPayload

__all__ = ["HostWorkload", "accept_lengths", "host_benchmark", "prompt_lengths"]

VOCAB = 32000
EOS = 31999
STEPS = 3
DRAFT_TOKENS = 4
RESERVE = 8
HIDDEN = 256
CONTEXT = 4096
PAYLOAD_SETS = 4


@attrs.frozen(kw_only=True)
class HostWorkload:
    """The replayed workload: every number that defines it."""

    page_sizes: tuple[int, ...] = (1, 16)
    batch_sizes: tuple[int, ...] = (1, 64, 256, 1024)
    iters: int = 300
    warmup: int = 20
    repeats: int = 5


class _PrefillWorker:
    """Answers the (untimed) prefill like the workload's emulated prefill; never decodes."""

    def __init__(self, gen: torch.Generator) -> None:
        self._gen = gen

    @property
    def capabilities(self) -> WorkerCapabilities:
        return WorkerCapabilities(
            algorithm="eagle",
            num_steps=STEPS,
            num_draft_tokens=DRAFT_TOKENS,
            keeps_draft_kv=True,
        )

    def attach(self, memory: WorkerMemory) -> None:
        """Nothing to build."""

    def forward_batch_generation(
        self, batch: ForwardBatch, *, on_publish: OnPublish | None = None
    ) -> GenerationBatchResult:
        b = batch.batch_size
        tokens = torch.randint(0, EOS, (b,), generator=self._gen)
        return GenerationBatchResult(
            next_token_ids=tokens,
            accept_lens=torch.ones(b, dtype=torch.int64),
            stride=1,
            new_seq_lens=batch.seq_lens,
            next_draft_input=_payload(tokens, self._gen),
        )


def _payload(bonus: torch.Tensor, gen: torch.Generator) -> RelayPayload:
    b = bonus.numel()
    return RelayPayload(
        bonus_tokens=bonus,
        topk_p=torch.rand((b, 1), generator=gen),
        topk_index=torch.randint(0, VOCAB, (b, 1), generator=gen),
        hidden_states=torch.randn((b, HIDDEN), generator=gen).to(torch.bfloat16),
    )


def _kv_tokens(bs: int, page: int, iters: int) -> int:
    need = bs * (2000 + 64 + DRAFT_TOKENS * iters + 2 * page)
    return -(-need // page) * page


def _percentile(sorted_values: Sequence[float], q: float) -> float:
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[rank - 1]


def _stats(values: Sequence[float]) -> dict[str, float]:
    ordered = sorted(values)
    n = len(ordered)
    median = (ordered[(n - 1) // 2] + ordered[n // 2]) / 2
    return {"median": round(median, 2), "p90": round(_percentile(ordered, 0.9), 2)}


@attrs.define
class _Run:
    reserve: list[float] = attrs.Factory(list)
    relay: list[float] = attrs.Factory(list)
    settle: list[float] = attrs.Factory(list)
    loop_s: float = 0.0


def prompt_lengths(bs: int) -> list[int]:
    """Request ``r``'s prompt length: draw ``r`` of ``random.Random(1234)``, 100..2000."""
    rng = random.Random(1234)
    return [rng.randint(100, 2000) for _ in range(bs)]


def accept_lengths(bs: int, iterations: int) -> list[torch.Tensor]:
    """Iteration ``i``'s accept lengths: draws ``i * bs + r`` of ``random.Random(5678)``, 1..4."""
    rng = random.Random(5678)
    return [
        torch.tensor([rng.randint(1, 4) for _ in range(bs)], dtype=torch.int64)
        for _ in range(iterations)
    ]


def _one_run(page: int, bs: int, workload: HostWorkload) -> _Run:
    """One run from a fresh engine: prefill (untimed), then warm-up + measured iterations."""
    prompt_lens = prompt_lengths(bs)
    total_iters = workload.warmup + workload.iters
    accepts = accept_lengths(bs, total_iters)
    gen = torch.Generator().manual_seed(9012)
    config = EngineConfig(
        overlap=False,
        page_size=page,
        kv_tokens=_kv_tokens(bs, page, total_iters),
        max_running=bs,
        max_prefill_tokens=sum(prompt_lens) + 1,
    )
    limits = RequestLimits(vocab_size=VOCAB, max_context_len=CONTEXT, eos_token_ids={EOS})
    engine = Engine(_PrefillWorker(gen), limits=limits, config=config)
    try:
        for r, n in enumerate(prompt_lens):
            params = SamplingParams(max_new_tokens=DRAFT_TOKENS * total_iters + 2)
            engine.submit(f"r{r}", range(n), params)
        while engine.scheduler.waiting or engine.scheduler.prefilling:
            engine.step()  # untimed prefill: one output token, frontier and payload relayed
        tokens = [torch.randint(0, EOS, (bs * DRAFT_TOKENS,), generator=gen) for _ in range(4)]
        payloads = [
            _payload(torch.randint(0, EOS, (bs,), generator=gen), gen) for _ in range(PAYLOAD_SETS)
        ]
        run = _loop(engine, accepts, tokens, payloads, workload)
        _check(engine, prompt_lens, accepts)
        return run
    finally:
        engine.close()


def _loop(
    engine: Engine,
    accepts: list[torch.Tensor],
    tokens: list[torch.Tensor],
    payloads: list[RelayPayload],
    workload: HostWorkload,
) -> _Run:
    fm = engine.rounds.launcher.future_map
    scheduler = engine.scheduler
    run = _Run()
    previous: tuple[LaunchPlan, GenerationBatchResult] | None = None
    clock = time.perf_counter_ns
    gc.collect()
    gc.freeze()
    start = clock()
    for i in range(workload.warmup + workload.iters):
        t0 = clock()
        plan, _ = scheduler.schedule()
        t1 = clock()
        assert plan is not None
        batch = plan.batch
        indices = batch.future_indices
        assert indices is not None
        resolve_batch_seq_lens(fm, batch)
        resolve_batch_forward_inputs(fm, batch)
        t2 = clock()
        seq_lens = batch.seq_lens
        assert isinstance(seq_lens, torch.Tensor)
        new = seq_lens + accepts[i]  # the simulated forward, untimed
        payload = payloads[i % PAYLOAD_SETS]
        result = GenerationBatchResult(
            next_token_ids=tokens[i % len(tokens)],
            accept_lens=accepts[i],
            stride=DRAFT_TOKENS,
            new_seq_lens=new,
            next_draft_input=payload,
        )
        t3 = clock()
        fm.publish(indices, new)
        fm.stash(indices, payload)
        t4 = clock()
        if previous is not None:
            _settle(engine, previous)
        t5 = clock()
        previous = (plan, result)
        if i >= workload.warmup:
            run.reserve.append((t1 - t0) / 1e3)
            run.relay.append((t2 - t1 + t4 - t3) / 1e3)
            run.settle.append((t5 - t4) / 1e3)
    run.loop_s = (clock() - start) / 1e9
    gc.unfreeze()
    if previous is not None:
        _settle(engine, previous)
    return run


def _settle(engine: Engine, flight: tuple[LaunchPlan, GenerationBatchResult]) -> None:
    plan, result = flight
    assert result.new_seq_lens is not None
    # The host-CPU view the engine settles from; ``seq_lens`` only feeds the value check,
    # which the launch runs (not timed here, as SGLang's functions check nothing).
    engine.rounds.settle_result(plan, HostResult.view(result, result.new_seq_lens))


def _check(engine: Engine, prompt_lens: list[int], accepts: list[torch.Tensor]) -> None:
    """Untimed: the workload's invariants, and the engine's own checker."""
    check_engine(engine)
    total = torch.stack(accepts).sum(0)
    for r, n in enumerate(prompt_lens):
        req = engine.request(f"r{r}")
        entry = engine.ledger.snapshot(engine.allocator.slot_of(req))
        want = n + int(total[r])
        if entry.kv_committed_len != want or req.seqlen != want + 1:
            raise InvariantViolation(
                "commit-settlement",
                f"request r{r}: committed {entry.kv_committed_len}, seqlen {req.seqlen}; "
                f"expected {want} and {want + 1}",
            )
        p = engine.allocator.window.page_size
        if entry.kv_allocated_len % p or entry.kv_allocated_len < want:
            raise InvariantViolation("reserve", f"request r{r}: allocated {entry.kv_allocated_len}")


def host_benchmark(
    *,
    page_sizes: Sequence[int] = (1, 16),
    batch_sizes: Sequence[int] = (1, 64, 256, 1024),
    iters: int = 300,
    warmup: int = 20,
    repeats: int = 5,
    progress: Callable[[str], None] | None = None,
) -> dict[str, object]:
    """Run the workload; a JSON-able dict shaped like the SGLang harness's output."""
    workload = HostWorkload(
        page_sizes=tuple(page_sizes),
        batch_sizes=tuple(batch_sizes),
        iters=iters,
        warmup=warmup,
        repeats=repeats,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    runs: dict[tuple[int, int], list[_Run]] = {}
    try:
        for rep in range(repeats):
            for page in workload.page_sizes:
                for bs in workload.batch_sizes:
                    if progress is not None:
                        progress(f"repeat {rep + 1}/{repeats}: page {page}, bs {bs}")
                    runs.setdefault((page, bs), []).append(_one_run(page, bs, workload))
    finally:
        torch.set_num_threads(threads)
    results = [_row(page, bs, rs, workload) for (page, bs), rs in runs.items()]
    return {
        "peer": "specstate",
        "version": specstate.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "config": {
            "algorithm": "eagle",
            "speculative_num_steps": STEPS,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": DRAFT_TOKENS,
            "alloc_len_per_decode": 4,
            "reserve": RESERVE,
            "page_sizes": list(workload.page_sizes),
            "batch_sizes": list(workload.batch_sizes),
            "iters": iters,
            "warmup": warmup,
            "repeats": repeats,
            "vocab_size": VOCAB,
            "hidden_size": HIDDEN,
            "torch_threads": 1,
        },
        "results": results,
        "notes": [
            "reserve = Scheduler.schedule (decode round); relay = FutureMap resolve of frontier "
            "and inputs + publish + stash; settle = ResultProcessor.settle of the previous "
            "iteration's result. Checks (ownership, invariants) off, as in production.",
        ],
    }


def _row(page: int, bs: int, runs: list[_Run], workload: HostWorkload) -> dict[str, object]:
    reserve = [x for r in runs for x in r.reserve]
    relay = [x for r in runs for x in r.relay]
    settle = [x for r in runs for x in r.settle]
    totals = [x for r in runs for x in _totals(r)]
    per_repeat = [_stats(_totals(r))["median"] for r in runs]
    total = _stats(totals)
    return {
        "page_size": page,
        "bs": bs,
        "iters": workload.iters,
        "warmup": workload.warmup,
        "repeats": len(runs),
        "samples": len(totals),
        "reserve_us": _stats(reserve),
        "relay_us": _stats(relay),
        "settle_us": _stats(settle),
        "total_us": total,
        "total_us_per_req": {k: round(v / bs, 3) for k, v in total.items()},
        "total_us_median_per_repeat": per_repeat,
        "total_us_best_repeat_median": min(per_repeat),
        "kv_pool_tokens": _kv_tokens(bs, page, workload.warmup + workload.iters),
        "loop_s": [round(r.loop_s, 2) for r in runs],
    }


def _totals(run: _Run) -> list[float]:
    return [a + b + c for a, b, c in zip(run.reserve, run.relay, run.settle, strict=True)]
