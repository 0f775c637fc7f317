"""The block drafters behind the front doors: `AsyncEngine` streams and `specstate serve`.

Concurrent streams through dflash and uno emit exactly HF ``generate()``'s greedy tokens, each
once, with runs of several tokens; ``specstate serve --algorithm dflash|uno --draft DIR``
builds the worker the generate flags describe and answers the openai client with the same
tokens.
"""

from __future__ import annotations

import argparse
import asyncio

import pytest
from block_checkpoints import BLOCK_FAMILIES, BlockCheckpoints
from hf_oracle import greedy
from serving_harness import BOUND_S, bounded, token_ids
from spec_checkpoints import MIXED_PROMPTS

from specstate import AsyncEngine, FinishReason, RequestLimits, SamplingParams
from specstate.engine.config import EngineConfig
from specstate.engine.engine import Engine
from specstate.serving.background import BackgroundServer
from specstate.serving.openai_server import create_app
from specstate.tools import serve

NEW = 12


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_streams_through_a_block_drafter_emit_hf_greedy_tokens(
    block_ckpt: BlockCheckpoints, family: str
) -> None:
    """Every stream yields HF's greedy tokens once, then its finish; runs of several tokens."""
    engine = Engine(
        block_ckpt.worker(family),
        limits=RequestLimits(vocab_size=97, max_context_len=64),
        config=EngineConfig(overlap=True, check_invariants=True, debug_relay=True),
    )

    async def main() -> tuple[list[list[int]], list[int]]:
        async with AsyncEngine(engine) as front:
            params = SamplingParams(max_new_tokens=NEW)
            streams = [await front.submit(f"r{i}", p, params) for i, p in enumerate(MIXED_PROMPTS)]
            outs = []
            for stream in streams:
                tokens: list[int] = []
                async with stream:
                    async for event in stream:  # each token once, in order
                        tokens.extend(event.tokens)
                assert stream.finish is not None and stream.finish.reason is FinishReason.LENGTH
                outs.append(tokens)
            return outs, [n for s in streams for n in s.accept_lengths]

    outs, accepts = asyncio.run(asyncio.wait_for(main(), BOUND_S))
    for prompt, tokens in zip(MIXED_PROMPTS, outs, strict=True):
        assert tokens == greedy(block_ckpt.hf, prompt, NEW)
    assert max(accepts) > 2


@pytest.mark.parametrize("family", BLOCK_FAMILIES)
def test_serve_with_a_block_drafter_answers_the_openai_client(
    block_ckpt: BlockCheckpoints, family: str
) -> None:
    """`serve` builds dflash or uno from --algorithm and --draft; completions are exact."""
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    draft = block_ckpt.assistant if family == "dflash" else block_ckpt.adapter
    args = parser.parse_args(
        ["--model", str(block_ckpt.target), "--algorithm", family, "--draft", str(draft)]
    )
    front, model = serve.build(args)
    try:
        caps = bounded(front.read(lambda engine: engine.worker.capabilities))
        assert caps.algorithm == family
        with BackgroundServer(create_app(front, model)) as server:
            import openai

            client = openai.OpenAI(
                base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=BOUND_S
            )
            prompt = list(MIXED_PROMPTS[0])
            done = client.completions.create(
                model=model.name, prompt=prompt, max_tokens=NEW, temperature=0
            )
    finally:
        bounded(front.close())
    assert token_ids(done.choices[0]) == greedy(block_ckpt.hf, prompt, NEW)
