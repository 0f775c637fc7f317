"""The flags of a command that builds an engine on a worker, and the `EngineConfig` they make.

``specstate generate`` and ``specstate serve`` both build a worker (the reference registry, or a
``--worker MODULE:FACTORY``) and an engine from the same flags, so both take them from here:
`add_worker_options` (what model and drafter run, read by
`specstate.tools.generate.build_worker` or by a factory, which gets the whole
`argparse.Namespace`) and `add_engine_options` (the engine's configuration, one keyword of
`engine_config` per flag). To add an engine flag: one ``add_argument`` in `add_engine_options`
and one keyword in `engine_config`.

Nothing here imports torch or the engine at import time, so ``--help`` stays instant, and
nothing imports a command's own module, so each command loads only itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Final

from specstate.engine.planning import parse_bytes

if TYPE_CHECKING:
    from specstate.engine.config import EngineConfig

__all__ = [
    "ALGORITHMS",
    "DTYPES",
    "THREADS_NOTE",
    "add_engine_options",
    "add_worker_options",
    "engine_config",
    "fraction",
    "positive",
]

ALGORITHMS: Final = (
    "none",
    "draft_model",
    "eagle",
    "ngram",
    "mtp",
    "eagle3",
    "frozen_kv_mtp",
    "dflash",
    "dspark",
    "uno",
)
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


def add_worker_options(parser: argparse.ArgumentParser, *, model_help: str) -> None:
    """What model and drafter run, and how (read by `build_worker` or a ``--worker`` factory).

    ``model_help`` says what ``--model`` defaults to for this command.
    """
    parser.add_argument("--model", type=Path, help=model_help)
    parser.add_argument(
        "--draft",
        type=Path,
        help="the drafter: a draft checkpoint (draft_model), a head (eagle, eagle3), an "
        "assistant (frozen_kv_mtp, dflash, dspark) or a PEFT LoRA adapter (uno); mtp drafts "
        "with the MTP layers inside --model",
    )
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="none", help="drafting")
    parser.add_argument(
        "--num-steps",
        type=int,
        default=4,
        help="draft steps per round (dflash, dspark: at most the assistant's block_size - 1, "
        "which a larger value takes; uno: the first output token and num_steps - 1 drafts)",
    )
    parser.add_argument(
        "--topk",
        type=positive,
        default=1,
        help="draft branches per step: above 1 the drafter grows a tree (draft_model, eagle, "
        "eagle3, uno)",
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


def add_engine_options(parser: argparse.ArgumentParser) -> None:
    """The engine's configuration: each flag is one keyword of `engine_config`."""
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="choose each round's draft steps from recent acceptance (speculation switches "
        "off when drafts are rarely accepted, and back on after a probe)",
    )
    parser.add_argument(
        "--verify-budget",
        default=None,
        metavar="POLICY",
        help="plan each row's verify budget: fixed, goodput, confidence, or "
        "schedule:SIZE=DRAFTS,...[,beyond=DRAFTS] (docs/engine.md, 'Verify budgets')",
    )
    parser.add_argument(
        "--cost-profile",
        default=None,
        metavar="FILE",
        help="the JSON cost profile of the goodput and confidence policies (default: each "
        "draft costs 15%% of a plain step)",
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


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The `EngineConfig` of the parsed flags; a bad value is `InvalidConfig` before any load."""
    from specstate.engine.config import EngineConfig

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
        verify_budget=args.verify_budget,
        cost_profile=args.cost_profile,
    )
