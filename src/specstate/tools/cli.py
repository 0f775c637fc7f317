"""The ``specstate`` command: one subcommand per job, each delegating to its owner module.

Subcommands:

* ``specstate demo`` — the main job on the embedded model (`specstate.tools.demo`).
* ``specstate lint PATH...`` — the ownership linter (`specstate.tools.lint`).
* ``specstate generate --model DIR ...`` — JSONL in, JSONL out (`specstate.tools.generate`).
* ``specstate serve [--model DIR]`` — an OpenAI-compatible server (`specstate.tools.serve`).
* ``specstate bench {host,compare,engine,overlap,serve,recurrent,grammar,prefix,tp,pd}`` — host
  time per round, serving load, the capabilities' costs (`specstate.tools.bench`).
* ``specstate trace FILE`` — summarize a recorded trace, one request, Perfetto
  (`specstate.tools.trace`).

Startup is cheap: this module imports no subcommand module. The top-level parser lists the
subcommands by name, and only the one on the command line is imported and given its
arguments, so ``specstate --version`` and ``specstate --help`` never import torch, and
``specstate lint`` imports only the linter.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Final, Protocol

__all__ = ["COMMANDS", "main"]

COMMANDS: Final[dict[str, tuple[str, str]]] = {
    "demo": ("specstate.tools.demo", "the main job on the embedded model"),
    "lint": ("specstate.tools.lint", "report counter writes outside owner scopes"),
    "generate": ("specstate.tools.generate", "run a JSONL of requests on a checkpoint"),
    "serve": ("specstate.tools.serve", "serve an OpenAI-compatible completions endpoint"),
    "bench": ("specstate.tools.bench", "measure host time per round; compare with a peer"),
    "trace": ("specstate.tools.trace", "summarize a recorded trace; export Perfetto"),
}
"""Subcommand -> (its module, one line of help). Each module has ``add_arguments(parser)``
and ``run(args) -> int``."""


class _Command(Protocol):
    """What a subcommand module provides."""

    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


class _ShowDefaults(argparse.HelpFormatter):
    """``--help`` shows each option's default (unless it is None or off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, False, argparse.SUPPRESS)
        said = "%(default)" in text or "(default" in text  # the help already says it
        if shown and action.option_strings and not said:
            text += " (default: %(default)s)"
        return text


def _command_named(argv: Sequence[str]) -> str | None:
    """The subcommand on the command line: its first word that is not an option.

    The top-level options (``--help``, ``--version``) take no value, so this is the word
    argparse will dispatch on; None when there is none (``specstate --version``).
    """
    for word in argv:
        if word == "--":
            return None
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def _load(command: str) -> _Command:
    module: _Command = importlib.import_module(COMMANDS[command][0])
    return module


def _parser(command: str | None) -> argparse.ArgumentParser:
    """The parser; only ``command``'s module is imported, to give it its arguments."""
    from specstate import __version__  # a constant: importing the package imports no torch

    parser = argparse.ArgumentParser(
        prog="specstate",
        description="Scheduling state for speculative decoding under overlap scheduling.",
    )
    parser.add_argument("--version", action="version", version=f"specstate {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (_, help_line) in COMMANDS.items():
        sub = commands.add_parser(name, help=help_line, formatter_class=_ShowDefaults)
        if name == command:
            _load(name).add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``specstate`` command; returns the process exit code."""
    words = sys.argv[1:] if argv is None else list(argv)
    args = _parser(_command_named(words)).parse_args(words)
    try:
        return _load(args.command).run(args)
    except BrokenPipeError:  # the reader went away (``specstate trace F | head``): no traceback
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
