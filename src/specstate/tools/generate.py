"""``specstate generate``: run a JSONL of requests through the engine on an HF Llama checkpoint.

Input, one JSON object per line::

    {"id": str, "input_ids": [int, ...] | "text": str, "max_new_tokens"?: int,
     "stop_token_ids"?: [int, ...], "temperature"?: number, "top_p"?: number,
     "top_k"?: int | null, "seed"?: int | null, "speculative"?: bool,
     "repetition_penalty"?: number, "frequency_penalty"?: number,
     "presence_penalty"?: number, "min_new_tokens"?: int,
     "stop_sequences"?: [[int, ...], ...], "logprobs"?: bool}

Output, one per request in input order: ``{"id", "output_ids", "finish_reason",
"accept_lengths"}``, plus ``"text"`` (the output decoded) when the request gave ``"text"``,
``"logprobs"`` (one float per output token) when it asked for them, and ``"error"`` (the
reason) for a request that ended with an error; the exit code is then 1.
``--trace FILE`` records the run (spans, rounds, events: the JSONL of `specstate.engine.trace`,
read back by ``specstate trace FILE``) and ``--perfetto FILE`` writes its timeline as Chrome /
Perfetto trace events. On a terminal a progress bar runs on stderr; at the end a summary
(requests, tokens, tok/s, mean accept length) goes to stderr, and with ``--summary-json FILE``
to a file as JSON.

Input is read strictly: a line with an unknown field or a wrong type or range (a string of
digits for ``input_ids``, a float, a bool, a null ``id``, a negative temperature) fails before
any request runs, naming the file, the line and the field; so does an output path that cannot be
written. Result rows are written in input order as soon as a request and every earlier one have
ended, so nothing computed is lost if the run stops.

``text`` needs a byte-level checkpoint (`byte_codec`): its ids 0-255 are the UTF-8 bytes, as in
the embedded model; the prompt is its BOS id (if the config names one) then the text's bytes.
``seed`` is the request's own seed (`SamplingParams.seed`): a seeded sampled request emits the
same tokens whatever else runs; ``--seed`` seeds the worker's generator, which the unseeded
sampled requests draw from.

``--worker MODULE:FACTORY`` drives a custom worker: ``FACTORY(args)`` receives the parsed
arguments (an `argparse.Namespace`; ``args.seed`` is ``--seed``, the worker's seed, or None)
and returns ``(worker, limits)``, a `WorkerProtocol` and the `RequestLimits` of its model;
`build_worker` is the default factory and `checkpoint_limits` reads the limits of a checkpoint.

This module imports torch and the engine only when the command runs, so ``--help`` is instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final

import attrs

from specstate.core.errors import InvalidConfig, InvalidRequest, SpecStateError
from specstate.core.request import FinishReason, Req, RequestLimits, SamplingParams

if TYPE_CHECKING:
    import torch

    from specstate.engine.engine import Engine, EngineConfig
    from specstate.engine.trace import TraceRecorder
    from specstate.engine.worker import WorkerProtocol
    from specstate.reference.model import ModelConfig

__all__ = [
    "ByteCodec",
    "RunSummary",
    "WorkerFactory",
    "add_arguments",
    "build_worker",
    "byte_codec",
    "checkpoint_limits",
    "load_factory",
    "run",
]

ALGORITHMS = ("none", "draft_model", "eagle", "ngram")
_DTYPES: Final = ("float32", "bfloat16", "float16")

WorkerFactory = Callable[[argparse.Namespace], "tuple[WorkerProtocol, RequestLimits]"]
"""``--worker MODULE:FACTORY``: parsed arguments in, ``(worker, limits)`` out."""

NUM_BYTES: Final = 256
MAX_SPECIAL_IDS: Final = 16
"""A byte-level vocabulary: the 256 byte values, then at most this many special ids."""

THREADS_NOTE: Final = (
    "torch intra-op threads (torch.set_num_threads); default: torch's own choice. With "
    "--no-overlap the forward runs on the main thread in torch's intra-op pool, which on a "
    "busy or small machine can be many times slower than fewer threads: set it to the cores "
    "you can spare (1 on a shared 2-core machine)"
)


@attrs.frozen(kw_only=True)
class _Line:
    where: str
    request_id: str
    input_ids: tuple[int, ...] | None
    text: str | None
    params: SamplingParams


@attrs.frozen(kw_only=True)
class ByteCodec:
    """Text <-> ids of a byte-level model: ids 0-255 are UTF-8 bytes; others are special."""

    bos_token_id: int | None

    def encode(self, text: str) -> tuple[int, ...]:
        """BOS (if the model has one), then the UTF-8 bytes of ``text``."""
        head = () if self.bos_token_id is None else (self.bos_token_id,)
        return (*head, *text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        """Byte ids as UTF-8 (an invalid sequence becomes U+FFFD); special ids are dropped."""
        return bytes(i for i in ids if 0 <= i < NUM_BYTES).decode("utf-8", errors="replace")


def _positive(text: str) -> int:
    """An integer >= 1 (argparse turns the ValueError into a usage error, exit 2)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``generate`` command's arguments."""
    parser.description = "Generate for a JSONL of requests with speculation and overlap."
    parser.epilog = (
        "Request lines: {id, input_ids | text, max_new_tokens?, stop_token_ids?, temperature?, "
        "top_p?, top_k?, seed?, speculative?, repetition_penalty?, frequency_penalty?, "
        "presence_penalty?, min_new_tokens?, stop_sequences?, logprobs?}. Exit codes: 0 all "
        "requests ended normally, 1 some ended with an error, 2 bad input, options or "
        "checkpoint. Threads: with --no-overlap the forward runs on the main thread, so "
        "--threads matters most there."
    )
    parser.add_argument(
        "--model", type=Path, help="HF Llama checkpoint dir (optional with --worker)"
    )
    parser.add_argument("--draft", type=Path, help="draft checkpoint (draft_model) or head (eagle)")
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="none", help="drafting")
    parser.add_argument("--num-steps", type=int, default=4, help="draft steps per round")
    parser.add_argument(
        "--topk",
        type=_positive,
        default=1,
        help="draft branches per step: above 1 the drafter grows a tree (draft_model, eagle)",
    )
    parser.add_argument(
        "--num-draft-tokens",
        type=_positive,
        metavar="N",
        help="tree nodes verified per round, root included (default: num_steps * topk + 1)",
    )
    parser.add_argument(
        "--adaptive",
        action="store_true",
        help="choose each round's draft steps from recent acceptance (speculation switches "
        "off when drafts are rarely accepted, and back on after a probe)",
    )
    parser.add_argument(
        "--worker",
        metavar="MODULE:FACTORY",
        help="drive a custom worker: FACTORY(args) returns (WorkerProtocol, RequestLimits); "
        "MODULE is imported from the working directory or sys.path",
    )
    parser.add_argument("--page-size", type=int, default=1, help="KV page size")
    parser.add_argument(
        "--overlap",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="schedule the next batch while the forward runs (--no-overlap: the forward runs "
        "on the main thread; see --threads)",
    )
    parser.add_argument("--kv-tokens", type=int, default=16384, help="KV token slots")
    parser.add_argument("--max-running", type=int, default=32, help="most requests at once")
    parser.add_argument(
        "--chunked-prefill", type=int, default=None, help="prefill tokens per forward"
    )
    parser.add_argument("--input", type=Path, required=True, help="requests, JSONL")
    parser.add_argument("--output", type=Path, required=True, help="results, JSONL")
    parser.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the worker's generator, which sampled requests without their own seed "
        "draw from (they reproduce for the same seed and requests); default: a fresh one",
    )
    parser.add_argument("--threads", type=_positive, metavar="N", help=THREADS_NOTE)
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


