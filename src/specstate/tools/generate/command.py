"""The ``generate`` run, top-down: read, configure, open outputs, load, serve, report.

Every check that can fail without the model (the requests, the flags, the output paths) runs
before the model loads, so a bad input costs nothing. Exit codes: 0 every request ended
normally, 1 some ended with an error, 2 bad input, options or checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import IO, TYPE_CHECKING

import attrs

from specstate.core.errors import InvalidConfig, InvalidRequest, SpecStateError
from specstate.core.request import Req
from specstate.core.status import FinishReason
from specstate.serving.byte_codec import byte_codec
from specstate.serving.text import Codec
from specstate.tools.engine_options import engine_config
from specstate.tools.generate.kv_memory import resolve_kv_tokens
from specstate.tools.generate.options import STDIO
from specstate.tools.generate.report import Progress, ResultWriter, RunSummary, write_trace
from specstate.tools.generate.request_lines import RequestLine, read_requests
from specstate.tools.generate.workers import load_engine, load_factory

if TYPE_CHECKING:
    from specstate.engine.engine import Engine

__all__ = ["run"]


def run(args: argparse.Namespace) -> int:
    """Run the command; 0 on success, 1 if a request ended with an error, 2 on bad input."""
    if args.tp > 1 and getattr(args, "tp_leader", None) is None:
        from specstate.tools.generate_tp import run_tp

        if str(args.input) == STDIO and "RANK" not in os.environ:  # spawned ranks: no stdin
            args = argparse.Namespace(**vars(args), stdin=sys.stdin.read())
        return run_tp(args, run)
    reqs: list[Req] = []
    try:
        reqs = _serve(args)
    except SpecStateError as exc:
        print(f"specstate generate: {exc}", file=sys.stderr)
        return 2
    failed = [r for r in reqs if r.finish is not None and r.finish.reason is FinishReason.ERROR]
    if failed:
        first = failed[0]
        detail = first.finish.detail if first.finish is not None else ""
        print(
            f"specstate generate: {len(failed)} of {len(reqs)} requests ended with an error "
            f"(first: {first.request_id}: {detail})",
            file=sys.stderr,
        )
        return 1
    return 0


def _serve(args: argparse.Namespace) -> list[Req]:
    """Check everything that needs no model, then load it and serve every request."""
    from specstate.engine.trace import TraceRecorder

    if args.model is None and args.worker is None:
        raise InvalidConfig("--model DIR is required (or --worker MODULE:FACTORY)")
    requests = read_requests(args.input, stdin=getattr(args, "stdin", None))
    sized = resolve_kv_tokens(args)  # --kv-memory / --kv-fraction: from the config.json
    config = engine_config(args)  # before loading the model: a bad flag fails at once
    if sized is not None and not args.quiet:
        print(f"specstate generate: {sized}", file=sys.stderr)
    factory = None if args.worker is None else load_factory(args.worker)
    codec = _codec(args, requests)
    if args.threads is not None:
        import torch

        torch.set_num_threads(args.threads)
    # Every output opens before the model loads: a bad path fails at once.
    _one_standard_output(args)
    recorder = TraceRecorder() if args.trace or args.perfetto else None
    with ExitStack() as files:
        out = files.enter_context(_open_output(args.output, "--output"))
        trace = _maybe_open(files, args.trace, "--trace")
        perfetto = _maybe_open(files, args.perfetto, "--perfetto")
        summary_file = _maybe_open(files, args.summary_json, "--summary-json")
        started = time.perf_counter()
        with load_engine(args, config, recorder, factory) as engine:
            loaded = time.perf_counter()
            reqs = [_submit(engine, line, codec) for line in requests]
            codecs = [codec if line.text is not None else None for line in requests]
            show = args.progress if args.progress is not None else _interactive(args)
            progress = Progress(reqs, show=show)
            try:
                _drive(engine, ResultWriter(out, reqs, codecs), progress)
            finally:
                progress.close(engine)
                if recorder is not None:
                    write_trace(recorder, trace, perfetto)
            done = time.perf_counter()
            summary = RunSummary.of(engine, reqs, load_s=loaded - started, wall_s=done - loaded)
        if summary_file is not None:
            json.dump(attrs.asdict(summary), summary_file, indent=2)
            summary_file.write("\n")
    if not args.quiet:
        for text in summary.lines():
            print(f"specstate generate: {text}", file=sys.stderr)
    return reqs


def _codec(args: argparse.Namespace, requests: Sequence[RequestLine]) -> Codec | None:
    """The text codec when some line gives ``text``: the bytes of a byte-level model, else the
    checkpoint's tokenizer (`specstate.serving.text.load_codec`: ``tokenizer.json`` with the
    ``tokenizers`` package, or transformers'); its refusal names the first such line."""
    texts = [r for r in requests if r.text is not None]
    if not texts:
        return None
    try:
        return byte_codec(args.model)
    except InvalidRequest as exc:
        refusal = exc
    from specstate.serving.text import load_codec

    try:
        codec = load_codec(args.model)
    except InvalidConfig as exc:
        raise InvalidRequest(f"{texts[0].where}: {exc}") from None
    if codec is None:
        raise InvalidRequest(f"{texts[0].where}: {refusal}") from None
    return codec


def _drive(engine: Engine, writer: ResultWriter, progress: Progress) -> None:
    while not engine.is_idle:
        report = engine.step()
        progress.step(engine, report.ended)
        writer.flush_finished()
    writer.flush_finished()


def _interactive(args: argparse.Namespace) -> bool:
    """Show progress by default only to a person: stderr is a terminal and not ``--quiet``."""
    return not args.quiet and sys.stderr.isatty()


def _submit(engine: Engine, line: RequestLine, codec: Codec | None) -> Req:
    """Submit one line; a request the engine refuses names its line."""
    if line.text is not None:
        assert codec is not None  # the run refuses text without one
        prompt: Sequence[int] = codec.encode(line.text)
    else:
        assert line.input_ids is not None
        prompt = line.input_ids
    try:
        return engine.submit(line.request_id, prompt, line.params)
    except InvalidRequest as exc:
        raise InvalidRequest(f"{line.where}: {exc}") from None


def _one_standard_output(args: argparse.Namespace) -> None:
    """At most one output goes to standard output (``-``): two would interleave."""
    flags = {"--output": args.output, "--trace": args.trace, "--perfetto": args.perfetto}
    flags["--summary-json"] = args.summary_json
    named = [flag for flag, path in flags.items() if path is not None and str(path) == STDIO]
    if len(named) > 1:
        raise InvalidRequest(
            f"{' and '.join(named)} are both '-': only one output can go to standard output"
        )


def _maybe_open(files: ExitStack, path: Path | None, flag: str) -> IO[str] | None:
    return None if path is None else files.enter_context(_open_output(path, flag))


def _open_output(path: Path, flag: str) -> AbstractContextManager[IO[str]]:
    """An output file, opened before any work (a bad path fails at once, nothing lost);
    ``-`` is standard output (left open)."""
    if str(path) == STDIO:
        return nullcontext(sys.stdout)
    try:
        return path.open("w", encoding="utf-8")
    except OSError as exc:
        raise InvalidRequest(f"{flag} {path}: cannot write ({exc.strerror or exc})") from None
