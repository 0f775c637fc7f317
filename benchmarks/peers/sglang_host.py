"""SGLang 0.5.23's whole host round per speculative decode round, on `specstate bench host`'s draws.

Run it with the interpreter of the environment ``setup_sglang.sh`` builds; it prints one JSON
report on stdout (the shape ``specstate bench host --json`` prints, so ``specstate bench compare``
reads both) and its progress on stderr.

One timed sample is one iteration of `Scheduler.event_loop_overlap` for a decode batch, made of
SGLang's own functions on SGLang's own objects, in its own order (the result of forward N is
processed after forward N+1 is launched):

1. the next batch (the decode lines of `Scheduler.get_next_batch_to_run`): the prefill batch
   of the requests that joined is filtered and merged (``filter_batch``, ``merge_batch``), the
   running batch filtered (``filter_batch()``, every step), then
   ``Scheduler.update_running_batch`` itself: the in-flight-finish scan
   (``_reqs_finishing_inflight`` over the queued batch), the second ``filter_batch``,
   ``check_decode_mem``, the new-token-ratio decay and ``prepare_for_decode`` (the EAGLE
   reservation, R = 2L);
2. the launch (the spec-v2 path of `Scheduler.run_batch`): ``FutureMap.resolve_seq_lens_cpu``,
   ``resolve_forward_inputs``, ``Scheduler._forward_isolation`` around the forward, in which
   the worker's ``on_publish`` is ``FutureMap.publish`` and ``Scheduler._relay_forward_payload``
   stashes the next round's inputs, then ``copy_to_cpu`` of the result and the recommit of
   ``spec_info``; ``batch.copy()`` into the result queue;
3. the previous result: ``process_batch_result_decode`` whole (metrics off): the resolve of the
   spec-v2 tokens, per request ``time_stats``, ``output_ids.extend``, the reasoning-token check,
   ``update_finish_state``, ``_handle_finish_state_updated_req`` (for a request that finished,
   ``release_kv_cache(req, tree_cache, checkpoint=True)``), ``stream_output`` and the free
   group, on the tree cache 0.5.23 builds for a server without prefix caching
   (``create_tree_cache`` -> ``UnifiedRadixCache``, disabled).

Each round gives two figures. **Bookkeeping**: the output message is replaced by the minimal
read a streaming server needs (each request's new tokens; the time of the real
``stream_output`` is taken out and the read's put in). **Bookkeeping + output hand-off**: the
real ``stream_output`` (a ``BatchTokenIDOutput`` of every streaming request, sent with
``send_pyobj``: pickled; the socket itself is a sink that pickles and drops).

Not timed: the forward itself (it adds the drawn accept lengths and returns the drawn tokens),
and the prefill of the requests that join (between rounds; they then wait, prefilled, for the
merge of the next round). Every tensor operation in the timed parts is counted (`peer_common`)
and charged one ``--launch-us``; SGLang's Triton kernels (the ``req_to_token`` assignment, the
relay's fused gather, and at page 16 the paged allocation and ``get_last_loc``, for which SGLang
runs its own torch fallbacks on a CPU) do their work untimed and count as one operation each.
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
import pickle  # noqa: E402
import time  # noqa: E402
import types  # noqa: E402
import warnings  # noqa: E402
from array import array  # noqa: E402
from collections import deque  # noqa: E402
from typing import Any  # noqa: E402

warnings.filterwarnings("ignore")

import sglang  # noqa: E402
import sglang.srt.managers.overlap_utils as overlap_utils  # noqa: E402
import sglang.srt.mem_cache.allocation as allocation  # noqa: E402
import sglang.srt.mem_cache.allocator.paged as paged  # noqa: E402
from sglang.srt.beam_search.coordinator import BeamCoordinator  # noqa: E402
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
from sglang.srt.managers.scheduler_components.new_token_ratio_tracker import (  # noqa: E402
    NewTokenRatioTracker,
)
from sglang.srt.managers.scheduler_components.output_sender import SenderWrapper  # noqa: E402
from sglang.srt.managers.scheduler_components.output_streamer import (  # noqa: E402
    SchedulerOutputStreamer,
)
from sglang.srt.managers.utils import GenerationBatchResult  # noqa: E402
from sglang.srt.mem_cache.allocation_sizing import get_req_to_token_extra_context_len  # noqa: E402
from sglang.srt.mem_cache.allocator import (  # noqa: E402
    PagedTokenToKVPoolAllocator,
    TokenToKVPoolAllocator,
)
from sglang.srt.mem_cache.cache_init_params import CacheInitParams  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool  # noqa: E402
from sglang.srt.mem_cache.registry import TreeCacheBuildContext, create_tree_cache  # noqa: E402
from sglang.srt.model_executor.forward_batch_info import ForwardMode  # noqa: E402
from sglang.srt.runtime_context import get_context, get_parallel  # noqa: E402
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo  # noqa: E402
from sglang.srt.sampling.sampling_params import SamplingParams  # noqa: E402
from sglang.srt.server_args import ServerArgs  # noqa: E402
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker  # noqa: E402
from sglang.srt.speculative.eagle_info import EagleDraftInput  # noqa: E402
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm  # noqa: E402

wl = peer_common.WORKLOAD

STEPS, TOPK, DRAFT_TOKENS = 3, 1, 4
HIDDEN = 256
CONTEXT = 4096
PAYLOAD_SETS = 4
DEVICE = "cpu"

# ------------------------------------------------------------------ the device model
EXCLUDED = peer_common.Excluded()  # the stand-ins' own time, taken out of the sample


def _modelled(fn: Any) -> Any:
    """``fn`` does the kernel's work untimed; it counts as one operation."""

    def launch(*args: Any, **kwargs: Any) -> Any:
        return EXCLUDED.run(peer_common.COUNTER.kernel, 1, lambda: fn(*args, **kwargs))

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
    """``kernel[grid](*args)`` runs the modelled kernel."""

    def __init__(self, fn: Any) -> None:
        self._fn = _modelled(fn)

    def __getitem__(self, grid: Any) -> Any:
        return self._fn