# ---------------------------------------------------------------------------- input
_FIELDS = frozenset(
    {
        "id",
        "input_ids",
        "text",
        "max_new_tokens",
        "stop_token_ids",
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "speculative",
        "repetition_penalty",
        "frequency_penalty",
        "presence_penalty",
        "min_new_tokens",
        "stop_sequences",
        "logprobs",
    }
)
_MAX_SEED: Final = 2**63
"""A request's seed is an integer in [0, 2^63) (`SamplingParams.seed`)."""


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
    rid = obj.get("id")
    if not isinstance(rid, str) or not rid:
        raise InvalidRequest(f'{where}: "id" must be a non-empty string, got {rid!r}')
    ids, text = _prompt(obj, where)
    cap = obj.get("max_new_tokens", 128)
    if not _is_id(cap):
        raise InvalidRequest(f'{where}: "max_new_tokens" must be an integer, got {cap!r}')
    stops = obj.get("stop_token_ids", [])
    if not isinstance(stops, list) or not all(_is_id(t) for t in stops):
        raise InvalidRequest(
            f'{where}: "stop_token_ids" must be a list of integers, got {stops!r:.60}'
        )
    temperature = obj.get("temperature", 0.0)
    if not _is_number(temperature) or temperature < 0:
        raise InvalidRequest(
            f'{where}: "temperature" must be a number >= 0 (0: greedy), got {temperature!r}'
        )
    top_p = obj.get("top_p", 1.0)
    if not _is_number(top_p) or not 0 < top_p <= 1:
        raise InvalidRequest(f'{where}: "top_p" must be a number in (0, 1], got {top_p!r}')
    top_k = obj.get("top_k")
    if top_k is not None and (not _is_id(top_k) or top_k < 1):
        raise InvalidRequest(f'{where}: "top_k" must be an integer >= 1 or null, got {top_k!r}')
    seed = obj.get("seed")
    if seed is not None and (not _is_id(seed) or not 0 <= seed < _MAX_SEED):
        raise InvalidRequest(f'{where}: "seed" must be an integer in [0, 2^63), got {seed!r}')
    flags = {name: obj.get(name, default) for name, default in _FLAGS.items()}
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise InvalidRequest(f'{where}: "{name}" must be true or false, got {value!r}')
    penalties = {name: obj.get(name, default) for name, default in _PENALTIES.items()}
    for name, value in penalties.items():
        if not _is_number(value):
            raise InvalidRequest(f'{where}: "{name}" must be a number, got {value!r}')
    min_new = obj.get("min_new_tokens", 0)
    if not _is_id(min_new):
        raise InvalidRequest(f'{where}: "min_new_tokens" must be an integer, got {min_new!r}')
    sequences = obj.get("stop_sequences", [])
    if not isinstance(sequences, list) or not all(
        isinstance(q, list) and q and all(_is_id(t) for t in q) for q in sequences
    ):
        raise InvalidRequest(
            f'{where}: "stop_sequences" must be a list of non-empty lists of integers, '
            f"got {sequences!r:.60}"
        )
    params = SamplingParams(  # ranges are checked at submit, naming this line
        max_new_tokens=cap,
        stop_token_ids=stops,
        temperature=float(temperature),
        top_p=float(top_p),
        top_k=top_k,
        seed=seed,
        min_new_tokens=min_new,
        stop_sequences=tuple(tuple(q) for q in sequences),
        repetition_penalty=float(penalties["repetition_penalty"]),
        frequency_penalty=float(penalties["frequency_penalty"]),
        presence_penalty=float(penalties["presence_penalty"]),
        speculative=flags["speculative"],
        logprobs=flags["logprobs"],
    )
    return _Line(where=where, request_id=rid, input_ids=ids, text=text, params=params)


