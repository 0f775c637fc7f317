"""vLLM 0.33's V1 KV manager and accept bookkeeping per speculative round, on the same draws.

Run it with the interpreter of the environment ``setup_vllm.sh`` builds; it prints one JSON
report on stdout (the shape ``specstate bench host --json`` prints) and its progress on stderr.

What one timed sample is, per round, for every running request, with vLLM's own objects
(`vllm.v1.request.Request`, `KVCacheManager` over a one-group `KVCacheConfig`, prefix caching
off): the previous round's three drafts become its ``spec_token_ids`` (what
``Scheduler.update_draft_token_ids`` does), ``KVCacheManager.allocate_slots(req, n,
num_lookahead_tokens=3)`` reserves the verify tokens and the EAGLE lookahead (the call
``Scheduler.schedule`` makes for a running request) and ``num_computed_tokens`` advances; after
the forward the rejected drafts are taken back, the accepted run goes through
``Scheduler._update_request_with_output`` (append, ``check_stop`` per token), a request that
stopped is freed (``KVCacheManager.free``), and a streaming server reads each request's new
tokens. A round that allocated blocks pays one ``--launch-us`` spin, the block-table upload its
model runner makes (the device-write model of ``specstate bench host``).

This is vLLM's KV and accept bookkeeping, not its whole scheduler round: ``Scheduler.schedule``
also builds the scheduler output and its block tables, and the model runner keeps its persistent
input batch; none of that is timed here, so the figure is a lower bound of vLLM's host work. The
whole ``schedule()`` / ``update_from_output()`` round would prefill the requests that join inside
the next timed ``schedule()`` (continuous batching), which moves every later draw by a round; the
KV manager lets the joiners' prefill run between rounds, untimed, as on specstate's side.
"""

from __future__ import annotations

import os
import sys

_JSON = None
if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peer_common

    _JSON = peer_common.json_stdout()

import import_stubs  # noqa: E402  (before anything imports vllm)
import peer_common  # noqa: E402
import torch  # noqa: E402

STUBBED = import_stubs.install()

import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from typing import Any  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("vllm").setLevel(logging.ERROR)

import vllm  # noqa: E402
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.request import Request  # noqa: E402

wl = peer_common.load_workload()

STEPS = 3  # EAGLE chain: 3 drafts a round, verify width 4
CONTEXT = 4096


