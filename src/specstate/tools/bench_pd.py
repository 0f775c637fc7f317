"""``specstate bench pd``: what a prefill → decode handoff costs, per algorithm and prompt length.

On the embedded model, in one process, for each algorithm and prompt length: a prefill engine
runs one request's prefill and first token, the record crosses in its wire form
(`specstate.handoff`), a decode engine admits it. Reported per handoff:

* ``bytes``: tensor data that crossed (every slot-state buffer plus the draft state);
* ``export_ms``: export and encode on the prefill side; ``admit_ms``: decode and admit;
* ``first_decode_token_ms``: from the admission until the decode engine emitted the request's
  first token of its own (the import batch, then one decode round);
* ``prefill_tokens_avoided`` / ``drafter_prefill_tokens_avoided``: the positions the decode
  engine did not prefill (the committed length; the drafter's only for algorithms that prefill
  a drafter model).

A measurement, never an assertion: the numbers are for the record (docs/handoff.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from specstate.tools.bench_reports import header
from specstate.tools.cli_types import positive_ints

__all__ = ["add_parser", "measure", "run"]

_ALGORITHMS = ("none", "ngram", "draft_model", "eagle")
_DRAFTER_MODELS = frozenset({"draft_model", "eagle"})
_TEXT = "import os\nimport sys\n\n\ndef main(argv):\n    return len(argv)\n\n" * 40


def add_parser(benches: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``bench pd`` under the ``bench`` command's subcommands."""
    parser = benches.add_parser("pd", help="bytes and time per prefill → decode handoff")
    parser.add_argument(
        "--algorithms",
        type=lambda text: tuple(text.split(",")),
        default=_ALGORITHMS,
        metavar="LIST",
        help="default " + ",".join(_ALGORITHMS),
    )
    parser.add_argument(
        "--prompt-lens",
        type=positive_ints,
        default=(16, 128, 512),
        metavar="LIST",
        help="default 16,128,512",
    )
    parser.add_argument("--page-size", type=int, default=16, help="KV page size")
    parser.add_argument("--json", action="store_true", help="print JSON, not a table")


def _worker(algorithm: str) -> Any:
    import torch

    from specstate.reference import embedded
    from specstate.reference.workers import default_registry

    options: dict[str, object] = {"target": embedded.target_dir(), "dtype": torch.float32}
    if algorithm != "none":
        options["num_steps"] = 4
    if algorithm == "draft_model":
        options["draft"] = embedded.draft_dir()
    if algorithm == "eagle":
        options["eagle"] = embedded.eagle_dir()
    return default_registry().create(algorithm, **options)


def measure(algorithm: str, prompt_len: int, *, page_size: int = 16) -> dict[str, Any]:
    """One handoff of a ``prompt_len``-token request under ``algorithm`` (module docstring)."""
    from specstate import Engine, EngineConfig, RequestLimits, SamplingParams
    from specstate.handoff import decode, encode
    from specstate.reference import embedded

    limits = RequestLimits(
        vocab_size=embedded.VOCAB_SIZE, max_context_len=prompt_len + 64, eos_token_ids=()
    )
    config = EngineConfig(kv_tokens=4 * (prompt_len + 64), page_size=page_size)
    prompt = [embedded.BOS_ID, *embedded.encode(_TEXT)[: prompt_len - 1]]
    params = SamplingParams(max_new_tokens=16)
    with (
        Engine(_worker(algorithm), limits=limits, config=config) as prefill,
        Engine(_worker(algorithm), limits=limits, config=config) as decoder,
    ):
        prefill.submit_prefill("r", prompt, params)
        while not prefill.handoff_ready():
            prefill.step()
        started = time.perf_counter()
        wire = encode(prefill.export_handoff("r"))
        exported = time.perf_counter()
        req = decoder.admit_handoff(decode(wire))
        admitted = time.perf_counter()
        prefill.release_handoff("r")
        while req.num_outputs < 2 and not req.is_finished:
            decoder.step()
        first = time.perf_counter()
        decoder.run_until_idle()
        committed = len(prompt)
        return {
            "algorithm": algorithm,
            "prompt_len": prompt_len,
            "bytes": sum(t.numel() * t.element_size() for t in wire),
            "export_ms": (exported - started) * 1e3,
            "admit_ms": (admitted - exported) * 1e3,
            "first_decode_token_ms": (first - admitted) * 1e3,
            "prefill_tokens_avoided": committed,
            "drafter_prefill_tokens_avoided": committed if algorithm in _DRAFTER_MODELS else 0,
        }


def run(args: argparse.Namespace) -> int:
    """Run the bench; print a table or JSON."""
    rows = []
    for algorithm in args.algorithms:
        for prompt_len in args.prompt_lens:
            print(f"bench pd: {algorithm} prompt {prompt_len}", file=sys.stderr, flush=True)
            rows.append(measure(algorithm, prompt_len, page_size=args.page_size))
    if args.json:
        config = {"page_size": args.page_size, "model": "embedded"}
        print(json.dumps({**header("pd"), "config": config, "results": rows}, indent=2))
        return 0
    print(
        f"{'algorithm':<12}{'prompt':>7}{'bytes':>12}{'export ms':>11}{'admit ms':>10}"
        f"{'1st tok ms':>12}{'prefill avoided':>17}{'drafter avoided':>17}"
    )
    for r in rows:
        print(
            f"{r['algorithm']:<12}{r['prompt_len']:>7}{r['bytes']:>12}{r['export_ms']:>11.2f}"
            f"{r['admit_ms']:>10.2f}{r['first_decode_token_ms']:>12.2f}"
            f"{r['prefill_tokens_avoided']:>17}{r['drafter_prefill_tokens_avoided']:>17}"
        )
    return 0