_FLAGS: Final = {"speculative": True, "logprobs": False}
_PENALTIES: Final = {"repetition_penalty": 1.0, "frequency_penalty": 0.0, "presence_penalty": 0.0}


def _prompt(obj: dict[str, Any], where: str) -> tuple[tuple[int, ...] | None, str | None]:
    """``input_ids`` or ``text``: exactly one of them."""
    if "text" in obj:
        text = obj["text"]
        if "input_ids" in obj:
            raise InvalidRequest(f'{where}: give "input_ids" or "text", not both')
        if not isinstance(text, str):
            raise InvalidRequest(f'{where}: "text" must be a string, got {text!r:.60}')
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidRequest(f'{where}: "text" is not valid Unicode ({exc.reason})') from None
        return None, text
    ids = obj.get("input_ids")
    if not isinstance(ids, list) or not all(_is_id(t) for t in ids):
        raise InvalidRequest(
            f'{where}: "input_ids" must be a list of integers (or give "text"), got {ids!r:.60}'
        )
    return tuple(ids), None


def _is_id(value: object) -> bool:
    """A JSON integer (JSON true/false are bools, and 1e400 is a float)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    """A finite JSON number (not a bool; Python's JSON reads NaN and Infinity, refused here;
    an integer too large for a float, such as 1 followed by 400 zeros, is refused too)."""
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:
        return False


# ---------------------------------------------------------------------------- text
def byte_codec(model: Path | None) -> ByteCodec:
    """The text codec of a byte-level checkpoint; `InvalidRequest` saying why not otherwise.

    A checkpoint is byte-level when its ``config.json`` has a ``vocab_size`` of 256 to 256 +
    `MAX_SPECIAL_IDS` and every BOS / EOS id it names is >= 256: ids 0-255 are then the byte
    values (the embedded model: 260 ids, BOS 256, EOS 257).
    """
    if model is None:
        raise InvalidRequest('"text" needs --model DIR, a byte-level checkpoint to encode it')
    from specstate.reference.checkpoint import read_model_config

    config = read_model_config(model)
    specials = [*config.eos_token_ids]
    if config.bos_token_id is not None:
        specials.append(config.bos_token_id)
    in_range = NUM_BYTES <= config.vocab_size <= NUM_BYTES + MAX_SPECIAL_IDS
    if not in_range or any(t < NUM_BYTES for t in specials):
        raise InvalidRequest(
            f'"text" needs a byte-level model (ids 0-255 are UTF-8 bytes: vocab_size 256 to '
            f"{NUM_BYTES + MAX_SPECIAL_IDS}, special ids >= 256), but --model {model} has "
            f"vocab_size {config.vocab_size} and special ids {sorted(specials)}; "
            'send "input_ids" instead'
        )
    return ByteCodec(bos_token_id=config.bos_token_id)


# ---------------------------------------------------------------------------- workers
def _torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of ``--dtype`` (None for ``checkpoint``: keep the saved one)."""
    import torch

    return getattr(torch, name) if name in _DTYPES else None


