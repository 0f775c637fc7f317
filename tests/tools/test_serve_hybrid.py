"""`specstate serve --model DIR` builds its engine as `generate` does: a NemotronH or an LFM2
checkpoint is served, and a greedy request through the front door equals transformers'
greedy `generate()`."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from hf_oracle import greedy
from hybrid_oracle import make_hybrid_checkpoints
from lfm2_oracle import make_lfm2_checkpoints
from serving_harness import bounded

from specstate import SamplingParams
from specstate.tools import serve

PROMPT = [3, 14, 15, 92, 65, 35, 89]
NEW_TOKENS = 12


@pytest.mark.parametrize("kind", ["nemotron_h", "lfm2"])
def test_serve_builds_a_hybrid_checkpoint(kind: str, tmp_path: Path) -> None:
    ckpt = (make_hybrid_checkpoints if kind == "nemotron_h" else make_lfm2_checkpoints)(tmp_path)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(ckpt.target), "--draft", str(ckpt.partial), "--algorithm",
         "draft_model", "--num-steps", "3", "--check-invariants"]
    )  # fmt: skip
    front, _ = serve.build(args)

    async def tokens() -> list[int]:
        try:
            stream = await front.submit("h", PROMPT, SamplingParams(max_new_tokens=NEW_TOKENS))
            return [t for event in [e async for e in stream] for t in event.tokens]
        finally:
            await front.close()

    assert bounded(tokens()) == greedy(ckpt.hf, PROMPT, NEW_TOKENS)