def install_device_model() -> None:
    """Every Triton kernel of the round: its effect untimed, one counted operation."""
    allocation.assign_req_to_token_pool = _Kernel(_assign)
    overlap_utils.gather_spec_extras = _modelled(_gather)
    # Page 16: SGLang's torch fallbacks of its alloc_extend and get_last_loc kernels.
    paged.alloc_extend_naive = _modelled(paged.alloc_extend_naive)
    allocation.get_last_loc_torch = _modelled(allocation.get_last_loc_torch)


# ------------------------------------------------------------------- SGLang's collaborators
class _ModelConfig:
    vocab_size = wl.VOCAB
    is_encoder_decoder = False
    self_opened_think_start_ids = None  # not a reasoning model (_maybe_update_reasoning_tokens)
    think_end_ids = None


class _NonAdaptiveWorker:
    on_verify_complete_cpu = BaseSpecWorker.on_verify_complete_cpu  # SGLang's own no-op


class _PickleSink:
    """The detokenizer socket: ``send_pyobj`` pickles the message (as zmq does) and drops it."""

    def __init__(self) -> None:
        self.sent_bytes = 0

    def send_pyobj(self, obj: Any, flags: int = 0, protocol: int = pickle.HIGHEST_PROTOCOL) -> None:
        self.sent_bytes += len(pickle.dumps(obj, protocol))