def checkpoint_limits(model: Path) -> RequestLimits:
    """The `RequestLimits` of an HF Llama checkpoint: its vocabulary, context and EOS ids."""
    from specstate.reference.checkpoint import read_model_config

    config = read_model_config(model)
    return RequestLimits(
        vocab_size=config.vocab_size,
        max_context_len=config.max_position_embeddings,
        eos_token_ids=frozenset(config.eos_token_ids),
    )


def build_worker(args: argparse.Namespace) -> tuple[WorkerProtocol, RequestLimits]:
    """The default factory: the reference worker named by ``--algorithm`` on ``--model``.

    It reads ``model``, ``draft``, ``algorithm``, ``num_steps``, ``dtype``, ``kv_tokens`` and
    ``seed`` of ``args``.
    """
    from specstate.reference.checkpoint import read_model_config
    from specstate.reference.workers import default_registry

    if args.model is None:
        raise InvalidConfig("--model DIR is required (or --worker MODULE:FACTORY)")
    config = read_model_config(args.model)
    _check_kv_memory(args, config)
    limits = checkpoint_limits(args.model)
    if args.draft is not None and args.algorithm not in ("draft_model", "eagle"):
        raise InvalidRequest(f"--draft is used by draft_model and eagle, not {args.algorithm}")
    options: dict[str, object] = {"target": args.model, "dtype": _torch_dtype(args.dtype)}
    if getattr(args, "seed", None) is not None:
        options["seed"] = args.seed
    if args.algorithm != "none":
        options["num_steps"] = args.num_steps
    if args.topk != 1 or args.num_draft_tokens is not None:
        if args.algorithm not in ("draft_model", "eagle"):
            raise InvalidRequest(
                f"--topk and --num-draft-tokens grow a draft tree (draft_model, eagle), not "
                f"{args.algorithm}"
            )
        options["topk"] = args.topk
        options["num_draft_tokens"] = args.num_draft_tokens
    if args.algorithm in ("draft_model", "eagle"):
        if args.draft is None:
            raise InvalidRequest(f"--algorithm {args.algorithm} needs --draft DIR")
        options["draft" if args.algorithm == "draft_model" else "eagle"] = args.draft
    return default_registry().create(args.algorithm, **options), limits


