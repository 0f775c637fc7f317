"""Test-only: what the tests of the two example adapters (``examples/*.py``) share.

``examples/`` is not a package (each file is a standalone adapter a user copies), so an
example is imported by its path. Both tests serve the same prompts through the engine with the
invariant checker after every step and compare with transformers' greedy ``generate()``, clear
of argmax near-ties; both docs walk-throughs quote their example verbatim.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

import torch
from engine_driver import run_checked
from hf_oracle import greedy
from transformers import GPT2LMHeadModel, LlamaForCausalLM

from specstate import Engine, EngineConfig, RequestLimits, SamplingParams, WorkerProtocol
from specstate.engine.invariants import check_engine

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
NEW_TOKENS = 20
STEPS = 3  # K; D = 4
PROMPTS = [
    [62, 93, 3, 60, 5, 62, 93, 3, 60, 5],
    [70, 32, 4, 70, 32, 4],
    [75, 48, 75],
    [11, 12, 13, 14, 15, 16, 17, 18],
    [42],
]
"""Repetition makes n-gram drafts hit, fully or in part; one 1-token prompt. Each continuation
is clear of argmax near-ties (see `clear_greedy`), so a comparison tests the adapter, not
rounding."""

Served = tuple[list[list[int]], list[str], dict[int, int], tuple[str, ...]]
"""Each request's tokens and finish reason, the accept-length histogram, the retracted ids."""


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py``, imported by path."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def clear_greedy(model: LlamaForCausalLM | GPT2LMHeadModel) -> list[list[int]]:
    """transformers' greedy ``generate()`` of every prompt, checked to be free of near-ties.

    The adapter and ``generate()`` (which caches KV its own way) round differently; where the
    two best logits are within rounding of each other, argmax may differ without any bug.
    """
    outputs = [greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    for prompt, out in zip(PROMPTS, outputs, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + out]), use_cache=False).logits
        top2 = logits[0, len(prompt) - 1 :].topk(2, dim=-1).values
        margin = float((top2[:, 0] - top2[:, 1]).min())
        assert margin > 1e-3, f"prompt {prompt} has an argmax near-tie ({margin}); pick another"
    return outputs


def stops_mid_output(
    expected: Sequence[Sequence[int]],
) -> tuple[list[int | None], list[list[int]]]:
    """Every other request stops at its output's tenth token: the stops, and the outputs."""
    stops = [out[9] if i % 2 == 0 else None for i, out in enumerate(expected)]
    wants = [
        list(out) if s is None else list(out[: out.index(s) + 1])
        for out, s in zip(expected, stops, strict=True)
    ]
    return stops, wants


def serve(
    worker: WorkerProtocol,
    vocab_size: int,
    config: EngineConfig,
    stops: Sequence[int | None],
    *,
    abort: str | None = None,
) -> Served:
    """Serve PROMPTS on ``worker`` with the invariant checker after every step; ``abort`` is
    aborted after the third step. Every page is free at the end."""
    limits = RequestLimits(vocab_size=vocab_size, max_context_len=64)
    with Engine(worker, limits=limits, config=config) as engine:
        reqs = [
            engine.submit(
                f"p{i}",
                prompt,
                SamplingParams(max_new_tokens=NEW_TOKENS, stop_token_ids=() if s is None else (s,)),
            )
            for i, (prompt, s) in enumerate(zip(PROMPTS, stops, strict=True))
        ]
        retracted: list[str] = []
        if abort is not None:
            for _ in range(3):
                retracted.extend(engine.step().retracted)
                check_engine(engine)
            engine.abort(abort)
        log = run_checked(engine)
        snap = engine.snapshot()
    assert snap.num_open_slots == 0 and snap.num_free_pages == snap.num_pages
    reasons = [r.finish.reason.value if r.finish is not None else "none" for r in reqs]
    outputs = [list(r.emitted_ids) for r in reqs]
    return outputs, reasons, dict(snap.metrics.histogram), (*retracted, *log.retracted)


def assert_quotes_verbatim(example: str, doc: str, *, at_least: int) -> None:
    """Every ``py-excerpt`` block of ``docs/<doc>`` (at least ``at_least``) is a run of the
    lines of ``examples/<example>.py``."""
    page = EXAMPLES.parent / "docs" / doc
    blocks = re.findall(r"```py-excerpt\n(.*?)```", page.read_text(encoding="utf-8"), re.S)
    path = EXAMPLES / f"{example}.py"
    source = "\n".join(line.strip() for line in path.read_text(encoding="utf-8").splitlines())
    assert len(blocks) >= at_least
    for block in blocks:
        quoted = "\n".join(line.strip() for line in block.strip("\n").splitlines())
        assert f"\n{quoted}\n" in f"\n{source}\n", f"not in the example:\n{block}"
