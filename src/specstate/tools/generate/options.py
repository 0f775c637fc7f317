"""The ``generate`` flags, one function per group, and the `EngineConfig` they make.

To add an engine flag: one ``add_argument`` in `_engine_options` and one keyword in
`engine_config`; a worker flag goes in `_worker_options` and is read by
`specstate.tools.generate.workers.build_worker` (and by any ``--worker`` factory, which gets the
whole `argparse.Namespace`). Nothing here imports torch at import time.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Final

from specstate.memory.planning import parse_bytes

if TYPE_CHECKING:
    from specstate.engine.engine import EngineConfig

__all__ = [
    "ALGORITHMS",
    "DTYPES",
    "THREADS_NOTE",
    "add_arguments",
    "engine_config",
    "fraction",
    "positive",
]

ALGORITHMS: Final = ("none", "draft_model", "eagle", "ngram")
DTYPES: Final = ("float32", "bfloat16", "float16")
"""The ``--dtype`` names that are torch dtypes (``checkpoint`` keeps the saved one)."""

THREADS_NOTE: Final = (
    "torch intra-op threads (torch.set_num_threads); default: torch's own choice. With "
    "--no-overlap the forward runs on the main thread in torch's intra-op pool, which on a "
    "busy or small machine can be many times slower than fewer threads: set it to the cores "
    "you can spare (1 on a shared 2-core machine)"
)


def positive(text: str) -> int:
    """An integer >= 1 (argparse turns the ValueError into a usage error, exit 2)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def fraction(text: str) -> float:
    """A number in (0, 1] (argparse turns the ValueError into a usage error, exit 2)."""
    value = float(text)
    if not 0 < value <= 1:
        raise ValueError(text)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``generate`` command's arguments."""
    parser.description = "Generate for a JSONL of requests with speculation and overlap."
    parser.epilog = (
        "Request lines: {id, input_ids | text, max_new_tokens?, stop_token_ids?, temperature?, "
        "top_p?, top_k?, seed?, speculative?, repetition_penalty?, frequency_penalty?, "
        "presence_penalty?, min_new_tokens?, stop_sequences?, logprobs?, grammar?}. Exit codes: "
        "0 all requests ended normally, 1 some ended with an error, 2 bad input, options or "
        "checkpoint. Threads: with --no-overlap the forward runs on the main thread, so "
        "--threads matters most there."
    )
    _worker_options(parser)
    _engine_options(parser)
    _io_options(parser)
    _run_options(parser)


def _worker_options(parser: argparse.ArgumentParser) -> None:
    """What model and drafter run, and how (read by `build_worker` or a ``--worker`` factory)."""
    parser.add_argument(
        "--model", type=Path, help="HF Llama checkpoint dir (optional with --worker)"
    )
    parser.add_argument("--draft", type=Path, help="draft checkpoint (draft_model) or head (eagle)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="none", help="drafting")
    parser.add_argument("--num-steps", type=int, default=4, help="draft steps per round")
    parser.add_argument(
        "--topk",
        type=positive,
        default=1,
        help="draft branches per step: above 1 the drafter grows a tree (draft_model, eagle)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=positive,
        metavar="N",
        help="tree nodes verified per round, root included (default: num_steps * topk + 1)",
    )
    parser.add_argument(
        "--worker",
        metavar="MODULE:FACTORY",
        help="drive a custom worker: FACTORY(args) returns (WorkerProtocol, RequestLimits); "
        "MODULE is imported from the working directory or sys.path",
    )
    parser.add_argument(
        "--dtype",
        choices=(*DTYPES, "checkpoint"),
        default="float32",
        help="parameter and KV dtype (float32 is lossless on a CPU; 'checkpoint' keeps the "
        "saved dtype)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the worker's generator, which sampled requests without their own seed "
        "draw from (they reproduce for the same seed and requests); default: a fresh one",
    )


def _engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's configuration: each flag is one keyword of `engine_config`."""
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="choose each round's draft steps from recent acceptance (speculation switches "
        "off when drafts are rarely accepted, and back on after a probe)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the engine's tensors and the reference worker's model and KV live: cpu, "
        "cuda, cuda:1, ... (a device this machine lacks is refused before anything loads)",
    )
    parser.add_argument("--page-size", type=int, default=1, help="KV page size")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule the next batch while the forward runs (--no-overlap: the forward runs "
        "on the main thread; see --threads)",
    )
    parser.add_argument(
        "--prefix-cache",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="share committed KV between requests with common prefixes (--no-prefix-cache: off)",
    )
    pool = parser.add_mutually_exclusive_group()
    pool.add_argument("--kv-tokens", type=int, default=None, help="KV token slots (default: 16384)")
    pool.add_argument(
        "--kv-memory",
        type=parse_bytes,
        metavar="SIZE",
        help="size the KV pool to fit SIZE bytes of KV cache (2GiB, 512MiB, 1.5GB): the "
        "most token slots whose caches (target and drafter, in --dtype) fit",
    )
    pool.add_argument(
        "--kv-fraction",
        type=fraction,
        metavar="F",
        help="size the KV pool to fit this fraction (0 < F <= 1) of the memory free on "
        "--device: CUDA's free memory on a GPU, the OS's MemAvailable on the CPU",
    )
    parser.add_argument("--max-running", type=int, default=32, help="most requests at once")
    parser.add_argument(
        "--chunked-prefill", type=int, default=None, help="prefill tokens per forward"
    )
    parser.add_argument(
        "--check-invariants",
        action="store_true",
        help="check every engine invariant and counter owner after every step (slower; a "
        "broken one stops the run with exit 2, naming the invariant)",
    )
    parser.add_argument(
        "--forward-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail a batch whose forward takes longer (its requests end with 'error')",
    )


def _io_options(parser: argparse.ArgumentParser) -> None:
    """The requests in and the results out."""
    parser.add_argument("--input", type=Path, required=True, help="requests, JSONL")
    parser.add_argument("--output", type=Path, required=True, help="results, JSONL")


def _run_options(parser: argparse.ArgumentParser) -> None:
    """How the run is shown and recorded."""
    parser.add_argument("--threads", type=positive, metavar="N", help=THREADS_NOTE)
    parser.add_argument(
        "--tp",
        type=positive,
        default=1,
        metavar="N",
        help="tensor parallelism: shard the model over N ranks, spawned here or started by "
        "torchrun (specstate.tools.generate_tp)",
    )
    parser.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="progress bar on stderr (default: when stderr is a terminal and not --quiet)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="no progress bar and no summary (errors only)"
    )
    parser.add_argument(
        "--summary-json",
        type=Path,
        metavar="FILE",
        help="write the summary (requests, tokens, tok/s, acceptance) as JSON",
    )
    parser.add_argument(
        "--trace", type=Path, help="record spans, rounds and events (JSONL; `specstate trace`)"
    )
    parser.add_argument(
        "--perfetto", type=Path, help="write the run as a Perfetto / Chrome timeline"
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of the parsed flags; a bad value is `InvalidConfig` before any load."""
    from specstate.engine.engine import EngineConfig

    return EngineConfig(
        overlap=args.overlap,
        page_size=args.page_size,
        kv_tokens=args.kv_tokens,
        max_running=args.max_running,
        chunked_prefill=args.chunked_prefill,
        check_invariants=args.check_invariants,
        check_ownership=args.check_invariants,
        forward_timeout_s=args.forward_timeout,
        adaptive_draft=args.adaptive,
        prefix_cache=args.prefix_cache,
        device=args.device,
    )