class _TimedStreamer:
    """SGLang's `SchedulerOutputStreamer`, timed, with the minimal read timed beside it.

    The minimal read (what a streaming server needs: each request's new tokens, counted) runs
    first and changes nothing; then the real ``stream_output`` runs, which builds the
    ``BatchTokenIDOutput`` and pickles it (`_PickleSink`). The round's two figures swap one
    for the other (module docstring)."""

    def __init__(self, tree: Any) -> None:
        self.sink = _PickleSink()
        self.real = SchedulerOutputStreamer(
            send_to_detokenizer=SenderWrapper(self.sink),  # type: ignore[arg-type]
            tree_cache=tree,
            server_args=get_context().server_args,
            is_generation=True,
            spec_algorithm=SpeculativeAlgorithm.EAGLE,
            disaggregation_mode=DisaggregationMode.NULL,
            enable_hicache_storage=lambda: False,
        )
        self.read_ns = self.read_cpu_ns = self.real_ns = self.real_cpu_ns = 0
        self.sent = 0

    def stream_output(self, reqs: Any, return_logprob: bool, skip_req: Any = None) -> None:
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        c0, t0 = cpu(), clock()
        sent = 0
        for req in reqs:
            sent += len(req.output_ids[req.send_token_offset : req.finished_len])
        t1, c1 = clock(), cpu()
        self.real.stream_output(reqs, return_logprob, skip_req)
        t2, c2 = clock(), cpu()
        self.sent += sent
        self.read_ns += t1 - t0
        self.read_cpu_ns += c1 - c0
        self.real_ns += t2 - t1
        self.real_cpu_ns += c2 - c1

    def reset(self) -> None:
        self.read_ns = self.read_cpu_ns = self.real_ns = self.real_cpu_ns = 0


def _reporter() -> SchedulerMetricsReporter:
    """SGLang's metrics reporter with metrics off: the counters ``process_batch_result_decode``
    bumps, and ``report_decode_stats`` returning at once (no metrics, not the logging rank)."""
    reporter = object.__new__(SchedulerMetricsReporter)
    reporter.scheduler = types.SimpleNamespace(enable_fpm=False)
    reporter.num_generated_tokens = 0
    reporter.spec_num_accept_tokens = reporter.spec_num_correct_drafts = 0
    reporter.spec_num_forward_ct = reporter.spec_num_block_accept_tokens = 0
    reporter.spec_num_cap_tokens = 0
    reporter.forward_ct_decode = 0
    reporter.current_scheduler_metrics_enabled = False
    reporter.is_stats_logging_rank = False
    reporter.decode_log_interval = 40
    reporter.enable_mfu_metrics = False
    return reporter


def _processor(allocator: Any, tree: Any, r2t: Any, streamer: Any) -> SchedulerBatchResultProcessor:
    none = dict.fromkeys(
        (
            "hisparse_coordinator",
            "decode_offload_manager",
            "metrics_collector",
            "draft_worker",
            "logprob_result_processor",
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
        metrics_reporter=_reporter(),
        model_worker=_NonAdaptiveWorker(),
        output_streamer=streamer,
        **none,
    )


def _scheduler_host(fm: Any, allocator: Any, tree: Any, r2t: Any) -> Any:
    """What `Scheduler.update_running_batch`, `_reqs_finishing_inflight`, `_forward_isolation`
    and `_relay_forward_payload` read from the scheduler; they run as SGLang's own functions
    with this object as ``self``."""
    host = types.SimpleNamespace(
        enable_skip_finishing_decode=True,  # set by event_loop_overlap
        result_queue=deque(),
        new_token_ratio_tracker=NewTokenRatioTracker.from_config(),
        token_to_kv_pool_allocator=allocator,
        tree_cache=tree,
        decode_offload_manager=None,
        forward_ct=0,
        batch_record_ct=0,
        batch_record_buf=[None, None],
        spec_algorithm=SpeculativeAlgorithm.EAGLE,
        future_map=fm,
        beam_coordinator=BeamCoordinator(
            model_config=_ModelConfig(),  # type: ignore[arg-type]
            spec_algorithm=SpeculativeAlgorithm.EAGLE,
            dllm_enabled=False,
            max_req_len=CONTEXT,
            req_to_token_pool=r2t,
            token_to_kv_pool_allocator=allocator,
            tree_cache=tree,
            future_map=fm,
        ),
        chunked_req=None,
    )
    for name in ("_reqs_finishing_inflight", "record_batch_in_overlap"):
        setattr(host, name, getattr(Scheduler, name).__get__(host))
    return host


def _server_args(page: int) -> None:
    """The server's configuration, as a scheduler process of rank 0 (one replica) reads it."""
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
            disable_radix_cache=True,  # no prefix caching, as on specstate's side
        )
    )
    ranks = ("tp_rank", "pp_rank", "attn_tp_rank", "attn_dp_rank", "attn_cp_rank")
    get_parallel().override_permanently(dp_rank=None, **dict.fromkeys(ranks, 0))


