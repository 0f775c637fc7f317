"""``specstate generate``: run a JSONL of requests through the engine on an HF Llama checkpoint.

Input, one JSON object per line: ``{"id", "input_ids", "max_new_tokens", "stop_token_ids"?}``.
Output, one per request in input order: ``{"id", "output_ids", "finish_reason",
"accept_lengths"}``. With ``--trace FILE`` every step is written as one JSON line (what was
launched, what finished or was retracted, queue sizes, free pages).

Bad input lines fail before any request runs, naming the line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import IO

import attrs

from specstate.core.errors import InvalidRequest, SpecStateError
from specstate.core.request import RequestLimits, SamplingParams
from specstate.engine.engine import Engine, EngineConfig, StepReport
from specstate.engine.worker import WorkerProtocol

__all__ = ["add_arguments", "build_worker", "run"]

ALGORITHMS = ("none", "draft_model", "eagle", "ngram")


@attrs.frozen(kw_only=True)
class _Line:
    request_id: str
    input_ids: tuple[int, ...]
    params: SamplingParams


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``generate`` command's arguments."""
    parser.description = "Generate for a JSONL of requests with speculation and overlap."
    parser.add_argument("--model", type=Path, required=True, help="HF Llama checkpoint dir")
    parser.add_argument("--draft", type=Path, help="draft checkpoint (draft_model) or head (eagle)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="none")
    parser.add_argument("--num-steps", type=int, default=4, help="draft steps per round")
    parser.add_argument("--page-size", type=int, default=1)
    parser.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--kv-tokens", type=int, default=16384)
    parser.add_argument("--max-running", type=int, default=32)
    parser.add_argument("--chunked-prefill", type=int, default=None)
    parser.add_argument("--input", type=Path, required=True, help="requests, JSONL")
    parser.add_argument("--output", type=Path, required=True, help="results, JSONL")
    parser.add_argument("--trace", type=Path, help="write one JSON line per engine step")
    parser.add_argument("--check-invariants", action="store_true")


def _read_requests(path: Path) -> list[_Line]:
    lines = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            obj = json.loads(raw)
            lines.append(
                _Line(
                    request_id=str(obj["id"]),
                    input_ids=tuple(int(t) for t in obj["input_ids"]),
                    params=SamplingParams(
                        max_new_tokens=int(obj.get("max_new_tokens", 128)),
                        stop_token_ids=obj.get("stop_token_ids", ()),
                    ),
                )
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidRequest(f"{path}:{number}: bad request line ({exc!r})") from None
    return lines


def build_worker(args: argparse.Namespace) -> tuple[WorkerProtocol, RequestLimits]:
    """The worker named by ``--algorithm`` and the target's request limits."""
    from specstate.reference.checkpoint import read_model_config
    from specstate.reference.workers import default_registry

    config = read_model_config(args.model)
    limits = RequestLimits(
        vocab_size=config.vocab_size,
        max_context_len=config.max_position_embeddings,
        eos_token_ids=frozenset(config.eos_token_ids),
    )
    options: dict[str, object] = {"target": args.model}
    if args.algorithm != "none":
        options["num_steps"] = args.num_steps
    if args.algorithm in ("draft_model", "eagle"):
        if args.draft is None:
            raise InvalidRequest(f"--algorithm {args.algorithm} needs --draft DIR")
        options["draft" if args.algorithm == "draft_model" else "eagle"] = args.draft
    return default_registry().create(args.algorithm, **options), limits


def _trace_row(step: int, engine: Engine, report: StepReport) -> str:
    snap = engine.snapshot()
    row: dict[str, object] = {"step": step, **attrs.asdict(report)}
    row |= {
        "num_waiting": snap.num_waiting,
        "num_running": snap.num_running,
        "num_free_pages": snap.num_free_pages,
    }
    return json.dumps(row)


def _drive(engine: Engine, trace: IO[str] | None) -> None:
    step = 0
    while not engine.is_idle:
        report = engine.step()
        step += 1
        if trace is not None:
            print(_trace_row(step, engine, report), file=trace)


def run(args: argparse.Namespace) -> int:
    """Run the command; 0 on success, 2 on bad input or configuration."""
    try:
        requests = _read_requests(args.input)
        config = EngineConfig(  # before loading the model: a bad flag fails at once
            overlap=args.overlap,
            page_size=args.page_size,
            kv_tokens=args.kv_tokens,
            max_running=args.max_running,
            chunked_prefill=args.chunked_prefill,
            check_invariants=args.check_invariants,
            check_ownership=args.check_invariants,
        )
        worker, limits = build_worker(args)
        with Engine(worker, limits=limits, config=config) as engine:
            reqs = [engine.submit(r.request_id, r.input_ids, r.params) for r in requests]
            trace = args.trace.open("w", encoding="utf-8") if args.trace else None
            try:
                _drive(engine, trace)
            finally:
                if trace is not None:
                    trace.close()
            rows = [
                {
                    "id": r.request_id,
                    "output_ids": list(r.emitted_ids),
                    "finish_reason": None if r.finish is None else r.finish.reason.value,
                    "accept_lengths": list(engine.results.accept_lengths(r)),
                }
                for r in reqs
            ]
    except SpecStateError as exc:
        print(f"specstate generate: {exc}", file=sys.stderr)
        return 2
    args.output.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return 0
