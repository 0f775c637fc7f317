"""vLLM 0.33's scheduler round per speculative decode round, on ``specstate bench host``'s draws.

Run it with the interpreter of the environment ``setup_vllm.sh`` builds; it prints one JSON
report on stdout (the shape ``specstate bench host --json`` prints) and its progress on stderr.

What one timed sample is: one `EngineCore.step` + ``post_step`` of vLLM's synchronous
engine core, the model executor left out, on vLLM's own objects: a `Scheduler` built from a CPU
`VllmConfig` (a local Llama config with an EAGLE draft config, 3 speculative tokens, block size
16, prefix caching off, chunked prefill on) over a one-group `KVCacheConfig`:

1. ``Scheduler.schedule()`` whole (running requests: ``allocate_slots`` with the EAGLE
   lookahead, ``_make_cached_request_data``, the `SchedulerOutput`, ``_update_after_schedule``;
   waiting requests, i.e. the requests that joined: their prefill, inside the same call) and
   ``get_grammar_bitmask`` (no structured output: it returns at once);
2. -- the model executor (not timed): the drawn accepted run of every decoding request, the
   first token of every prefilled one, as a `ModelRunnerOutput` --
3. ``Scheduler.update_from_output()`` whole (``make_spec_decoding_stats``, the rejected drafts
   taken back, ``_update_request_with_output`` with ``check_stop`` per token, the free of a
   request that stopped, the `EngineCoreOutputs`);
4. ``Scheduler.update_draft_token_ids()`` with 3 drafts per request (``post_step``);
5. what a streaming server reads: the new tokens of every `EngineCoreOutput`, counted.

The second figure (``handoff_total_us``) adds the output hand-off: the `EngineCoreOutputs`
encoded with vLLM's ``MsgpackEncoder`` (which its engine core's output thread runs).

vLLM joins requests its own way: a request that joins is added between rounds (untimed), and
its prefill is scheduled inside the next timed ``schedule()``, beside the decodes; it decodes
from the round after. So a joiner starts one round later than on specstate's side (which
prefills between rounds, untimed), every later generation shifts, and the runs' `digest`
differs; the first cohort (`cohort_digest`) and every request's own tokens and finish agree.

Not timed, or absent: the model executor's CPU side (`GPUModelRunner._update_states`,
`InputBatch` add / remove / condense, the block tables, ``_prepare_inputs``), which this
harness does not drive (see docs/benchmarks.md); the engine core's request intake and abort
queue. Every tensor operation in the timed parts is counted (`peer_common`; the scheduler's
are few: it is Python over request objects) and charged one ``--launch-us``.
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

import functools  # noqa: E402
import json  # noqa: E402
import logging  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
import warnings  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

warnings.filterwarnings("ignore")
logging.getLogger("vllm").setLevel(logging.ERROR)

import vllm  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    VllmConfig,
)
from vllm.sampling_params import SamplingParams  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import DraftTokenIds, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.serial_utils import MsgpackEncoder  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

wl = peer_common.WORKLOAD

STEPS = 3  # EAGLE chain: 3 drafts a round, verify width 4
CONTEXT = 4096
BLOCK = 16
_LLAMA = {
    "model_type": "llama",
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "num_hidden_layers": 1,
    "vocab_size": wl.VOCAB,
    "max_position_embeddings": CONTEXT,
    "torch_dtype": "bfloat16",
    "eos_token_id": wl.EOS,
    "bos_token_id": 1,
    "rms_norm_eps": 1e-5,
}
"""A tiny Llama config: the scheduler reads the model's shape, never its weights."""


