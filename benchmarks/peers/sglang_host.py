"""SGLang 0.5.23's host work per speculative decode round, on ``specstate bench host``'s workload.

Run it with the interpreter of the environment ``setup_sglang.sh`` builds; it prints one JSON
report on stdout (the shape ``specstate bench host --json`` prints, so ``specstate bench compare``
reads both) and its progress on stderr.

One timed sample is one decode round, made of SGLang's own functions on SGLang's own objects,
in the order of a round that is settled before the next one is scheduled (as specstate's normal
loop, which ``specstate bench host`` times):

1. the running batch (`Scheduler.update_running_batch` without retraction):
   ``filter_batch()`` drops the requests that finished, ``merge_batch()`` adds the batch of
   requests prefilled since the last round (`Scheduler.get_next_batch_to_run`),
   ``check_decode_mem()``, ``prepare_for_decode()`` (the EAGLE reservation, R = 2L);
2. the launch (`Scheduler.run_batch`): ``FutureMap.resolve_seq_lens_cpu``,
   ``resolve_forward_inputs``, ``Scheduler._forward_isolation`` around the forward, in which the
   worker's ``on_publish`` is ``FutureMap.publish`` and the scheduler stashes the next round's
   inputs (``RelayPayload.from_draft_input`` + ``FutureMap.stash``, as
   `Scheduler._relay_forward_payload`), then the recommit of ``spec_info``;
3. the result (the core of `process_batch_result_decode`): ``free_group_begin()``,
   ``_resolve_spec_v2_tokens``, then per request ``output_ids.extend(run)`` and
   ``update_finish_state(len(run))``, and for a request that finished
   ``release_kv_cache(req, tree_cache, checkpoint=False)`` (no prefix caching, as on specstate's
   side); ``free_group_end()``;
4. what a streaming server reads: each request's new tokens since the previous round.

Not timed: the forward itself (it adds the drawn accept lengths and returns the drawn tokens),
and the prefill of the requests that join (between rounds; they then wait, prefilled, for the
``merge_batch`` of the next round).

Device work is modelled as on specstate's side: SGLang's Triton kernels (the
``req_to_token`` assignment, the relay's fused gather, and at page 16 the paged allocation and
``get_last_loc``, for which SGLang runs its own torch fallbacks on a CPU) each still do their
work, but their time is taken out of the sample and replaced by a ``--launch-us`` spin, the cost
specstate's side pays for each of its ``req_to_token`` writes. Every other torch operation runs
on the CPU inside the timed region, on both sides.
"""

from __future__ import annotations

import os
import sys

_JSON = None
if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import peer_common

    _JSON = peer_common.json_stdout()
    os.environ.setdefault("SGLANG_IS_IN_CI", "0")  # production: no CI-only debug asserts

import import_stubs  # noqa: E402  (before anything imports sglang)
import peer_common  # noqa: E402
import torch  # noqa: E402

STUBBED = import_stubs.install()

import json  # noqa: E402
import logging  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from array import array  # noqa: E402
from typing import Any  # noqa: E402

warnings.filterwarnings("ignore")

import sglang  # noqa: E402
import sglang.srt.managers.overlap_utils as overlap_utils  # noqa: E402
import sglang.srt.mem_cache.allocation as allocation  # noqa: E402
import sglang.srt.mem_cache.allocator.paged as paged  # noqa: E402
from sglang.srt.disaggregation.utils import DisaggregationMode  # noqa: E402
from sglang.srt.managers.overlap_utils import RelayPayload, resolve_forward_inputs  # noqa: E402
from sglang.srt.managers.schedule_batch import Req, ScheduleBatch  # noqa: E402
from sglang.srt.managers.scheduler import Scheduler  # noqa: E402
from sglang.srt.managers.scheduler_components.batch_result_processor import (  # noqa: E402
    SchedulerBatchResultProcessor,
)
from sglang.srt.managers.scheduler_components.metrics_reporter import (  # noqa: E402
    SchedulerMetricsReporter,
)
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len  # noqa: E402
from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.common import release_kv_cache  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.radix_cache import RadixCache  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_context  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

