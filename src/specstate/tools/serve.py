"""``specstate serve``: an OpenAI-compatible completions server over one engine (or N ranks).

Takes ``specstate generate``'s worker and engine flags (`specstate.tools.engine_options`) and
builds the worker and the engine the way it does (`specstate.tools.generate.build_worker`, or
``--worker MODULE:FACTORY``), puts the engine behind an `AsyncEngine` and serves
`specstate.serving.openai_server` with uvicorn on ``--host:--port`` until interrupted: then
the live requests are aborted first (their streams end with ``finish_reason: "abort"``), the
engine closes and the command exits within
`specstate.serving.uvicorn_server.SHUTDOWN_BOUND_S`. Without ``--model`` (and ``--worker``) it
serves the embedded byte-level model, its draft model and EAGLE head included, so it runs on a
fresh install; text prompts work whenever the checkpoint has a codec
(`specstate.serving.text.load_codec`).

``--tp N`` shards the model over ``N`` ranks, this process serving as rank 0
(`specstate.tools.serve_tp`).

Needs the ``serve`` extra: without it the command prints the install line and exits 2. Exit
codes: 0 after a clean shutdown, 2 for bad options, a checkpoint that cannot be loaded or a
missing extra.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from specstate.core.errors import SpecStateError
from specstate.tools.engine_options import (
    THREADS_NOTE,
    add_engine_options,
    add_worker_options,
    engine_config,
    positive,
)

if TYPE_CHECKING:
    from specstate.serving.async_engine import AsyncEngine
    from specstate.serving.driver import RemotePrefill
    from specstate.serving.openai_server import ServedModel

__all__ = ["add_arguments", "build", "run"]

INSTALL_HINT = "specstate serve: the server needs the 'serve' extra: pip install 'specstate[serve]'"
EMBEDDED_NAME = "specstate-embedded"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``serve`` command's arguments: ``generate``'s worker and engine flags, the server's."""
    parser.description = (
        "Serve OpenAI-compatible /v1/completions and /v1/chat/completions endpoints over one "
        "engine (--tp N: over N tensor-parallel ranks, this process rank 0)."
    )
    parser.epilog = (
        "Without --model it serves the embedded byte-level model (--draft defaults to its "
        "draft model or EAGLE head). Routes: POST /v1/completions, POST /v1/chat/completions, "
        "GET /v1/models, "
        "GET /health, GET /metrics. Needs: pip install 'specstate[serve]'."
    )
    add_worker_options(parser, model_help="HF Llama checkpoint dir (default: the embedded model)")
    parser.add_argument("--served-model-name", help="the model's name in requests")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on")
    parser.add_argument("--port", type=int, default=8000, help="port to listen on")
    parser.add_argument("--max-waiting", type=int, default=1024, help="queued requests (429 past)")
    parser.add_argument(
        "--chat-template",
        type=Path,
        metavar="FILE",
        help="a Jinja2 chat template for /v1/chat/completions, instead of the checkpoint's "
        "(chat_template.jinja, or tokenizer_config.json's chat_template)",
    )
    parser.add_argument(
        "--max-n",
        type=positive,
        default=8,
        metavar="N",
        help="the most choices (n) a chat request may ask for (default 8)",
    )
    add_engine_options(parser)
    parser.add_argument("--threads", type=positive, metavar="N", help=THREADS_NOTE)
    parser.add_argument(
        "--tp",
        type=positive,
        default=1,
        metavar="N",
        help="tensor parallelism: shard the model over N ranks, this process serving as rank 0 "
        "and starting the others, or each started by torchrun (specstate.tools.serve_tp)",
    )
    parser.add_argument(
        "--prefill",
        type=positive,
        metavar="N",
        help="disaggregate: N prefill processes (only 1): a spawned process prefills every "
        "request and hands it to this process, which decodes it (specstate.tools.serve_pd)",
    )
    parser.add_argument(
        "--decode",
        type=positive,
        metavar="M",
        help="with --prefill: M decode engines (only 1: this process; the default)",
    )
    parser.add_argument(
        "--handoff-timeout",
        type=float,
        default=600.0,
        metavar="S",
        help="with --prefill: seconds a request may wait on the prefill side for its handoff "
        "before it fails (default 600)",
    )
    parser.add_argument("--log-level", default="info", help="uvicorn's log level")