@functools.cache
def _model_dirs() -> tuple[str, str]:
    """Two local model folders (target and EAGLE draft), each only a ``config.json``; made once
    per process."""
    root = Path(tempfile.mkdtemp(prefix="vllm-host-"))
    for name, arch in (("target", "LlamaForCausalLM"), ("draft", "EagleLlamaForCausalLM")):
        (root / name).mkdir()
        config = {**_LLAMA, "architectures": [arch]}
        (root / name / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return str(root / "target"), str(root / "draft")


def _vllm_config(bs: int, page: int) -> VllmConfig:
    """vLLM's configuration of a server for this run, on the CPU."""
    target, draft = _model_dirs()
    model = ModelConfig(
        model=target, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=CONTEXT
    )
    spec = SpeculativeConfig(
        method="eagle",
        model=draft,
        num_speculative_tokens=STEPS,
        target_model_config=model,
        target_parallel_config=ParallelConfig(),
    )
    scheduler = SchedulerConfig(
        max_num_seqs=bs,
        # room for every decode and for the prefills of a round's joiners in one step
        max_num_batched_tokens=bs * (wl.MAX_ACCEPT + wl.PROMPT_RANGE[1]),
        max_model_len=CONTEXT,
        enable_chunked_prefill=True,
        is_encoder_decoder=False,
        async_scheduling=False,
    )
    cache = CacheConfig(block_size=page, enable_prefix_caching=False)
    return VllmConfig(
        model_config=model,
        scheduler_config=scheduler,
        cache_config=cache,
        speculative_config=spec,
        device_config=DeviceConfig(device="cpu"),
    )


class _Replay:
    """One (page, bs) run: vLLM's scheduler, its requests and the draws."""

    def __init__(self, page: int, bs: int, args: Any) -> None:
        self.page, self.bs = page, bs
        self.churn = args.workload == "churn"
        self.rounds = args.warmup + args.iters
        config = _vllm_config(bs, page)
        blocks = wl.kv_tokens(bs, page, self.rounds, churn=self.churn) // page + 1
        spec = FullAttentionSpec(block_size=page, num_kv_heads=1, head_size=8, dtype=torch.float32)
        kv_config = KVCacheConfig(
            num_blocks=blocks,
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        config.cache_config.num_gpu_blocks = blocks
        self.sched = Scheduler(
            vllm_config=config,
            kv_cache_config=kv_config,
            structured_output_manager=StructuredOutputManager(config),
            block_size=page,
            log_stats=False,
        )
        self.encoder = MsgpackEncoder()
        self.draws = wl.Draws(bs)
        self.steady = wl.steady_accepts(bs, self.rounds) if not self.churn else []
        self.live: dict[str, tuple[Request, Any]] = {}
        self.joining: set[str] = set()
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
        self._add(first)
        self._step(-1)  # untimed: the first cohort's prefill, as on the other sides

    def _add(self, draws: list[Any]) -> None:
        """Untimed: submit requests (their prefill runs in the next ``schedule()``)."""
        for d in draws:
            params = SamplingParams(
                max_tokens=d.max_new_tokens if self.churn else d.length, temperature=0.0
            )
            params.update_from_generation_config({}, eos_token_id=wl.EOS)
            req = Request(f"r{d.index}", list(range(d.prompt_len)), params, None)
            self.sched.add_request(req)
            self.live[req.request_id] = (req, d)
            self.joining.add(req.request_id)

    def _model_output(self, r: int, so: Any) -> ModelRunnerOutput:
        """Untimed: what the model executor returns: the first token of a prefilled request,
        the drawn accepted run of a decoding one."""
        req_ids = list(so.num_scheduled_tokens)
        sampled = []
        steady = iter(self.steady[r]) if not self.churn and r >= 0 else None
        for rid in req_ids:
            _, d = self.live[rid]
            if rid in self.joining:
                sampled.append([wl.FILLER])
            elif steady is not None:
                a = next(steady)
                d.emitted += a
                sampled.append([wl.FILLER] * a)
            else:
                a, tokens = d.next_run()
                sampled.append(tokens[:a])
        self.joining.difference_update(req_ids)
        return ModelRunnerOutput(
            req_ids=req_ids,
            req_id_to_index={rid: i for i, rid in enumerate(req_ids)},
            sampled_token_ids=sampled,
        )

    def _step(self, r: int) -> tuple[int, int, int, int]:
        """One engine-core step; its timed wall and CPU ns, the model executor left out, and
        the wall ns of the hand-off; the round's finishes are recorded untimed."""
        sched = self.sched
        clock, cpu = time.perf_counter_ns, time.thread_time_ns
        c0, t0 = cpu(), clock()
        peer_common.COUNTER.enabled = True
        so = sched.schedule()
        sched.get_grammar_bitmask(so)
        peer_common.COUNTER.enabled = False
        c1, t1 = cpu(), clock()
        mro = self._model_output(r, so)  # the model executor: not timed
        c2, t2 = cpu(), clock()
        peer_common.COUNTER.enabled = True
        outputs = sched.update_from_output(so, mro)
        req_ids = mro.req_ids
        drafts = [[wl.FILLER] * STEPS for _ in req_ids]
        sched.update_draft_token_ids(DraftTokenIds(req_ids, drafts))  # post_step
        sent = 0
        ended = []
        for batch in outputs.values():  # what a streaming server reads
            for out in batch.outputs:
                sent += len(out.new_token_ids)
                if out.finish_reason is not None:
                    ended.append(out.request_id)
        peer_common.COUNTER.enabled = False
        c3, t3 = cpu(), clock()
        for batch in outputs.values():  # the hand-off: as the output thread encodes them
            self.encoder.encode(batch)
        c4, t4 = cpu(), clock()
        self.emitted += sent
        for rid in ended:
            req, d = self.live.pop(rid)
            self.finished.append((r, d.index, req.num_output_tokens))
        if ended and self.churn:  # untimed: they join; vLLM prefills them in the next round
            self._add([self.draws.next() for _ in ended])
        wall = (t1 - t0) + (t3 - t2)
        cpu_ns = (c1 - c0) + (c3 - c2)
        return wall, cpu_ns, wall + t4 - t3, cpu_ns + c4 - c3

    def round(self, r: int) -> tuple[int, int, int, int]:
        """One timed round (module docstring)."""
        return self._step(r)

    def check(self) -> None:
        """Untimed: every finish is where the draws put it; the survivors are where they are
        (a request that joined after the last round waits for its prefill, with no output)."""
        by_index = {d.index: d for d in self.draws.requests}
        for _, index, emitted in self.finished:
            if emitted != by_index[index].length:
                raise AssertionError(
                    f"request r{index}: {emitted} outputs, drawn {by_index[index]}"
                )
        for req, d in self.live.values():
            if req.request_id in self.joining:  # joined after the last round: not prefilled
                if req.num_output_tokens or d.emitted != 1:
                    raise AssertionError(f"{req.request_id}: outputs before its prefill")
                continue
            if req.is_finished() or req.num_output_tokens != d.emitted:
                raise AssertionError(f"{req.request_id}: {req.num_output_tokens} outputs, {d}")


def main() -> None:
    args = peer_common.parser(__doc__.split("\n\n")[0]).parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr, force=True)
    logging.getLogger("vllm").setLevel(logging.ERROR)
    pages = [p for p in peer_common.ints(args.page_sizes) if p % BLOCK == 0]
    if len(pages) < len(peer_common.ints(args.page_sizes)):
        print(
            "vllm: page sizes below or not a multiple of 16 skipped: not a servable vLLM 0.33 "
            "configuration (its CUDA attention backends take block sizes of 16 and up)",
            file=sys.stderr,
        )
    args.page_sizes = ",".join(map(str, pages))
    allocator_set = peer_common.set_allocator(
        args.malloc_mmap_threshold, args.malloc_trim_threshold
    )
    torch.set_num_threads(1)
    results = peer_common.sweep(args, "vllm", _Replay, wl.digest)
    timed = (
        "vLLM's engine-core step without the model executor: Scheduler.schedule() (with the "
        "joiners' prefill), get_grammar_bitmask, update_from_output(), "
        "update_draft_token_ids(), the streaming read; handoff_total_us: with the "
        "EngineCoreOutputs msgpack-encoded"
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