def _describe(exc: BaseException) -> str:
    """``Type: message (at file:line)``, the innermost frame: one line about user code."""
    frames = traceback.extract_tb(exc.__traceback__)
    at = f" (at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__name__}: {exc}{at}"


def load_factory(spec: str) -> WorkerFactory:
    """The callable named by ``MODULE:FACTORY`` (``FACTORY`` may be dotted: ``mod:Cls.make``).

    The working directory is searched first (added to ``sys.path`` if missing), as a user
    running ``specstate generate --worker my_workers:make`` next to ``my_workers.py`` expects.

    Raises:
        InvalidConfig: a malformed spec, a module that is missing or fails to import, a missing
            attribute, or one that is not callable; one line each.
    """
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise InvalidConfig(f"--worker {spec}: expected MODULE:FACTORY, e.g. my_workers:make")
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        missing = exc.name or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            raise InvalidConfig(
                f"--worker {spec}: no module named {missing!r} (searched the working directory "
                "and sys.path)"
            ) from None
        raise InvalidConfig(
            f"--worker {spec}: importing {module_name} failed: {_describe(exc)}"
        ) from None
    except BaseException as exc:  # a custom BaseException too; an interrupt stays one
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise InvalidConfig(
            f"--worker {spec}: importing {module_name} failed: {_describe(exc)}"
        ) from None
    found: object = module
    for part in attr.split("."):
        if not hasattr(found, part):
            raise InvalidConfig(f"--worker {spec}: module {module_name} has no attribute {attr!r}")
        found = getattr(found, part)
    if not callable(found):
        raise InvalidConfig(
            f"--worker {spec}: {attr} is a {type(found).__name__}, not a callable factory"
        )
    factory: WorkerFactory = found
    return factory


