"""`specstate serve --model DIR` on a checkpoint with a subword ``tokenizer.json``.

Built as the command builds it (`specstate.tools.serve.build`), served with uvicorn and asked
with the real ``openai`` client: text prompts go through the tokenizer, the output text is the
tokenizer's decoding of the output ids, and ``response_format`` constrains the output through
the vocabulary read from ``tokenizer.json``, with the tokens `Engine` emits for the same request.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import openai
from serving_harness import bounded, token_ids
from subword_tokenizers import subword_checkpoint

from specstate import Engine, EngineConfig, Grammar, SamplingParams
from specstate.reference.workers import default_registry
from specstate.serving.background import BackgroundServer
from specstate.serving.openai_server import create_app
from specstate.tools import serve
from specstate.tools.generate.workers import checkpoint_limits

SCHEMA = {
    "type": "object",
    "properties": {"count": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["count"],
    "additionalProperties": False,
}


def test_a_subword_checkpoint_serves_text_and_structured_output(tmp_path: Path) -> None:
    tok, eos, draft = subword_checkpoint(tmp_path)
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(
        ["--model", str(tmp_path), "--draft", str(draft), "--algorithm", "draft_model",
         "--num-steps", "3", "--kv-tokens", "2048"]
    )  # fmt: skip
    front, model = serve.build(args)
    assert model.codec is not None and model.codec.kind == "tokenizer"
    prompt = "def add(a, b):\n"
    try:
        with (
            BackgroundServer(create_app(front, model)) as server,
            openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client,
        ):
            plain = client.completions.create(
                model=model.name, prompt=prompt, max_tokens=12, temperature=0
            ).choices[0]
            structured = client.completions.create(
                model=model.name,
                prompt=prompt,
                max_tokens=40,
                temperature=0,
                extra_body={
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"schema": SCHEMA},
                    }
                },
            ).choices[0]
    finally:
        bounded(front.close())
    assert plain.text == tok.decode(token_ids(plain))
    assert structured.finish_reason == "stop"
    assert set(json.loads(structured.text)) == {"count"}
    # The same requests through `Engine`: the prompt as the tokenizer encodes it.
    worker = default_registry().create(
        "draft_model", target=str(tmp_path), draft=str(draft), num_steps=3
    )
    config = EngineConfig(kv_tokens=2048, check_invariants=True)
    with Engine(worker, limits=checkpoint_limits(tmp_path), config=config) as engine:
        ids = tok.encode(prompt).ids
        by_engine = engine.submit("p", ids, SamplingParams(max_new_tokens=12))
        grammar = Grammar.json_schema(SCHEMA)
        constrained = engine.submit("s", ids, SamplingParams(max_new_tokens=40, grammar=grammar))
        engine.run_until_idle()
    assert token_ids(plain) == list(by_engine.emitted_ids)
    assert token_ids(structured) == list(constrained.emitted_ids)
    assert constrained.emitted_ids[-1] == eos
