"""Prefix-cache cost per scheduler round: SGLang 0.5.23's ``RadixCache`` on a shared workload.

Replays the workload of specstate's ``src/specstate/tools/prefix_workload.py`` (loaded by file
path with ``peer_common``; ``specstate bench prefix`` replays the same one) through SGLang's own
radix tree, on CPU, and times the tree's work of each round:

  finish   for each request that ends this round: ``insert`` its committed tokens (prompt +
           output minus the pending last token, page-aligned down) with its KV slot indices,
           then ``dec_lock_ref`` on the node it locked at admission;
  admit    for each arriving request: ``match_prefix`` of its prompt (at most n - 1 tokens,
           ``RadixKey(limit=...)``), ``inc_lock_ref`` on the last matched node, and the matched
           slot indices (``path_device_indices``), which the scheduler writes into the row;
  evict    ``evict`` down to the cache's token budget.

Keys are built from the request's token list in the timed region, as a scheduler does. The
token allocator is a stand-in whose ``free_segment`` does nothing (the pool's own work is
not the tree's, and specstate's side does not time its pool either). Output: one JSON object
on stdout with the median microseconds per round for every (page size, concurrency), the
workload config echoed; progress on stderr.

Run with the SGLang venv's python (it needs ``import_stubs.py`` from this folder, which stubs
``torchvision``, and ``triton`` where it is not installed, for the import):

    /path/to/peer-venv/bin/python benchmarks/peers/sglang_radix_bench.py > sglang-prefix.json

This file and the workload module import nothing beyond the standard library at import time,
so specstate's tests load this file to check that both sides replay the same requests.
"""

from __future__ import annotations

import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import peer_common  # standard library only

workload = peer_common.load_workload(peer_common.PREFIX_WORKLOAD_PATH, "specstate_prefix_workload")
make_workload = workload.make_workload


def _run_sglang(
    page_size: int, concurrency: int, rounds: int, warmup: int, seed: int
) -> list[float]:
    """Microseconds of tree work per round (after ``warmup`` untimed rounds)."""
    import time
    from array import array

    import torch
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InsertParams,
        MatchPrefixParams,
    )
    from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

    class _Pool:
        device = "cpu"

        def free_segment(self, indices: Any, start_pos: int = 0) -> None:
            del indices, start_pos

        def free(self, indices: Any) -> None:
            del indices

    work = make_workload(concurrency=concurrency, rounds=warmup + rounds, seed=seed)
    requests, churn, budget = work["requests"], work["churn"], work["budget_tokens"]
    cache = RadixCache.create_simulated(mock_allocator=_Pool(), page_size=page_size)
    next_slot = [1]
    state: dict[int, tuple[Any, torch.Tensor]] = {}  # request -> (locked node, its slots)

    def admit(i: int) -> None:
        prompt, _out = requests[i]
        limit = (len(prompt) - 1) // page_size * page_size
        res = cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", prompt), limit=limit)))
        node = res.last_device_node
        cache.inc_lock_ref(node)
        prefix = cache.path_device_indices(node)[: res.device_prefix_len]
        state[i] = (node, prefix)

    def own_slots(i: int) -> None:  # the allocator's part: untimed
        node, prefix = state[i]
        prompt, out = requests[i]
        n = len(prompt) + len(out)
        fresh = torch.arange(next_slot[0], next_slot[0] + n - prefix.numel())
        next_slot[0] += fresh.numel()
        state[i] = (node, torch.cat([prefix, fresh]))

    def finish(i: int) -> None:
        node, slots = state.pop(i)
        prompt, out = requests[i]
        tokens = prompt + out
        k = (len(tokens) - 1) // page_size * page_size
        key = RadixKey(array("q", tokens), limit=k)
        cache.insert(InsertParams(key=key, value=slots[:k]))
        cache.dec_lock_ref(node)

    for i in range(concurrency):
        admit(i)
        own_slots(i)
    times = []
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
        excess = cache.evictable_size() + cache.protected_size() - budget
        if excess > 0:
            cache.evict(EvictParams(num_tokens=excess))
        t1 = time.perf_counter_ns()
        for i in new:
            own_slots(i)
        live += new
        if r >= warmup:
            times.append((t1 - t0) / 1e3)
    return times


def main() -> None:
    """Run the sweep; print the JSON report on stdout."""
    import argparse
    import json
    import statistics

    import import_stubs  # before anything imports sglang

    import_stubs.install()
    import torch

    torch.set_num_threads(1)
    import sglang

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--page-sizes", default="1,16")
    parser.add_argument("--concurrency", default="16,64,256")
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    results = []
    for p in (int(x) for x in args.page_sizes.split(",")):
        for c in (int(x) for x in args.concurrency.split(",")):
            medians = []
            for rep in range(args.repeats):
                print(f"sglang radix: page {p}, concurrency {c}, run {rep}", file=sys.stderr)
                medians.append(
                    statistics.median(_run_sglang(p, c, args.rounds, args.warmup, args.seed))
                )
            results.append(
                {
                    "page_size": p,
                    "concurrency": c,
                    "us_per_round": statistics.median(medians),
                    "runs": medians,
                }
            )
    report = {
        "peer": "sglang",
        "version": sglang.__version__,
        "torch": torch.__version__,
        "bench": "prefix",
        "config": workload.config(args.rounds, args.warmup, args.seed),
        "results": results,
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