def _call_factory(
    factory: WorkerFactory, args: argparse.Namespace
) -> tuple[WorkerProtocol, RequestLimits]:
    """Run a ``--worker`` factory and check what it returns."""
    from specstate.engine.worker import WorkerProtocol

    spec = args.worker
    try:
        built: object = factory(args)
    except SpecStateError as exc:
        raise InvalidConfig(f"--worker {spec}: {exc}") from None
    except BaseException as exc:  # a custom BaseException too; an interrupt stays one
        if isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise InvalidConfig(f"--worker {spec}: the factory raised {_describe(exc)}") from None
    if isinstance(built, tuple) and len(built) == 2:
        worker, limits = built
        if isinstance(worker, WorkerProtocol) and isinstance(limits, RequestLimits):
            return worker, limits
    shape = (
        f"({', '.join(type(x).__name__ for x in built)})"
        if isinstance(built, tuple)
        else type(built).__name__
    )
    raise InvalidConfig(
        f"--worker {spec}: the factory must return (worker, limits), a WorkerProtocol "
        f"(capabilities, attach, forward_batch_generation) and a RequestLimits; it returned "
        f"{shape}"
    )


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
    dtype = _torch_dtype(args.dtype) or config.dtype
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
    args: argparse.Namespace,
    config: EngineConfig,
    trace: TraceRecorder | None,
    factory: WorkerFactory | None,
) -> Engine:
    """The worker and the engine; a worker that cannot be built is `InvalidConfig`."""
    from specstate.engine.engine import Engine

    what = f"--worker {args.worker}" if factory is not None else f"--model {args.model}"
    try:
        if factory is not None:
            worker, limits = _call_factory(factory, args)
        else:
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
        raise InvalidConfig(f"{what}: cannot load the worker ({_describe(exc)})") from None
    except (OSError, ValueError, KeyError) as exc:  # safetensors, torch, json
        raise InvalidConfig(
            f"{what}: cannot load the checkpoint ({type(exc).__name__}: {exc})"
        ) from None
    except BaseException as exc:  # a custom BaseException too; an interrupt stays one
        if factory is None or isinstance(exc, KeyboardInterrupt | SystemExit):
            raise
        raise InvalidConfig(f"{what}: the worker failed to attach ({_describe(exc)})") from None


# ---------------------------------------------------------------------------- output
class _Writer:
    """Writes result rows in input order, each as soon as it and every earlier one ended."""

    def __init__(self, out: IO[str], reqs: list[Req], codecs: list[ByteCodec | None]) -> None:
        self._out = out
        self._reqs = reqs
        self._codecs = codecs
        self._next = 0

    def flush_finished(self) -> None:
        """Write every finished request not written yet that follows the rows written."""
        while self._next < len(self._reqs) and self._reqs[self._next].is_finished:
            r = self._reqs[self._next]
            codec = self._codecs[self._next]
            row: dict[str, object] = {
                "id": r.request_id,
                "output_ids": list(r.emitted_ids),
                "finish_reason": None if r.finish is None else r.finish.reason.value,
                "accept_lengths": list(r.accept_lengths),
            }
            if codec is not None:
                row["text"] = codec.decode(r.emitted_ids)
            if r.logprobs is not None:
                row["logprobs"] = list(r.logprobs)
            if r.finish is not None and r.finish.reason is FinishReason.ERROR:
                row["error"] = r.finish.detail
            print(json.dumps(row), file=self._out, flush=True)
            self._next += 1


class _Progress:
    """A tqdm bar of ended requests on stderr, with tokens, tok/s and acceptance as postfix."""

    _EVERY_S: Final = 0.5

    def __init__(self, reqs: list[Req], *, show: bool) -> None:
        self._reqs = reqs
        self._live = {id(r): r for r in reqs}
        self._done_tokens = 0
        self._start = self._last = time.perf_counter()
        self._bar: Any = None
        if show:
            from tqdm import tqdm

            self._bar = tqdm(
                total=len(reqs), unit="req", desc="generate", file=sys.stderr, dynamic_ncols=True
            )

    def step(self, engine: Engine, ended: Sequence[Req]) -> None:
        """After a step: count the requests that ended; refresh the postfix now and then."""
        for r in ended:
            if self._live.pop(id(r), None) is not None:
                self._done_tokens += len(r.emitted_ids)
        if self._bar is None:
            return
        if ended:
            self._bar.update(len(ended))
        if time.perf_counter() - self._last >= self._EVERY_S:
            self._postfix(engine)

    def _postfix(self, engine: Engine) -> None:
        self._last = now = time.perf_counter()
        tokens = self._done_tokens + sum(r.num_outputs for r in self._live.values())
        rate = tokens / (now - self._start) if now > self._start else 0.0
        accept = engine.snapshot().metrics.mean_accept_length
        self._bar.set_postfix_str(f"{tokens} tok, {rate:.1f} tok/s, accept {accept:.2f}")

    def close(self, engine: Engine) -> None:
        """Show the final numbers and end the bar's line."""
        if self._bar is not None:
            self._postfix(engine)
            self._bar.close()


