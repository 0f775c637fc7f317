"""``specstate generate``: run a JSONL of requests through the engine on an HF Llama checkpoint.

Input, one JSON object per line: ``{"id", "input_ids", "max_new_tokens", "stop_token_ids"?}``.
Output, one per request in input order: ``{"id", "output_ids", "finish_reason",
"accept_lengths"}``, plus ``"error"`` (the reason) for a request that ended with an error; the
exit code is then 1. ``--trace FILE`` records the run (spans, rounds, events: the JSONL of
`specstate.engine.trace`, read back by ``specstate trace FILE``) and ``--perfetto FILE`` writes
its timeline as Chrome / Perfetto trace events.

Input is read strictly: a line with an unknown field or a wrong type (a string of digits for
``input_ids``, a float, a bool, a null ``id``) fails before any request runs, naming the file,
the line and the field; so does an output path that cannot be written. Result rows are written
in input order as soon as a request and every earlier one have ended, so nothing computed is
lost if the run stops.
"""

from __future__ import annotations

import argparse
import json
import sys
from contextlib import ExitStack
from pathlib import Path
from typing import IO, TYPE_CHECKING

import attrs
import torch

from specstate.core.errors import InvalidConfig, InvalidRequest, SpecStateError
from specstate.core.request import FinishReason, Req, RequestLimits, SamplingParams
from specstate.engine.engine import Engine, EngineConfig
from specstate.engine.trace import TraceRecorder
from specstate.engine.worker import WorkerProtocol

if TYPE_CHECKING:
    from specstate.reference.model import ModelConfig

__all__ = ["add_arguments", "build_worker", "run"]

ALGORITHMS = ("none", "draft_model", "eagle", "ngram")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="none", help="drafting")
    parser.add_argument("--num-steps", type=int, default=4, help="draft steps per round")
    parser.add_argument("--page-size", type=int, default=1, help="KV page size")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule the next batch while the forward runs",
    )
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV token slots")
    parser.add_argument("--max-running", type=int, default=32, help="most requests at once")
    parser.add_argument(
        "--chunked-prefill", type=int, default=None, help="prefill tokens per forward"
    )
    parser.add_argument("--input", type=Path, required=True, help="requests, JSONL")
    parser.add_argument("--output", type=Path, required=True, help="results, JSONL")
    parser.add_argument(
        "--trace", type=Path, help="record spans, rounds and events (JSONL; `specstate trace`)"
    )
    parser.add_argument(
        "--perfetto", type=Path, help="write the run as a Perfetto / Chrome timeline"
    )
    parser.add_argument("--check-invariants", action="store_true")
    parser.add_argument(
        "--forward-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="fail a batch whose forward takes longer (its requests end with 'error')",
    )
    parser.add_argument(
        "--dtype",
        choices=(*_DTYPES, "checkpoint"),
        default="float32",
        help="parameter and KV dtype (float32 is lossless on a CPU; 'checkpoint' keeps the "
        "saved dtype)",
    )


_FIELDS = frozenset({"id", "input_ids", "max_new_tokens", "stop_token_ids"})


