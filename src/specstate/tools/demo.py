"""``specstate demo``: the main job on the embedded default model, with no download.

Serves a built-in workload of Python code prompts with speculation and overlap, shows progress,
then prints throughput, acceptance, the overlap gain, the prefix cache's hit rate, whether the
output equals plain greedy decoding, and that every invariant held and no KV slot leaked. The
workload has two turns: each prompt, then a follow-up that repeats the prompt and its answer and
asks for more (so the second turn shares long prefixes with the first). Three runs of it:

1. baseline: no speculation, normal loop;
2. speculative, normal loop;
3. speculative, overlap loop (the configuration being shown).

``--device`` puts the engine and the models on a device (``cuda``; CPU by default).
``--threads N`` sets torch's intra-op threads (default 1: the model is tiny, and the host
thread and the forward stream's thread then get a core each). The baseline and the first
speculative run use the normal loop, where the forward runs on the main thread in torch's
intra-op pool; more threads than free cores slow them down many times over.

This module imports torch and the engine only when the demo runs, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from specstate.core.errors import InvalidConfig
from specstate.core.params import RequestLimits, SamplingParams
from specstate.core.request import Req
from specstate.tools.cli_types import positive

if TYPE_CHECKING:
    from specstate.engine.config import EngineConfig
    from specstate.engine.settle.results import AcceptMetrics
    from specstate.engine.trace import TraceRecorder
    from specstate.engine.worker import WorkerProtocol

__all__ = ["PROMPTS", "add_arguments", "run"]

PROMPTS: tuple[str, ...] = (
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\n\ndef main(argv):\n    ",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n",
    "    def __repr__(self):\n        return ",
    "for i in range(len(items)):\n    if ",
    "def read_file(path):\n    with open(path) as f:\n        ",
    "        except (OSError, ValueError) as exc:\n            ",
    "    @property\n    def name(self):\n        ",
)


FOLLOW_UP = "\n\n# The same again, in fewer lines:\n"
"""Appended to a prompt and its answer to make the second turn of the workload."""


@attrs.frozen(kw_only=True)
class _RunResult:
    label: str
    seconds: float
    outputs: tuple[tuple[int, ...], ...]
    num_tokens: int
    num_steps: int
    mean_accept: float
    clean: bool
    hit_tokens: int = 0
    queried_tokens: int = 0

    @property
    def tokens_per_second(self) -> float:
        return self.num_tokens / self.seconds if self.seconds else 0.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``demo`` command's arguments."""
    parser.description = "Serve a built-in workload on the embedded model and report."
    parser.add_argument(
        "--algorithm", choices=("eagle", "draft_model", "ngram"), default="eagle", help="drafting"
    )
    parser.add_argument("--num-steps", type=positive, default=4, help="draft steps per round")
    parser.add_argument(
        "--requests", type=positive, default=len(PROMPTS), help="requests in the workload"
    )
    parser.add_argument("--max-new-tokens", type=positive, default=96, help="tokens per request")
    parser.add_argument("--page-size", type=positive, default=16, help="KV page size")
    parser.add_argument(
        "--threads",
        type=positive,
        default=1,
        metavar="N",
        help="torch intra-op threads (torch.set_num_threads); the normal-loop runs do the "
        "forward on the main thread, where more threads than free cores is much slower",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the engine's tensors and the models live: cpu, cuda, cuda:1, ... (a "
        "device this machine lacks is refused at once)",
    )
    parser.add_argument("--quiet", action="store_true", help="no per-step progress")
    parser.add_argument(
        "--trace", type=Path, metavar="FILE", help="record the spec+overlap run (JSONL)"
    )
    parser.add_argument(
        "--perfetto",
        type=Path,
        metavar="FILE",
        help="write both speculative runs as a Perfetto / Chrome timeline (two processes)",
    )


def _worker(algorithm: str, num_steps: int) -> WorkerProtocol:
    import torch

    from specstate.reference import embedded
    from specstate.reference.workers import default_registry

    # The shipped weights are float16; a CPU computes float32 faster and exactly.
    options: dict[str, object] = {"target": embedded.target_dir(), "dtype": torch.float32}
    if algorithm != "none":
        options["num_steps"] = num_steps
    if algorithm == "draft_model":
        options["draft"] = embedded.draft_dir()
    if algorithm == "eagle":
        options["eagle"] = embedded.eagle_dir()
    return default_registry().create(algorithm, **options)


def _accept(metrics: AcceptMetrics) -> str:
    """Tokens per verify so far; ``-`` before the first verify (prefill only), not 0.00."""
    return f"{metrics.mean_accept_length:.2f}" if metrics.num_verifies else "-"


def _config(args: argparse.Namespace, *, overlap: bool) -> EngineConfig:
    """The engine configuration of one run; `InvalidConfig` for a device this machine lacks."""
    from specstate.engine.config import EngineConfig

    return EngineConfig(
        overlap=overlap,
        page_size=args.page_size,
        kv_tokens=32768,
        chunked_prefill=64,
        check_invariants=True,
        check_ownership=True,
        device=args.device,
    )


