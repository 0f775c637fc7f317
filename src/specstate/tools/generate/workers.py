"""The worker and engine of a ``generate`` run: the reference registry or a ``--worker`` factory.

Everything that can go wrong while building them (a missing module, a factory that raises, an
unreadable checkpoint, a KV cache that cannot fit) becomes one `InvalidConfig` line naming the
flag, before any request runs.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from specstate.core.errors import InvalidConfig, InvalidRequest, SpecStateError
from specstate.core.params import RequestLimits
from specstate.grammar.spec import GrammarVocabulary
from specstate.serving.byte_codec import MAX_SPECIAL_IDS, NUM_BYTES
from specstate.serving.vocabulary import read_vocabulary
from specstate.tools.engine_options import DTYPES
from specstate.tools.generate.kv_memory import check_kv_fits

if TYPE_CHECKING:
    import torch

    from specstate.engine.config import EngineConfig
    from specstate.engine.engine import Engine
    from specstate.engine.trace import TraceRecorder
    from specstate.engine.worker import WorkerProtocol

__all__ = [
    "WorkerFactory",
    "build_worker",
    "checkpoint_limits",
    "load_engine",
    "load_factory",
    "torch_dtype",
]

_TREES: Final = ("draft_model", "eagle", "eagle3", "uno")
"""The algorithms that grow a draft tree with ``--topk`` above 1."""

WorkerFactory = Callable[[argparse.Namespace], "tuple[WorkerProtocol, RequestLimits]"]
"""``--worker MODULE:FACTORY``: parsed arguments in, ``(worker, limits)`` out."""


def torch_dtype(name: str) -> torch.dtype | None:
    """The torch dtype of ``--dtype`` (None for ``checkpoint``: keep the saved one)."""
    import torch

    return getattr(torch, name) if name in DTYPES else None


def checkpoint_limits(model: Path) -> RequestLimits:
    """The `RequestLimits` of a Hugging Face checkpoint: its vocabulary, context and EOS ids.

    Read from ``config.json`` for any architecture (``max_position_embeddings``, or GPT-2's
    ``n_positions``), so a ``--worker`` factory can use it for the model it runs. The grammar
    vocabulary is the bytes for a byte-level model, else read from ``tokenizer.json`` when the
    checkpoint has one (`GrammarVocabulary.from_tokenizer_json`; a tokenizer it cannot spell
    is reported on stderr, and grammars are then refused), else None; a model without an EOS id
    has none (a grammar ends on EOS).
    """
    config = read_vocabulary(model)
    specials = [*config.eos_token_ids]
    if config.bos_token_id is not None:
        specials.append(config.bos_token_id)
    byte_level = NUM_BYTES <= config.vocab_size <= NUM_BYTES + MAX_SPECIAL_IDS and all(
        t >= NUM_BYTES for t in specials
    )
    vocabulary = None
    if byte_level and config.eos_token_ids:  # `byte_codec`: ids 0-255 are bytes
        vocabulary = GrammarVocabulary.byte_level(config.vocab_size)
    elif config.eos_token_ids and (model / "tokenizer.json").is_file():
        try:  # a subword tokenizer that spells its tokens as bytes
            vocabulary = GrammarVocabulary.from_tokenizer_json(
                model / "tokenizer.json", vocab_size=config.vocab_size, special_ids=specials
            )
        except InvalidConfig as exc:  # the model still serves; grammars are refused
            print(f"specstate: no grammar vocabulary: {exc}", file=sys.stderr)
    return RequestLimits(
        vocab_size=config.vocab_size,
        max_context_len=config.max_context_len,
        eos_token_ids=frozenset(config.eos_token_ids),
        grammar_vocabulary=vocabulary,
    )


def build_worker(args: argparse.Namespace) -> tuple[WorkerProtocol, RequestLimits]:
    """The default factory: the reference worker named by ``--algorithm`` on ``--model`` (a
    Llama, or a NemotronH or LFM2 hybrid: `specstate.reference.hybrid`).

    It reads ``model``, ``draft``, ``algorithm``, ``num_steps``, ``topk``,
    ``num_draft_tokens``, ``dtype``, ``kv_tokens``, ``page_size``, ``device`` and ``seed`` of
    ``args`` (the reference worker's models go where the engine's memory is, ``device``).
    """
    from specstate.reference.checkpoint import read_model_config
    from specstate.reference.hybrid.checkpoint import is_hybrid_checkpoint, read_hybrid_config
    from specstate.reference.workers import default_registry

    if args.model is None:
        raise InvalidConfig("--model DIR is required (or --worker MODULE:FACTORY)")
    try:  # a checkpoint the reference model cannot load fails first
        if is_hybrid_checkpoint(args.model):
            read_hybrid_config(args.model)  # NemotronH or LFM2: a reference hybrid model
        else:
            read_model_config(args.model)
    except InvalidConfig as exc:
        if "model_type" not in str(exc):
            raise
        raise InvalidConfig(
            f"{exc}. The reference workers run Llama, NemotronH and LFM2 checkpoints; drive "
            "another architecture with --worker MODULE:FACTORY (a factory of your adapter)"
        ) from None
    check_kv_fits(args)
    limits = checkpoint_limits(args.model)
    drafter = _DRAFTER_OPTION.get(args.algorithm)
    if args.draft is not None and drafter is None:
        raise InvalidRequest(
            f"--draft is used by {', '.join(_DRAFTER_OPTION)}, not {args.algorithm}"
        )
    options: dict[str, object] = {"target": args.model, "dtype": torch_dtype(args.dtype)}
    if getattr(args, "seed", None) is not None:
        options["seed"] = args.seed
    if args.algorithm != "none":
        options["num_steps"] = args.num_steps
    if args.topk != 1 or args.num_draft_tokens is not None:
        if args.algorithm not in _TREES:
            raise InvalidRequest(
                f"--topk and --num-draft-tokens grow a draft tree ({', '.join(_TREES)}), not "
                f"{args.algorithm}"
            )
        options["topk"] = args.topk
        options["num_draft_tokens"] = args.num_draft_tokens
    if drafter is not None:
        if args.draft is None and args.algorithm != "uno":  # uno without one decodes plainly
            raise InvalidRequest(f"--algorithm {args.algorithm} needs --draft DIR")
        options[drafter] = args.draft
    if args.algorithm in ("dflash", "dspark"):  # the verified drafts fit the assistant's block
        from specstate.reference.dflash_checkpoint import read_dflash_config

        block = read_dflash_config(args.draft).block_size
        options["num_steps"] = min(args.num_steps, block - 1)
    return default_registry().create(args.algorithm, **options), limits


_DRAFTER_OPTION: Final = {
    "draft_model": "draft",
    "eagle": "eagle",
    "eagle3": "eagle3",
    "frozen_kv_mtp": "assistant",
    "dflash": "assistant",
    "dspark": "assistant",
    "uno": "adapter",
}
"""The worker option ``--draft`` fills, by algorithm (``mtp``'s layers are in ``--model``)."""


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


def load_engine(
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
        leader = getattr(args, "tp_leader", None)
        if leader is not None:  # --tp: rank 0 of a tensor-parallel group (a `TpLeader`)
            engine: Engine = leader.engine(worker, limits=limits, config=config, trace=trace)
            return engine
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
