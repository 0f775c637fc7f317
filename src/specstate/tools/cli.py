"""The ``specstate`` command: one subcommand per job, each delegating to its owner module.

Subcommands available now:

* ``specstate demo`` — the main job on the embedded model (`specstate.tools.demo`).
* ``specstate lint PATH...`` — the ownership linter (`specstate.tools.lint`).
* ``specstate generate --model DIR ...`` — JSONL in, JSONL out (`specstate.tools.generate`).
* ``specstate bench {host,compare,engine,overlap}`` — host time per round (`specstate.tools.bench`).
* ``specstate trace FILE`` — summarize a recorded trace, one request, Perfetto
  (`specstate.tools.trace`).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from specstate.tools import bench, demo, generate, lint, trace

__all__ = ["main"]


class _ShowDefaults(argparse.HelpFormatter):
    """``--help`` shows each option's default (unless it is None or off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS)
        if shown and action.option_strings and "%(default)" not in text:
            text += " (default: %(default)s)"
        return text


def _parser() -> argparse.ArgumentParser:
    from specstate import __version__

    parser = argparse.ArgumentParser(
        prog="specstate",
        description="Scheduling state for speculative decoding under overlap scheduling.",
    )
    parser.add_argument("--version", action="version", version=f"specstate {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    defaults = _ShowDefaults
    demo.add_arguments(
        commands.add_parser(
            "demo", help="the main job on the embedded model", formatter_class=defaults
        )
    )
    lint.build_parser(
        commands.add_parser(
            "lint", help="report counter writes outside owner scopes", formatter_class=defaults
        )
    )
    generate.add_arguments(
        commands.add_parser(
            "generate", help="run a JSONL of requests on a checkpoint", formatter_class=defaults
        )
    )
    bench.add_arguments(
        commands.add_parser(
            "bench",
            help="measure host time per round; compare with a peer",
            formatter_class=defaults,
        )
    )
    trace.add_arguments(
        commands.add_parser(
            "trace", help="summarize a recorded trace; export Perfetto", formatter_class=defaults
        )
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specstate`` command; returns the process exit code."""
    args = _parser().parse_args(argv)
    try:
        return _dispatch(args)
    except BrokenPipeError:  # the reader went away (``specstate trace F | head``): no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "demo":
        return demo.run(args)
    if args.command == "lint":
        return lint.run(args)
    if args.command == "generate":
        return generate.run(args)
    if args.command == "bench":
        return bench.run(args)
    if args.command == "trace":
        return trace.run(args)
    raise AssertionError(f"unhandled command {args.command}")  # argparse rejects others


if __name__ == "__main__":
    sys.exit(main())
