"""``specstate bench prefix``: the prefix cache's work per scheduler round, on a peer's workload.

Replays the workload of `specstate.tools.prefix_workload` through `PrefixCache` and times the
tree's work of each round, exactly as ``benchmarks/peers/sglang_radix_bench.py`` times SGLang's
``RadixCache`` on the same requests (it loads that module by file path)::

    finish   each request that ends: insert its committed tokens (prompt + output minus the
             pending last token, whole pages) with its KV pages, then unlock its match
    admit    each arriving request: match its prompt (at most n - 1 tokens), lock the match,
             and its pages (what the allocator maps into the row)
    evict    down to the cache's token budget

Keys are built from the request's token list inside the timed region (both sides); the pool's
own work (taking and freeing pages) is outside it on both sides. The result is the median
microseconds per round over the measured rounds, per (page size, concurrency); with ``--peer``
the peer's report is shown beside it.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import numpy as np

from specstate.memory.prefix_cache import PrefixCache, PrefixMatch, PrefixSharing, as_token_array
from specstate.tools.prefix_workload import OUTPUT_LEN, make_workload

__all__ = ["prefix_benchmark", "run_rounds"]


def run_rounds(
    page_size: int, concurrency: int, *, rounds: int, warmup: int, seed: int = 0
) -> tuple[list[float], PrefixCache]:
    """Microseconds of tree work per round (after ``warmup`` untimed rounds), and the tree."""
    work = make_workload(concurrency=concurrency, rounds=warmup + rounds, seed=seed)
    requests, churn = work["requests"], work["churn"]
    budget_pages = work["budget_tokens"] // page_size
    cache = PrefixCache(page_size=page_size, sharing=PrefixSharing.TOKEN)
    p = page_size
    next_page = [1]
    state: dict[int, tuple[PrefixMatch, Any, Any]] = {}  # (match, prompt array, pages)

    def admit(i: int) -> None:  # as `PrefixRows.match` and `PrefixRows.map`
        prompt = as_token_array(requests[i][0])
        limit = (len(prompt) - 1) // p * p
        match = cache.match(cache.keys(prompt[:limit]))
        if match.num_tokens:
            cache.lock(match)
        state[i] = (match, prompt, match.pages)

    def own_pages(i: int) -> None:  # the allocator's part: untimed
        match, prompt, cached = state[i]
        n = -(-(len(prompt) + OUTPUT_LEN) // p)
        fresh = np.arange(next_page[0], next_page[0] + n - cached.size, dtype=np.int64)
        next_page[0] += fresh.size
        state[i] = (match, prompt, np.concatenate([cached, fresh]))

    def finish(i: int) -> None:  # as `PrefixRows.release`: the outputs join the prompt's array
        match, prompt, pages = state.pop(i)
        tokens = np.concatenate([prompt, as_token_array(requests[i][1])])
        k = (len(tokens) - 1) // p * p
        cache.insert(cache.keys(tokens[:k]), pages[: k // p])
        if match.num_tokens:
            cache.unlock(match)

    for i in range(concurrency):
        admit(i)
        own_pages(i)
    times: list[float] = []
    arrived = concurrency
    live = list(range(concurrency))
    for r in range(warmup + rounds):
        done, live = live[:churn], live[churn:]
        new = list(range(arrived, arrived + churn))
        arrived += churn
        t0 = time.perf_counter_ns()
        for i in done:
            finish(i)
        for i in new:
            admit(i)
        excess = cache.num_cached_pages - budget_pages
        if excess > 0:
            cache.evict(excess)
        t1 = time.perf_counter_ns()
        for i in new:
            own_pages(i)
        live += new
        if r >= warmup:
            times.append((t1 - t0) / 1e3)
    return times, cache


def prefix_benchmark(
    *,
    page_sizes: tuple[int, ...],
    concurrency: tuple[int, ...],
    rounds: int,
    warmup: int,
    repeats: int,
    seed: int = 0,
    progress: Any = None,
) -> list[dict[str, Any]]:
    """Per (page size, concurrency): the median µs per round, the median of ``repeats`` runs."""
    results = []
    for p in page_sizes:
        for c in concurrency:
            medians = []
            for rep in range(repeats):
                if progress is not None:
                    progress(f"bench prefix: page {p}, concurrency {c}, run {rep}")
                times, _ = run_rounds(p, c, rounds=rounds, warmup=warmup, seed=seed)
                medians.append(statistics.median(times))
            results.append(
                {
                    "page_size": p,
                    "concurrency": c,
                    "us_per_round": statistics.median(medians),
                    "runs": medians,
                }
            )
    return results


# ------------------------------------------------------------------- hit rates
HIT_ALGORITHMS = ("none", "ngram", "draft_model", "eagle")
HIT_MEMORY = {"ample": (16384, 8), "tight": (2048, 4)}  # (KV tokens, max running)
HIT_TURNS = 4
HIT_NEW_TOKENS = 48


def _conversations(
    algorithm: str, *, page_size: int, kv_tokens: int, max_running: int, cache: bool
) -> dict[str, Any]:
    """Serve the multi-turn workload once; hit statistics and first-round accept lengths."""
    from specstate.core.params import RequestLimits, SamplingParams
    from specstate.engine.config import EngineConfig
    from specstate.engine.engine import Engine
    from specstate.reference import embedded
    from specstate.tools.demo import PROMPTS, _worker

    limits = RequestLimits(
        vocab_size=embedded.VOCAB_SIZE, max_context_len=2048, eos_token_ids={embedded.EOS_ID}
    )
    config = EngineConfig(
        page_size=page_size,
        kv_tokens=kv_tokens,
        max_running=max_running,
        chunked_prefill=64,
        prefix_cache=cache,
    )
    prompts = [[embedded.BOS_ID, *embedded.encode(p)] for p in PROMPTS]
    first: list[int] = []  # first accept length of every request past the first turn
    outputs = []
    params = SamplingParams(max_new_tokens=HIT_NEW_TOKENS, ignore_eos=True)
    with Engine(_worker(algorithm, 4), limits=limits, config=config) as engine:
        for turn in range(HIT_TURNS):
            reqs = [engine.submit(f"c{c}t{turn}", p, params) for c, p in enumerate(prompts)]
            engine.run_until_idle()
            for c, req in enumerate(reqs):
                follow = embedded.encode("\n\n" + PROMPTS[(c + turn + 1) % len(PROMPTS)])
                prompts[c] = [*prompts[c], *req.emitted_ids, *follow]
                outputs.append(req.emitted_ids)
                if turn and req.accept_lengths:
                    first.append(req.accept_lengths[0])
        snap = engine.snapshot().prefix_cache
    return {
        "hit_tokens": 0 if snap is None else snap.num_hit_tokens,
        "queried_tokens": 0 if snap is None else snap.num_queried_tokens,
        "evicted_pages": 0 if snap is None else snap.num_evicted_pages,
        "first_accept": first,
        "outputs": outputs,
    }


def hit_rates(*, page_sizes: tuple[int, ...], progress: Any = None) -> list[dict[str, Any]]:
    """Hit rate of every algorithm at equal KV memory, and its first-round acceptance on
    cached prefixes against the same requests with the cache off (embedded model, greedy)."""
    import torch

    torch.set_num_threads(1)
    rows = []
    for p in page_sizes:
        for memory, (kv_tokens, running) in HIT_MEMORY.items():
            plain: Any = None
            for algorithm in HIT_ALGORITHMS:
                if progress is not None:
                    progress(f"bench prefix --hits: page {p}, {memory} memory, {algorithm}")
                options = {"page_size": p, "kv_tokens": kv_tokens, "max_running": running}
                on = _conversations(algorithm, cache=True, **options)
                off = _conversations(algorithm, cache=False, **options)
                plain = plain or on
                rows.append(
                    {
                        "page_size": p,
                        "memory": memory,
                        "kv_tokens": kv_tokens,
                        "max_running": running,
                        "algorithm": algorithm,
                        "hit_rate": on["hit_tokens"] / max(on["queried_tokens"], 1),
                        "hit_tokens": on["hit_tokens"],
                        "queried_tokens": on["queried_tokens"],
                        "evicted_pages": on["evicted_pages"],
                        "first_accept_cached": statistics.fmean(on["first_accept"] or [0]),
                        "first_accept_uncached": statistics.fmean(off["first_accept"] or [0]),
                        "same_acceptance": on["first_accept"] == off["first_accept"],
                        "same_outputs": on["outputs"] == off["outputs"] == plain["outputs"],
                    }
                )
    return rows


def print_hit_rates(rows: list[dict[str, Any]]) -> None:
    """The hit-rate report as a table."""
    print(
        f"multi-turn hit rate and first-round acceptance ({HIT_TURNS} turns x 8 conversations,"
        f" {HIT_NEW_TOKENS} new tokens a turn, embedded model, greedy)"
    )
    print(
        f"{'P':>3} {'memory':>13} {'algorithm':>11} {'hit rate':>9} {'evicted':>8} "
        f"{'1st accept cached':>17} {'uncached':>9} {'same':>5}"
    )
    for r in rows:
        memory = f"{r['memory']} {r['kv_tokens']}"
        print(
            f"{r['page_size']:>3} {memory:>13} {r['algorithm']:>11} {r['hit_rate']:>9.1%} "
            f"{r['evicted_pages']:>8} {r['first_accept_cached']:>17.2f} "
            f"{r['first_accept_uncached']:>9.2f} "
            f"{'yes' if r['same_acceptance'] and r['same_outputs'] else 'NO':>5}"
        )