def _serve(
    label: str,
    worker: WorkerProtocol,
    prompts: Sequence[Sequence[int]],
    args: argparse.Namespace,
    *,
    overlap: bool,
    progress: Callable[[str], None] | None,
    trace: TraceRecorder | None = None,
) -> _RunResult:
    from specstate.engine.engine import Engine
    from specstate.reference import embedded

    limits = RequestLimits(
        vocab_size=embedded.VOCAB_SIZE, max_context_len=1024, eos_token_ids={embedded.EOS_ID}
    )
    config = _config(args, overlap=overlap)
    params = SamplingParams(max_new_tokens=args.max_new_tokens)
    follow = embedded.encode(FOLLOW_UP)
    with Engine(worker, limits=limits, config=config, trace=trace) as engine:
        start = time.perf_counter()
        steps = 0
        reqs: list[Req] = []
        for turn in range(2):  # the second turn: each prompt, its answer, a follow-up
            wave = (
                prompts
                if turn == 0
                else [[*p, *r.emitted_ids, *follow] for p, r in zip(prompts, reqs, strict=True)]
            )
            reqs += [engine.submit(f"{label}-{turn}-{i}", p, params) for i, p in enumerate(wave)]
            while not engine.is_idle:
                engine.step()
                steps += 1
                if progress is not None and steps % 8 == 0:
                    done = sum(len(r.output_ids) for r in reqs)
                    snap = engine.snapshot()
                    progress(
                        f"  [{label}] step {steps:4d} | running {snap.num_running:2d} | "
                        f"tokens {done:5d} | accept {_accept(snap.metrics)}"
                    )
        seconds = time.perf_counter() - start
        snap = engine.snapshot()
    cache = snap.prefix_cache
    return _RunResult(
        label=label,
        seconds=seconds,
        outputs=tuple(r.emitted_ids for r in reqs),
        num_tokens=sum(len(r.emitted_ids) for r in reqs),
        num_steps=steps,
        mean_accept=snap.metrics.mean_accept_length,
        clean=snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages,
        hit_tokens=0 if cache is None else cache.num_hit_tokens,
        queried_tokens=0 if cache is None else cache.num_queried_tokens,
    )


def run(args: argparse.Namespace) -> int:
    """Run the demo; 0 when every check passed, 1 otherwise."""
    import torch

    from specstate.engine.trace import TraceRecorder
    from specstate.reference import embedded

    try:
        _config(args, overlap=True)  # a device this machine lacks fails before any model loads
    except InvalidConfig as exc:
        print(f"specstate demo: {exc}", file=sys.stderr)
        return 2
    prompts = [
        [embedded.BOS_ID, *embedded.encode(PROMPTS[i % len(PROMPTS)])] for i in range(args.requests)
    ]
    torch.set_num_threads(args.threads)  # default 1: host and stream thread get a core each
    say = print
    progress = None if args.quiet else say
    say(
        f"specstate demo: {len(prompts)} code prompts and their follow-ups x "
        f"{args.max_new_tokens} new tokens on the "
        f"embedded byte-level Llama, {args.algorithm} (K={args.num_steps}), page size "
        f"{args.page_size}, {args.threads} torch thread(s), on {args.device}, invariant checks "
        "after every step"
    )
    base = _serve("baseline", _worker("none", 0), prompts, args, overlap=False, progress=progress)
    tracing = args.trace is not None or args.perfetto is not None
    spec_trace = TraceRecorder() if tracing else None
    both_trace = TraceRecorder() if tracing else None
    spec = _serve(
        "spec",
        _worker(args.algorithm, args.num_steps),
        prompts,
        args,
        overlap=False,
        progress=None,
        trace=spec_trace,
    )
    both = _serve(
        "spec+overlap",
        _worker(args.algorithm, args.num_steps),
        prompts,
        args,
        overlap=True,
        progress=progress,
        trace=both_trace,
    )
    if args.trace is not None and both_trace is not None:
        both_trace.write_jsonl(args.trace)
        say(f"trace of the spec+overlap run: {args.trace} (read it with: specstate trace FILE)")
    if args.perfetto is not None and spec_trace is not None and both_trace is not None:
        events = spec_trace.chrome_trace(pid=1, name="spec, normal loop")
        events += both_trace.chrome_trace(pid=2, name="spec+overlap, overlap loop")
        args.perfetto.write_text(json.dumps({"traceEvents": events}), encoding="utf-8")
        say(f"timeline of both speculative runs: {args.perfetto} (open in ui.perfetto.dev)")
    lossless = base.outputs == spec.outputs == both.outputs
    clean = base.clean and spec.clean and both.clean
    say("")
    for r in (base, spec, both):
        accept = f", mean accept {r.mean_accept:.2f}" if r.label != "baseline" else ""
        say(
            f"{r.label:>13}: {r.num_tokens} tokens in {r.seconds:6.2f} s = "
            f"{r.tokens_per_second:7.1f} tok/s over {r.num_steps} steps{accept}"
        )
    say(f"speedup over baseline: {both.tokens_per_second / base.tokens_per_second:.2f}x")
    say(f"overlap gain (spec+overlap vs spec): {spec.seconds / both.seconds:.2f}x")
    say(
        "  (here the forward is CPU work sharing the cores with the host; on a device the overlap"
        " loop costs max(host, device) per round, as `pytest tests/benchmarks --benchmark-enable`"
        " shows with a timed-wait device)"
    )
    rate = both.hit_tokens / both.queried_tokens if both.queried_tokens else 0.0
    say(
        f"prefix cache: hit rate {rate:.1%} ({both.hit_tokens} of {both.queried_tokens} prefill "
        "tokens came from the cache; the follow-ups share their prompt and answer)"
    )
    say(f"lossless (all runs emit identical tokens): {'yes' if lossless else 'NO'}")
    say(f"invariants held after every step; KV fully released: {'yes' if clean else 'NO'}")
    say("")
    say(
        "sample completion by the embedded model (a 2.4M-parameter byte-level Llama trained on "
        "the standard library's sources for testing: code-shaped, not meant to be correct):"
    )
    say(embedded.decode(prompts[0][1:]) + embedded.decode(both.outputs[0]))
    return 0 if lossless and clean else 1