def _drive(engine: Engine, writer: _Writer, progress: _Progress) -> None:
    while not engine.is_idle:
        report = engine.step()
        progress.step(engine, report.ended)
        writer.flush_finished()
    writer.flush_finished()


def _write_trace(recorder: TraceRecorder, trace: IO[str] | None, perfetto: IO[str] | None) -> None:
    """Write what was recorded (also after a failed run: it shows what happened)."""
    if trace is not None:
        for record in recorder.records():
            trace.write(json.dumps(record) + "\n")
    if perfetto is not None:
        json.dump({"traceEvents": recorder.chrome_trace(name="specstate generate")}, perfetto)


@attrs.frozen(kw_only=True)
class RunSummary:
    """What one run did: printed to stderr at the end, and ``--summary-json`` writes it.

    ``finished`` counts requests that ended by a stop or the length cap, ``failed`` those that
    ended with an error, ``aborted`` those the engine had to abort; ``wall_s`` runs from the
    first submit to the last result (``load_s``, building the worker and engine, is apart) and
    ``tokens_per_second`` is ``generated_tokens / wall_s``. A run drives one worker, so one
    algorithm: ``mean_accept_length`` is tokens per verify (bonus included; 1.0 without
    speculation) and ``draft_acceptance`` the share of proposed drafts accepted (None without
    drafts).
    """

    requests: int
    finished: int
    failed: int
    aborted: int
    finish_reasons: dict[str, int]
    prompt_tokens: int
    generated_tokens: int
    load_s: float
    wall_s: float
    tokens_per_second: float
    algorithm: str
    num_steps: int
    verifies: int
    mean_accept_length: float
    draft_acceptance: float | None
    overlap: bool
    threads: int

    @classmethod
    def of(cls, engine: Engine, reqs: Sequence[Req], *, load_s: float, wall_s: float) -> RunSummary:
        """The summary of ``engine``'s run of ``reqs``."""
        import torch

        reasons = Counter(r.finish.reason.value for r in reqs if r.finish is not None)
        metrics = engine.snapshot().metrics
        caps = engine.worker.capabilities
        generated = sum(len(r.emitted_ids) for r in reqs)
        proposed = metrics.num_proposed_drafts
        return cls(
            requests=len(reqs),
            finished=reasons["stop"] + reasons["length"],
            failed=reasons["error"],
            aborted=reasons["abort"],
            finish_reasons=dict(sorted(reasons.items())),
            prompt_tokens=sum(len(r.prompt_ids) for r in reqs),
            generated_tokens=generated,
            load_s=round(load_s, 4),
            wall_s=round(wall_s, 4),
            tokens_per_second=round(generated / wall_s, 2) if wall_s > 0 else 0.0,
            algorithm=caps.algorithm,
            num_steps=caps.num_steps,
            verifies=metrics.num_verifies,
            mean_accept_length=round(metrics.mean_accept_length, 4),
            draft_acceptance=round(metrics.num_correct_drafts / proposed, 4) if proposed else None,
            overlap=engine.config.overlap,
            threads=torch.get_num_threads(),
        )

    def lines(self) -> list[str]:
        """The summary for people, three lines."""
        aborted = f", {self.aborted} aborted" if self.aborted else ""
        reasons = ", ".join(f"{k} {v}" for k, v in self.finish_reasons.items()) or "none"
        if self.num_steps:
            drafts = (
                ""
                if self.draft_acceptance is None
                else f", {100 * self.draft_acceptance:.1f}% of drafts accepted"
            )
            accept = (
                f"{self.algorithm} K={self.num_steps}: mean accept length "
                f"{self.mean_accept_length:.2f} over {self.verifies} verifies{drafts}"
            )
        else:
            accept = f"{self.algorithm}: no speculation (1 token per verify)"
        return [
            f"{self.requests} requests: {self.finished} finished, {self.failed} failed"
            f"{aborted} (finish reasons: {reasons})",
            f"{self.generated_tokens} tokens in {self.wall_s:.2f} s = "
            f"{self.tokens_per_second:.1f} tok/s (prompts {self.prompt_tokens} tokens; load "
            f"{self.load_s:.2f} s; {self.threads} torch thread(s), "
            f"{'overlap' if self.overlap else 'normal'} loop)",
            accept,
        ]


