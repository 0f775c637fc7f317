"""``specstate serve``: an OpenAI-compatible completions server over one engine.

Builds the worker the way ``specstate generate`` does (`specstate.tools.generate.build_worker`,
or ``--worker MODULE:FACTORY``), puts the engine behind an `AsyncEngine` and serves
`specstate.serving.openai_server` with uvicorn on ``--host:--port`` until interrupted (then
the live requests are aborted and the engine closes). Without ``--model`` (and ``--worker``)
it serves the embedded byte-level model, its draft model and EAGLE head included, so it runs
on a fresh install; text prompts work whenever the checkpoint has a codec
(`specstate.serving.text.load_codec`).

Needs the ``serve`` extra: without it the command prints the install line and exits 2. Exit
codes: 0 after a clean shutdown, 2 for bad options, a checkpoint that cannot be loaded or a
missing extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specstate.core.errors import InvalidConfig, SpecStateError
from specstate.core.request import RequestLimits

if TYPE_CHECKING:
    from specstate.engine.worker import WorkerProtocol
    from specstate.serving.async_engine import AsyncEngine
    from specstate.serving.openai_server import ServedModel

__all__ = ["add_arguments", "build", "run"]

INSTALL_HINT = "specstate serve: the server needs the 'serve' extra: pip install 'specstate[serve]'"
EMBEDDED_NAME = "specstate-embedded"
ALGORITHMS = ("none", "draft_model", "eagle", "ngram")
"""The reference algorithms (as ``specstate generate``; spelled out so --help stays light)."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` command's arguments."""
    parser.description = "Serve an OpenAI-compatible /v1/completions endpoint over one engine."
    parser.epilog = (
        "Without --model it serves the embedded byte-level model (--draft defaults to its "
        "draft model or EAGLE head). Routes: POST /v1/completions, GET /v1/models, "
        "GET /health, GET /metrics. Needs: pip install 'specstate[serve]'."
    )
    parser.add_argument("--model", type=Path, help="HF Llama checkpoint dir (default: embedded)")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (draft_model) or head (eagle)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="none", help="drafting")
    parser.add_argument("--num-steps", type=int, default=4, help="draft steps per round")
    parser.add_argument("--topk", type=int, default=1, help="draft branches per step (a tree)")
    parser.add_argument("--num-draft-tokens", type=int, help="tree nodes verified per round")
    parser.add_argument("--adaptive", action="store_true", help="adaptive draft length")
    parser.add_argument(
        "--worker", metavar="MODULE:FACTORY", help="a custom worker (as `specstate generate`)"
    )
    parser.add_argument("--served-model-name", help="the model's name in requests")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--max-waiting", type=int, default=1024, help="queued requests (429 past)")
    parser.add_argument("--page-size", type=int, default=1, help="KV page size")
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV token slots")
    parser.add_argument("--max-running", type=int, default=32, help="most requests at once")
    parser.add_argument("--chunked-prefill", type=int, help="prefill tokens per forward")
    parser.add_argument("--seed", type=int, help="seed of the worker's own generator")
    parser.add_argument(
        "--threads", type=int, metavar="N", help="torch intra-op threads (torch.set_num_threads)"
    )
    parser.add_argument("--forward-timeout", type=float, metavar="SECONDS")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16", "float16", "checkpoint"), default="float32"
    )
    parser.add_argument("--check-invariants", action="store_true")
    parser.add_argument("--log-level", default="info", help="uvicorn's log level")


def _embedded_defaults(args: argparse.Namespace) -> str:
    """Point ``args`` at the embedded model set when no model is given; the served name."""
    if args.model is not None or args.worker is not None:
        return str(args.served_model_name or (args.model.name if args.model else args.worker))
    from specstate.reference import embedded

    args.model = embedded.target_dir()
    if args.draft is None and args.algorithm == "draft_model":
        args.draft = embedded.draft_dir()
    if args.draft is None and args.algorithm == "eagle":
        args.draft = embedded.eagle_dir()
    return str(args.served_model_name or EMBEDDED_NAME)


def _worker(args: argparse.Namespace) -> tuple[WorkerProtocol, RequestLimits]:
    from specstate.engine.worker import WorkerProtocol
    from specstate.tools.generate import build_worker, load_factory

    if args.worker is None:
        return build_worker(args)
    built: object = load_factory(args.worker)(args)
    if isinstance(built, tuple) and len(built) == 2:
        worker, limits = built
        if isinstance(worker, WorkerProtocol) and isinstance(limits, RequestLimits):
            return worker, limits
    raise InvalidConfig(f"--worker {args.worker}: the factory must return (worker, limits)")


def build(args: argparse.Namespace) -> tuple[AsyncEngine, ServedModel]:
    """The front door and the served model of the parsed arguments.

    Raises:
        SpecStateError: bad options, or a checkpoint or worker that cannot be built.
    """
    from specstate.engine.engine import Engine, EngineConfig
    from specstate.serving.async_engine import AsyncEngine
    from specstate.serving.openai_server import ServedModel

    name = _embedded_defaults(args)
    config = EngineConfig(
        overlap=args.overlap,
        page_size=args.page_size,
        kv_tokens=args.kv_tokens,
        max_running=args.max_running,
        chunked_prefill=args.chunked_prefill,
        check_invariants=args.check_invariants,
        check_ownership=args.check_invariants,
        forward_timeout_s=args.forward_timeout,
        adaptive_draft=args.adaptive,
    )
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    worker, limits = _worker(args)
    if args.model is not None:
        model = ServedModel.from_checkpoint(args.model, limits, name=name)
    else:
        model = ServedModel(name=name, limits=limits)
    engine = Engine(worker, limits=limits, config=config)
    return AsyncEngine(engine, max_waiting=args.max_waiting), model


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 2 on bad options or without the ``serve`` extra."""
    try:
        import uvicorn

        from specstate.serving.openai_server import create_app
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    try:
        front, model = build(args)
    except (SpecStateError, OSError, ValueError) as exc:
        print(f"specstate serve: {exc}", file=sys.stderr)
        return 2
    codec = "no codec: token-id prompts" if model.codec is None else f"{model.codec.kind} codec"
    print(
        f"specstate serve: {model.name} ({codec}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    app = create_app(front, model, close_on_shutdown=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