class _Replay:
    """One (page, bs) run: vLLM's KV manager, its requests and the draws."""

    def __init__(self, page: int, bs: int, args: Any) -> None:
        self.page, self.bs = page, bs
        self.churn = args.workload == "churn"
        self.rounds = args.warmup + args.iters
        tokens = wl.kv_tokens(bs, page, self.rounds, churn=self.churn)
        spec = FullAttentionSpec(block_size=page, num_kv_heads=1, head_size=8, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=tokens // page + 1,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.kv = KVCacheManager(
            config,
            max_model_len=CONTEXT,
            scheduler_block_size=page,
            hash_block_size=page,
            enable_caching=False,  # no prefix caching, as on specstate's side
            use_eagle=True,
        )
        self.sched = types.SimpleNamespace(max_model_len=CONTEXT)  # what the accept loop reads
        self.launch_ns = int(args.launch_us * 1e3)
        self.draws = wl.Draws(bs)
        self.steady = wl.steady_accepts(bs, self.rounds) if not self.churn else []
        self.live: dict[str, tuple[Request, Any]] = {}
        self.sent: dict[str, int] = {}
        self.finished: list[tuple[int, int, int]] = []
        self.emitted = 0
        first = (
            [self.draws.next() for _ in range(bs)]
            if self.churn
            else [
                wl.Request(
                    index=i,
                    prompt_len=n,
                    length=wl.MAX_ACCEPT * self.rounds + 8,
                    by_eos=False,
                    accepts=[],
                )
                for i, n in enumerate(wl.steady_prompts(bs))
            ]
        )
        self._prefill(first)

    def _prefill(self, draws: list[Any]) -> None:
        """Untimed: each request as its prefill leaves it (prompt KV, output 0, drafts)."""
        for d in draws:
            params = SamplingParams(
                max_tokens=d.max_new_tokens if self.churn else d.length, temperature=0.0
            )
            params.update_from_generation_config({}, eos_token_id=wl.EOS)
            req = Request(f"r{d.index}", list(range(d.prompt_len)), params, None)
            blocks = self.kv.allocate_slots(req, d.prompt_len)
            assert blocks is not None, "KV pool too small"
            req.num_computed_tokens = d.prompt_len
            req.append_output_token_ids(wl.FILLER)
            self.live[req.request_id] = (req, d)
            self.sent[req.request_id] = 1

    def _draws(self, r: int) -> list[tuple[int, list[int]]]:
        """Untimed: this round's accept length and tokens of every running request."""
        if self.churn:
            return [d.next_run() for _, d in self.live.values()]
        runs = []
        for (_, d), a in zip(self.live.values(), self.steady[r], strict=True):
            d.emitted += a
            runs.append((a, [wl.FILLER] * wl.MAX_ACCEPT))
        return runs

    def round(self, r: int) -> tuple[int, int]:
        """One timed round: its wall and CPU time in ns (the forward not counted)."""
        kv, live = self.kv, list(self.live.values())
        drafts = [wl.FILLER] * STEPS
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        c0, t0 = cpu(), clock()
        allocated = False
        scheduled = []
        for req, _ in live:
            req.spec_token_ids = list(drafts)  # Scheduler.update_draft_token_ids
            n = req.num_tokens_with_spec - req.num_computed_tokens
            blocks = kv.allocate_slots(req, n, num_lookahead_tokens=STEPS)
            if blocks is None:
                raise RuntimeError(f"{req.request_id}: out of KV blocks")
            allocated |= any(blocks.blocks)
            req.num_computed_tokens += n
            scheduled.append(n)
        if allocated:
            peer_common.spin(self.launch_ns)  # the block-table upload
        t1, c1 = clock(), cpu()
        runs = self._draws(r)  # the forward: not timed
        c2, t2 = cpu(), clock()
        ended = []
        sent = 0
        for (req, _), n, (accept, tokens) in zip(live, scheduled, runs, strict=True):
            req.num_computed_tokens -= n - accept  # the rejected drafts
            req.spec_token_ids = []
            _, stopped = Scheduler._update_request_with_output(self.sched, req, tokens[:accept])
            if stopped:
                kv.free(req)
                ended.append(req)
        for req, _ in live:  # what a streaming server reads
            out = req.output_token_ids
            k = self.sent[req.request_id]
            sent += len(out) - k
            self.sent[req.request_id] = len(out)
        t3, c3 = clock(), cpu()
        self.emitted += sent
        for req in ended:
            _, d = self.live.pop(req.request_id)
            self.finished.append((r, d.index, req.num_output_tokens))
        if ended:  # untimed: the joiners' prefill; they decode from the next round
            self._prefill([self.draws.next() for _ in ended])
        return (t1 - t0) + (t3 - t2), (c1 - c0) + (c3 - c2)

    def check(self) -> None:
        """Untimed: every finish is where the draws put it; the survivors are where they are."""
        by_index = {d.index: d for d in self.draws.requests}
        for _, index, emitted in self.finished:
            if emitted != by_index[index].length:
                raise AssertionError(
                    f"request r{index}: {emitted} outputs, drawn {by_index[index]}"
                )
        for req, d in self.live.values():
            if req.is_finished() or req.num_output_tokens != d.emitted:
                raise AssertionError(f"{req.request_id}: {req.num_output_tokens} outputs, {d}")
            if req.num_computed_tokens != d.prompt_len + d.emitted - 1:
                raise AssertionError(f"{req.request_id}: computed {req.num_computed_tokens}")


def main() -> None:
    args = peer_common.parser(__doc__.split("\n\n")[0]).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    allocator_set = peer_common.set_allocator(
        args.malloc_mmap_threshold, args.malloc_trim_threshold
    )
    torch.set_num_threads(1)
    results = peer_common.sweep(args, "vllm", _Replay, wl.digest)
    timed = (
        "vLLM's KV manager (allocate_slots with the EAGLE lookahead, free) and accept "
        "bookkeeping (_update_request_with_output), drafts set, the streaming read; "
        "a lower bound of its scheduler round"
    )
    report = {
        "peer": "vllm",
        "version": vllm.__version__,
        "torch": torch.__version__,
        "config": {**peer_common.settings(args, allocator_set, timed), "stubbed": STUBBED},
        "results": results,
    }
    assert _JSON is not None
    _JSON.write(json.dumps(report, indent=2) + "\n")
    _JSON.flush()


if __name__ == "__main__":
    main()