def _tree_cache(r2t: Any, allocator: Any, page: int) -> Any:
    """The tree cache SGLang 0.5.23 builds for this server (`create_tree_cache`)."""
    return create_tree_cache(
        TreeCacheBuildContext(
            server_args=get_context().server_args,
            params=CacheInitParams(
                disable=True,
                req_to_token_pool=r2t,
                token_to_kv_pool_allocator=allocator,
                page_size=page,
                is_eagle=True,
            ),
            is_hybrid_swa=False,
            is_hybrid_ssm=False,
            enable_hierarchical_cache=False,
            disable_radix_cache=True,
            tp_worker=None,
            model_config=_ModelConfig(),  # type: ignore[arg-type]
            tp_size=1,
            tp_rank=0,
            tp_group=None,
        )
    )


# --------------------------------------------------------------------------- one run
class _Replay:
    """One (page, bs) run: SGLang's pools, allocator, tree cache, relay and processor, and the
    draws, driven in the overlap loop's order."""

    def __init__(self, page: int, bs: int, args: Any) -> None:
        _server_args(page)
        self.page, self.bs = page, bs
        self.churn = args.workload == "churn"
        self.rounds = args.warmup + args.iters
        tokens = wl.kv_tokens(bs, page, self.rounds + 1, churn=self.churn)
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
            size=3 * bs + 2, max_context_len=width, device=DEVICE, enable_memory_saver=False
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
        self.tree = _tree_cache(self.r2t, self.allocator, page)
        self.fm = SpeculativeAlgorithm.EAGLE.create_future_map(torch.device(DEVICE), self.r2t)
        self.streamer = _TimedStreamer(self.tree)
        self.proc = _processor(self.allocator, self.tree, self.r2t, self.streamer)
        self.host = _scheduler_host(self.fm, self.allocator, self.tree, self.r2t)
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
        self.running = self._prefill(self._first())
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
                stream=True,  # a streaming client: every round's tokens are sent
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

    def _forward(self, r: int, batch: ScheduleBatch) -> GenerationBatchResult:
        """Untimed: the drawn accept lengths and tokens of every row, as a worker returns them.

        A row whose request has already emitted all its drawn tokens (it finished in the
        forward before, whose result SGLang has not processed yet: the overlap loop's one extra
        row) accepts one filler token, which SGLang drops (the request is finished by then)."""
        accepts, tokens = [], []
        if self.churn:
            for req in batch.reqs:
                d = self.live[req]
                a, run = d.next_run() if d.emitted < d.length else (1, [wl.FILLER] * 4)
                accepts.append(a)
                tokens.extend(run)
        else:
            accepts = self.steady[r]
            tokens = [wl.FILLER] * (wl.MAX_ACCEPT * len(batch.reqs))
            for req, a in zip(batch.reqs, accepts, strict=True):
                self.live[req].emitted += a
        accept = torch.tensor(accepts, dtype=torch.int32)
        return GenerationBatchResult(
            next_token_ids=torch.tensor(tokens, dtype=torch.int64),
            accept_lens=accept,
            speculative_num_draft_tokens=DRAFT_TOKENS,
            new_seq_lens=batch.seq_lens + accept,
            next_draft_input=self._payload(len(batch.reqs), r),
        )

    def _next_batch(self) -> ScheduleBatch:
        """The decode lines of `Scheduler.get_next_batch_to_run` (timed)."""
        running = self.running
        if self.joiners is not None:  # last_batch was the joiners' prefill (extend)
            self.joiners.filter_batch(reqs_to_exclude=[])
            if not self.joiners.is_empty():
                running.merge_batch(self.joiners)
            self.joiners = None
        running.filter_batch()
        batch = Scheduler.update_running_batch(self.host, running)
        assert batch is running and not batch.is_empty(), "the harness never retracts"
        return batch

    def _launch(self, r: int, batch: ScheduleBatch) -> tuple[int, int]:
        """The spec-v2 launch of `Scheduler.run_batch` (timed, but the forward: its wall and
        CPU ns are returned)."""
        fm, host = self.fm, self.host
        host.forward_ct += 1
        batch.forward_iter = host.forward_ct
        batch.launch_ts = time.monotonic()
        fm.resolve_seq_lens_cpu(batch)
        resolve_forward_inputs(batch, fm)
        with Scheduler._forward_isolation(host, batch, overlap=True):
            future_indices = batch.req_pool_indices
            peer_common.COUNTER.enabled = False
            c1, t1 = time.thread_time_ns(), time.perf_counter_ns()
            result = self._forward(r, batch)  # not timed
            t2, c2 = time.perf_counter_ns(), time.thread_time_ns()
            peer_common.COUNTER.enabled = True
            fm.publish(future_indices, result.new_seq_lens)  # the worker's on_publish
            result.copy_done = torch.cpu.Event()
            Scheduler._relay_forward_payload(host, batch, future_indices, result)
            result.copy_to_cpu(return_logprob=False, return_hidden_states=False)
        batch.input_ids = None
        batch.spec_info = result.next_draft_input
        batch.spec_info.future_dsa_topk_indices_available = False
        batch.spec_info.future_indices = future_indices
        host.result_queue.append((batch.copy(), result))
        return t2 - t1, c2 - c1

    def _process(self, r: int) -> list[Req]:
        """``process_batch_result_decode`` of the previous round's result (timed); the
        requests it finished."""
        done_batch, result = self.host.result_queue.popleft()
        was_live = [req for req in done_batch.reqs if not req.finished()]
        self.proc.process_batch_result_decode(done_batch, result)
        return [req for req in was_live if req.finished()]

    def round(self, r: int) -> tuple[int, int, int, int]:
        """One timed iteration: wall and CPU ns of its bookkeeping, then of bookkeeping with
        the output hand-off (module docstring); device work as modelled."""
        EXCLUDED.reset()
        self.streamer.reset()
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        c0, t0 = cpu(), clock()
        peer_common.COUNTER.enabled = True
        batch = self._next_batch()
        forward_ns, forward_cpu_ns = self._launch(r, batch)
        ended = self._process(r) if len(self.host.result_queue) > 1 else []
        peer_common.COUNTER.enabled = False
        t1, c1 = clock(), cpu()
        self._settle_untimed(r - 1, ended)
        st = self.streamer
        wall = t1 - t0 - forward_ns - EXCLUDED.ns
        cpu_ns = c1 - c0 - forward_cpu_ns - EXCLUDED.cpu_ns
        return (
            wall - st.real_ns,
            cpu_ns - st.real_cpu_ns,
            wall - st.read_ns,
            cpu_ns - st.read_cpu_ns,
        )

    def _settle_untimed(self, forward: int, ended: list[Req]) -> None:
        """Untimed: record the finishes of forward ``forward``; prefill as many joiners (they
        are merged in the next round, as SGLang merges its last prefill batch)."""
        self.emitted += self.streamer.sent
        self.streamer.sent = 0
        for req in ended:
            d = self.live.pop(req)
            self.finished.append((forward, d.index, len(req.output_ids[: req.finished_len])))
        if ended and self.churn:
            self.joiners = self._prefill([self.draws.next() for _ in ended])

    def check(self) -> None:
        """Untimed: process the last result, then: every finish is where the draws put it; the
        survivors are where they are."""
        if self.host.result_queue:
            self.streamer.reset()
            self._settle_untimed(self.rounds - 1, self._process(self.rounds))
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
    install_device_model()
    results = peer_common.sweep(args, "sglang", _Replay, wl.digest)
    timed = (
        "SGLang's overlap-loop iteration: next batch (filter, merge, update_running_batch with "
        "the in-flight-finish scan), the spec-v2 launch (relay, isolation, batch.copy()), "
        "process_batch_result_decode whole (metrics off, release_kv_cache checkpoint=True) "
        "with the minimal read for stream_output; handoff_total_us: with stream_output and "
        "its pickle"
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
