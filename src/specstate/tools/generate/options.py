"""The ``generate`` flags, one function per group.

The worker and engine flags, and the `EngineConfig` they make (`engine_config`), are shared with
``specstate serve`` and live in `specstate.tools.engine_options` (re-exported here); this module
adds the requests in, the results out and how a run is shown. Nothing here imports torch at
import time.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Final

from specstate.tools.engine_options import (
    THREADS_NOTE,
    add_engine_options,
    add_worker_options,
    positive,
)

__all__ = ["STDIO", "add_arguments"]

STDIO: Final = "-"
"""``--input -`` reads the requests from standard input, ``--output -`` (the default) writes the
results to standard output."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``generate`` command's arguments."""
    parser.description = "Generate for a JSONL of requests with speculation and overlap."
    parser.epilog = (
        "Request lines: {id, input_ids | text, max_new_tokens?, stop_token_ids?, temperature?, "
        "top_p?, top_k?, seed?, speculative?, repetition_penalty?, frequency_penalty?, "
        "presence_penalty?, min_new_tokens?, stop_sequences?, logprobs?, top_logprobs?, grammar?}. "
        "Exit codes: "
        "0 all requests ended normally, 1 some ended with an error, 2 bad input, options or "
        "checkpoint. Threads: with --no-overlap the forward runs on the main thread, so "
        "--threads matters most there."
    )
    add_worker_options(parser, model_help="HF Llama checkpoint dir (optional with --worker)")
    add_engine_options(parser)
    _io_options(parser)
    _run_options(parser)


def _io_options(parser: argparse.ArgumentParser) -> None:
    """The requests in and the results out."""
    parser.add_argument(
        "--input", type=Path, required=True, help="requests, JSONL ('-': standard input)"
    )
    parser.add_argument(
        "--output",
        type=Path,
        default=Path(STDIO),
        help="results, JSONL ('-': standard output; progress and summary stay on stderr)",
    )


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