# ---------------------------------------------------------------------------- the command
def run(args: argparse.Namespace) -> int:
    """Run the command; 0 on success, 1 if a request ended with an error, 2 on bad input."""
    from specstate.engine.engine import EngineConfig
    from specstate.engine.trace import TraceRecorder

    reqs: list[Req] = []
    try:
        if args.model is None and args.worker is None:
            raise InvalidConfig("--model DIR is required (or --worker MODULE:FACTORY)")
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
            adaptive_draft=args.adaptive,
        )
        factory = None if args.worker is None else load_factory(args.worker)
        codec = None
        texts = [r for r in requests if r.text is not None]
        if texts:
            try:
                codec = byte_codec(args.model)
            except InvalidRequest as exc:
                raise InvalidRequest(f"{texts[0].where}: {exc}") from None
        if args.threads is not None:
            import torch

            torch.set_num_threads(args.threads)
        # Every output opens before the model loads: a bad path fails at once.
        recorder = TraceRecorder() if args.trace or args.perfetto else None
        with ExitStack() as files:
            out = files.enter_context(_open_output(args.output, "--output"))
            trace = _maybe_open(files, args.trace, "--trace")
            perfetto = _maybe_open(files, args.perfetto, "--perfetto")
            summary_file = _maybe_open(files, args.summary_json, "--summary-json")
            started = time.perf_counter()
            with _load_engine(args, config, recorder, factory) as engine:
                loaded = time.perf_counter()
                reqs = [_submit(engine, line, codec) for line in requests]
                codecs = [codec if line.text is not None else None for line in requests]
                show = args.progress if args.progress is not None else _interactive(args)
                progress = _Progress(reqs, show=show)
                try:
                    _drive(engine, _Writer(out, reqs, codecs), progress)
                finally:
                    progress.close(engine)
                    if recorder is not None:
                        _write_trace(recorder, trace, perfetto)
                done = time.perf_counter()
                summary = RunSummary.of(engine, reqs, load_s=loaded - started, wall_s=done - loaded)
            if summary_file is not None:
                json.dump(attrs.asdict(summary), summary_file, indent=2)
                summary_file.write("\n")
        if not args.quiet:
            for text in summary.lines():
                print(f"specstate generate: {text}", file=sys.stderr)
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


def _interactive(args: argparse.Namespace) -> bool:
    """Show progress by default only to a person: stderr is a terminal and not ``--quiet``."""
    return not args.quiet and sys.stderr.isatty()


def _submit(engine: Engine, line: _Line, codec: ByteCodec | None) -> Req:
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


def _maybe_open(files: ExitStack, path: Path | None, flag: str) -> IO[str] | None:
    return None if path is None else files.enter_context(_open_output(path, flag))


def _open_output(path: Path, flag: str) -> IO[str]:
    """An output file, opened before any work (a bad path fails at once, nothing lost)."""
    try:
        return path.open("w", encoding="utf-8")
    except OSError as exc:
        raise InvalidRequest(f"{flag} {path}: cannot write ({exc.strerror or exc})") from None