def _read_requests(path: Path) -> list[_Line]:
    """Every request line of ``path``; `InvalidRequest` naming the file, line and field."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"{path}: cannot read the requests ({exc})") from None
    lines = []
    for number, raw in enumerate(text.splitlines(), start=1):
        if raw.strip():
            lines.append(_parse_line(raw, f"{path}:{number}"))
    return lines


def _parse_line(raw: str, where: str) -> _Line:
    """One request object, with exact types: nothing is converted or silently ignored."""
    try:
        obj = json.loads(raw)
    except ValueError as exc:
        raise InvalidRequest(f"{where}: not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise InvalidRequest(f"{where}: a request line must be a JSON object")
    unknown = sorted(set(obj) - _FIELDS)
    if unknown:
        raise InvalidRequest(f"{where}: unknown fields {unknown} (known: {sorted(_FIELDS)})")
    rid, ids = obj.get("id"), obj.get("input_ids")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest(f'{where}: "id" must be a non-empty string, got {rid!r}')
    if not isinstance(ids, list) or not all(_is_id(t) for t in ids):
        raise InvalidRequest(f'{where}: "input_ids" must be a list of integers, got {ids!r:.60}')
    cap = obj.get("max_new_tokens", 128)
    if not _is_id(cap):
        raise InvalidRequest(f'{where}: "max_new_tokens" must be an integer, got {cap!r}')
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(_is_id(t) for t in stops):
        raise InvalidRequest(
            f'{where}: "stop_token_ids" must be a list of integers, got {stops!r:.60}'
        )
    return _Line(
        request_id=rid,
        input_ids=tuple(ids),
        params=SamplingParams(max_new_tokens=cap, stop_token_ids=stops),
    )


def _is_id(value: object) -> bool:
    """A JSON integer (JSON true/false are bools, and 1e400 is a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _open_output(path: Path, flag: str) -> IO[str]:
    """An output file, opened before any work (a bad path fails at once, nothing lost)."""
    try:
        return path.open("w", encoding="utf-8")
    except OSError as exc:
        raise InvalidRequest(f"{flag} {path}: cannot write ({exc.strerror or exc})") from None


def build_worker(args: argparse.Namespace) -> tuple[WorkerProtocol, RequestLimits]:
    """The worker named by ``--algorithm`` and the target's request limits."""
    from specstate.reference.checkpoint import read_model_config
    from specstate.reference.workers import default_registry

    config = read_model_config(args.model)
    _check_kv_memory(args, config)
    limits = RequestLimits(
        vocab_size=config.vocab_size,
        max_context_len=config.max_position_embeddings,
        eos_token_ids=frozenset(config.eos_token_ids),
    )
    if args.draft is not None and args.algorithm not in ("draft_model", "eagle"):
        raise InvalidRequest(f"--draft is used by draft_model and eagle, not {args.algorithm}")
    options: dict[str, object] = {"target": args.model, "dtype": _DTYPES.get(args.dtype)}
    if args.algorithm != "none":
        options["num_steps"] = args.num_steps
    if args.algorithm in ("draft_model", "eagle"):
        if args.draft is None:
            raise InvalidRequest(f"--algorithm {args.algorithm} needs --draft DIR")
        options["draft" if args.algorithm == "draft_model" else "eagle"] = args.draft
    return default_registry().create(args.algorithm, **options), limits


def _available_memory() -> int | None:
    """Bytes of memory the OS says are available (``MemAvailable``), if it says."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _check_kv_memory(args: argparse.Namespace, config: ModelConfig) -> None:
    """Refuse a ``--kv-tokens`` whose KV cache cannot fit in memory, before allocating it."""
    dtype = _DTYPES.get(args.dtype) or config.dtype
    per_token = (
        2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    ) * dtype.itemsize
    if args.algorithm in ("draft_model", "eagle"):
        per_token *= 2  # the drafter keeps its own KV (an upper bound for a 1-layer head)
    need = args.kv_tokens * per_token
    available = _available_memory()
    if available is not None and need > available:
        raise InvalidConfig(
            f"--kv-tokens {args.kv_tokens}: the KV cache needs {need / 2**30:.1f} GiB "
            f"({per_token} bytes a token) but {available / 2**30:.1f} GiB of memory is "
            "available; lower --kv-tokens"
        )


def _load_engine(
    args: argparse.Namespace, config: EngineConfig, trace: TraceRecorder | None
) -> Engine:
    """The worker and the engine; a checkpoint that cannot be loaded is `InvalidConfig`."""
    try:
        worker, limits = build_worker(args)
        return Engine(worker, limits=limits, config=config, trace=trace)
    except SpecStateError:
        raise
    except (MemoryError, RuntimeError) as exc:
        if isinstance(exc, MemoryError) or "allocate" in str(exc):
            raise InvalidConfig(
                f"out of memory building the engine with --kv-tokens {args.kv_tokens} "
                f"({type(exc).__name__}: {str(exc)[:200]}); lower --kv-tokens"
            ) from None
        raise InvalidConfig(
            f"--model {args.model}: cannot load the checkpoint ({type(exc).__name__}: {exc})"
        ) from None
    except (OSError, ValueError, KeyError) as exc:  # safetensors, torch, json
        raise InvalidConfig(
            f"--model {args.model}: cannot load the checkpoint ({type(exc).__name__}: {exc})"
        ) from None


class _Writer:
    """Writes result rows in input order, each as soon as it and every earlier one ended."""

    def __init__(self, out: IO[str], reqs: list[Req]) -> None:
        self._out = out
        self._reqs = reqs
        self._next = 0

    def flush_finished(self) -> None:
        """Write every finished request not written yet that follows the rows written."""
        while self._next < len(self._reqs) and self._reqs[self._next].is_finished:
            r = self._reqs[self._next]
            row = {
                "id": r.request_id,
                "output_ids": list(r.emitted_ids),
                "finish_reason": None if r.finish is None else r.finish.reason.value,
                "accept_lengths": list(r.accept_lengths),
            }
            if r.finish is not None and r.finish.reason is FinishReason.ERROR:
                row["error"] = r.finish.detail
            print(json.dumps(row), file=self._out, flush=True)
            self._next += 1


def _drive(engine: Engine, writer: _Writer) -> None:
    while not engine.is_idle:
        engine.step()
        writer.flush_finished()
    writer.flush_finished()


def _write_trace(recorder: TraceRecorder, trace: IO[str] | None, perfetto: IO[str] | None) -> None:
    """Write what was recorded (also after a failed run: it shows what happened)."""
    if trace is not None:
        for record in recorder.records():
            trace.write(json.dumps(record) + "\n")
    if perfetto is not None:
        json.dump({"traceEvents": recorder.chrome_trace(name="specstate generate")}, perfetto)


def run(args: argparse.Namespace) -> int:
    """Run the command; 0 on success, 1 if a request ended with an error, 2 on bad input."""
    reqs: list[Req] = []
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
            forward_timeout_s=args.forward_timeout,
        )
        # Every output opens before the model loads: a bad path fails at once.
        recorder = TraceRecorder() if args.trace or args.perfetto else None
        with ExitStack() as files:
            out = files.enter_context(_open_output(args.output, "--output"))
            trace = (
                None
                if args.trace is None
                else files.enter_context(_open_output(args.trace, "--trace"))
            )
            perfetto = (
                None
                if args.perfetto is None
                else files.enter_context(_open_output(args.perfetto, "--perfetto"))
            )
            with _load_engine(args, config, recorder) as engine:
                reqs = [engine.submit(r.request_id, r.input_ids, r.params) for r in requests]
                try:
                    _drive(engine, _Writer(out, reqs))
                finally:
                    if recorder is not None:
                        _write_trace(recorder, trace, perfetto)
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