wl = peer_common.load_workload()

STEPS, TOPK, DRAFT_TOKENS = 3, 1, 4
HIDDEN = 256
CONTEXT = 4096
PAYLOAD_SETS = 4
DEVICE = "cpu"

# ------------------------------------------------------------------ the device-write model
EXCLUDED = peer_common.Excluded()  # the stand-ins' own time, taken out of the sample
LAUNCH_NS = [5000]
LAUNCHES = [0]  # modelled launches in the current round


def _modelled(fn: Any) -> Any:
    """``fn`` does the kernel's work untimed, then costs one launch."""

    def launch(*args: Any, **kwargs: Any) -> Any:
        out = EXCLUDED.run(fn, *args, **kwargs)
        LAUNCHES[0] += 1
        peer_common.spin(LAUNCH_NS[0])
        return out

    launch.__wrapped__ = fn  # type: ignore[attr-defined]
    return launch


def _assign(req_pool_indices, req_to_token, start, end, out_cache_loc, pool_len, bs_upper):  # type: ignore[no-untyped-def]
    """The effect of SGLang's ``assign_req_to_token_pool`` kernel: row ``i``, columns
    ``[start_i, end_i)``, takes the next ``end_i - start_i`` slots, in row order."""
    lens = end - start
    owner = torch.repeat_interleave(lens)
    cols = torch.arange(out_cache_loc.numel()) + (start - (torch.cumsum(lens, 0) - lens))[owner]
    req_to_token[req_pool_indices[owner], cols] = out_cache_loc.to(req_to_token.dtype)


def _gather(indices, topk_p, topk_index, tokens, hidden):  # type: ignore[no-untyped-def]
    """The effect of SGLang's fused ``gather_spec_extras`` kernel."""
    return (
        topk_p[indices],
        topk_index[indices],
        tokens[indices],
        None if hidden is None else hidden[indices],
    )


class _Kernel:
    """``kernel[grid](*args)`` runs the modelled launch."""

    def __init__(self, fn: Any) -> None:
        self._fn = _modelled(fn)

    def __getitem__(self, grid: Any) -> Any:
        return self._fn


def install_device_model(launch_us: float) -> None:
    """Every Triton kernel of the round: its effect untimed, plus one modelled launch."""
    LAUNCH_NS[0] = int(launch_us * 1e3)
    allocation.assign_req_to_token_pool = _Kernel(_assign)
    overlap_utils.gather_spec_extras = _modelled(_gather)
    # Page 16: SGLang's torch fallbacks of its alloc_extend and get_last_loc kernels.
    paged.alloc_extend_naive = _modelled(paged.alloc_extend_naive)
    allocation.get_last_loc_torch = _modelled(allocation.get_last_loc_torch)


# ------------------------------------------------------------------- SGLang's collaborators
class _ModelConfig:
    vocab_size = wl.VOCAB
    is_encoder_decoder = False


class _NonAdaptiveWorker:
    on_verify_complete_cpu = BaseSpecWorker.on_verify_complete_cpu  # SGLang's own no-op


def _processor(allocator: Any, tree: Any, r2t: Any) -> SchedulerBatchResultProcessor:
    reporter = object.__new__(SchedulerMetricsReporter)  # reads only scheduler.enable_fpm
    reporter.scheduler = types.SimpleNamespace(enable_fpm=False)
    none = dict.fromkeys(
        (
            "hisparse_coordinator",
            "decode_offload_manager",
            "metrics_collector",
            "draft_worker",
            "logprob_result_processor",
            "output_streamer",
            "beam_coordinator",
            "abort_request",
        )
    )
    return SchedulerBatchResultProcessor(
        is_generation=True,
        disaggregation_mode=DisaggregationMode.NULL,
        enable_overlap=True,
        enable_overlap_mlx=False,
        model_config=_ModelConfig(),
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree,
        req_to_token_pool=r2t,
        metrics_reporter=reporter,
        model_worker=_NonAdaptiveWorker(),
        **none,
    )


