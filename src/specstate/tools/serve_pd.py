"""``specstate serve --prefill 1 --decode 1``: the server with prefill and decode disaggregated.

The process layout (docs/handoff.md)::

    this process (rank 1 of a gloo pair)          a spawned process (rank 0)
    ------------------------------------          --------------------------
    HTTP front door (specstate serve)             the prefill engine, in
    AsyncEngine over the decode engine   --req->  `serve_prefill(remote=True)`:
      a request waits on the prefill side  <-ack-   prefill + drafter prefill +
      its record lands, is admitted      <-record-  first token, export
      (`Engine.admit_handoff`), decodes  --ack->    release on the ACK
      the stream reads every token from the decode engine (the first one included, once)

Both processes build the same worker from the same arguments (their records' descriptors
match). The connection is `TorchDistributedTransport` over a gloo group on 127.0.0.1; the
messages are those of the role loops (`specstate.handoff.transport`). Only ``--prefill 1
--decode 1`` is served: other counts, and ``--tp`` with them, are refused (exit 2).

Faults: the prefill process dies: its connection closes, requests waiting on it end with
``finish_reason: "error"`` and new ones are answered 503 (`EngineUnavailable`); a request
with no record within ``--handoff-timeout`` seconds fails the same way. A client that leaves
while its request is on the prefill side aborts it there (and its record, if already on its
way, is refused and freed on both sides). Stopping: as ``specstate serve``; the server's
shutdown closes the connection, and the prefill process exits.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import traceback
from collections.abc import Callable
from typing import Final

from specstate.core.errors import SpecStateError

__all__ = ["HANDOFF_TIMEOUT_S", "check_counts", "run_serve_pd"]

HANDOFF_TIMEOUT_S: Final = 600.0
"""The default ``--handoff-timeout``: how long a request may wait on the prefill side."""

_Serve = Callable[[argparse.Namespace, object], int]


def check_counts(args: argparse.Namespace) -> str | None:
    """Why ``--prefill``/``--decode`` (and ``--tp``) cannot be served; None if they can."""
    if args.prefill is None:
        return None if args.decode is None else "--decode needs --prefill"
    decode = 1 if args.decode is None else args.decode
    if (args.prefill, decode) != (1, 1):
        return (
            f"--prefill {args.prefill} --decode {decode}: only --prefill 1 --decode 1 is "
            "served (one prefill process and this process decoding)"
        )
    if args.tp > 1:
        return "--prefill cannot be combined with --tp"
    return None


def run_serve_pd(args: argparse.Namespace, serve: _Serve) -> int:
    """Start the prefill process, join it, and serve as the decode side (module docstring)."""
    from specstate.distributed.groups import RankGroup
    from specstate.distributed.spawn import free_port
    from specstate.handoff.transport import TorchDistributedTransport
    from specstate.serving.driver import RemotePrefill
    from specstate.tools.serve_tp import IDLE_TIMEOUT_S, _port_in_use, _reap, _stop_signals_ignored

    busy = _port_in_use(args.host, args.port)
    if busy is not None:
        print(
            f"specstate serve: cannot listen on {args.host}:{args.port} ({busy})", file=sys.stderr
        )
        return 2
    port = free_port()
    context = multiprocessing.get_context("spawn")
    with _stop_signals_ignored():  # the prefill process stops when this one closes it
        prefill = context.Process(
            target=_prefill_main,
            args=(port, args),
            name="specstate-serve-prefill",
            daemon=True,
        )
        prefill.start()
    code = 2
    try:
        group = RankGroup.init(
            rank=1, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=IDLE_TIMEOUT_S
        )
        with group:
            remote = RemotePrefill(
                transport=TorchDistributedTransport(0), handoff_timeout_s=args.handoff_timeout
            )
            code = serve(args, remote)
    except (SpecStateError, RuntimeError) as exc:  # the pair could not form
        print(f"specstate serve: decode side: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        failed = _reap([prefill])
    for _, exitcode in failed:
        print(f"specstate serve: the prefill process exited with code {exitcode}", file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NOTE: the pair's group cannot be torn down once its peer is gone


def _prefill_main(port: int, args: argparse.Namespace) -> None:
    """The spawned prefill process: build the engine, serve the front door's requests."""
    import torch

    from specstate.distributed.groups import RankGroup
    from specstate.handoff.transport import TorchDistributedTransport, serve_prefill
    from specstate.tools.engine_options import engine_config
    from specstate.tools.generate.kv_memory import resolve_kv_tokens
    from specstate.tools.generate.workers import load_engine, load_factory
    from specstate.tools.serve_tp import IDLE_TIMEOUT_S, _ignore_stop_signals

    _ignore_stop_signals()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    code = 2
    try:
        group = RankGroup.init(
            rank=0, world_size=2, init_method=f"tcp://127.0.0.1:{port}", timeout_s=IDLE_TIMEOUT_S
        )
        with group:
            resolve_kv_tokens(args)
            factory = load_factory(args.worker) if args.worker is not None else None
            with load_engine(args, engine_config(args), None, factory) as engine:
                transport = TorchDistributedTransport(1)
                serve_prefill(
                    engine, transport, (), remote=True, ack_timeout_s=args.handoff_timeout
                )
            code = 0
    except BaseException as exc:  # its last word, on the terminal the server logs to
        print(f"specstate serve: prefill process: {type(exc).__name__}: {exc}", file=sys.stderr)
        if not isinstance(exc, SpecStateError):
            traceback.print_exc()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # NOTE: no interpreter teardown: a broken group may block it