def _embedded_defaults(args: argparse.Namespace) -> str:
    """Point ``args`` at the embedded model set when no model is given; the served name.

    Idempotent: every rank of ``--tp`` applies it to the same arguments.
    """
    if args.model is not None or args.worker is not None:
        return str(args.served_model_name or (args.model.name if args.model else args.worker))
    from specstate.reference import embedded

    args.model = embedded.target_dir()
    if args.draft is None and args.algorithm == "draft_model":
        args.draft = embedded.draft_dir()
    if args.draft is None and args.algorithm == "eagle":
        args.draft = embedded.eagle_dir()
    args.served_model_name = args.served_model_name or EMBEDDED_NAME
    return str(args.served_model_name)


def build(
    args: argparse.Namespace, remote_prefill: RemotePrefill | None = None
) -> tuple[AsyncEngine, ServedModel]:
    """The front door and the served model of the parsed arguments (with ``remote_prefill``,
    the engine is the decode engine of that prefill process).

    The worker and the engine are built as ``specstate generate`` builds them
    (`specstate.tools.generate.workers.load_engine`), a ``--kv-memory`` or ``--kv-fraction``
    budget included (one line on stderr says what it bought).

    Raises:
        SpecStateError: bad options, or a checkpoint or worker that cannot be built.
    """
    from specstate.serving.async_engine import AsyncEngine
    from specstate.serving.openai_server import ServedModel
    from specstate.tools.generate.kv_memory import resolve_kv_tokens
    from specstate.tools.generate.workers import load_engine, load_factory

    name = _embedded_defaults(args)
    bought = resolve_kv_tokens(args)
    if bought is not None:
        print(f"specstate serve: {bought}", file=sys.stderr)
    config = engine_config(args)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    factory = load_factory(args.worker) if args.worker is not None else None
    engine = load_engine(args, config, None, factory)
    if args.model is not None:
        model = ServedModel.from_checkpoint(
            args.model, engine.limits, name=name, chat_template=args.chat_template
        )
    else:
        from specstate.serving.chat_template import load_chat_template

        template = load_chat_template(None, args.chat_template)
        model = ServedModel(name=name, limits=engine.limits, chat_template=template)
    front = AsyncEngine(engine, max_waiting=args.max_waiting, remote_prefill=remote_prefill)
    return front, model


def run(args: argparse.Namespace) -> int:
    """Serve until interrupted; 2 on bad options or without the ``serve`` extra."""
    try:
        import specstate.serving.openai_server
        import specstate.serving.uvicorn_server  # noqa: F401
    except ImportError:
        print(INSTALL_HINT, file=sys.stderr)
        return 2
    from specstate.tools.serve_pd import check_counts, run_serve_pd

    refused = check_counts(args)
    if refused is not None:
        print(f"specstate serve: {refused}", file=sys.stderr)
        return 2
    if args.prefill is not None:
        _embedded_defaults(args)  # both processes build the worker from these arguments
        return run_serve_pd(args, _serve)
    if args.tp > 1 and getattr(args, "tp_leader", None) is None:
        from specstate.tools.serve_tp import run_serve_tp

        _embedded_defaults(args)  # every rank builds the worker from these arguments
        return run_serve_tp(args, run)
    return _serve(args, None)


def _serve(args: argparse.Namespace, remote_prefill: object) -> int:
    """Build the front door (over ``remote_prefill``'s decode engine, if given) and serve."""
    from specstate.serving.driver import RemotePrefill
    from specstate.serving.openai_server import create_app
    from specstate.serving.uvicorn_server import serve_front_door

    remote = remote_prefill if isinstance(remote_prefill, RemotePrefill) else None
    try:
        front, model = build(args, remote)
    except (SpecStateError, OSError, ValueError) as exc:
        print(f"specstate serve: {exc}", file=sys.stderr)
        return 2
    codec = "no codec: token-id prompts" if model.codec is None else f"{model.codec.kind} codec"
    print(
        f"specstate serve: {model.name} ({codec}) on http://{args.host}:{args.port}/v1",
        file=sys.stderr,
    )
    if model.chat_template is None:
        print(
            "specstate serve: no chat template (give --chat-template FILE): "
            "/v1/chat/completions answers 400",
            file=sys.stderr,
        )
    app = create_app(
        front, model, max_n=args.max_n
    )  # the server closes the front door: live requests first
    serve_front_door(app, front, host=args.host, port=args.port, log_level=args.log_level)
    return 0