def _isolation_host() -> Any:
    """What `Scheduler._forward_isolation` reads from the scheduler: its keep-alive ring."""
    host = types.SimpleNamespace(batch_record_ct=0, batch_record_buf=[None, None])
    host.record_batch_in_overlap = lambda batch: Scheduler.record_batch_in_overlap(host, batch)
    return host


def _server_args(page: int) -> None:
    get_context().set_server_args(
        ServerArgs(
            model_path="unused",
            device=DEVICE,
            speculative_algorithm="EAGLE",
            speculative_draft_model_path="unused",
            speculative_num_steps=STEPS,
            speculative_eagle_topk=TOPK,
            speculative_num_draft_tokens=DRAFT_TOKENS,
            page_size=page,
            attention_backend="torch_native",  # get_last_loc takes SGLang's torch path
        )
    )


# --------------------------------------------------------------------------- one run
class _Replay:
    """One (page, bs) run: SGLang's pools, allocator, relay and processor, and the draws."""

    def __init__(self, page: int, bs: int, args: Any) -> None:
        _server_args(page)
        self.page, self.bs = page, bs
        self.churn = args.workload == "churn"
        self.rounds = args.warmup + args.iters
        tokens = wl.kv_tokens(bs, page, self.rounds, churn=self.churn)
        kv = MHATokenToKVPool(
            size=tokens,
            page_size=page,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=8,
            layer_num=1,
            device=DEVICE,
            enable_memory_saver=False,
        )
        width = CONTEXT + get_req_to_token_extra_context_len()
        self.r2t = ReqToTokenPool(
            size=2 * bs + 2, max_context_len=width, device=DEVICE, enable_memory_saver=False
        )
        common = {
            "size": tokens,
            "dtype": torch.bfloat16,
            "device": DEVICE,
            "kvcache": kv,
            "need_sort": False,
        }
        self.allocator = (
            TokenToKVPoolAllocator(**common)
            if page == 1
            else PagedTokenToKVPoolAllocator(page_size=page, **common)
        )
        self.tree = RadixCache(
            CacheInitParams(
                disable=True,  # no prefix caching, as on specstate's side
                req_to_token_pool=self.r2t,
                token_to_kv_pool_allocator=self.allocator,
                page_size=page,
                is_eagle=True,
            )
        )
        self.fm = SpeculativeAlgorithm.EAGLE.create_future_map(torch.device(DEVICE), self.r2t)
        self.proc = _processor(self.allocator, self.tree, self.r2t)
        self.iso = _isolation_host()
        gen = torch.Generator().manual_seed(9012)
        self.payloads = [
            {
                "bonus_tokens": torch.full((bs,), wl.FILLER, dtype=torch.int64),
                "topk_p": torch.rand((bs, TOPK), generator=gen),
                "topk_index": torch.randint(0, wl.VOCAB - 1, (bs, TOPK), generator=gen),
                "hidden_states": torch.randn((bs, HIDDEN), generator=gen).to(torch.bfloat16),
            }
            for _ in range(PAYLOAD_SETS)
        ]
        self.draws = wl.Draws(bs)
        self.steady = wl.steady_accepts(bs, self.rounds) if not self.churn else []
        self.live: dict[Req, Any] = {}
        self.finished: list[tuple[int, int, int]] = []
        self.emitted = 0
        self.batch = self._prefill(self._first())
        self.joiners: ScheduleBatch | None = None

    def _first(self) -> list[Any]:
        if self.churn:
            return [self.draws.next() for _ in range(self.bs)]
        cap = wl.MAX_ACCEPT * self.rounds + 8  # never reached in the run
        return [
            wl.Request(index=i, prompt_len=n, length=cap, by_eos=False, accepts=[])
            for i, n in enumerate(wl.steady_prompts(self.bs))
        ]

    def _payload(self, n: int, k: int) -> EagleDraftInput:
        return EagleDraftInput(**{key: t[:n] for key, t in self.payloads[k % PAYLOAD_SETS].items()})

    def _prefill(self, draws: list[Any]) -> ScheduleBatch:
        """Untimed: requests as their prefill leaves them, and the relay it publishes."""
        reqs = []
        for d in draws:
            params = SamplingParams(max_new_tokens=d.max_new_tokens if self.churn else d.length)
            params.normalize(None)
            params.verify(wl.VOCAB)
            req = Req(
                rid=f"r{d.index}",
                origin_input_text="",
                origin_input_ids=array("q", range(d.prompt_len)),
                sampling_params=params,
                eos_token_ids={wl.EOS},
                vocab_size=wl.VOCAB,
            )
            reqs.append(req)
            self.live[req] = d
        rows = self.r2t.alloc(reqs)
        assert rows is not None, "req_to_token pool too small"
        for req, row, d in zip(reqs, rows, draws, strict=True):
            n = d.prompt_len
            locs = self.allocator.alloc(-(-n // self.page) * self.page)
            assert locs is not None, "KV pool too small"
            self.r2t.write((row, slice(0, n)), locs[:n].to(torch.int32))
            req.kv.kv_committed_len = req.kv.kv_allocated_len = n
            req.extend_batch_idx = 1
            req.output_ids.append(wl.FILLER)  # output 0, the prefill's token
            req.send_token_offset = 1
        batch = ScheduleBatch.init_new(
            reqs=reqs,
            req_to_token_pool=self.r2t,
            token_to_kv_pool_allocator=self.allocator,
            tree_cache=self.tree,
            model_config=_ModelConfig(),
            enable_overlap=True,
            spec_algorithm=SpeculativeAlgorithm.EAGLE,
        )
        batch.forward_mode = ForwardMode.DECODE
        index = torch.tensor(rows, dtype=torch.int64)
        batch.req_pool_indices, batch.req_pool_indices_cpu = index, index.clone()
        lens = torch.tensor([d.prompt_len for d in draws], dtype=torch.int64)
        batch.seq_lens, batch.seq_lens_cpu = lens, lens.clone()
        batch.orig_seq_lens = lens.to(torch.int32)
        batch.seq_lens_sum = int(lens.sum())
        batch.sampling_info = SamplingBatchInfo.from_schedule_batch(batch, wl.VOCAB)
        ndi = self._payload(len(reqs), len(self.finished))
        self.fm.publish(index, lens)
        self.fm.stash(index, RelayPayload.from_draft_input(ndi))
        ndi.future_indices = index
        batch.spec_info = ndi
        batch.input_ids = None
        return batch

    def _forward(self, r: int, seq_lens: torch.Tensor) -> GenerationBatchResult:
        """Untimed: the drawn accept lengths and tokens of every row, as a worker returns them."""
        reqs = self.batch.reqs
        accepts, tokens = [], []
        if self.churn:
            for req in reqs:
                a, run = self.live[req].next_run()
                accepts.append(a)
                tokens.extend(run)
        else:
            accepts = self.steady[r]
            tokens = [wl.FILLER] * (wl.MAX_ACCEPT * len(reqs))
            for req, a in zip(reqs, accepts, strict=True):
                self.live[req].emitted += a
        accept = torch.tensor(accepts, dtype=torch.int32)
        return GenerationBatchResult(
            next_token_ids=torch.tensor(tokens, dtype=torch.int64),
            accept_lens=accept,
            speculative_num_draft_tokens=DRAFT_TOKENS,
            new_seq_lens=seq_lens + accept,
            next_draft_input=self._payload(len(reqs), r),
        )

    def round(self, r: int) -> tuple[int, int]:
        """One timed decode round: its wall and CPU time in ns, device work as modelled."""
        batch, fm = self.batch, self.fm
        EXCLUDED.reset()
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        c0 = cpu()
        t0 = clock()
        # -- the running batch (Scheduler.update_running_batch, get_next_batch_to_run)
        batch.filter_batch()
        if self.joiners is not None:
            batch.merge_batch(self.joiners)
            self.joiners = None
        batch.check_decode_mem()
        batch.prepare_for_decode()
        # -- the launch (Scheduler.run_batch)
        fm.resolve_seq_lens_cpu(batch)
        resolve_forward_inputs(batch, fm)
        with Scheduler._forward_isolation(self.iso, batch, overlap=True):
            future_indices = batch.req_pool_indices
            t1 = clock()
            c1 = cpu()
            result = self._forward(r, batch.seq_lens)  # not timed
            c2 = cpu()
            t2 = clock()
            fm.publish(future_indices, result.new_seq_lens)  # the worker's on_publish
            fm.stash(future_indices, RelayPayload.from_draft_input(result.next_draft_input))
        batch.input_ids = None
        batch.spec_info = result.next_draft_input
        batch.spec_info.future_indices = future_indices
        # -- the result (process_batch_result_decode)
        allocator = self.allocator
        allocator.free_group_begin()
        runs = self.proc._resolve_spec_v2_tokens(result, batch)
        ended = []
        for req, run in zip(batch.reqs, runs, strict=True):
            if req.finished() or req.is_retracted:
                continue
            req.output_ids.extend(run)
            req.update_finish_state(len(run))
            if req.finished():
                release_kv_cache(req, self.tree, checkpoint=False)
                ended.append(req)
        allocator.free_group_end()
        # -- what a streaming server reads: each request's new tokens
        sent = 0
        for req in batch.reqs:
            new = req.output_ids[req.send_token_offset : req.finished_len]
            req.send_token_offset += len(new)
            sent += len(new)
        t3 = clock()
        c3 = cpu()
        self.emitted += sent
        for req in ended:
            d = self.live.pop(req)
            self.finished.append((r, d.index, len(req.output_ids[: req.finished_len])))
        if ended:  # untimed: the joiners' prefill; they join the next round
            self.joiners = self._prefill([self.draws.next() for _ in ended])
        wall = (t1 - t0) + (t3 - t2) - EXCLUDED.ns
        return wall, (c1 - c0) + (c3 - c2) - EXCLUDED.cpu_ns

    def check(self) -> None:
        """Untimed: every finish is where the draws put it; the pools balance."""
        by_index = {d.index: d for d in self.draws.requests}
        for _, index, emitted in self.finished:
            d = by_index[index]
            if emitted != d.length:
                raise AssertionError(f"request r{index}: emitted {emitted}, drawn {d}")
        for req, d in self.live.items():
            outputs = len(req.output_ids)
            if req.finished() or outputs != d.emitted:
                raise AssertionError(f"{req.rid}: {outputs} outputs, drawn {d.emitted}")
            if req.kv.kv_committed_len != d.prompt_len + outputs - 1:
                raise AssertionError(f"{req.rid}: committed {req.kv.kv_committed_len}")


def main() -> None:
    args = peer_common.parser(__doc__.split("\n\n")[0]).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    logging.getLogger("sglang").setLevel(logging.WARNING)
    allocator_set = peer_common.set_allocator(
        args.malloc_mmap_threshold, args.malloc_trim_threshold
    )
    torch.set_num_threads(1)
    install_device_model(args.launch_us)
    results = peer_common.sweep(args, "sglang", _Replay, wl.digest)
    timed = (
        "SGLang's running-batch update, launch-side relay and isolation, result processing, "
        "release of finished requests and the streaming read (normal-loop order)"
    )
    report = {
        "peer": "sglang",
        "version": sglang.__version__,
        "torch": torch.__version__,
        "config": {**peer_common.settings(args, allocator_set, timed), "stubbed": STUBBED},
        "results": results,
    }
    assert _JSON is not None
    _JSON.write(json.dumps(report, indent=2) + "\n")
    _JSON.flush()


if __name__ == "__main__":
    main()
