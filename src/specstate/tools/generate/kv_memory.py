"""The KV pool of a ``generate`` run: ``--kv-tokens``, or sized by a memory budget.

``--kv-memory 2GiB`` buys the most token slots whose KV caches fit in 2 GiB, and
``--kv-fraction 0.5`` half of the memory free on ``--device`` (on a GPU what
``torch.cuda.mem_get_info`` reports free; on the CPU what the OS reports available,
``MemAvailable``), by `specstate.engine.planning`: bytes a token from the checkpoints'
``config.json`` (the target and, for ``draft_model`` / ``eagle``, the drafter's cache), in the
run's ``--dtype``. A hybrid target or drafter (NemotronH, LFM2) also keeps recurrent state
rows, whose size does not depend on the pool (`recurrent_state_bytes`: ``--max-running`` and
the verify width): they come off the budget first. Either sets ``args.kv_tokens`` before the
engine config is made, so a ``--worker`` factory sees the number too (only ``--model``'s KV is
counted then: the factory's drafter and state are unknown). Whatever sets it, a pool whose
caches and state rows cannot fit in the free memory is refused before anything is allocated.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Final

import attrs

from specstate.core.errors import InvalidConfig
from specstate.tools.engine_options import DTYPES

if TYPE_CHECKING:
    from specstate.engine.planning import KvLayout
    from specstate.memory.recurrent_layout import RecurrentStateSpec

__all__ = ["DEFAULT_KV_TOKENS", "check_kv_fits", "free_memory", "resolve_kv_tokens"]

DEFAULT_KV_TOKENS: Final = 16384
"""``--kv-tokens`` when neither it nor ``--kv-memory`` / ``--kv-fraction`` is given."""


def resolve_kv_tokens(args: argparse.Namespace) -> str | None:
    """Set ``args.kv_tokens``; for a budget, one line saying what it bought (else None).

    Raises:
        InvalidConfig: a budget without ``--model`` to size a token by, a budget under two
            pages (after a hybrid's state rows), or ``--kv-fraction`` where the free memory is
            unknown.
    """
    if args.kv_memory is None and args.kv_fraction is None:
        if args.kv_tokens is None:
            args.kv_tokens = DEFAULT_KV_TOKENS
        return None
    from specstate.engine.planning import format_bytes, kv_bytes_for_tokens, kv_tokens_for_budget

    flag = "--kv-memory" if args.kv_memory is not None else "--kv-fraction"
    if args.model is None:
        raise InvalidConfig(f"{flag} needs --model DIR: its config.json sizes a KV token")
    reference = args.worker is None
    layouts = _layouts(args, reference=reference)
    state, state_line = _state_bytes(args, reference=reference)
    if args.kv_memory is not None:
        budget, what = args.kv_memory, f"--kv-memory {format_bytes(args.kv_memory)}"
    else:
        free = free_memory(args.device)
        if free is None:
            raise InvalidConfig(f"--kv-fraction: the free memory of {args.device} is unknown")
        budget = int(args.kv_fraction * free)
        what = f"--kv-fraction {args.kv_fraction:g} of {format_bytes(free)} free on {args.device}"
    if state and state >= budget:
        raise InvalidConfig(
            f"{what}: the recurrent state rows alone take {format_bytes(state)} ({state_line}); "
            "raise the budget or lower --max-running"
        )
    try:
        args.kv_tokens = kv_tokens_for_budget(budget - state, layouts, page_size=args.page_size)
    except InvalidConfig as exc:
        left = f" (after {format_bytes(state)} of recurrent state)" if state else ""
        raise InvalidConfig(f"{what}{left}: {exc}") from None
    need = kv_bytes_for_tokens(args.kv_tokens, layouts, page_size=args.page_size)
    line = (
        f"{what}: --kv-tokens {args.kv_tokens}, {format_bytes(need)} of KV cache at "
        f"{_describe(layouts)}"
    )
    return line + (
        f", and {format_bytes(state)} of recurrent state ({state_line})" if state else ""
    )


def check_kv_fits(args: argparse.Namespace) -> None:
    """Refuse a pool whose KV caches cannot fit in the free memory, before allocating it.

    Counts the caches of the reference worker ``args`` names (`kv_layouts`), on ``--device``.
    """
    from specstate.engine.planning import format_bytes, kv_bytes_for_tokens

    kv_tokens = DEFAULT_KV_TOKENS if args.kv_tokens is None else args.kv_tokens
    device = getattr(args, "device", "cpu")  # a Namespace a factory built by hand may lack it
    layouts = _layouts(args, reference=True)
    need = kv_bytes_for_tokens(kv_tokens, layouts, page_size=getattr(args, "page_size", 1))
    state, state_line = _state_bytes(args, reference=True)
    available = free_memory(device)
    if available is not None and need + state > available:
        per_token = sum(layout.bytes_per_token for layout in layouts)
        rows = f" and {format_bytes(state)} of recurrent state ({state_line})" if state else ""
        raise InvalidConfig(
            f"--kv-tokens {kv_tokens}: the KV cache needs {format_bytes(need)} "
            f"({per_token} bytes a token){rows} but {format_bytes(available)} of memory is "
            f"available on {device}; lower --kv-tokens (or size it with --kv-memory)"
        )


def free_memory(device: str) -> int | None:
    """Bytes free on ``device``: CUDA's free memory, or on the CPU the OS's ``MemAvailable``."""
    import torch

    parsed = torch.device(device)
    if parsed.type == "cuda":
        free, _total = torch.cuda.mem_get_info(parsed)
        return int(free)
    if parsed.type != "cpu":
        return None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _layouts(args: argparse.Namespace, *, reference: bool) -> tuple[KvLayout, ...]:
    """The caches of the run's worker: the target's and, for the reference drafters, theirs.

    A ``--worker`` factory's own drafter is unknown here (``reference`` False): only
    ``--model`` is counted.
    """
    import torch

    from specstate.engine.planning import KvLayout, kv_layouts

    draft = args.draft if reference and args.algorithm == "draft_model" else None
    eagle = args.draft if reference and args.algorithm in ("eagle", "eagle3") else None
    dtype = getattr(torch, args.dtype) if args.dtype in DTYPES else None
    layouts = kv_layouts(args.model, draft=draft, eagle=eagle, dtype=dtype)
    if reference and args.algorithm == "mtp":  # L layers, each the target's KV geometry
        from specstate.reference.mtp import read_mtp_spec

        count = read_mtp_spec(args.model).num_layers
        layouts = (*layouts, attrs.evolve(layouts[0], num_layers=count, name="mtp"))
    if reference and args.algorithm in ("dflash", "dspark") and args.draft is not None:
        # The assistant keeps a KV cache per token slot too, in the target's dtype.
        assistant = KvLayout.from_config(args.draft, name="assistant")
        layouts += (attrs.evolve(assistant, dtype_bytes=layouts[0].dtype_bytes),)
    return layouts


def _state_bytes(args: argparse.Namespace, *, reference: bool) -> tuple[int, str]:
    """The bytes of the reference worker's recurrent state rows, and how they add up.

    A hybrid target (and a hybrid ``draft_model`` drafter) keeps ``C = D + 1`` rows per
    request slot (`recurrent_state_bytes`), ``D`` = ``--num-steps`` + 1 with a drafter and 1
    without. (0, "") for a Llama, and for a ``--worker`` factory (``reference`` False).
    """
    if not reference or args.model is None:
        return 0, ""
    import torch

    from specstate.engine.config import EngineConfig
    from specstate.engine.planning import recurrent_state_bytes
    from specstate.reference.hybrid.checkpoint import is_hybrid_checkpoint, read_hybrid_config

    dtype = getattr(torch, args.dtype) if args.dtype in DTYPES else None
    specs: list[RecurrentStateSpec] = []
    draft = args.draft if args.algorithm == "draft_model" else None
    for path, prefix in ((args.model, "target"), (draft, "draft")):
        if path is None or not is_hybrid_checkpoint(path):
            continue
        config = read_hybrid_config(path)
        if dtype is not None:
            config = attrs.evolve(config, dtype=dtype)
        spec = config.recurrent_spec(prefix)
        if spec is not None:
            specs.append(spec)
    if not specs:
        return 0, ""
    merged = specs[0].merged(specs[1] if len(specs) > 1 else None)
    max_running = getattr(args, "max_running", None) or EngineConfig().max_running
    width = 1 if args.algorithm == "none" else args.num_steps + 1
    state = recurrent_state_bytes(merged, max_running=max_running, num_draft_tokens=width)
    slots = 2 * max_running + 1
    return state, f"{slots} slots x {width + 1} rows x {merged.bytes_per_row} bytes"


def _describe(layouts: tuple[KvLayout, ...]) -> str:
    """``N bytes a token (target 2 x 4 layers x 2 heads x 64 x 4 B + eagle ...)``."""
    total = sum(layout.bytes_per_token for layout in layouts)
    parts = " + ".join(
        f"{layout.name} 2x{layout.num_layers}x{layout.num_kv_heads}x{layout.head_dim}x"
        f"{layout.dtype_bytes} B"
        for layout in layouts
    )
    return f"{total} bytes a token ({parts})"
